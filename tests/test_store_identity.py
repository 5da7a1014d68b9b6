"""What a durable sweep's store records of its DAG's nodes (:mod:`daskdag.transport.content`,
:func:`daskdag.durable.identity.node_parts`): an edit that changes nothing a node computes (a
comment above it, a docstring, the script renamed or moved) resumes the stored sweep, computing
no stored item again; a change to what it computes (a constant in its code, a global rebound,
an array it closes over changed) is refused, naming the node and what differs. On threads, on
a process cluster, and on a cluster whose workers cannot import the user's module.

Node calls are counted in a file (each node appends its name and item), so that workers' calls
count too and the node functions' content stays the same between calls.
"""

import importlib.util
import json
import sys
import uuid
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import daskdag

N, CHUNK = 12, 4
XS = np.random.default_rng(5).uniform(-1.0, 1.0, (N, 3)).astype(np.float32)

SOURCE = '''
"""A sweep's DAG, as a user's script holds it."""
import jax.numpy as jnp
import numpy as np

COUNT = {count!r}
SCALE = 2.0
W = np.linspace(0.5, 1.5, 3).astype(np.float32)


def counted(node, i):
    with open(COUNT, "a") as f:
        f.write(f"{{node}} {{int(i)}}\\n")


def a(x, i):
    """The first node."""
    counted("A", i)
    return jnp.sin(x) * 3.0


def g(a, i):
    counted("G", i)
    return a * SCALE


def make_s(w):
    def s(g, i):
        counted("S", i)
        return jnp.sum((g * w) ** 2)
    return s


DAG = {{"A": (a, ["x", "i"]), "G": (g, ["A", "i"]), "S": (make_s(W), ["G", "i"])}}
'''

EDITED = '''# A comment added at the top of the script, and another below.
#
# (The script was renamed and moved too.)
''' + SOURCE.replace('"""The first node."""', '"""The first node, its docstring edited."""')


def load(path: Path, source: str):
    """``source`` written to ``path`` and imported from there, as a fresh module named after
    the file (as ``import`` would run a user's script)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(source)
    # (a name no other test's module took: one module object per name in this process)
    name = f"{path.stem}_{uuid.uuid4().hex[:8]}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def script(tmp_path: Path, where: str, source: str = SOURCE):
    return load(tmp_path / where, source.format(count=str(tmp_path / "count")))


def calls(tmp_path: Path) -> list[tuple[str, int]]:
    f = tmp_path / "count"
    return [(n, int(i)) for n, i in (line.split() for line in f.read_text().splitlines())] \
        if f.exists() else []


def sweep(m, store, **kw):
    return daskdag.sweep_grads(m.DAG, {"x": XS, "i": np.arange(N)}, "S", batched=["x", "i"],
                               wrt=["x"], chunk_size=CHUNK, store=store, **kw)


def reference(scale=2.0, w=None):
    """Values and gradients of the composed function, in plain JAX, item by item."""
    w = np.linspace(0.5, 1.5, 3).astype(np.float32) if w is None else w
    composed = lambda x: jnp.sum((jnp.sin(x) * 3.0 * scale * w) ** 2)  # noqa: E731
    return jax.vmap(jax.value_and_grad(composed))(jnp.asarray(XS))


def assert_is_reference(res):
    value, grad = reference()
    np.testing.assert_allclose(res.value, value, rtol=1e-5)
    np.testing.assert_allclose(res.grad["x"], grad, rtol=1e-5, atol=1e-6)


def files(store: Path) -> dict[str, bytes]:
    return {str(p.relative_to(store)): p.read_bytes() for p in store.rglob("*") if p.is_file()}


def check_identity(tmp_path, **kw):
    """Stored with the script as first written; a piece lost (as an interrupted sweep loses
    what it had not written); resumed from the edited, renamed, moved script, computing the
    lost piece alone; then refused after each real change, naming the node and what differs,
    with nothing computed or written."""
    store = tmp_path / "store"
    first = script(tmp_path, "project/sweep_dag.py")
    assert_is_reference(sweep(first, store, **kw))
    assert sorted(calls(tmp_path)) == sorted((n, i) for n in "AGS" for i in range(N))
    pieces = sorted(p for p in (store / "done").iterdir() if p.is_dir())
    assert len(pieces) == N // CHUNK
    lost = pieces[1]
    lo, hi = map(int, lost.name.split("-"))
    for p in lost.iterdir():
        p.unlink()
    lost.rmdir()
    before = len(calls(tmp_path))

    edited = script(tmp_path, "elsewhere/renamed_script.py", EDITED)
    assert edited.a.__code__.co_filename != first.a.__code__.co_filename
    assert edited.a.__code__.co_firstlineno != first.a.__code__.co_firstlineno
    assert_is_reference(sweep(edited, store, **kw))
    assert sorted(calls(tmp_path)[before:]) == sorted((n, i) for n in "AGS" for i in range(lo, hi))

    kept, before = files(store), len(calls(tmp_path))
    constant = script(tmp_path, "changed/constant.py", SOURCE.replace("* 3.0", "* 3.5"))
    rebound = script(tmp_path, "changed/rebound.py")
    rebound.SCALE = 3.0
    in_place = script(tmp_path, "changed/in_place.py")
    in_place.W[0] += 1.0  # (the array node S closes over)
    for m, what in [(constant, "the DAG's nodes ['A'] differ (node 'A': its code)"),
                    (rebound, "the DAG's nodes ['G'] differ (node 'G': the global 'SCALE')"),
                    (in_place, "the DAG's nodes ['S'] differ (node 'S': the value it closes "
                               "over, 'w')")]:
        with pytest.raises(daskdag.StoreError) as refused:
            sweep(m, store, **kw)
        assert what in str(refused.value), str(refused.value)
    assert files(store) == kept and len(calls(tmp_path)) == before


def test_an_edit_that_changes_nothing_resumes_a_real_change_is_refused(tmp_path):
    check_identity(tmp_path)


@pytest.mark.cluster
@pytest.mark.timeout(240)
def test_on_a_process_cluster(tmp_path, client):
    check_identity(tmp_path, client=client)


@pytest.mark.cluster
@pytest.mark.timeout(240)
def test_on_a_cluster_that_cannot_import_the_script(tmp_path, cli_client):
    check_identity(tmp_path, client=cli_client)


def test_a_store_of_an_older_format_is_refused_saying_so(tmp_path):
    store = tmp_path / "store"
    m = script(tmp_path, "project/sweep_dag.py")
    sweep(m, store)
    root = json.loads((store / "zarr.json").read_text())
    root["attributes"]["daskdag"]["format"] = 2
    (store / "zarr.json").write_text(json.dumps(root))
    kept, before = files(store), len(calls(tmp_path))
    with pytest.raises(daskdag.StoreError, match="in store format 2; this daskdag .* reads "
                                                 "format 5 only"):
        sweep(m, store)
    assert files(store) == kept and len(calls(tmp_path)) == before


HOLDS_A_MODULE = '''
import jax.numpy as jnp


def make_g(params):
    return lambda a, i: a * params.SCALE


def a(x, i):
    return jnp.sin(x) * 3.0


def s(g, i):
    return jnp.sum(g ** 2)


def dag(params):
    return {"A": (a, ["x", "i"]), "G": (make_g(params), ["A", "i"]), "S": (s, ["G", "i"])}
'''


def check_a_module_held_by_a_closure(tmp_path, **kw):
    """A node that reads a module of the user's through a value it closes over: changing what
    it reads of the module is a change, refused naming the node; the rest of the module is not."""
    store = tmp_path / "store"
    params = load(tmp_path / "project/params.py", "SCALE = 2.0\nUNUSED = 0\n")
    m = load(tmp_path / "project/holder.py", HOLDS_A_MODULE)
    first = sweep(as_script(m.dag(params)), store, **kw)
    params.UNUSED = 1  # (no node reads it)
    np.testing.assert_array_equal(sweep(as_script(m.dag(params)), store, **kw).value, first.value)
    params.SCALE = 3.0
    with pytest.raises(daskdag.StoreError, match=r"node 'G': the value it closes over, 'params'"):
        sweep(as_script(m.dag(params)), store, **kw)


def as_script(dag):
    """A stand-in module holding ``dag`` as ``DAG``, for :func:`sweep`."""
    return type("Script", (), {"DAG": dag})


def test_a_module_held_by_a_closure_counts(tmp_path):
    check_a_module_held_by_a_closure(tmp_path)


@pytest.mark.cluster
@pytest.mark.timeout(240)
def test_a_module_held_by_a_closure_counts_on_a_cluster(tmp_path, cli_client):
    check_a_module_held_by_a_closure(tmp_path, client=cli_client)
