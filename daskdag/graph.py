"""Wire a :class:`~daskdag.plan.Plan` into one Dask graph of forward and backward tasks.

In:  a plan, the input values, the user's cotangents.
Out: ``{output: (value, {input: grad})}`` of ``dask.delayed`` objects sharing one graph.

Keys are readable and deterministic: ``fwd-B-<token>`` (plus ``val-B``/``pb-B`` splitting the
primal from the pullback, so downstream forward tasks never fetch residuals), ``bwd-D-B-<token>``
for node B's backward pass towards output D, ``grad-D-x-<token>``. Outputs share forward keys, so
every node runs once per call; tokens hash functions and inputs, so repeated calls on one
cluster share them too.
"""

from __future__ import annotations

from contextlib import nullcontext
from functools import partial
from operator import getitem

import dask
from dask.base import tokenize
from dask.delayed import Delayed, delayed

from . import tasks
from .plan import Plan
from .protocol import cached_token  # importing it registers daskdag's types with Dask


def build(plan: Plan, values: dict, cotangents: dict, batched: bool = False
          ) -> dict[str, tuple[Delayed, dict[str, Delayed]]]:
    """The graph of one call; ``batched``: outputs carry a leading item axis (a sweep's chunk)."""
    spec = plan.spec
    val = {i: delayed(v, name=f"input-{i}-{cached_token(v)}", traverse=False) for i, v in values.items()}
    pb = {}

    # Forward: each needed node once; under jax.vjp when it depends on a differentiated input.
    for n in plan.needed:
        node, deps = spec.nodes[n], spec.nodes[n].deps
        active = tuple(d in plan.wrt or d in plan.active for d in deps)
        tok = tokenize(n, cached_token(node.fn), node.jit, active, [val[d].key for d in deps])
        with _placed(node):
            fwd = delayed(partial(tasks.forward, n, node, active), name=f"forward-{n}-{tok}")(
                *(val[d] for d in deps), dask_key_name=f"fwd-{n}-{tok}")
            if n in plan.active:
                val[n] = delayed(getitem, pure=True)(fwd, 0, dask_key_name=f"val-{n}-{tok}")
                pb[n] = delayed(getitem, pure=True)(fwd, 1, dask_key_name=f"pb-{n}-{tok}")
            else:
                val[n] = fwd

    # Backward, per output: a node's cotangent is the sum of its consumers' shares.
    results = {}
    for o in plan.outputs:
        bwd = {}
        for n in reversed(plan.backward[o]):
            if n == o:
                ct = cotangents.get(o)
                sources = [delayed(tasks.seed, pure=True)(
                    o, val[o], ct, batched, dask_key_name=f"seed-{o}-{tokenize(val[o].key, ct)}")]
                positions = (None,)
            else:
                sources, positions = _shares(plan.consumers(n, o), bwd)
            tok = tokenize(pb[n].key, [s.key for s in sources], positions)
            deps = spec.nodes[n].deps
            with _placed(spec.nodes[n]):
                bwd[n] = delayed(partial(tasks.backward, n, positions, len(deps)),
                                 name=f"backward-{n}")(
                    pb[n], *(val[d] for d in deps), *sources, dask_key_name=f"bwd-{o}-{n}-{tok}")
        grads = {}
        for i in plan.wrt:
            sources, positions = _shares(plan.consumers(i, o), bwd)
            tok = tokenize(val[i].key, [s.key for s in sources], positions)
            grads[i] = delayed(partial(tasks.gradient, positions), name="gradient")(
                val[i], *sources, dask_key_name=f"grad-{o}-{i}-{tok}")
        results[o] = (val[o], grads)
    return results


def _placed(node):
    """Annotate the tasks made inside with the node's resources, for distributed's scheduler."""
    return dask.annotate(resources=node.needs) if node.needs else nullcontext()


def _shares(uses, bwd):
    """The backward tasks of a node's consumers, and the node's position among each one's deps."""
    return [bwd[c] for c, _ in uses], tuple(i for _, i in uses)
