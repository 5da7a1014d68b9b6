"""daskdag never makes the host wait for a device value where the user's code does not (issue 68):
on a mixed DAG (jitted trunk, an eager gate with Python control flow on a value, jitted heads),
every call of every kind reads a device value on the host only where the gate does.

What is counted: the reads that go through ``jax.Array``'s host value (``bool``, ``float``,
``int``, ``.item()``, ``.tolist()``, ``jax.device_get``), by where they come from. (On the CPU,
``np.asarray`` of a ``jax.Array`` reads its buffer directly, without a hook to count it; on an
accelerator, ``jax.transfer_guard_device_to_host("disallow")`` catches it.)
"""

import collections
import sys

import dask
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src import array as jax_array

import daskdag

GATE = "gate"


def gate(h):
    return h * (0.5 if jnp.mean(jnp.abs(h)) > 1.0 else 1.0)


def layer(h, w):
    return jnp.tanh(h @ w)


def loss(g, v, y):
    return jnp.mean((g @ v - y) ** 2)


def dag() -> dict:
    return {"t0": daskdag.Node(layer, ["x", "w0"], jit=True),
            "t1": daskdag.Node(layer, ["t0", "w1"], jit=True),
            "g": (gate, ["t1"]),
            "L0": daskdag.Node(lambda g, v: loss(g, v, 0.0), ["g", "v0"], jit=True),
            "L1": daskdag.Node(lambda g, v: loss(g, v, 1.0), ["g", "v1"], jit=True),
            "S": daskdag.Node(lambda a, b: a + b, ["L0", "L1"], jit=True)}


def values() -> dict:
    rng = np.random.default_rng(0)
    return {name: jnp.asarray(rng.standard_normal(shape, np.float32))
            for name, shape in [("x", (5, 4)), ("w0", (4, 4)), ("w1", (4, 4)), ("v0", (4, 2)),
                                ("v1", (4, 2))]}


@pytest.fixture
def host_reads(monkeypatch):
    """Per function that asked, the host reads of device values it made (the innermost frame
    of the gate's module or of daskdag)."""
    reads: collections.Counter = collections.Counter()
    value = jax_array.ArrayImpl._value

    def counted(self):
        frame = sys._getframe(1)
        while frame is not None:
            name = frame.f_code.co_filename
            if "/daskdag/" in name or name == __file__:
                reads[frame.f_code.co_name if name == __file__ else
                      f"daskdag {frame.f_code.co_name}"] += 1
                break
            frame = frame.f_back
        return value.fget(self)

    monkeypatch.setattr(jax_array.ArrayImpl, "_value", property(counted))
    return reads


WRT = ["w0", "w1", "v0", "v1"]


def calls() -> dict:
    """Per kind, a call of it on the values (``value_and_grad`` prepared here)."""
    tangent = {"w1": jnp.ones((4, 4))}
    return {
        "compute_grads": lambda v: daskdag.compute_grads(dag(), v, ["L0", "L1"], wrt=WRT),
        "value_and_grad": daskdag.value_and_grad(dag(), "S", wrt=WRT),
        "jacobian": lambda v: daskdag.jacobian(dag(), v, ["L0", "L1"], wrt=["w1"]),
        "compute_jvps": lambda v: daskdag.compute_jvps(dag(), v, tangent, ["L0", "L1"],
                                                       wrt=["w1"]),
        "compute_hvps": lambda v: daskdag.compute_hvps(dag(), v, tangent, ["L0", "L1"],
                                                       wrt=["w1"]),
    }


CALLS = calls()


@pytest.mark.parametrize("kind", list(CALLS))
@pytest.mark.parametrize("scheduler", ["threads", "sync"])
def test_a_call_reads_device_values_on_the_host_only_where_the_users_code_does(
        kind, scheduler, host_reads):
    call, v = CALLS[kind], values()
    call(v)  # (its first call: checks, traces, compiles)
    host_reads.clear()
    with dask.config.set(scheduler=scheduler):
        jax.block_until_ready(call(v))
    assert dict(host_reads) == {GATE: 1}, dict(host_reads)


ONE, HALF = jnp.float32(1.0), jnp.float32(0.5)


def gate_of_device_values(h):
    # (gate's control flow, its constants device arrays: the user's code sends nothing)
    return h * HALF if jnp.mean(jnp.abs(h)) > ONE else h


@pytest.mark.parametrize("batch", ["auto", "always"])
@pytest.mark.parametrize("kind", [k for k in CALLS if k != "jacobian"])
@pytest.mark.parametrize("scheduler", ["threads", "sync"])
def test_a_call_sends_nothing_from_the_host_to_the_device(kind, scheduler, batch, monkeypatch):
    # Zeros, seeds, stacked cotangents and their slices are made on the device: each value sent
    # from the host is a transfer and a dispatch (about 0.1 ms each on a TPU host). (A
    # Jacobian's basis rows are made in NumPy and sent, once per output and stage.)
    monkeypatch.setattr(sys.modules[__name__], "gate", gate_of_device_values)
    call, v = calls()[kind], values()
    with dask.config.set({"scheduler": scheduler, "daskdag.batch-cotangents": batch}):
        want = call(v)
        with jax.transfer_guard_host_to_device("disallow"):
            got = jax.block_until_ready(call(v))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(a, b, rtol=1e-6)
