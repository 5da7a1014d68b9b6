import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest


def assert_tree_close(actual, expected, rtol=1e-5, atol=1e-6):
    """Same pytree structure, leaves equal within tolerance."""
    assert jax.tree.structure(actual) == jax.tree.structure(expected)
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=rtol, atol=atol)


class Counted:
    """Wraps a node function and counts its calls."""

    def __init__(self, fn):
        self.fn, self.calls = fn, 0

    def __call__(self, *args):
        self.calls += 1
        return self.fn(*args)


def seed_functions():
    """The seed question's DAG with concrete functions (x -> A -> B -> C -> D, B -> E)."""
    return {
        "x_to_A": lambda x: jnp.sin(x) * 2.0,
        "A_to_B": lambda A: A ** 2 + 1.0,
        "B_to_C": lambda B: jnp.cumsum(B) / 3.0,
        "C_to_D": lambda C: jnp.sum(jnp.log(C)),
        "B_to_E": lambda B: jnp.sum(jnp.sqrt(B) * jnp.arange(B.shape[0])),
    }


@pytest.fixture
def seed():
    f = {k: Counted(v) for k, v in seed_functions().items()}
    dag = {"A": (f["x_to_A"], ["x"]), "B": (f["A_to_B"], ["A"]), "C": (f["B_to_C"], ["B"]),
           "D": (f["C_to_D"], ["C"]), "E": (f["B_to_E"], ["B"])}
    g = seed_functions()
    composed = {"D": lambda x: g["C_to_D"](g["B_to_C"](g["A_to_B"](g["x_to_A"](x)))),
                "E": lambda x: g["B_to_E"](g["A_to_B"](g["x_to_A"](x)))}
    return dag, f, composed


@pytest.fixture
def x5():
    return jnp.array([1.0, 2.0, 3.0, 4.0, 5.0], dtype=jnp.float32)


CTRL_C_CHILD = Path(__file__).with_name("ctrl_c_child.py")


def interrupt(target: str, tmp_path, progress: bool = False):
    """Start ``ctrl_c_child.py`` on ``target``, send it SIGINT once its first slow node runs.

    Returns ``(seconds until KeyboardInterrupt reached it, nodes started by then, nodes started
    1.5 s later, the process)``; the process waits on its stdin, which the caller closes.
    """
    log = tmp_path / f"starts-{target.replace('/', '_').replace(':', '_')}-{progress}"
    proc = subprocess.Popen([sys.executable, str(CTRL_C_CHILD), target, str(log)]
                            + (["progress"] if progress else []),
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().startswith("ready")
    deadline = time.monotonic() + 60
    while not log.exists():  # the first node has started: the call is under way
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.02)
    time.sleep(0.2)
    sent = time.monotonic()
    proc.send_signal(signal.SIGINT)
    line = ""
    while not any(w in line for w in ("interrupted", "finished", "Error")):  # past progress bars
        line = proc.stdout.readline()
        assert line, "the child exited without a word"
    took = time.monotonic() - sent
    assert "interrupted" in line, line
    started = log.read_text().count("start")
    time.sleep(1.5)
    return took, started, log.read_text().count("start"), proc
