"""The command line's files: inputs and cotangents read from ``.npz`` (dict inputs leaf by leaf,
key paths joined with dots), results written to one, and the summary printed."""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from daskdag.cli import UsageError

NPZ_LAYOUT = """npz layout:
  --inputs: one key per free input of the DAG, named after it. A dict-shaped input is given leaf
    by leaf, its key path joined with dots: params.w, params.b -> params = {'w': ..., 'b': ...}.
    A DAG with a single free input also takes a file with the single key arr_0 (what
    numpy.savez(file, x) writes). Keys that name no free input are an error (exit 2).
  --cotangents: the same, keyed by output names (sweep: one item's cotangent, for every item).
  RESULT.npz: <output>.value and <output>.grad.<input or node in --wrt>, pytree leaves joined
    with their key path (D.value.a, D.grad.params.w); None and non-array leaves are left out.
    sweep: every array has a leading item axis; with --errors collect, <output>.failed holds
    the indices of the failed items (their rows are NaN).
  Arrays become JAX arrays: float64 ones are computed in float32 unless JAX_ENABLE_X64=1 is set
    (on a cluster's workers too)."""


def load_npz(path: str | os.PathLike[str], names: Sequence[str], what: str,
             needed: Iterable[str] = (), single_ok: bool = False) -> dict:
    """``{name: value}`` from ``path``, keys matched against ``names`` (dotted keys: leaves of a
    dict-shaped value). ``needed`` must all be there; ``single_ok``: one name and a file with
    the single key ``arr_0`` (``numpy.savez(file, x)``) gives it."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise UsageError(f"no {what} file {str(p)!r}")
    try:
        with np.load(p, allow_pickle=False) as f:
            arrays = {k: f[k] for k in f.files}
    except Exception as e:
        raise UsageError(f"cannot read {what} file {str(p)!r} as .npz: "
                         f"{type(e).__name__}: {e}") from e
    if single_ok and len(names) == 1 and list(arrays) == ["arr_0"]:
        arrays = {names[0]: arrays["arr_0"]}
    by_length = sorted(names, key=len, reverse=True)
    values: dict[str, Any] = {}
    extra = []
    for key, a in arrays.items():
        name = next((n for n in by_length if key == n or key.startswith(n + ".")), None)
        if name is None:
            extra.append(key)
            continue
        if name in values and (key == name or not isinstance(values[name], dict)):
            raise UsageError(f"{what} file {str(p)!r} gives {name!r} both whole and leaf by leaf")
        if key == name:
            values[name] = a
            continue
        node = values.setdefault(name, {})
        *parents, leaf = key[len(name) + 1:].split(".")
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise UsageError(f"{what} file {str(p)!r}: key {key!r} goes below a leaf")
        if leaf in node:
            raise UsageError(f"{what} file {str(p)!r}: key {key!r} goes below a leaf")
        node[leaf] = a
    keys = ", ".join(arrays) or "none"
    for n in needed:
        if n not in values:
            raise UsageError(f"{what} file {str(p)!r} has no value for {n!r}; its keys: {keys}")
    if extra:
        raise UsageError(f"{what} file {str(p)!r} has keys that name no "
                         f"{'free input' if what == 'inputs' else 'requested output'}: "
                         f"{', '.join(extra)} (expected: {', '.join(names) or 'none'})")
    return values


def to_jax(tree: Any) -> Any:
    return jax.tree.map(jnp.asarray, tree)


def flatten(prefix: str, tree: Any) -> dict:
    """``{prefix.key.path: array}`` for the array leaves of ``tree``."""
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if isinstance(leaf, (bool, int, float, complex)) or hasattr(leaf, "__array__"):
            a = np.asarray(leaf)
            if a.dtype.kind in "biufc":
                key = jax.tree_util.keystr(path, simple=True, separator=".")
                out[f"{prefix}.{key}" if path else prefix] = a
    return out


def result_arrays(results: dict, inputs: Sequence[str], wrt: Sequence[str] | None) -> dict:
    """The RESULT.npz arrays of ``{output: Result}``, given the DAG's free inputs and ``--wrt``."""
    alone = len(inputs) == 1 and (wrt is None or list(wrt) == list(inputs))
    arrays = {}
    for o, r in results.items():
        if r.value is not None:
            arrays.update(flatten(f"{o}.value", r.value))
        grads = {inputs[0]: r.grad} if alone else r.grad
        for i, g in grads.items():
            arrays.update(flatten(f"{o}.grad.{i}", g))
    return arrays


def save(path: Path, arrays: dict) -> None:
    """``numpy.savez`` to exactly ``path`` (no .npz appended), atomically."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            np.savez(f, **arrays)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _shape(a: Any) -> str:
    return f"{a.dtype}[{','.join(map(str, a.shape))}]"


def summary(arrays: dict, outputs: Iterable[str], failed: dict | None = None) -> str:
    """A table: output, its value's shape and dtype, its gradients' shapes (and failed items)."""
    rows = [("output", "value", "gradients") + (("failed",) if failed is not None else ())]
    for o in outputs:
        vals = [(f"{k[len(o) + 7:]}: " if k != f"{o}.value" else "") + _shape(a)
                for k, a in arrays.items() if k == f"{o}.value" or k.startswith(f"{o}.value.")]
        grads = [f"{k[len(o) + 6:]}: {_shape(a)}" for k, a in arrays.items()
                 if k.startswith(f"{o}.grad.")]
        rows.append((o, ", ".join(vals) or "-", ", ".join(grads) or "-")
                    + ((str(len(failed.get(o, ()))),) if failed is not None else ()))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)
