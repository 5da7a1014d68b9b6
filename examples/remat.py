"""Memory-bounded backward passes: nodes that recompute their forward pass in their
backward task (``Node(..., remat=True)``, as ``jax.checkpoint``) instead of keeping
residuals.

    x -> n0 -> n1 -> n2 -> n3 -> loss,
    n_i(h) = tanh(h[:, None] @ v_i[None, :]) @ u_i + h

Each node's output is 1,000 floats, but its residuals are two float32[1000, 5000] arrays
(40 MB). Prints how much Dask counts the residuals of one node's forward task as, with
and without remat, how often each node ran, and the largest difference to ``jax.grad``
of the composed function (each node under ``jax.checkpoint``); exits non-zero if
anything disagrees.
"""

import sys
from functools import partial

import dask
import jax
import jax.numpy as jnp
import numpy as np
from dask.sizeof import sizeof

import daskdag

rng = np.random.default_rng(0)
WEIGHTS = [(jnp.asarray(rng.standard_normal(5000, np.float32) / 50),
            jnp.asarray(rng.standard_normal(5000, np.float32) / 5000))
           for _ in range(4)]
runs = {}


def layer(h, v, u, name):
    runs[name] = runs.get(name, 0) + 1
    return jnp.tanh(h[:, None] @ v[None, :]) @ u + h


def chain(remat):
    dag, prev = {}, "x"
    for i, (v, u) in enumerate(WEIGHTS):
        dag[f"n{i}"] = daskdag.Node(partial(layer, v=v, u=u, name=f"n{i}"), [prev],
                                    remat=remat)
        prev = f"n{i}"
    dag["loss"] = (lambda h: jnp.sum(h * h), [prev])
    return dag


def composed(x):
    for v, u in WEIGHTS:
        x = jax.checkpoint(
            lambda h, v=v, u=u: jnp.tanh(h[:, None] @ v[None, :]) @ u + h)(x)
    return jnp.sum(x * x)


x = jnp.linspace(-1.0, 1.0, 1000)
want = jax.grad(composed)(x)
worst = 0.0
for remat in (False, True):
    runs.clear()
    res = daskdag.compute_grads(chain(remat), x, "loss")
    worst = max(worst,
                float(jnp.max(jnp.abs(res.grad - want)) / jnp.max(jnp.abs(want))))
    # each node: once, or with remat twice (forward, then in its backward task)
    ran = dict(runs)
    assert set(ran.values()) == {2 if remat else 1}, ran
    # What Dask counts node n1's forward task as (its value and its pullback), each
    # node a task
    with dask.config.set({"daskdag.fuse-chains": False}):
        graph = dict(daskdag.grads(chain(remat), x, "loss").__dask_graph__())
    [key] = [k for k in graph if k.startswith("fwd:n1-")]
    held = sizeof(dask.get(graph, key))
    print(f"remat={remat}: node n1's forward task holds {held / 1e6:.1f} MB as Dask "
          f"sees it; each node ran {ran['n1']} time(s) in compute_grads")
    assert held > 30e6 if not remat else held < 1e5, held
print("largest relative difference to jax.grad of the composed function (JAX): "
      f"{worst:.1e}")
sys.exit(0 if worst < 1e-4 else 1)
