"""Scenario: repeated calls, as an optimiser makes them: the same DAG, new inputs each call.

Four models, each built twice from the same JAX component functions: as a daskdag DAG (every
node ``jit=True``; eager nodes as a column of their own) and as an OpenMDAO model (one
``ExplicitComponent`` per node: ``compute`` calls the jitted function, ``compute_partials``
``jax.jit(jax.jacrev(...))`` of it, exact partials, declared sparse (rows and columns) where
under half their entries can be nonzero, as for elementwise maps and stencils):

dense:          a small dense design model: 8 components, 20 inputs, a Jacobian 23 x 20.
many_to_few:    1,000 inputs -> 2 scalars (4 components): reverse mode's case.
few_to_many:    4 inputs -> 2,000 outputs (3 components): forward mode's case.
banded:         2,000 x 2,000, 5 components, a banded Jacobian (elementwise maps and a
                3-point stencil): coloured (OpenMDAO's total colouring; daskdag's
                ``sparsity=``, given or ``"detect"``).

Methods, each one call's values and full Jacobians of the model's outputs at a new x:

openmdao:            ``prob.set_val`` + ``prob.run_model()`` + ``prob.compute_totals()``: what a
                     driver pays per iteration (the model set up once, ``mode="auto"``).
openmdao_user:       OpenMDAO as a user writes the model first: one component per function,
                     its partials declared with the Jacobian's real (dense) shape from
                     ``jax.jacrev``, no colouring; ``run_solve_nonlinear`` + ``compute_totals``
                     (where no partial has over ``USER_PARTIALS`` entries: not few_to_many, nor banded
                     at its full size).
daskdag:             ``daskdag.jacobian(dag, x, outputs)``, the default call (``mode="auto"``),
                     repeated: it reuses its preparation (the guide "Repeated calls").
daskdag_prepared:    ``daskdag.value_and_jacobian(dag, outputs)`` made once, then called.
daskdag_unprepared:  the default call with ``daskdag.prepared-calls`` 0: every call prepares
                     (checks, plan, packing, the mode's trace): what a call cost before
                     preparations were kept.
daskdag_eager:       the default call on the same DAG with eager nodes (the tuple form).
jax_jit:             ``jax.jit`` of ``jax.jacfwd`` or ``jax.jacrev`` (whichever has fewer passes)
                     of the composed function: the limit, no DAG.
banded adds ``daskdag_detect`` (``sparsity="detect"``, repeated: the pattern detected once)
and ``daskdag`` there is ``sparsity=pattern`` given; ``openmdao`` is coloured.

Every method's values and Jacobians are checked against ``jax_jit``'s (relative 1e-9, float64)
before timing. Each timed sample is ``inner`` calls at inputs that change every call; the
methods are timed interleaved; medians per call.

More cases:

seed loop:      the seed question's DAG (eager nodes), ``compute_grads`` in a loop of 1,000 calls
                on Dask's threads against the question's hand-written VJP plumbing.
seed DAG prepared: the same DAG's ``value_and_grad`` (outputs D and E), every node
                ``jit=True``, against ``jax.jit`` of the composed function's two
                ``value_and_grad``; each prepared call with ``cotangents=`` given (ones, the
                same work) against the same call without, all-jit and eager.
cluster seed loop: the same prepared calls on the default 2-worker cluster, all-jit against
                one ``client.submit`` of that ``jax.jit`` function kept on the workers, eager
                against one ``client.submit`` of the question's plumbing; Dask's own round
                trip (a task that returns its input) as the floor; the bytes a step of the
                loop writes to the scheduler (measured after the loops).
cluster loop:   a 200-step gradient descent on the default 2-worker cluster with the dense
                model's ``value_and_grad`` of a scalar loss (float32, as the workers compute
                unless told otherwise), the parameters new every step: the
                bytes each step sends (distributed's own counter of what the client writes to
                the scheduler, and what daskdag placed), and the time per step against the same
                loop on threads.
optimisation:   SciPy's SLSQP on the stepped cantilever of ``examples/design_optimisation.py``,
                daskdag's ``value_and_jacobian`` (threads) against OpenMDAO's
                ``ScipyOptimizeDriver`` (SLSQP) on components of the same functions: iterations,
                wall time, the optimum.

Targets (issue 40): ``daskdag_prepared/openmdao`` <= 0.25 and ``daskdag_eager/openmdao`` <= 1 on
every model; ``daskdag_prepared/jax_jit`` <= 2 on the dense model and on the seed DAG; calls
with cotangents within 5% of the same calls without; seed loop ``daskdag/hand_written`` <=
1.05; cluster seed loop, each prepared call <= 1.2x its ``client.submit``.

Targets (issue 29): ``daskdag/openmdao`` <= 0.5 and ``daskdag_prepared/openmdao`` <= 0.25 on
every model; ``daskdag_prepared/jax_jit`` <= 3 on the dense model (8 nodes); on the banded
model ``daskdag_detect/daskdag`` <= 1.1; seed loop ``daskdag/hand_written`` <= 1.1.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import statistics
import time
from dataclasses import asdict, dataclass
from functools import partial

import dask
import jax
import jax.numpy as jnp
import numpy as np

import daskdag
from daskdag import Node
from daskdag.transport import packing

from .. import common, report

TITLE = "Repeated calls"
DESCRIPTION = ("repeated calls as an optimiser makes them: four models against OpenMDAO's "
               "``compute_totals`` on the same JAX components and ``jax.jit``, SLSQP "
               "against OpenMDAO's ``ScipyOptimizeDriver``, a 200-step loop on the "
               "default cluster with its bytes per step, the seed DAG in a 1,000-call "
               "loop")
CLUSTERS = ("2w", "2w_tuned")  # its cluster loop on 2w (2w_tuned: up, unused)
RTOL = 1e-9


@dataclass(frozen=True)
class Config:
    reps: int
    inner: int  # calls per timed sample
    seed_calls: int
    steps: int  # cluster loop
    banded_n: int


FULL = Config(reps=7, inner=20, seed_calls=1000, steps=200, banded_n=2000)
QUICK = Config(reps=3, inner=5, seed_calls=200, steps=40, banded_n=400)


@contextlib.contextmanager
def float64():
    """The scenario's arithmetic in float64, as an optimiser wants it (OpenMDAO computes in
    float64); JAX's setting put back after."""
    before = jax.config.read("jax_enable_x64")
    jax.config.update("jax_enable_x64", True)
    try:
        yield
    finally:
        jax.config.update("jax_enable_x64", before)


# --- The models: component functions ------------------------------------------------------------

def dense_model():
    """8 components, x float64[20] -> h float64[23]."""
    f = {
        "a": (lambda x: jnp.sin(x[:10]) * 2.0 + x[10:], ["x"]),
        "b": (lambda x: x[10:] ** 2 + jnp.cos(x[:10]), ["x"]),
        "c": (lambda a, b: a * b + 1.0, ["a", "b"]),
        "d": (lambda c: jnp.cumsum(c) / 10.0, ["c"]),
        "e": (lambda b, d: jnp.concatenate([b, d[:2]]), ["b", "d"]),
        "f": (lambda e: jnp.tanh(e), ["e"]),
        "g": (lambda f: jnp.sum(f ** 2, keepdims=True) + f[:6], ["f"]),
        "h": (lambda f, g: jnp.concatenate([f, g, jnp.sum(g, keepdims=True), f[:4]]), ["f", "g"]),
    }
    return f, ["h"], np.linspace(0.1, 2.0, 20)


def many_to_few_model(n: int = 1000):
    f = {
        "a": (lambda x: jnp.sin(x) * x, ["x"]),
        "b": (lambda a: jnp.cumsum(a) / a.shape[0], ["a"]),
        "l1": (lambda a: jnp.sum(a ** 2), ["a"]),
        "l2": (lambda b: jnp.sum(jnp.log1p(b ** 2)), ["b"]),
    }
    return f, ["l1", "l2"], np.linspace(-1.0, 1.0, n)


def few_to_many_model(m: int = 2000):
    grid = np.linspace(0.0, 1.0, m)
    f = {
        "a": (lambda x: jnp.outer(jnp.asarray(grid), x), ["x"]),
        "b": (lambda a: jnp.sin(a) * jnp.cos(a[:, ::-1]), ["a"]),
        "y": (lambda b: jnp.sum(b, axis=1) + b[:, 0] ** 2, ["b"]),
    }
    return f, ["y"], np.array([0.3, -0.7, 1.1, 0.5])


def _stencil(a):
    return jnp.pad(a[2:] - 2 * a[1:-1] + a[:-2], 1)


def banded_model(n: int = 2000):
    f = {
        "a": (lambda x: jnp.tanh(x) * 1.5, ["x"]),
        "b": (lambda a: _stencil(a) + a, ["a"]),
        "c": (lambda b: jnp.sin(b) * b, ["b"]),
        "d": (lambda c, a: c * a + _stencil(c), ["c", "a"]),
        "e": (lambda d: jnp.exp(-d ** 2) + d, ["d"]),
    }
    return f, ["e"], np.linspace(-1.0, 1.0, n)


def composed(functions: dict, outputs: list[str]):
    """The model as one function of x: ``{output: value}``."""
    def f(x):
        values = {"x": x}
        for name, (fn, deps) in functions.items():
            values[name] = fn(*(values[d] for d in deps))
        return {o: values[o] for o in outputs}
    return f


def dag_of(functions: dict, jit: bool) -> dict:
    return {name: Node(fn, deps, jit=True) if jit else (fn, deps)
            for name, (fn, deps) in functions.items()}


# --- OpenMDAO ------------------------------------------------------------------------------------

def openmdao_problem(functions: dict, outputs: list[str], x0: np.ndarray, banded: bool = False):
    """One ``ExplicitComponent`` per node (its function jitted, its partials
    ``jax.jit(jax.jacrev(...))``, declared sparse on a banded model), set up once."""
    import openmdao.api as om

    shapes = {"x": jnp.asarray(x0)}
    for name, (fn, deps) in functions.items():
        shapes[name] = jax.eval_shape(fn, *(shapes[d] for d in deps))
    shapes = {name: tuple(s.shape) for name, s in shapes.items()}

    prob = om.Problem(reports=False)
    model = prob.model
    model.add_subsystem("inputs", om.IndepVarComp("x", val=np.asarray(x0, float)), promotes=["*"])
    for name, (fn, deps) in functions.items():
        model.add_subsystem(name, _component(fn, deps, name, shapes, banded), promotes=["*"])
    prob.setup(mode="auto", force_alloc_complex=False)
    prob.set_val("x", np.asarray(x0, float))
    prob.run_model()
    coloring = None
    if banded:  # the total colouring, computed once, as a driver would
        from openmdao.utils.coloring import ColoringMeta, compute_total_coloring
        coloring = ColoringMeta()
        coloring.coloring = compute_total_coloring(prob, of=outputs, wrt=["x"])
        coloring.dynamic = False
    return prob, coloring


def _component(fn, deps, name, shapes, banded):
    """An ``ExplicitComponent`` of ``fn`` (its inputs ``deps``, its output ``name``, their
    ``shapes``): values from ``jax.jit(fn)``, partials from ``jax.jit(jax.jacrev(fn))``, or
    where they are sparse, from ``jax.jvp`` pushed along one seed per colour of their columns
    (a compressed Jacobian, as a user who knows JAX would compute them)."""
    import openmdao.api as om
    from daskdag.model import colouring

    value = jax.jit(fn)
    partials = jax.jit(jax.jacrev(fn, argnums=tuple(range(len(deps)))))
    sizes = {k: int(np.prod(s)) for k, s in shapes.items()}

    @partial(jax.jit, static_argnums=0)
    def pushed(d, args, seeds):  # (colours, output elements): fn's jvp along each seed of dep d
        def push(seed):
            tangents = [seed.reshape(shapes[d]) if e == d else jnp.zeros_like(a)
                        for e, a in zip(deps, args)]
            return jax.jvp(fn, tuple(args), tuple(tangents))[1].reshape(-1)
        return jax.vmap(push)(seeds)

    class Component(om.ExplicitComponent):
        def setup(self):
            for d in dict.fromkeys(deps):
                self.add_input(d, shape=shapes[d] or 1)
            self.add_output(name, shape=shapes[name] or 1)

        def setup_partials(self):
            # Sparse where the partials are (elementwise maps, stencils), as an OpenMDAO user
            # declares them: the pattern of the Jacobian at a random point.
            self._declared, self._seeds = {}, {}
            point = [np.random.default_rng(0).uniform(0.1, 1, shapes[e]) for e in deps]
            for d in dict.fromkeys(deps):
                block = self._block(partials(*point), d)
                rows, cols = np.nonzero(block)
                if len(rows) < 0.5 * sizes[name] * sizes[d]:
                    colours = colouring.colour_columns(block != 0)
                    self._declared[d] = rows, cols, colours[cols]
                    self._seeds[d] = jnp.asarray(colouring.seeds(colours, np.float64))
                    self.declare_partials(name, d, rows=rows, cols=cols)
                else:
                    self.declare_partials(name, d)

        def _block(self, blocks, d):  # (a dep given twice: its blocks add up)
            return sum(np.asarray(b).reshape(sizes[name], sizes[d])
                       for e, b in zip(deps, blocks) if e == d)

        def compute(self, inputs, outputs):
            outputs[name] = np.asarray(value(*(inputs[d].reshape(shapes[d]) for d in deps)))

        def compute_partials(self, inputs, jac):
            args = [inputs[d].reshape(shapes[d]) for d in deps]
            dense = [d for d in dict.fromkeys(deps) if d not in self._declared]
            blocks = partials(*args) if dense else None
            for d in dict.fromkeys(deps):
                if d in self._declared:
                    rows, cols, colour = self._declared[d]
                    jac[name, d] = np.asarray(pushed(d, args, self._seeds[d]))[colour, rows]
                else:
                    jac[name, d] = self._block(blocks, d)

    Component.__name__ = f"Component_{name}"
    return Component()


#: The most entries of one dense partial for which ``openmdao_user`` runs (8 MB in float64): the
#: few-to-many model's 8,000 x 8,000 and the banded model's 2,000 x 2,000 take seconds a call.
USER_PARTIALS = 1_000_000


def largest_partial(functions: dict, x0) -> int:
    """The entries of the model's largest partial Jacobian, dense."""
    sizes = {"x": int(np.size(x0))}
    shapes = {"x": jnp.asarray(x0)}
    for name, (fn, deps) in functions.items():
        shapes[name] = jax.eval_shape(fn, *(shapes[d] for d in deps))
        sizes[name] = int(np.prod(shapes[name].shape))
    return max(sizes[name] * sizes[d] for name, (_, deps) in functions.items() for d in deps)


def openmdao_user_problem(functions: dict, outputs: list[str], x0: np.ndarray):
    """The model as a user writes it first: one ``ExplicitComponent`` per function, its partials
    declared with the Jacobian's real (dense) shape and computed by ``jax.jacrev``, no
    colouring; run with ``run_solve_nonlinear`` and ``compute_totals``."""
    import openmdao.api as om

    shapes = {"x": jnp.asarray(x0)}
    for name, (fn, deps) in functions.items():
        shapes[name] = jax.eval_shape(fn, *(shapes[d] for d in deps))
    shapes = {name: tuple(s.shape) for name, s in shapes.items()}
    sizes = {k: int(np.prod(s)) for k, s in shapes.items()}

    def component(fn, deps, name):
        value = jax.jit(fn)
        partials = jax.jit(jax.jacrev(fn, argnums=tuple(range(len(deps)))))

        class Component(om.ExplicitComponent):
            def setup(self):
                for d in dict.fromkeys(deps):
                    self.add_input(d, shape=shapes[d] or 1)
                self.add_output(name, shape=shapes[name] or 1)
                for d in dict.fromkeys(deps):
                    self.declare_partials(name, d)

            def compute(self, inputs, outputs):
                outputs[name] = np.asarray(value(*(inputs[d].reshape(shapes[d]) for d in deps)))

            def compute_partials(self, inputs, jac):
                blocks = partials(*(inputs[d].reshape(shapes[d]) for d in deps))
                for d in dict.fromkeys(deps):
                    jac[name, d] = sum(np.asarray(b).reshape(sizes[name], sizes[d])
                                       for e, b in zip(deps, blocks) if e == d)

        Component.__name__ = f"User_{name}"
        return Component()

    prob = om.Problem(reports=False)
    prob.model.add_subsystem("inputs", om.IndepVarComp("x", val=np.asarray(x0, float)),
                             promotes=["*"])
    for name, (fn, deps) in functions.items():
        prob.model.add_subsystem(name, component(fn, deps, name), promotes=["*"])
    prob.setup(mode="auto")
    prob.set_val("x", np.asarray(x0, float))
    prob.run_model()
    return prob


def openmdao_user_call(prob, outputs: list[str], x: np.ndarray):
    prob.set_val("x", x)
    prob.model.run_solve_nonlinear()
    totals = prob.compute_totals(of=outputs, wrt=["x"], return_format="flat_dict")
    return ({o: np.asarray(prob.get_val(o)) for o in outputs},
            {o: np.asarray(totals[o, "x"]) for o in outputs})


def openmdao_call(problem, outputs: list[str], x: np.ndarray):
    prob, coloring = problem
    prob.set_val("x", x)
    prob.run_model()
    totals = prob.compute_totals(of=outputs, wrt=["x"], return_format="flat_dict",
                                 coloring_info=coloring)
    return ({o: np.asarray(prob.get_val(o)) for o in outputs},
            {o: np.asarray(totals[o, "x"]) for o in outputs})


# --- daskdag and plain JAX -----------------------------------------------------------------------

def daskdag_call(dag, outputs, x, **kwargs):
    res = daskdag.jacobian(dag, x, outputs, **kwargs)
    return {o: res[o].value for o in outputs}, {o: res[o].grad for o in outputs}


def prepared_call(f, x):
    return f(x)


def unprepared_call(dag, outputs, x, **kwargs):
    with dask.config.set({"daskdag.prepared-calls": 0}):
        return daskdag_call(dag, outputs, x, **kwargs)


def _dense(j):
    return j.toarray() if hasattr(j, "toarray") else np.asarray(j)


def jax_limit(functions, outputs, x0):
    f = composed(functions, outputs)
    n_in = int(np.size(x0))
    n_out = sum(int(np.size(v)) for v in jax.eval_shape(f, jnp.asarray(x0)).values())
    jac = (jax.jacfwd if n_in <= n_out else jax.jacrev)(f)
    both = jax.jit(lambda x: (f(x), jac(x)))
    return lambda x: both(jnp.asarray(x))


class Points:
    """Inputs that change every call: x0 moved a little, cycling through a few."""

    def __init__(self, x0, k: int = 8):
        rng = np.random.default_rng(1)
        self.points = [np.asarray(x0, float) * (1.0 + 0.01 * rng.standard_normal(np.shape(x0)))
                       for _ in range(k)]
        self.i = 0

    def __call__(self):
        self.i = (self.i + 1) % len(self.points)
        return self.points[self.i]


def repeated(fn, points: Points, inner: int):
    for _ in range(inner):
        out = fn(points())
    return out


def _check(name, got, want, label):
    values, jacs = got
    want_values, want_jacs = want
    worst = max(common.worst_difference(np.asarray(values[o]).reshape(-1),
                                        np.asarray(want_values[o]).reshape(-1))
                for o in want_values)
    worst = max(worst, max(common.worst_difference(_dense(jacs[o]).reshape(-1),
                                                   np.asarray(want_jacs[o]).reshape(-1))
                           for o in want_jacs))
    if worst > RTOL:
        raise AssertionError(f"{TITLE}, {label}: {name} disagrees with jax.jit by {worst:.2e}")
    return worst


def model_case(cfg: Config, label: str, functions, outputs, x0, banded: bool = False) -> dict:
    print(f"{TITLE}, {label}", flush=True)
    dag, eager = dag_of(functions, True), dag_of(functions, False)
    limit = jax_limit(functions, outputs, x0)
    kwargs: dict = {}
    if banded:
        kwargs["sparsity"] = daskdag.jacobian_sparsity(dag, x0, outputs)
    prob = openmdao_problem(functions, outputs, x0, banded)
    prepared = daskdag.value_and_jacobian(dag, outputs, **kwargs)
    methods = {
        "openmdao": partial(openmdao_call, prob, outputs),
        "daskdag": partial(daskdag_call, dag, outputs, **kwargs),
        "daskdag_prepared": partial(prepared_call, prepared),
        "daskdag_unprepared": partial(unprepared_call, dag, outputs, **kwargs),
        "daskdag_eager": partial(daskdag_call, eager, outputs, **kwargs),
        "jax_jit": limit,
    }
    if banded:
        methods["daskdag_detect"] = partial(daskdag_call, dag, outputs, sparsity="detect")
    if largest_partial(functions, x0) <= USER_PARTIALS:
        methods["openmdao_user"] = partial(openmdao_user_call,
                                           openmdao_user_problem(functions, outputs, x0), outputs)
    want = jax.block_until_ready(limit(x0))
    worst = {}
    for name, fn in methods.items():  # (each runs once first: its compilation and preparation)
        worst[name] = _check(name, jax.block_until_ready(fn(x0)), want, label)
    points = Points(x0)
    runs = {name: partial(repeated, fn, points, cfg.inner) for name, fn in methods.items()}
    times = common.interleaved(runs, cfg.reps, f"{label}: ")
    per_call = {m: [t / cfg.inner for t in ts] for m, ts in times.items()}
    info = daskdag.jacobian(dag, x0, outputs, **kwargs)[outputs[0]].info
    ratios = {"daskdag/openmdao": ("daskdag", "openmdao"),
              "daskdag_prepared/openmdao": ("daskdag_prepared", "openmdao"),
              "daskdag_unprepared/openmdao": ("daskdag_unprepared", "openmdao"),
              "daskdag_eager/openmdao": ("daskdag_eager", "openmdao"),
              "daskdag_prepared/jax_jit": ("daskdag_prepared", "jax_jit"),
              "daskdag/openmdao_user": ("daskdag", "openmdao_user"),
              "daskdag_eager/openmdao_user": ("daskdag_eager", "openmdao_user"),
              "daskdag_unprepared/daskdag": ("daskdag_unprepared", "daskdag")}
    if banded:
        ratios["daskdag_detect/daskdag"] = ("daskdag_detect", "daskdag")
    n_out = sum(int(np.size(want[0][o])) for o in outputs)
    return common.case(label, {"nodes": len(functions), "inputs": int(np.size(x0)),
                               "output_elements": n_out, "inner": cfg.inner,
                               "mode": info.mode, "passes": info.passes,
                               "colours": info.colours, "sparsity": info.sparsity},
                       per_call, ratios, baseline="openmdao", max_rel_diff=max(worst.values()))


# --- The seed loop --------------------------------------------------------------------------------

def seed_case(cfg: Config) -> dict:
    from .tiny_nodes import SEED_DAG, seed_hand_written

    print(f"{TITLE}, seed loop", flush=True)
    x = jnp.array([1.0, 2.0, 3.0, 4.0, 5.0], dtype=jnp.float32)

    def loop(fn):
        for k in range(cfg.seed_calls):
            out = fn(x + 0.001 * (k % 7))
        return out

    def with_daskdag(x):
        r = daskdag.compute_grads(SEED_DAG, x, ["D", "E"])
        return [(r["D"].value, r["D"].grad), (r["E"].value, r["E"].grad)]

    runs = {"daskdag": partial(loop, with_daskdag), "hand_written": partial(loop, seed_hand_written)}
    out = {m: common.timed(fn)[1] for m, fn in runs.items()}
    diff = common.worst_difference(out["daskdag"], out["hand_written"])
    if diff > 1e-5:
        raise AssertionError(f"{TITLE}, seed loop: daskdag disagrees by {diff}")
    times = common.interleaved(runs, max(3, cfg.reps // 2), "seed loop: ")
    per_call = {m: [t / cfg.seed_calls for t in ts] for m, ts in times.items()}
    return common.case("seed loop", {"calls_per_sample": cfg.seed_calls}, per_call,
                       {"daskdag/hand_written": ("daskdag", "hand_written")},
                       baseline="hand_written", max_rel_diff=diff)


# --- The seed DAG, all jit=True, and with cotangents given ---------------------------------------

def seed_dags():
    """The seed question's DAG (outputs D and E) with every node ``jit=True``, and as it is
    (eager nodes)."""
    from .tiny_nodes import SEED_DAG
    return ({name: Node(fn, deps, jit=True) for name, (fn, deps) in SEED_DAG.items()},
            dict(SEED_DAG))


def seed_composed(x):
    """``(D, E)`` of the seed DAG, composed."""
    from .tiny_nodes import A_to_B, B_to_C, B_to_E, C_to_D, x_to_A
    b = A_to_B(x_to_A(x))
    return C_to_D(B_to_C(b)), B_to_E(b)


def seed_jitted():
    """``jax.jit`` of the value and gradient of each of the seed DAG's two outputs."""
    return jax.jit(lambda x: (jax.value_and_grad(lambda x: seed_composed(x)[0])(x),
                              jax.value_and_grad(lambda x: seed_composed(x)[1])(x)))


def _pairs(out):
    """``[(D, dD/dx), (E, dE/dx)]`` from what each method returns."""
    if isinstance(out, list):  # (the question's plumbing)
        return out
    if isinstance(out[0], dict):  # (a prepared function of daskdag: values, grads)
        return [(out[0][o], out[1][o]) for o in ("D", "E")]
    return list(out)  # (jax.jit's)


def seed_jit_case(cfg: Config) -> dict:
    """In this process: the prepared ``value_and_grad`` of the all-jit seed DAG against
    ``jax.jit`` of the composed function's, and each prepared call with ``cotangents=`` given
    (ones: the same work) against the same call without."""
    print(f"{TITLE}, seed DAG prepared", flush=True)
    jit_dag, eager_dag = seed_dags()
    ones = {"D": jnp.float32(1.0), "E": jnp.float32(1.0)}
    methods = {"daskdag_jit": daskdag.value_and_grad(jit_dag, ["D", "E"]),
               "daskdag_jit_cotangents": daskdag.value_and_grad(jit_dag, ["D", "E"],
                                                                cotangents=ones),
               "daskdag_eager": daskdag.value_and_grad(eager_dag, ["D", "E"]),
               "daskdag_eager_cotangents": daskdag.value_and_grad(eager_dag, ["D", "E"],
                                                                  cotangents=ones),
               "jax_jit": seed_jitted()}
    x = jnp.array([1.0, 2.0, 3.0, 4.0, 5.0], dtype=jnp.float32)
    want = _pairs(jax.block_until_ready(methods["jax_jit"](x)))
    diff = max(common.worst_difference(_pairs(jax.block_until_ready(fn(x))), want)
               for fn in methods.values())
    if diff > 1e-5:
        raise AssertionError(f"{TITLE}, seed DAG prepared: disagrees with jax.jit by {diff}")
    inner = cfg.seed_calls // 2

    def loop(fn):
        for k in range(inner):
            out = fn(x + 0.001 * (k % 7))
        return out

    times = common.interleaved({m: partial(loop, fn) for m, fn in methods.items()},
                               max(3, cfg.reps // 2), "seed DAG prepared: ")
    per_call = {m: [t / inner for t in ts] for m, ts in times.items()}
    return common.case("seed DAG prepared", {"calls_per_sample": inner}, per_call,
                       {"daskdag_jit/jax_jit": ("daskdag_jit", "jax_jit"),
                        "jit_cotangents/jit": ("daskdag_jit_cotangents", "daskdag_jit"),
                        "eager_cotangents/eager": ("daskdag_eager_cotangents", "daskdag_eager")},
                       baseline="jax_jit", max_rel_diff=diff)


def call(fn, x):
    """``fn(x)``: a task calling a function kept on the workers."""
    return fn(x)


def cluster_seed_case(cfg: Config, client) -> dict:
    """A loop on the default 2-worker cluster, the inputs new at each step: the prepared
    all-jit seed DAG against one ``client.submit`` of ``seed_jitted()`` kept on the workers
    (scattered once, to every worker), the eager one against one ``client.submit`` of the
    question's plumbing; Dask's own round trip (``client.submit`` of a function that returns
    its input) is the floor."""
    from .tiny_nodes import seed_hand_written

    print(f"{TITLE}, cluster seed loop", flush=True)
    jit_dag, eager_dag = seed_dags()
    [jitted] = client.scatter([seed_jitted()], broadcast=True)
    [plumbing] = client.scatter([seed_hand_written], broadcast=True)
    methods = {
        "daskdag_jit": daskdag.value_and_grad(jit_dag, ["D", "E"], client=client),
        "daskdag_eager": daskdag.value_and_grad(eager_dag, ["D", "E"], client=client),
        "submit_jit": lambda x: client.submit(call, jitted, x, pure=False).result(),
        "submit_hand": lambda x: client.submit(call, plumbing, x, pure=False).result(),
        "dask_round_trip": lambda x: client.submit(call, _same, x, pure=False).result()}
    x0 = np.array([1.0, 2.0, 3.0, 4.0, 5.0], np.float32)
    want = _pairs(seed_jitted()(x0))
    diff = max(common.worst_difference(_pairs(fn(x0)), want)
               for m, fn in methods.items() if m != "dask_round_trip")
    if diff > 1e-4:
        raise AssertionError(f"{TITLE}, cluster seed loop: disagrees with jax.jit by {diff}")

    def loop(fn):
        for k in range(cfg.steps):
            out = fn(x0 + 0.001 * (k % 7))
        return out

    times = common.interleaved({m: partial(loop, fn) for m, fn in methods.items()},
                               max(2, cfg.reps // 3), "cluster seed loop: ")
    # (after the loops: a step as a loop's steps run, once the calls chose how to run)
    sent = {m: [common.bytes_sent(client, partial(methods[m], x0 + 0.001 * k))
                for k in range(5)] for m in ("daskdag_jit", "daskdag_eager", "submit_jit")}
    per_step = {m: [t / cfg.steps for t in ts] for m, ts in times.items()}
    return common.case(
        "cluster seed loop", {"steps": cfg.steps}, per_step,
        {"daskdag_jit/submit_jit": ("daskdag_jit", "submit_jit"),
         "daskdag_eager/submit_hand": ("daskdag_eager", "submit_hand"),
         "daskdag_jit/dask_round_trip": ("daskdag_jit", "dask_round_trip")},
        baseline="submit_jit", max_rel_diff=diff,
        bytes_per_step={m: statistics.median(s["to_scheduler"] for s in v)
                        for m, v in sent.items()})


def _same(x):
    return x


# --- The cluster loop -----------------------------------------------------------------------------

def cluster_case(cfg: Config, client) -> dict:
    print(f"{TITLE}, cluster loop", flush=True)
    functions, _, x0 = dense_model()
    dag = dag_of(functions, True)
    dag["loss"] = Node(lambda h: jnp.sum((h - 0.5) ** 2), ["h"], jit=True)
    plain = jax.jit(jax.value_and_grad(lambda x: jnp.sum((composed(functions, ["h"])(x)["h"]
                                                          - 0.5) ** 2)))
    step_size = 0.02

    def descend(f, steps):
        x = np.asarray(x0, np.float32)
        for _ in range(steps):
            loss, grad = f(x)
            x = x - step_size * np.asarray(grad)
        return x, loss

    on_threads = daskdag.value_and_grad(dag, "loss")
    on_cluster = daskdag.value_and_grad(dag, "loss", client=client)
    want = descend(plain, cfg.steps)
    got = {"threads": descend(on_threads, cfg.steps), "cluster": descend(on_cluster, cfg.steps)}
    diff = max(common.worst_difference(g, want) for g in got.values())
    if diff > 1e-4:
        raise AssertionError(f"{TITLE}, cluster loop: disagrees with JAX by {diff}")
    x = np.asarray(x0, np.float32)
    steps = []  # the bytes of each step of a fresh run of the loop on the cluster
    for k in range(min(cfg.steps, 20)):
        sent = common.bytes_sent(client, partial(on_cluster, x + 0.001 * k))
        steps.append(sent)
    runs = {"threads": partial(descend, on_threads, cfg.steps),
            "cluster_2w": partial(descend, on_cluster, cfg.steps),
            "jax_jit": partial(descend, plain, cfg.steps)}
    times = common.interleaved(runs, max(2, cfg.reps // 3), "cluster loop: ")
    per_step = {m: [t / cfg.steps for t in ts] for m, ts in times.items()}
    return common.case(
        "cluster loop", {"steps": cfg.steps,
                         "parameters_bytes": int(np.asarray(x0, np.float32).nbytes)},
        per_step, {"cluster_2w/threads": ("cluster_2w", "threads"),
                   "threads/jax_jit": ("threads", "jax_jit")},
        baseline="threads", max_rel_diff=diff,
        bytes_per_step={"to_scheduler": statistics.median(s["to_scheduler"] for s in steps[1:]),
                        "placed_by_daskdag": statistics.median(s["daskdag"] for s in steps[1:]),
                        "messages": statistics.median(s["messages"] for s in steps[1:]),
                        "first_step": steps[0],
                        # (each under 64 KiB: they travel inside the tasks that run them)
                        "node_functions_inline": sum(
                            len(packing.pack(node.fn, as_function=True).skeleton)
                            for node in dag.values())})


# --- SLSQP, daskdag against OpenMDAO's driver ------------------------------------------------------

def optimisation_case(cfg: Config) -> dict:
    import openmdao.api as om

    print(f"{TITLE}, optimisation", flush=True)
    m = common.example("design_optimisation")
    f = daskdag.value_and_jacobian(m.dag, ["volume", *m.MARGINS])
    results = {}
    start = time.perf_counter()
    out, calls, _ = m.optimise(f)
    results["daskdag"] = {"seconds": time.perf_counter() - start, "iterations": int(out.nit),
                          "calls": calls, "optimum": float(out.fun) * 1e5}
    start = time.perf_counter()
    out, calls, _ = m.optimise(m.plain_jax())
    results["jax_jit"] = {"seconds": time.perf_counter() - start, "iterations": int(out.nit),
                          "calls": calls, "optimum": float(out.fun) * 1e5}

    functions = {"inertia": (m.second_moment, ["design"]), "volume": (m.volume, ["design"]),
                 "stress": (m.stress, ["design", "inertia"]), "tip": (m.tip, ["inertia"])}
    prob = om.Problem(reports=False)
    model = prob.model
    model.add_subsystem("inputs", om.IndepVarComp("design", val=m.START), promotes=["*"])
    shapes = {"design": (2 * m.SEGMENTS,), "inertia": (m.SEGMENTS,), "volume": (),
              "stress": (m.SEGMENTS,), "tip": ()}
    for name, (fn, deps) in functions.items():
        model.add_subsystem(name, _component(fn, deps, name, shapes, False), promotes=["*"])
    model.add_subsystem("margins", om.ExecComp(
        ["stress_margin = 1.0 - stress / smax", "tip_margin = 1.0 - tip / tmax",
         "aspect_margin = amax * design[:5] / design[5:] - 1.0"],
        stress=np.ones(m.SEGMENTS), stress_margin=np.ones(m.SEGMENTS), tip=1.0, tip_margin=1.0,
        design=m.START, aspect_margin=np.ones(m.SEGMENTS), smax=m.STRESS_MAX, tmax=m.TIP_MAX,
        amax=m.ASPECT_MAX, has_diag_partials=False), promotes=["*"])
    lower = np.array([b[0] for b in m.BOUNDS])
    upper = np.array([b[1] for b in m.BOUNDS])
    model.add_design_var("design", lower=lower, upper=upper)
    model.add_objective("volume", scaler=1e-5)
    for margin in m.MARGINS:
        model.add_constraint(margin, lower=0.0)
    prob.driver = om.ScipyOptimizeDriver(optimizer="SLSQP", maxiter=200, tol=1e-9, disp=False)
    prob.setup()
    start = time.perf_counter()
    prob.run_driver()
    result = prob.driver._scipy_optimize_result  # (SciPy's OptimizeResult, as the driver got it)
    results["openmdao"] = {"seconds": time.perf_counter() - start, "iterations": int(result.nit),
                           "calls": int(prob.driver.iter_count),
                           "optimum": float(prob.get_val("volume")[0])}
    gap = abs(results["openmdao"]["optimum"] - results["daskdag"]["optimum"]) / results["daskdag"]["optimum"]
    times = {k: [v["seconds"]] for k, v in results.items()}
    return common.case("optimisation (SLSQP)", {"variables": 2 * m.SEGMENTS,
                                                "constraints": 2 * m.SEGMENTS + 1},
                       times, {"daskdag/openmdao": ("daskdag", "openmdao"),
                               "daskdag/jax_jit": ("daskdag", "jax_jit")},
                       baseline="openmdao", runs=results, optimum_gap=gap)


# --- The scenario ---------------------------------------------------------------------------------

def run(quick: bool, clients: dict) -> dict:
    """``clients["2w"]``: the default 2-worker cluster, for the cluster loop."""
    cfg = QUICK if quick else FULL
    # (OpenMDAO writes its problems' files, colourings among them, under its work dir)
    os.environ.setdefault("OPENMDAO_WORKDIR", tempfile.mkdtemp(prefix="daskdag-openmdao-"))
    with float64():
        cases = [model_case(cfg, "dense", *dense_model()),
                 model_case(cfg, "many_to_few", *many_to_few_model()),
                 model_case(cfg, "few_to_many", *few_to_many_model()),
                 model_case(cfg, "banded", *banded_model(cfg.banded_n), banded=True),
                 optimisation_case(cfg)]
    if "2w" in clients:  # (in float32: the cluster's workers compute as JAX does by default)
        cases.append(cluster_case(cfg, clients["2w"]))
        cases.append(cluster_seed_case(cfg, clients["2w"]))
    cases.append(seed_case(cfg))
    cases.append(seed_jit_case(cfg))
    models = ("dense", "many_to_few", "few_to_many", "banded")
    wanted = ([{"case": c, "ratio": "daskdag/openmdao", "op": "<=", "bound": 0.5,
                "source": "issue 29"} for c in models]
              + [{"case": c, "ratio": "daskdag_prepared/openmdao", "op": "<=", "bound": 0.25,
                  "source": "issue 29"} for c in models]
              + [{"case": "dense", "ratio": "daskdag_prepared/jax_jit", "op": "<=", "bound": 3.0,
                  "source": "issue 29"},
                 {"case": "banded", "ratio": "daskdag_detect/daskdag", "op": "<=", "bound": 1.1,
                  "source": "issue 29"},
                 {"case": "seed loop", "ratio": "daskdag/hand_written", "op": "<=", "bound": 1.1,
                  "source": "issue 29"}]
              + [{"case": c, "ratio": "daskdag_prepared/openmdao", "op": "<=", "bound": 0.25,
                  "source": "issue 40"} for c in models]
              + [{"case": c, "ratio": "daskdag_eager/openmdao", "op": "<=", "bound": 1.0,
                  "source": "issue 40"} for c in models]
              + [{"case": "dense", "ratio": "daskdag_prepared/jax_jit", "op": "<=", "bound": 2.0,
                  "source": "issue 40"},
                 {"case": "seed DAG prepared", "ratio": "daskdag_jit/jax_jit", "op": "<=",
                  "bound": 2.0, "source": "issue 40"},
                 {"case": "seed DAG prepared", "ratio": "jit_cotangents/jit", "op": "<=",
                  "bound": 1.05, "source": "issue 40"},
                 {"case": "seed DAG prepared", "ratio": "eager_cotangents/eager", "op": "<=",
                  "bound": 1.05, "source": "issue 40"},
                 {"case": "seed loop", "ratio": "daskdag/hand_written", "op": "<=", "bound": 1.05,
                  "source": "issue 40"},
                 {"case": "cluster seed loop", "ratio": "daskdag_jit/submit_jit", "op": "<=",
                  "bound": 1.2, "source": "issue 40"},
                 {"case": "cluster seed loop", "ratio": "daskdag_eager/submit_hand", "op": "<=",
                  "bound": 1.2, "source": "issue 40"},
                 {"case": "seed DAG prepared", "ratio": "daskdag_jit/jax_jit", "op": "<=",
                  "bound": 1.5, "was": "4.3", "source": "issue 52"}])
    return {"title": TITLE, "config": asdict(cfg), "cases": cases,
            "description": "Median seconds per call (cluster loop: per step; optimisation: the "
                           "whole run). Every method's values and Jacobians agree with "
                           "`jax_jit`'s to 1e-9 (float64).",
            "targets": common.targets(cases, wanted)}


# --- Its report (benchmarks/report.py draws the rest) ---------------------------------------------

def section(s: dict) -> str:
    """The generic tables, then what the cluster loop sent per step and what SLSQP did."""
    parts = [report.generic(s)]
    cases = {c["case"]: c for c in s["cases"]}
    loop = cases.get("cluster loop")
    if loop and "bytes_per_step" in loop:
        b = loop["bytes_per_step"]
        parts.append(
            f"Cluster loop, each step after the first: {b['to_scheduler']:,.0f} bytes to the "
            f"scheduler in {b['messages']:.0f} messages (distributed's count), and "
            f"{b['placed_by_daskdag']:,.0f} bytes placed by daskdag: the parameters "
            f"({loop['params']['parameters_bytes']} bytes) and one task. Every node is "
            f"`jit=True`, so the call is one program, kept on the workers since the first "
            f"step (the nodes' packed functions, {b['node_functions_inline']:,} bytes, went "
            f"once); no input, node or residual is sent again.")
    seed = cases.get("cluster seed loop")
    if seed and "bytes_per_step" in seed:
        parts.append("Cluster seed loop, bytes each step writes to the scheduler (distributed's "
                     "count): " + ", ".join(f"`{m}` {b:,.0f}"
                                            for m, b in seed["bytes_per_step"].items()) + ".")
    opt = next((c for c in s["cases"] if c["case"].startswith("optimisation")), None)
    if opt and "runs" in opt:
        runs = opt["runs"]
        parts.append("SLSQP on the stepped cantilever: " + "; ".join(
            f"`{m}` {r['iterations']} iterations, {r['calls']} calls, {r['seconds']:.2f} s, "
            f"volume {r['optimum']:,.2f} cm³" for m, r in runs.items())
            + f" (optima within {opt['optimum_gap']:.1e} of each other, relatively).")
    return "\n\n".join(parts)


# (one case, for a quick look: python -m benchmarks.scenarios.repeat_calls)
if __name__ == "__main__":
    with float64():
        print(model_case(QUICK, "dense", *dense_model())["ratios"])
    os._exit(0)
