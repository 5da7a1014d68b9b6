"""Checks on a ``distributed`` cluster before a graph goes to it: a closed client, no worker (or
none offering a node's resources or device), workers under other versions.
"""

from __future__ import annotations

import time
import uuid
import warnings
import weakref

from dask.utils import parse_timedelta

from daskdag.caches import Cache
from daskdag.errors import ClusterError, DAGError
from daskdag.model import devices
from daskdag.model.plan import Plan
from daskdag.transport.programs import versions
from daskdag.running import workers as worker_setup
import daskdag.config as config

_tuned: weakref.WeakSet = weakref.WeakSet()  # clients that registered daskdag's worker plugin
_told: weakref.WeakSet = weakref.WeakSet()  # clients whose workers registered the serializers
_placed: weakref.WeakSet = weakref.WeakSet()  # clients whose workers set up their JAX platform
KNOWN_WORKERS = 4096  # the most workers each cache below holds (then any may be asked again)
# (address, local directory) of each worker whose versions are this client's -> True
_same_versions: Cache[bool] = Cache("workers found under the same versions", KNOWN_WORKERS)
_devices: Cache[tuple[str, ...]] = Cache("workers' devices", KNOWN_WORKERS)  # as above -> devices
VERSIONS_WAIT = 5.0  # seconds the workers get to say their versions
RECHECK = 1.0  # seconds for which a client's check stands for its next calls
_checked: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # client -> (time, workers)


def workers(client, timeout: float | None = None) -> dict[str, dict]:
    """``{address: info}`` of the cluster's workers, asked of the scheduler now (its cached
    ``client.scheduler_info()`` may lack them)."""
    return client.sync(client.scheduler.identity, n_workers=-1, callback_timeout=timeout)["workers"]


def unreachable(e: Exception) -> str:
    """What asking the scheduler raised (``OSError``, ``TimeoutError``), as a problem."""
    return f"its scheduler cannot be reached ({type(e).__name__}: {e})"


def check(client, plan: Plan) -> dict[str, dict]:
    """The workers found, else a :class:`~daskdag.ClusterError`; it waits up to
    ``daskdag.worker-wait`` for workers (offering the nodes' resources), then registers
    daskdag's worker plugins. A pass stands for :data:`RECHECK` seconds."""
    check_client(client)
    last = _checked.get(client)
    if (last is not None and time.monotonic() - last[0] < RECHECK
            and _unmet(plan, last[1]) is None and _no_device(plan, last[1]) is None):
        tune_workers(client)
        platform_on_workers(client)
        return last[1]
    found = workers(client) or _wait_for_a_worker(client)
    found = _wait_for_resources(client, plan, found)
    _check_versions(client, found)
    tune_workers(client)
    platform_on_workers(client)  # (before anything opens JAX's backend on a worker)
    serializers_on_workers(client)
    _check_devices(client, plan, found)
    _checked[client] = (time.monotonic(), found)
    return found


def platform_on_workers(client) -> None:
    """Register :class:`daskdag.running.workers.Platform` once per client object (a failure is
    a :class:`~daskdag.ClusterError`, at every call until fixed)."""
    if client in _placed:
        return
    try:
        client.register_plugin(worker_setup.Platform(worker_platform()), name=worker_setup.PLATFORM)
    except RuntimeError as e:
        raise ClusterError(f"{describe(client)}: {e}") from e
    _placed.add(client)


def worker_platform() -> str:
    """The setting ``daskdag.worker-platform``, checked."""
    setting = config.get("worker-platform")
    if setting not in worker_setup.SETTINGS:
        raise DAGError(f"daskdag.worker-platform is {setting!r}: give one of "
                       f"{', '.join(map(repr, worker_setup.SETTINGS))}")
    return setting


def serializers_on_workers(client) -> None:
    """Register :class:`daskdag.running.workers.Serializers` once per client object."""
    if client in _told:
        return
    _told.add(client)
    client.register_plugin(worker_setup.Serializers(), name=worker_setup.SERIALIZERS)


def tune_workers(client) -> None:
    """Register :class:`daskdag.running.workers.TuneMalloc` once, if ``daskdag.tune-workers``."""
    if client in _tuned or not config.get("tune-workers"):
        return
    _tuned.add(client)  # before trying: a failing registration is not retried on every call
    try:
        client.register_plugin(worker_setup.TuneMalloc(), name=worker_setup.NAME)
    except Exception as e:
        warnings.warn(f"daskdag could not register its worker plugin {worker_setup.NAME!r} "
                      f"(workers keep distributed's malloc settings, which slow JAX down): "
                      f"{type(e).__name__}: {e}", RuntimeWarning, stacklevel=4)


def check_client(client) -> None:
    """A client that is not running (closed, still connecting) cannot take a graph."""
    if client.status != "running":
        raise ClusterError(f"{describe(client)} is {client.status}: pass a running "
                           f"distributed.Client (or none, for Dask's local threads)")


def describe(client) -> str:
    """``client <id> (scheduler <address>)``."""
    address = scheduler_address(client)
    return f"client {client.id}" + (f" (scheduler {address})" if address else "")


def scheduler_address(client) -> str | None:
    """The address of ``client``'s scheduler, where known (a closed client may not)."""
    return (client.scheduler.address if client.scheduler is not None else
            getattr(client.cluster, "scheduler_address", None))


def _probe() -> None:
    """A task that any worker can run: its only use is to be waiting for one."""


def _waited(client, wait: float, needs: dict | None = None) -> dict[str, dict]:
    """The workers once one (offering ``needs``) ran a probe task (which makes an adaptive
    cluster scale up), or after ``wait`` seconds."""
    probe = client.submit(_probe, pure=False, key=f"daskdag-worker-wait-{uuid.uuid4().hex}",
                          resources=needs)
    try:
        probe.result(timeout=max(wait, 0.001))
    except Exception:  # timed out, or its worker left again: the list below decides
        pass
    finally:
        probe.release()
    return workers(client)


def _wait_for_a_worker(client) -> dict[str, dict]:
    wait = parse_timedelta(config.get("worker-wait"), default="s")
    found = _waited(client, wait)
    if not found:
        raise ClusterError(f"{describe(client)}: the scheduler has no workers, and none joined "
                           f"within {wait:g} s: start some (`dask worker ADDRESS`), or wait longer "
                           f"with dask.config.set({{'daskdag.worker-wait': '120s'}})")
    return found


def _unmet(plan: Plan, workers: dict) -> tuple[str, dict] | None:
    """The first needed node whose resources no worker offers, and its needs; else None."""
    for n in plan.needed:
        needs = plan.spec.nodes[n].needs
        if needs and not _offering(needs, workers):
            return n, dict(needs)
    return None


def _wait_for_resources(client, plan: Plan, found: dict) -> dict[str, dict]:
    """The workers once some offer every needed node's resources (up to a wait)."""
    unmet = _unmet(plan, found)
    if unmet is None:
        return found
    wait = parse_timedelta(config.get("worker-wait"), default="s")
    deadline = time.monotonic() + wait
    while unmet is not None and time.monotonic() < deadline:
        found = _waited(client, deadline - time.monotonic(), unmet[1])
        unmet = _unmet(plan, found)
    if unmet is None:
        return found
    n, needs = unmet
    offered = {addr: w.get("resources", {}) for addr, w in found.items()}
    flag = " ".join(f"{r}={amount:g}" for r, amount in needs.items())
    flag = f'"{flag}"' if len(needs) > 1 else flag
    raise ClusterError(
        f"node {n!r} needs resources {needs}, but no worker offers them (workers offer "
        f"{offered}), and none that does joined within {wait:g} s (daskdag.worker-wait); "
        f"start a worker with e.g. `dask worker ADDRESS --resources {flag}`, or wait longer "
        f"with dask.config.set({{'daskdag.worker-wait': '120s'}})")


def _offering(needs: dict, workers: dict) -> list[str]:
    return [a for a, w in workers.items()
            if all(w.get("resources", {}).get(r, 0) >= amount for r, amount in needs.items())]


def _no_device(plan: Plan, workers: dict) -> tuple[str, str, dict] | None:
    """A needed node whose device no worker that could run it may have, that device, and those
    workers' devices; else None."""
    for n in plan.needed:
        node = plan.spec.nodes[n]
        if node.device is None or node.device == devices.DEFAULT:
            continue
        have = {a: _devices.get((a, workers[a].get("local_directory")))
                for a in _offering(node.needs, workers)}
        if not any(d is None or node.device in d for d in have.values()):
            return n, node.device, have
    return None


def _check_devices(client, plan: Plan, listed: dict[str, dict]) -> None:
    """Where some needed node has a device, ask the workers not asked yet for theirs; a
    :class:`~daskdag.ClusterError` names a node whose device no worker that could run it has."""
    if all(plan.spec.nodes[n].device in (None, devices.DEFAULT) for n in plan.needed):
        return
    found = _ask(client, devices.here, listed, lambda k: k not in _devices)
    for k, d in found.items():  # (none answered: the call's tasks say what a worker lacks)
        if isinstance(d, (tuple, list)):
            _devices.put(k, tuple(d))
    missing = _no_device(plan, listed)
    if missing is not None:
        n, device, have = missing
        there = "; ".join(f"{a}: {', '.join(d or ())}" for a, d in sorted(have.items()))
        raise ClusterError(
            f"node {n!r}: no worker that could run it has device {device!r} (their devices: "
            f"{there or 'no worker offers its resources'}); give the node a device the workers "
            f"have, or start workers that have it")


def _check_versions(client, listed: dict[str, dict]) -> None:
    found = _ask(client, versions, listed, lambda k: k not in _same_versions or k[1] is None)
    if not found:  # (all checked already; or none answered: the next call asks again)
        return
    here = versions()
    for k, v in found.items():
        if v == here:
            _same_versions.put(k, True)
    wrong = {addr: v for (addr, _), v in found.items()
             if v != here and not isinstance(v, (OSError, TimeoutError))}
    if wrong:
        detail = "; ".join(f"{addr}: {v if isinstance(v, dict) else f'{type(v).__name__}: {v}'}"
                           for addr, v in sorted(wrong.items(), key=lambda kv: kv[0]))
        what = ("differ from this client" if all(isinstance(v, dict) for v in wrong.values()) else
                "cannot run daskdag as this client does")
        raise ClusterError(f"workers {what} ({here}): {detail}. Backward programs only travel "
                           f"between identical jax, jaxlib and daskdag versions")


def _ask(client, fn, listed: dict[str, dict], asked) -> dict:
    """``{(address, local directory): fn() there, or what it raised}`` of the ``listed`` workers
    whose key ``asked`` says (a worker process is new where its directory is); ``{}`` where
    none answers within :data:`VERSIONS_WAIT` (one that died as it joined stays listed)."""
    known = {a: (a, w.get("local_directory")) for a, w in listed.items()}
    ask = [a for a, k in known.items() if asked(k)]
    try:
        found = client.run(fn, workers=ask, on_error="return",
                           callback_timeout=VERSIONS_WAIT) if ask else {}
    except TimeoutError:
        return {}
    return {known[a]: v for a, v in found.items() if a in known}


class Watch:
    """Whether a call waiting on ``client``'s cluster can still finish there: :meth:`check`
    raises :class:`~daskdag.ClusterError` once no worker could run the call for longer than
    ``daskdag.worker-wait``."""

    def __init__(self, client, plan: Plan | None = None):
        self.client, self.plan = client, plan
        self.wait = parse_timedelta(config.get("worker-wait"), default="s")
        # how long a question to the scheduler may take (a loaded one answers slowly)
        self.ask = max(self.wait, VERSIONS_WAIT)
        self.since: float | None = None  # since when the cluster cannot run the call

    def check(self, found: dict | None = None, failed: Exception | None = None) -> None:
        """``found``: the workers just asked for, or ``failed``: what asking raised."""
        if found is None and failed is None:
            try:
                found = workers(self.client, timeout=self.ask)
            except (OSError, TimeoutError) as e:
                failed = e
        problem = unreachable(failed) if failed is not None else self._problem(found or {})
        if problem is None:
            self.since = None
            return
        now = time.monotonic()
        self.since = self.since if self.since is not None else now
        if now - self.since > self.wait:
            raise ClusterError(
                f"{describe(self.client)}: {problem}, and it stayed so for {self.wait:g} s "
                f"(daskdag.worker-wait): the workers were lost (killed, out of memory, or their "
                f"machines went away) and none came back to finish the call. Start workers, or "
                f"wait longer with dask.config.set({{'daskdag.worker-wait': '120s'}})")

    def _problem(self, found: dict) -> str | None:
        if not found:
            return "the cluster has no worker left"
        unmet = _unmet(self.plan, found) if self.plan is not None else None
        if unmet is not None:
            return f"no worker left offers the resources {unmet[1]} that node {unmet[0]!r} needs"
        return None
