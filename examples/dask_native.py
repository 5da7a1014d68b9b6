"""daskdag as Dask: a lazy call computed with other Dask work, persisted, a sweep over a
dask array streamed to Zarr, and daskdag's log. The README's "Lazily" and "Sweeps over
dask arrays" sections point here; tests/test_examples.py runs it.

Prints what each step gave and the largest difference to plain JAX; exits non-zero if
any disagrees.
"""

import logging
import sys
import tempfile

import dask
import dask.array as da
import jax
import jax.numpy as jnp
import numpy as np

import daskdag

W = np.linspace(-1.0, 1.0, 256, dtype=np.float32)
dag = {"A": daskdag.Node(lambda x, w: jnp.tanh(x) * w, ["x", "w"], vmap=True),
       "S": daskdag.Node(lambda a: jnp.sum(a ** 2), ["A"], vmap=True),
       "M": daskdag.Node(lambda a: jnp.max(a), ["A"], vmap=True)}


def reference(x):
    a = jnp.tanh(x) * W
    return jnp.sum(a ** 2), jnp.max(a)


def main() -> int:
    logging.basicConfig(level=logging.WARNING,
                        format="%(name)s %(levelname)s: %(message)s")
    # what daskdag submits, and where
    logging.getLogger("daskdag").setLevel(logging.INFO)
    worst = 0.0
    x = np.linspace(0.0, 2.0, 256, dtype=np.float32)

    # The eager call, as daskdag's log shows it; then the same call lazily, computed
    # with a dask.array reduction in one go.
    daskdag.compute_grads(dag, {"x": x, "w": W}, ["S", "M"], wrt=["x"])
    call = daskdag.grads(dag, {"x": x, "w": W}, ["S", "M"], wrt=["x"])
    print(call)
    res, total = dask.compute(call, da.from_array(x, chunks=64).sum())
    s, gs = reference(x)[0], jax.grad(lambda x: reference(x)[0])(x)
    worst = max(worst, abs(float(res["S"].value - s)),
                float(jnp.max(jnp.abs(res["S"].grad["x"] - gs))))
    print("S =", res["S"].value, " M =", res["M"].value, " sum(x) =", total)

    # A sweep over a dask array: lazy, on the input's chunks, streamed into Zarr.
    xs = (da.random.default_rng(0).random((1024, 256), chunks=(128, 256))
          .astype(np.float32))
    swept = daskdag.sweep_grads(dag, {"x": xs, "w": W}, "S", batched=["x"])
    print("gradients:", swept.grad["x"])
    with tempfile.TemporaryDirectory() as store:
        dask.compute(da.to_zarr(swept.value, f"{store}/out.zarr", component="value",
                                compute=False),
                     da.to_zarr(swept.grad["x"], f"{store}/out.zarr", component="grad",
                                compute=False))
        got = da.from_zarr(f"{store}/out.zarr", component="grad")[:128].compute()
    want = jax.vmap(jax.grad(lambda x: reference(x)[0]))(xs[:128].compute())
    worst = max(worst, float(np.max(np.abs(got - want))))
    print(f"largest difference to plain JAX: {worst:.2e}")
    return 0 if worst < 1e-4 else 1


if __name__ == "__main__":
    sys.exit(main())
