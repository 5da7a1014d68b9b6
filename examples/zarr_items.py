"""Per-item gradients over a dataset stored in Zarr, on a cluster: finding mislabelled
items.

A logistic-regression model, already fitted, and a labelled dataset in a Zarr store
(features ``x``, labels ``y``), some of whose labels are wrong. The gradient of each
item's loss with respect to the model's weights says how hard that item pulls on the
model: mislabelled items pull hardest, so the per-item gradient norm is a cheap way to
find them (as in data-valuation and influence methods, which start from these
gradients).

    x (item), w (shared) -> logit -> nll  (this item's loss, with its label y)
                                  -> p    (the predicted probability)

The store is read with ``dask.array.from_zarr``; ``daskdag.sweep_grads`` over the dask
arrays returns dask arrays at once (nothing runs yet): the losses, the probabilities and
one gradient of the loss per item with respect to the shared ``w``, on the store's item
chunks. One ``dask.compute`` on a two-worker ``LocalCluster`` writes them back into the
store, a chunk of items per task, and the largest gradient norms are read back from it.
Prints what was found and the largest difference to ``jax.vmap(jax.grad(...))``; exits
non-zero if they disagree.
"""

import sys
import tempfile
import time

import dask
import dask.array as da
import jax
import jax.numpy as jnp
import numpy as np
import zarr
from distributed import Client, LocalCluster

import daskdag

N, F, CHUNK, FLIPPED = 4096, 32, 512, 40


def logit(x, w):
    # the last feature is a constant 1 (bias)
    return jnp.dot(x[:-1], w[:-1]) + w[-1] * x[-1]


def nll(z, y):  # the binary cross-entropy of one item, from its logit
    return jax.nn.softplus(z) - y * z


dag = {
    "logit": daskdag.Node(logit, ["x", "w"], vmap=True),
    "nll": daskdag.Node(nll, ["logit", "y"], vmap=True),
    "p": daskdag.Node(jax.nn.sigmoid, ["logit"], vmap=True),
}


def write_dataset(path: str) -> tuple[np.ndarray, np.ndarray]:
    """A small labelled dataset in a Zarr (v3) store, FLIPPED of its labels wrong;
    returns the model's weights and which items were flipped."""
    rng = np.random.default_rng(0)
    w = np.append(rng.normal(size=F - 1), 0.3).astype(np.float32)
    x = np.concatenate([rng.normal(size=(N, F - 1)), np.ones((N, 1))],
                       axis=1).astype(np.float32)
    # a confident model
    y = (rng.random(N) < 1 / (1 + np.exp(-2 * x @ w))).astype(np.float32)
    flipped = rng.choice(N, FLIPPED, replace=False)
    y[flipped] = 1 - y[flipped]
    root = zarr.open_group(path, mode="w")
    root.create_array("x", shape=x.shape, chunks=(CHUNK, F), dtype="float32")[:] = x
    root.create_array("y", shape=y.shape, chunks=(CHUNK,), dtype="float32")[:] = y
    return w, np.sort(flipped)


def shown(a) -> str:
    """A dask array's repr, indented, over two lines (the second its chunks)."""
    return "  " + repr(a).replace(" chunksize=", "\n             chunksize=")


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        store = f"{tmp}/items.zarr"
        w, flipped = write_dataset(store)
        x, y = (da.from_zarr(store, component="x"),
                da.from_zarr(store, component="y"))
        print("dataset:", shown(x), shown(y), sep="\n")

        with (LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                           dashboard_address=":0") as cluster,
              Client(cluster) as client):
            t = time.perf_counter()
            res = daskdag.sweep_grads(dag, {"x": x, "y": y, "w": w}, ["nll", "p"],
                                      batched=["x", "y"], wrt=["w"], client=client)
            # a dask array, one gradient per item: nothing ran yet
            grads = res["nll"].grad["w"]
            print("per-item gradients:", shown(grads), sep="\n")
            dask.compute(
                da.to_zarr(res["nll"].value, store, component="nll", compute=False),
                da.to_zarr(res["p"].value, store, component="p", compute=False),
                da.to_zarr(grads, store, component="grad_w", compute=False))
            print(f"swept {N} items on "
                  f"{len(client.scheduler_info()['workers'])} workers and "
                  f"wrote them to Zarr in {time.perf_counter() - t:.1f} s")

        stored = zarr.open_group(store, mode="r")
        print("store now holds:", sorted(stored.array_keys()))
        got_g, got_nll, got_p = stored["grad_w"][:], stored["nll"][:], stored["p"][:]
        norms = np.linalg.norm(got_g, axis=1)
        top = np.sort(np.argsort(norms)[-FLIPPED:])
        median, median_flipped = np.median(norms), np.median(norms[flipped])
        print(f"the {FLIPPED} largest gradient norms: "
              f"{len(np.intersect1d(top, flipped))} of "
              f"them are the {FLIPPED} flipped labels\n"
              f"   (median norm {median:.3f}, flipped {median_flipped:.3f})")

        xs, ys = stored["x"][:], stored["y"][:]

    def item_loss(w, x, y):
        return nll(logit(x, w), y)

    want_g = jax.vmap(jax.grad(item_loss), (None, 0, 0))(w, xs, ys)
    want_nll = jax.vmap(item_loss, (None, 0, 0))(w, xs, ys)
    want_p = jax.vmap(lambda x: jax.nn.sigmoid(logit(x, w)))(xs)
    worst = max(float(jnp.max(jnp.abs(got_g - want_g))),
                float(jnp.max(jnp.abs(got_nll - want_nll))),
                float(jnp.max(jnp.abs(got_p - want_p))))
    print("largest difference to jax.vmap(jax.grad(...)) in plain JAX: "
          f"{worst:.2e}")
    return 0 if worst < 1e-4 else 1


if __name__ == "__main__":
    sys.exit(main())
