"""A sweep's failed items, as users meet them: a failed sweep (items collected as failed, or the
first one raised) leaves nothing behind on the cluster or in its errors' frames; a sweep with no
items, or where every item fails (NaN rows), keeps its results' shapes; and the progress bar
counts item by item, on threads and on a cluster. (A lost worker: test_lost_workers.py and
test_internal_sweep_datapath.py; Ctrl-C: test_interrupts.py.)"""

import collections
import gc
import re
import time

import distributed
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import daskdag
from daskdag import NodeError
from daskdag.sweeps import progress
from .support.clusters import eventually, kept_keys, local_client, only_kept_left, scheduler_tasks
from .support.numbers import assert_tree_close
from .support.progress import Recorded


def encode(x, w):
    return jnp.tanh(w @ x)


def flaky(h):
    if jnp.sum(h) > 1.0:
        raise FloatingPointError("diverged")
    return jnp.sum(h ** 2)


# -- 1. failed sweeps release everything ----------------------------------------------------------

def live_futures(client):
    gc.collect()
    return [f for f in gc.get_objects() if isinstance(f, distributed.Future) and f.client is client]


@pytest.mark.cluster
@pytest.mark.timeout(180)
def test_failed_sweeps_release_everything_on_the_cluster():
    dag = {"H": (encode, ["x", "w"]), "L": (flaky, ["H"])}
    xs = jnp.linspace(-1.0, 1.0, 24)[:, None] * jnp.ones((24, 3))  # the last items fail
    inputs = {"x": xs, "w": jnp.eye(3)}
    with local_client() as client:
        before = scheduler_tasks(client)

        def released():
            return only_kept_left(client, before) and not any(
                n for k, n in client.refcount.items() if k not in kept_keys(client))

        def details():
            return (f"the scheduler holds {scheduler_tasks(client)} tasks ({before} before), "
                    f"the client {len(client.futures)} futures, {len(kept_keys(client))} kept")

        res = daskdag.sweep_grads(dag, inputs, "L", batched=["x"], chunk_size=4, errors="collect",
                                  client=client)
        assert res.failed
        eventually(released, 30, "the failed sweep's tasks and futures released", details)
        # the kept errors hold no frame holding a future; the client keeps its values alone
        assert {f.key for f in live_futures(client)} <= kept_keys(client)
        for i, err in res.failed.items():
            assert err.item == i and err.original.__traceback__ is None
            assert "in flaky" in "".join(err.original.__notes__)  # where it raised, as text

        with pytest.raises(NodeError, match="node 'L'") as raised:
            daskdag.sweep_grads(dag, inputs, "L", batched=["x"], chunk_size=4, client=client)
        # raised.value's traceback holds the sweep's frames, and still nothing is held
        assert raised.value.item == min(res.failed)
        eventually(released, 30, "the raising sweep's tasks and futures released", details)


def test_kept_errors_hold_no_frames_on_threads():
    dag = {"H": (encode, ["x", "w"]), "L": (flaky, ["H"])}
    xs = jnp.linspace(-1.0, 1.0, 12)[:, None] * jnp.ones((12, 3))
    res = daskdag.sweep_grads(dag, {"x": xs, "w": jnp.eye(3)}, "L", batched=["x"], chunk_size=4,
                              errors="collect")
    assert res.failed
    for err in res.failed.values():
        chain = [err, err.original]
        assert all(e.__traceback__ is None for e in chain)
        assert "in flaky" in "".join(err.original.__notes__)


# -- 2 and 3. no items, no successful item ----------------------------------------------------------

def pytree_dag():
    """A pytree input, a shared input and a pytree output that is not a scalar."""
    def f(p, w):
        return {"s": jnp.sin(p["a"]) @ w, "t": jnp.sum(p["c"] ** 2)}

    return {"Z": (f, ["p", "w"])}, f


def pytree_inputs(n):
    return {"p": {"a": jnp.ones((n, 2, 3)), "c": jnp.ones((n, 4))}, "w": jnp.ones((3, 5))}


def item_shapes(fn, inputs, batched):
    """One item's value and gradients, shaped by jax itself on the composed function."""
    one = {i: jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:] if i in batched else a.shape,
                                                          a.dtype), v) for i, v in inputs.items()}
    return jax.eval_shape(fn, *one.values()), one


def test_no_items_gives_shaped_empty_results():
    dag, f = pytree_dag()
    inputs = pytree_inputs(0)
    ct = {"s": jnp.ones((2, 5)), "t": jnp.float32(1.0)}
    res = daskdag.sweep_grads(dag, inputs, "Z", batched=["p"], wrt=["p", "w"], cotangents={"Z": ct})
    value, one = item_shapes(f, inputs, batched=["p"])
    for got, want in [(res.value, value), (res.grad["p"], one["p"]), (res.grad["w"], one["w"])]:
        assert jax.tree.structure(got) == jax.tree.structure(want)
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            assert g.shape == (0, *w.shape) and g.dtype == w.dtype
    assert res.failed == {}


def test_no_items_with_a_node_that_cannot_be_traced_gives_value_none():
    def branchy(h):
        return jnp.sum(h) if jnp.sum(h) > 0 else -jnp.sum(h)  # Python control flow on a value

    dag = {"H": (encode, ["x", "w"]), "B": (branchy, ["H"])}
    res = daskdag.sweep_grads(dag, {"x": jnp.ones((0, 3)), "w": jnp.eye(3)}, "B", batched=["x"])
    assert res.value is None  # the documented fallback
    assert res.grad["x"].shape == (0, 3)


def failing_backward():
    @jax.custom_vjp
    def g(h):
        return jnp.sum(h ** 2)

    def bwd(_, ct):
        raise ArithmeticError("no gradient here")

    g.defvjp(lambda h: (g(h), None), bwd)
    return g


def test_collect_where_every_item_fails_returns_nan_rows():
    dag, f = pytree_dag()
    g = failing_backward()
    dag = {**dag, "L": (lambda z: g(z["s"]) + z["t"], ["Z"])}
    inputs = pytree_inputs(5)
    res = daskdag.sweep_grads(dag, inputs, ["Z", "L"], batched=["p"], errors="collect",
                              cotangents={"Z": {"s": jnp.ones((2, 5)), "t": jnp.float32(1.0)}})
    value, one = item_shapes(lambda p, w: (f(p, w), g(f(p, w)["s"])), inputs, batched=["p"])
    for o, want in zip(["Z", "L"], value):
        assert sorted(res[o].failed) == list(range(5))
        assert all(e.phase == "backward" for e in res[o].failed.values())
        for got, w in [(res[o].value, want), (res[o].grad["p"], one["p"])]:
            assert jax.tree.structure(got) == jax.tree.structure(w)
            for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(w)):
                assert a.shape == (5, *b.shape) and a.dtype == b.dtype and np.isnan(a).all()


# -- 4. progress per item ---------------------------------------------------------------------------

def slow_square(x):
    time.sleep(0.05)
    return jnp.sum(x ** 2)


def check_progress_per_item(monkeypatch, client):
    monkeypatch.setattr(progress, "tqdm", Recorded)
    Recorded.counts = []
    items = 16  # one chunk: any count between 0 and 16 was reported from inside it
    res = daskdag.sweep_grads({"L": (slow_square, ["x"])}, jnp.ones((items, 3)), "L",
                              chunk_size=items, progress=True, client=client)
    counts = Recorded.counts
    assert any(0 < c < items for c in counts), counts
    assert counts == sorted(counts) and counts[-1] == items
    assert_tree_close(res.grad, 2 * jnp.ones((items, 3)))


def test_progress_advances_per_item_on_threads(monkeypatch):
    check_progress_per_item(monkeypatch, None)


@pytest.mark.cluster
@pytest.mark.timeout(180)
def test_progress_advances_per_item_on_a_cluster(monkeypatch):
    with local_client() as client:
        check_progress_per_item(monkeypatch, client)


# -- 5. each item runs once, a failing one too --------------------------------------------------

COUNTING_DAG = '''
import jax
import jax.numpy as jnp

import daskdag

LOG = {log!r}
FAIL = {fail!r}  # {{item: where it fails: "h", "loss" (forward), "g backward"}}


def counted(what, i):
    with open(LOG, "a") as f:
        f.write(f"{{what}} {{int(i)}}\\n")
    if FAIL.get(int(i)) == what:
        raise ValueError(f"{{what}} fails on item {{int(i)}}")


def h(x, i):
    counted("h", i)
    return jnp.tanh(x)


@jax.custom_vjp
def double(a, i):
    return a * 2.0


def double_fwd(a, i):
    return a * 2.0, i


def double_bwd(i, ct):
    counted("g backward", i)
    return ct * 2.0, None


double.defvjp(double_fwd, double_bwd)


def g(h, i):
    counted("g", i)
    return double(h, i)


def loss(g, i):
    counted("loss", i)
    return jnp.sum(g ** 2)


def loss_of_both(g, h, i):
    counted("loss", i)
    return jnp.sum(g ** 2) + 0.0 * jnp.sum(h)


def loss_over_a_chunk(g):  # (vmap=True: traced, its Python code runs once per shapes)
    return jnp.sum(g ** 2)


DAGS = {{  # a chain (one vjp per item), h used twice (node by node), a vmap=True last node
    "chain": {{"h": (h, ["x", "i"]), "g": (g, ["h", "i"]), "loss": (loss, ["g", "i"])}},
    "fan-out": {{"h": (h, ["x", "i"]), "g": (g, ["h", "i"]),
                "loss": (loss_of_both, ["g", "h", "i"])}},
    "vmap": {{"h": (h, ["x", "i"]), "g": (g, ["h", "i"]),
             "loss": daskdag.Node(loss_over_a_chunk, ["g"], vmap=True)}},
}}
'''

ITEMS = 12
XS = np.linspace(-1.0, 1.0, ITEMS * 3, dtype=np.float32).reshape(ITEMS, 3)


def counting_module(tmp_path, fail: dict):
    """:data:`COUNTING_DAG` as a user's module of its own (workers cannot import it): each node
    call, and each backward call of node g, noted in ``tmp_path/log`` by item; failing where
    ``fail`` says."""
    import importlib.util
    import sys
    import uuid

    name = f"counting_dag_{uuid.uuid4().hex[:8]}"
    path = tmp_path / f"{name}.py"
    path.write_text(COUNTING_DAG.format(log=str(tmp_path / "log"), fail=fail))
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def calls(tmp_path) -> collections.Counter:
    """``{(what, item): times}``."""
    log = tmp_path / "log"
    lines = log.read_text().splitlines() if log.exists() else []
    return collections.Counter((w.rsplit(" ", 1)[0], int(w.rsplit(" ", 1)[1])) for w in lines)


def plain_jax():
    """Each item's value and gradient of the composed function, in plain JAX."""
    return jax.vmap(jax.value_and_grad(lambda x: jnp.sum((jnp.tanh(x) * 2.0) ** 2)))(XS)


def sweep_counted(m, errors, shape="chain", **kw):
    return daskdag.sweep_grads(m.DAGS[shape], {"x": XS, "i": np.arange(ITEMS)}, "loss",
                               batched=["x", "i"], wrt=["x"], chunk_size=2, errors=errors, **kw)


WHERE = ["h", "loss", "g backward"]


def check_each_item_once(tmp_path, where, errors, store=False, shape="chain", **kw):
    """Item 7 fails (in chunk 6-7 of 2 items): every other item is computed once, forward
    and backward, and item 7 once up to where it fails, never after; its error names it. With
    a store, the same call again computes nothing (the failure is kept) under 'collect'; under
    'raise', item 7 alone (a failure is not kept)."""
    m = counting_module(tmp_path, {7: where})
    run = lambda: sweep_counted(m, errors, shape, store=tmp_path / "store" if store else None,  # noqa: E731
                                **kw)
    # (a node's backward pass fails under its stage's name where nodes run as one: 'h+g+loss')
    node = where.split()[0] if where != "g backward" else r"(h\+)?g(\+loss)?"
    named = (f"item 7: node '{node}' failed in its "
             f"{'backward' if 'backward' in where else 'forward'} pass: ValueError: {where} "
             f"fails on item 7")
    if errors == "raise":
        with pytest.raises(NodeError, match=named):
            run()
    else:
        res = run()
        assert sorted(res.failed) == [7] and re.match(named, str(res.failed[7]))
        value, grad = plain_jax()
        ok = np.arange(ITEMS) != 7
        np.testing.assert_allclose(res.value[ok], value[ok], rtol=1e-5)
        np.testing.assert_allclose(res.grad["x"][ok], grad[ok], rtol=1e-5, atol=1e-6)
        assert np.isnan(res.value[7]) and np.isnan(res.grad["x"][7]).all()
    seen = calls(tmp_path)
    assert max(seen.values()) == 1, {k: n for k, n in seen.items() if n > 1}
    counted = ["h", "g", "loss", "g backward"] if shape != "vmap" else ["h", "g", "g backward"]
    reached = counted[:counted.index(where) + 1]
    assert {w for w, i in seen if i == 7} == set(reached)
    done = range(ITEMS) if errors == "collect" else range(7)  # (raise: at least those)
    assert {(w, i) for w in counted for i in done if i != 7} <= set(seen)
    if store:
        before = calls(tmp_path)
        if errors == "collect":
            assert sorted(run().failed) == [7]
            assert calls(tmp_path) == before  # nothing computed again
        else:
            with pytest.raises(NodeError, match="item 7"):
                run()
            again = calls(tmp_path) - before
            assert {i for _, i in again} <= {7} | set(range(8, ITEMS)) - {i for _, i in before}
            assert {(w, 7) for w in reached} <= set(again)


@pytest.mark.parametrize("store", [False, True], ids=["", "store"])
@pytest.mark.parametrize("errors", ["collect", "raise"])
@pytest.mark.parametrize("shape, where", [(shape, where) for shape in ["chain", "fan-out", "vmap"]
                                          for where in WHERE
                                          # (a vmap=True node runs over the chunk, not an item)
                                          if (shape, where) != ("vmap", "loss")])
def test_each_item_runs_once_a_failing_one_up_to_its_failure(tmp_path, shape, where, errors,
                                                             store):
    check_each_item_once(tmp_path, where, errors, store, shape)


@pytest.mark.cluster
@pytest.mark.timeout(240)
@pytest.mark.parametrize("errors", ["collect", "raise"])
def test_each_item_runs_once_on_a_cluster(tmp_path, errors):
    with local_client() as client:
        for where in WHERE:
            (tmp_path / where.replace(" ", "_")).mkdir()
            check_each_item_once(tmp_path / where.replace(" ", "_"), where, errors, store=True,
                                 client=client)


@pytest.mark.cluster
@pytest.mark.timeout(240)
def test_each_item_runs_once_on_a_cluster_that_cannot_import_the_module(tmp_path, cli_client):
    for where in WHERE:
        (tmp_path / where.replace(" ", "_")).mkdir()
        check_each_item_once(tmp_path / where.replace(" ", "_"), where, "collect",
                             client=cli_client)
