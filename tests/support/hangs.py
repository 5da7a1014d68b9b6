"""Hangs: the stacks of every process of the tests' clusters, shown before pytest-timeout ends a
test, so that a hang in CI says where each side waited.

Every process that a test cluster starts (the workers of :func:`~.clusters.local_cluster`; the
scheduler, nannies and workers of :class:`~.clusters.DaskCLI`) imports :func:`preload_file` at
its start (distributed's ``preload``: a module file of the standard library alone, since the
``dask`` commands cannot import this repository). It registers ``faulthandler`` for
:data:`SIGNAL` into a file of its own, ``<pid>.stacks`` in :func:`directory`, and notes there
what it is (``<pid>.json``: its role, address, parent, event-loop thread). ``faulthandler`` dumps
from the signal handler itself, in C: it answers even while a thread holds the GIL or the event
loop is blocked.

The clusters are registered while they live (:func:`watch`, :func:`watching`). :func:`arm`
starts a timer a few seconds (:func:`lead`) before a test's timeout; when it fires for a test
marked ``cluster`` (or while a cluster is registered), :func:`dump` signals every registered
process, reads each one's stacks back and writes them to stderr under a header each (``== stacks
of worker tcp://127.0.0.1:port (pid N) ==``), then the stacks of this process: the client's,
and those of a ``LocalCluster``'s scheduler and nannies, which run here in its event-loop thread.
pytest shows them with the failure (captured stderr). A process already gone, or one that did
not register the signal, is named with a line saying so and not signalled. Nothing here raises.
"""

import atexit
import contextlib
import json
import os
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import pytest

#: The signal that makes a cluster process dump its threads' stacks (``faulthandler.register``).
SIGNAL = signal.SIGUSR1

#: How long :func:`dump` waits for the processes' dumps, at most (seconds).
WAIT = 3.0

PRELOAD_NAME = "_daskdag_hang_stacks.py"

# The preload module: imported by each process of a test cluster (more than once in one process:
# the dask commands import a --preload when they read their command line, and distributed imports
# it again, then reloads it). Its directory is written into it: distributed imports a copy of it
# from the worker's local directory.
PRELOAD = '''\
"""Written by tests/support/hangs.py (daskdag's tests): on SIGUSR1 this process writes the stacks
of its threads to <pid>.stacks, in the directory below; <pid>.json says what the process is."""

import faulthandler
import json
import os
import signal
import sys
import threading

DIRECTORY = {directory!r}
PID = os.getpid()
INFO = os.path.join(DIRECTORY, "%d.json" % PID)

_stacks = open(os.path.join(DIRECTORY, "%d.stacks" % PID), "a")
faulthandler.register(signal.SIGUSR1, file=_stacks, all_threads=True, chain=False)


def _note(**fields):
    info = {{"pid": PID, "ppid": os.getppid(), "argv": sys.argv}}
    if getattr(sys, "_daskdag_hang_stacks", None) == PID:  # (this process noted before)
        try:
            with open(INFO) as f:
                info.update(json.load(f))
        except (OSError, ValueError):
            pass
    sys._daskdag_hang_stacks = PID
    info.update(fields)
    with open(INFO + ".part", "w") as f:
        json.dump(info, f)
    os.replace(INFO + ".part", INFO)


_note()


def dask_setup(server):
    """distributed calls it in the server's event loop, once it listens."""
    _note(role=type(server).__name__, address=getattr(server, "address", None),
          loop_thread=threading.get_ident())
'''

_lock = threading.RLock()
_directory: list = []  # [Path], once made
_watched: dict = {}  # id(key) -> (name, processes)


def directory() -> Path:
    """The directory of this test session's dumps (made on first use, removed at exit), with
    the preload module in it."""
    with _lock:
        if not _directory:
            path = Path(tempfile.mkdtemp(prefix="daskdag-stacks-"))
            (path / PRELOAD_NAME).write_text(PRELOAD.format(directory=str(path)))
            atexit.register(shutil.rmtree, path, ignore_errors=True)
            _directory.append(path)
        return _directory[0]


def preload_file() -> str:
    """The module file that a cluster process preloads (distributed's ``preload=`` / ``dask
    worker --preload``) to dump its stacks on :data:`SIGNAL`."""
    return str(directory() / PRELOAD_NAME)


def process_info(pid: int) -> dict:
    """What the preload noted of process ``pid``: ``{}`` if nothing."""
    try:
        return json.loads((directory() / f"{pid}.json").read_text())
    except (OSError, ValueError):
        return {}


def noted() -> dict:
    """``{pid: info}`` of every process that ran the preload this session."""
    found = {}
    for path in directory().glob("*.json"):
        with contextlib.suppress(OSError, ValueError):
            info = json.loads(path.read_text())
            found[int(info["pid"])] = info
    return found


# -- the registry: the live test clusters --------------------------------------------------------

@dataclass
class Process:
    """A process of a cluster: ``pid`` (None: none runs), ``what`` it is (``worker
    tcp://...``), ``why`` it is not signalled, if it is not."""
    pid: int | None
    what: str
    why: str | None = None


def watch(key, name: str, processes) -> None:
    """Register a cluster (``key``: any object, registered once) while it lives: ``name`` says
    which, ``processes()`` gives ``(processes, notes, threads)``: its :class:`Process` list now,
    lines to print before their stacks, ``{ident: what it runs}`` of its threads in this process
    (a ``LocalCluster``'s event loop)."""
    with _lock:
        _watched[id(key)] = (name, processes)


def unwatch(key) -> None:
    with _lock:
        _watched.pop(id(key), None)


@contextlib.contextmanager
def watching(key, name: str, processes):
    watch(key, name, processes)
    try:
        yield
    finally:
        unwatch(key)


def watched() -> list:
    with _lock:
        return list(_watched.values())


def _described(info: dict, fallback: str) -> str:
    role = (info.get("role") or "").lower()
    if not role:
        return fallback
    return f"{role} {info['address']}" if info.get("address") else role


def local_cluster_processes(cluster):
    """The worker processes of a ``LocalCluster``: its scheduler and nannies run in this process
    (the client's), whose stacks :func:`dump` shows anyway."""
    processes, notes = [], []
    loop = _loop_thread(cluster)
    threads = {loop: f"the event loop of {type(cluster).__name__} {cluster.scheduler_address}: "
                     f"its scheduler and nannies"} if loop else {}
    notes.append(f"{type(cluster).__name__} {cluster.scheduler_address}: its scheduler and "
                 f"nannies run in the client's process (pid {os.getpid()}), in thread "
                 f"{_thread_label(loop) if loop else '(its event loop: unknown)'}; "
                 f"see the client's stacks")
    for name, server in list(cluster.workers.items()):
        if not hasattr(server, "pid"):  # (processes=False: a Worker in this process)
            notes.append(f"worker {getattr(server, 'address', name)}: in the client's process")
            continue
        address = getattr(server, "worker_address", None) or f"{name!r}"
        pid = server.pid
        processes.append(Process(pid, f"worker {address}",
                                 None if pid else "no process runs now (stopped, or restarting)"))
    return processes, notes, threads


def cli_processes(cli):
    """The processes a :class:`~.clusters.DaskCLI` started (schedulers; nannies or workers),
    with the worker process of each nanny (noted by the preload, with the nanny as its parent)."""
    processes, children = [], {}
    for info in noted().values():
        children.setdefault(info.get("ppid"), []).append(info)
    for proc in list(cli.procs):
        command = f"dask {proc.args[1]}" if len(proc.args) > 1 else "dask"
        code = proc.poll()
        if code is not None:
            processes.append(Process(proc.pid, command, f"it exited (code {code})"))
            continue
        info = process_info(proc.pid)
        processes.append(Process(proc.pid, _described(info, command)))
        for child in children.get(proc.pid, []):
            processes.append(Process(int(child["pid"]), _described(child, f"{command}'s child")))
    return processes, [], {}


def _loop_thread(cluster) -> int | None:
    """The ident of the thread that runs ``cluster``'s event loop, if found."""
    with contextlib.suppress(Exception):
        return cluster.loop.asyncio_loop._thread_id
    return None


def _thread_label(ident: int) -> str:
    names = {t.ident: t.name for t in threading.enumerate()}
    return f"{names.get(ident, '<unknown>')!r} (0x{ident:016x})"


# -- the dump -------------------------------------------------------------------------------------

def _signal_state(pid: int) -> str | None:
    """Why ``pid`` cannot be signalled now (gone, a zombie, no handler of :data:`SIGNAL`), or
    None. Without ``/proc``, a process that noted itself (the preload) is taken to handle it."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return "it has exited"
    except PermissionError:
        return "not ours (permission denied)"
    status = Path(f"/proc/{pid}/status")
    try:
        fields = dict(line.split(":", 1) for line in status.read_text().splitlines() if ":" in line)
    except OSError:
        return None if process_info(pid) else "it did not run the preload"
    if fields.get("State", "").strip().startswith(("Z", "X")):
        return "it has exited (a zombie)"
    caught = int(fields.get("SigCgt", "0").strip() or "0", 16)
    if not caught & (1 << (SIGNAL - 1)):
        return f"it does not handle {SIGNAL.name} (no preload: not signalled, as it would end it)"
    return None


def _annotated(text: str, labels: dict) -> str:
    """faulthandler's ``Thread 0x...`` lines, with ``labels[ident]`` after them."""
    if not labels:
        return text

    def label(m):
        extra = labels.get(int(m.group(2), 16))
        return f"{m.group(0)}  <- {extra}" if extra else m.group(0)

    return re.sub(r"^(Current thread|Thread) 0x([0-9a-fA-F]+) \(most recent call first\):",
                  label, text, flags=re.MULTILINE)


def _dumps(processes: list, wait: float) -> dict:
    """Signal each of ``processes`` (those that can be) and wait for its stacks: ``{pid: text
    or why there is none}``."""
    out, pending = {}, {}
    for p in processes:
        if p.pid is None or p.pid in out or p.pid in pending:
            continue
        if p.pid == os.getpid():
            out[p.pid] = "(this process: see the client's stacks)"
            continue
        why = p.why or _signal_state(p.pid)
        if why:
            out[p.pid] = f"(skipped: {why})"
            continue
        path = directory() / f"{p.pid}.stacks"
        offset = path.stat().st_size if path.exists() else 0
        try:
            os.kill(p.pid, SIGNAL)
        except OSError as e:
            out[p.pid] = f"(skipped: it could not be signalled: {e})"
            continue
        pending[p.pid] = (path, offset)
    deadline = time.monotonic() + wait
    sizes: dict = {}
    while pending and time.monotonic() < deadline:
        time.sleep(0.1)
        for pid, (path, offset) in list(pending.items()):
            size = path.stat().st_size if path.exists() else 0
            if size > offset and sizes.get(pid) == size:  # (written, and no longer growing)
                out[pid] = _read(path, offset)
                del pending[pid]
            sizes[pid] = size
    for pid, (path, offset) in pending.items():
        text = _read(path, offset) if path.exists() else ""
        out[pid] = text or (f"(nothing came in {wait:g} s: it was signalled; its dump was "
                            f"to go to {path})")
    return out


def _read(path: Path, offset: int) -> str:
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read().decode(errors="replace")


def own_stacks(labels: dict | None = None) -> str:
    """The stacks of this process's threads (main thread first, the caller's thread left out),
    each named, with ``labels[ident]`` after its name."""
    labels = labels or {}
    try:
        names = {t.ident: t.name for t in threading.enumerate()}
        me, main = threading.get_ident(), threading.main_thread().ident
        frames = sorted(sys._current_frames().items(), key=lambda kv: kv[0] != main)
        parts = []
        for ident, frame in frames:
            if ident == me:
                continue
            extra = f"  <- {labels[ident]}" if ident in labels else ""
            stack = traceback.extract_stack(frame)
            skipped = next((i for i, f in enumerate(stack) if not _pytests(f.filename)), 0)
            parts.append(f"Thread {names.get(ident, '<unknown>')!r} (0x{ident:016x}) (most "
                         f"recent call last):{extra}\n"
                         + (f"  ({skipped} frames of pytest's)\n" if skipped else "")
                         + "".join(traceback.format_list(stack[skipped:])))
        return "\n".join(parts)
    except Exception:  # (then faulthandler's)
        import faulthandler

        with tempfile.TemporaryFile("w+") as f:
            faulthandler.dump_traceback(f, all_threads=True)
            f.seek(0)
            return f.read()


def _pytests(filename: str) -> bool:
    """A frame of pytest's own (left out at the bottom of a stack)."""
    return "<frozen runpy>" in filename or any(
        f"{os.sep}{d}{os.sep}" in filename for d in ("_pytest", "pluggy", "pytest"))


def dump(title: str = "", wait: float = WAIT) -> str:
    """The stacks of every process of the registered clusters, then this process's: signals
    them, waits up to ``wait`` s for their dumps, and returns the text (never raises)."""
    lines = [f"{'+' * 20} stacks of every process of the test's clusters"
             + (f": {title} " if title else " ") + "+" * 20]
    labels = {}  # this process's threads -> what they run
    try:
        clusters = []
        for name, processes in watched():
            try:
                found, notes, threads = processes()
            except Exception as e:
                found, notes, threads = [], [f"(its processes could not be listed: {e!r})"], {}
            clusters.append((name, found, notes))
            labels.update(threads)
        every = [p for _, found, _ in clusters for p in found]
        stacks = _dumps(every, wait)
        for name, found, notes in clusters:
            lines.append(f"-- {name}: {len(found)} process(es) of its own")
            lines.extend(f"   {n}" for n in notes)
            for p in found:
                header = f"== stacks of {p.what} (pid {p.pid}) =="
                if p.pid is None:
                    lines += [header, f"(skipped: {p.why})"]
                    continue
                info = process_info(p.pid)
                loop = info.get("loop_thread")
                text = _annotated(stacks.get(p.pid, ""),
                                  {loop: f"the {(info.get('role') or 'server').lower()}'s event "
                                         f"loop"} if loop else {})
                lines += [header, text.rstrip("\n")]
        if not clusters:
            lines.append("-- no cluster of the tests is running")
    except Exception:
        lines.append("(the stacks of the clusters' processes could not be shown:)\n"
                     + traceback.format_exc())
    try:
        lines.append(f"== stacks of the client: this process (pid {os.getpid()}) ==")
        lines.append(own_stacks(labels).rstrip("\n"))
    except Exception:
        lines.append(traceback.format_exc())
    lines.append("+" * 40)
    return "\n".join(lines) + "\n"


# -- the timer: before pytest-timeout fires ----------------------------------------------------

_TIMER = pytest.StashKey[threading.Timer]()


def lead(timeout: float) -> float:
    """How long before the test's timeout its stacks are taken: 5 s, a fifth of a short one."""
    return min(5.0, timeout / 5)


def arm(item, timeout: float | None) -> None:
    """Start the timer of ``item``, whose timeout is ``timeout`` s from now (from
    pytest-timeout's ``pytest_timeout_set_timer``): :func:`lead` s before, :func:`fire`."""
    if not timeout or timeout <= 0:
        return
    disarm(item)
    before = lead(timeout)
    timer = threading.Timer(timeout - before, fire, (item, timeout, before))
    timer.daemon = True
    timer.name = f"stacks before the timeout of {item.nodeid}"
    item.stash[_TIMER] = timer
    timer.start()


def disarm(item) -> None:
    """Cancel ``item``'s timer, if any (pytest-timeout's ``pytest_timeout_cancel_timer``)."""
    with contextlib.suppress(Exception):
        timer = item.stash.get(_TIMER, None)
        if timer is not None:
            del item.stash[_TIMER]
            timer.cancel()


def fire(item, timeout: float, before: float) -> None:
    """For a ``cluster`` test, or while a cluster is registered: :func:`dump` to stderr (which
    pytest captures and shows with the failure)."""
    try:
        if item.get_closest_marker("cluster") is None and not watched():
            return
        text = dump(f"{item.nodeid}, {before:g} s before its timeout ({timeout:g} s)",
                    wait=min(WAIT, before / 2))
        sys.stderr.write(text)
        sys.stderr.flush()
    except Exception:
        with contextlib.suppress(Exception):
            sys.stderr.write("(the stacks before the timeout could not be shown:)\n"
                             + traceback.format_exc())
