"""Faults: distributed's log watched for defects, calls that must end in time, workers
killed (all at once, :class:`KillAt`, or one at random again and again, :class:`Chaos`)."""

import os
import random
import signal
import threading
import time
from pathlib import Path

import pytest


# -- faults: distributed's log, calls that must end, workers killed ----------------------------------

class DistributedLog:
    """What distributed logged while a test ran: the records of the ``distributed`` loggers of
    this process (a ``LocalCluster``'s scheduler runs here), and the lines that files given to
    :meth:`watch` (a :class:`DaskCLI` cluster's ``cluster.log``) gained meanwhile.

    :data:`DEFECTS` are lines that mean daskdag misused distributed: one key submitted with two
    different task specs, or data placed with ``Client.scatter`` lost with its only holder.
    (distributed logs a graph's first ``run_spec`` collision in each task group at WARNING, the
    others of that group in the same graph at DEBUG: every colliding submission shows.)"""

    DEFECTS = ("different `run_spec`", "lose scattered data")

    def __init__(self):
        import logging

        self.records: list = []
        self.files: list = []  # (path, offset when watched)
        log = self

        class Handler(logging.Handler):
            def emit(self, record):
                try:
                    log.records.append(f"{record.name} {record.levelname}: {record.getMessage()}")
                except Exception:  # a message that cannot be formatted is no reason to fail here
                    log.records.append(f"{record.name} {record.levelname}: {record.msg!r}")

        self.handler = Handler(logging.DEBUG)
        self.reported: set = set()  # defects a check already failed on

    def watch(self, path) -> None:
        """Read ``path``'s lines from its current end, too."""
        path = Path(path)
        self.files.append((path, path.stat().st_size if path.exists() else 0))

    def lines(self) -> list[str]:
        lines = list(self.records)
        for path, offset in self.files:
            if path.exists():
                with open(path, "rb") as f:
                    f.seek(offset)
                    lines.extend(f.read().decode(errors="replace").splitlines())
        return lines

    def defects(self) -> list[str]:
        return [line for line in self.lines() if any(d in line for d in self.DEFECTS)]

    def check(self) -> None:
        """Fail, quoting them (shortened), if distributed logged a defect."""
        found = [d for d in self.defects() if d not in self.reported]  # each fails one check
        if found:
            self.reported.update(found)
            pytest.fail(f"distributed logged {len(found)} defect(s) (daskdag misused it):\n"
                        + "\n".join(line[:1500] for line in found[:5]), pytrace=False)


def watching_distributed():
    """Yield a :class:`DistributedLog` attached to distributed's logger, then check it."""
    import logging

    log = DistributedLog()
    logger = logging.getLogger("distributed")
    logger.addHandler(log.handler)
    try:
        yield log
    finally:
        logger.removeHandler(log.handler)
    log.check()


class Hung(AssertionError):
    """A call that did not return within its bound."""


def bounded(fn, seconds: float, what: str = "the call"):
    """``fn()``'s result, or what it raised, if it ends within ``seconds``; else fail with
    :class:`Hung`. ``fn`` runs in a daemon thread, so a hang costs ``seconds``, not the test's
    timeout (the thread stays stuck until its client closes). Returns ``(result, seconds
    taken)``."""
    import threading

    out: dict = {}

    def run():
        try:
            out["result"] = fn()
        except BaseException as e:  # handed to the caller's thread
            out["error"] = e

    start = time.monotonic()
    thread = threading.Thread(target=run, daemon=True, name=f"bounded {what}")
    thread.start()
    thread.join(seconds)
    took = time.monotonic() - start
    if thread.is_alive():
        raise Hung(f"{what} did not return within {seconds:g} s: it hangs")
    if "error" in out:
        raise out["error"]
    return out["result"], took


def worker_pids(client) -> dict:
    """``{address: pid}`` of the cluster's worker processes."""
    import os

    return client.run(os.getpid)


def sigkill(pids) -> list:
    """SIGKILL each of ``pids``; returns those that were still there."""
    import os

    killed = []
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
        except ProcessLookupError:
            pass
    return killed


class KillAt(threading.Thread):
    """SIGKILLs ``pids`` together, ``delay`` seconds after it starts; ``killed``: those it
    found, ``at``: when (``time.monotonic()``)."""

    def __init__(self, pids, delay):
        super().__init__(daemon=True, name="kill-workers")
        self.pids, self.delay, self.killed, self.at = list(pids), delay, [], None

    def run(self):
        time.sleep(self.delay)
        self.killed = sigkill(self.pids)
        self.at = time.monotonic()


class Chaos(threading.Thread):
    """Every ``every`` seconds, SIGKILLs one worker process chosen at random among those that
    answer (``client.run``). ``kills``: the pids killed."""

    def __init__(self, client, every, seed=0):
        super().__init__(daemon=True, name="chaos")
        self.client, self.every, self.rng = client, every, random.Random(seed)
        self.stopped, self.kills, self.errors = threading.Event(), [], []

    def run(self):
        while not self.stopped.wait(self.every):
            try:
                pids = [p for p in self.client.run(os.getpid, on_error="return").values()
                        if isinstance(p, int)]
            except Exception as e:  # (the scheduler is busy with the dead; try at the next tick)
                self.errors.append(e)
                continue
            if pids:
                self.kills.extend(sigkill([self.rng.choice(sorted(pids))]))

    def stop(self):
        self.stopped.set()
        self.join(30)


def not_a_mismatch(call):
    """``call()``; a ClusterError saying the workers differ from this client (as a worker that
    died during daskdag's version check was reported) fails the test, plainly."""
    import daskdag

    try:
        return call()
    except daskdag.ClusterError as e:
        if "differ" in str(e):
            pytest.fail(f"workers that were killed were reported as a version mismatch: {e}")
        raise


# A LocalCluster closes for good the nanny of a worker whose name has been missing from the
# scheduler for this long (default 15 s): under repeated kills, or a restart slower than that on
# a loaded machine, the cluster shrinks for good. Tests that kill workers keep their nannies.
KEEP_NANNIES = {"distributed.deploy.lost-worker-timeout": "1 hour"}
