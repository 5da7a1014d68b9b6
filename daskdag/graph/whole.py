"""A call whose graph is one closed fused stage, run as one jitted program: one dispatch in this
process, one task on a cluster (:func:`one_task`).

Such a call's needed nodes are all one fused stage (every one ``jit=True``, none with rules of
its own, all on one device), its differentiated names that stage's deps. :class:`WholeGradients`
computes the call's ``{output: (value, {input: grad})}`` as its graph would, as one XLA program
compiled once for the call's shapes, on the stage's device: the stage's nodes once, one
backward pass per output a differentiated input reaches, seeded by its cotangent (an input of
the program), and each gradient laid out as :func:`daskdag.graph.tasks.gradient` lays it out.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from dask.base import tokenize

import daskdag.config as config
from daskdag.caches import Cache
from daskdag.errors import DAGError
from daskdag.graph.assembly import Intake, TaskGraph, key
from daskdag.graph.compiled import TRACED, rebuild, replay, split
from daskdag.graph.tasks import Fused, identity, placed
from daskdag.graph.stages import Stage
from daskdag.model.leaves import is_array, is_differentiable
from daskdag.model.plan import Plan
from daskdag.model.spec import Node
from daskdag.rules.vjp import basis, basis_rows, seed
from daskdag.rules.vjp import by_arg, diff_counts, vjp_leaves
from daskdag.transport.packing import Function, current, unpack
from daskdag.transport.scope import within
from daskdag.transport.transports import Transport


def whole_stage(plan: Plan, stages: Sequence[Stage]) -> Stage | None:
    """The one stage of ``plan`` when it is a whole call (see the module's docstring), else
    None; None too with ``daskdag.close-stages`` off, which keeps forward and backward apart."""
    if len(stages) != 1 or not config.get("close-stages"):
        return None
    stage = stages[0]
    deps = set(stage.deps)
    if not stage.fused or not all(i in deps for i in plan.wrt) or \
            not all(o in stage.outputs for o in plan.outputs):
        return None
    return stage


class WholeGradients:
    """The call's gradients as one program (see the module's docstring): ``stage``, its
    ``outputs`` (per output of the call: its name, its place among the stage's outputs, and
    whether a differentiated input reaches it), ``wrt`` (per differentiated input: its name and
    its place among the stage's deps) and ``nodes`` (the stage's, a prepared call's);
    ``rows``: each output's gradients are its Jacobian's rows, compressed by ``colours`` (a
    sparse Jacobian's, as :attr:`daskdag.graph.tasks.Rows.colours`) where it has them. It
    travels as those (a cluster's worker keeps it, and compiles it once: :func:`one_task`)."""

    def __init__(self, stage: Stage, outputs: tuple, wrt: tuple, nodes: Sequence[Node],
                 rows: bool = False, colours: tuple = ()):
        self.stage, self.outputs, self.wrt, self.nodes = stage, outputs, wrt, tuple(nodes)
        self.rows, self.colours = rows, colours
        self.active = stage.dep_active()
        self.fused = Fused(stage, [current(n.fn) for n in nodes], weakly=True)
        self._split = jax.jit(self._split_run, static_argnums=(0, 3))
        self._programs: dict[Any, Callable] = {}

    @classmethod
    def of(cls, plan: Plan, stage: Stage, shared: bool = True, rows: bool = False,
           colours: tuple = ()) -> WholeGradients:
        """The program of ``plan``, whose whole call is ``stage`` (:func:`whole_stage`);
        ``shared``: the one made already (:func:`made_once`), for a program that runs in this
        process; ``rows``: each output's gradients are its Jacobian's rows (the identity's rows
        over its elements pulled back, as a :class:`~daskdag.graph.tasks.Rows` seeding does),
        compressed where ``colours`` (its ``colours``) gives an output's."""
        outputs = tuple((o, stage.outputs.index(o), o in plan.active) for o in plan.outputs)
        wrt = tuple((i, stage.deps.index(i)) for i in plan.wrt)
        nodes = [plan.spec.nodes[n] for n in stage.nodes]
        if not shared:
            return cls(stage, outputs, wrt, nodes, rows, colours)
        return made_once(lambda: cls(stage, outputs, wrt, nodes, rows, colours),
                         (cls, stage, outputs, wrt, rows, colours), nodes)

    def __reduce__(self):
        return _receive, (self.token, self.stage, self.outputs, self.wrt, self.nodes, self.rows,
                          self.colours)

    @cached_property
    def token(self) -> str:
        """What the program is, as a token: the same for the same stage, outputs, inputs and
        node functions (their content tokens, where they are packed)."""
        return tokenize(self.stage, self.outputs, self.wrt, self.nodes, self.rows, self.colours)

    def __call__(self, values: dict[str, Any], cotangents: dict[str, Any],
                 then: Callable[[dict], Any] | None = None) -> Any:
        """``{output: (value, {input: grad})}`` for the input ``values`` and the outputs'
        ``cotangents`` (None: from 1); None where an input leaf that is held constant cannot be
        a constant of a program (it is not hashable): the call's graph runs it instead.
        ``then``: a function of those results, jittable and hashable, run in the same
        program (one compiled per ``then``); its results are the call's."""
        deps = {d: values[d] for d in self.stage.deps}
        if self.stage.device is None and all(map(is_array, jax.tree.leaves(deps))):
            return self.program(then)(deps, cotangents)  # (the common call, at once)
        parts = split(tuple(deps.values()), self.active)
        if parts is None:
            return None
        static, traced = parts
        if all(c is TRACED for c in static[1]):  # (every leaf an array, the common call)
            with placed(self.stage, (deps, cotangents)) as (deps, cotangents):
                return self.program(then)(deps, cotangents)
        cts = tuple(cotangents.get(o) for o, _, _ in self.outputs)
        with placed(self.stage, (traced, cts)) as (traced, cts):  # (on the stage's device)
            return self._split(static, traced, cts, then)

    def program(self, then: Callable[[dict], Any] | None = None) -> Callable[[dict, dict], Any]:
        """The call as one jitted function of its deps' values by name, every leaf an array,
        and the outputs' cotangents by name, ``then`` applied (:meth:`__call__`): one per
        ``then``, which every call of the same stage and outputs runs."""
        made = self._programs.get(then)
        if made is None:
            def run(deps, cotangents):
                leaves, treedef = jax.tree.flatten(tuple(deps[d] for d in self.stage.deps))
                return self._split_run((treedef, (TRACED,) * len(leaves)), tuple(leaves),
                                       tuple(cotangents.get(o) for o, _, _ in self.outputs),
                                       then)

            made = self._programs[then] = jax.jit(run)
        return made

    def _split_run(self, static, traced, cotangents, then):
        computed = self._by_name(self._run(static, traced, cotangents))
        return computed if then is None else then(computed)

    def _by_name(self, computed: tuple) -> dict:
        return {o: (value, dict(zip((i for i, _ in self.wrt), grads)))
                for (o, _, _), (value, grads) in zip(self.outputs, computed)}

    def _run(self, static, traced, cotangents):
        treedef, consts = static
        args = rebuild(treedef, consts, traced)
        fn = replay(self.fused, treedef, consts, traced)  # (the user's Python code runs once)
        # (an output reached is its vjp's primal: the nodes traced once per output, so that a
        # callback in them runs once a call where one output is asked)
        values = () if self.wrt and all(r for _, _, r in self.outputs) else fn(*args)
        out = []
        for (o, e, reached), ct in zip(self.outputs, cotangents):
            if not self.wrt:
                out.append((values[e], ()))
                continue
            colours = dict(self.colours).get(o)
            if reached:
                value, _, vjp_fn = vjp_leaves(lambda *a, e=e: fn(*a)[e], args, self.active)
                pulled = (jax.vmap(lambda c: vjp_fn(list(c)))(basis(o, value, colours))
                          if self.rows else vjp_fn(list(seed(value, o, ct))))
                shares = by_arg(pulled, self.active, diff_counts(args, self.active))
            else:  # (no differentiated input reaches it: zeros, as the graph's gradient tasks)
                value, shares = values[e], (None,) * len(args)
            lead = (basis_rows(value, colours),) if self.rows else ()
            out.append((value, tuple(_laid_out(args[d], shares[d], lead) for _, d in self.wrt)))
        return tuple(out)


class Entry:
    """A warm call in this process, start to end: its input ``x``, as given, taken apart as
    the call's first one was (``inputs``, the DAG's free inputs, and ``keyed``: a single one's
    value given under its name), the whole program run (:meth:`WholeGradients.program`) with
    the outputs' ``cotangents``, and ``finish`` of what it returns: the results as the caller
    gets them, with ``info``, the call's :class:`~daskdag.running.jobs.CallInfo`;
    ``rearranges``: ``finish`` only rearranges what the program returns, and the first call
    learns how (:func:`rearranged`). ``like``: the first call's input; :meth:`takes` tells an
    input of the same signature at a glance."""

    __slots__ = ("run", "deps", "single", "keyed", "cotangents", "finish", "info", "_finish",
                 "_like")

    def __init__(self, whole: WholeGradients, then: Callable[[dict], Any] | None,
                 inputs: tuple[str, ...], keyed: bool, cotangents: dict,
                 finish: Callable[[dict], Any], info: Any, rearranges: bool, like: Any):
        self.run, self.deps = whole.program(then), whole.stage.deps
        self.single = inputs[0] if len(inputs) == 1 else None
        self.keyed, self.cotangents, self.info = keyed, cotangents, info
        self._finish = finish
        self.finish = self._learn if rearranges else finish
        self._like = _glance(like) if isinstance(like, dict) or (
            self.single is not None and not keyed) else None

    def takes(self, x: Any) -> bool:
        """Whether ``x`` is, at a glance, an input of the signature this entry was made for (a
        single array, or a dict of arrays by the same names, each of the same
        type, shape, dtype and weak type); False: look it up."""
        like = self._like
        if like is None:
            return False
        if type(like) is dict:
            return type(x) is dict and len(x) == len(like) and all(
                _glance(x.get(name)) == one for name, one in like.items())
        return _glance(x) == like if type(x) is like[0] else False

    def __call__(self, x: Any) -> Any:
        if self.single is None or self.keyed:
            deps = {d: x[d] for d in self.deps}
        else:
            deps = {self.single: x} if self.deps else {}
        return self.finish(self.run(deps, self.cotangents))

    def _learn(self, computed: Any) -> Any:
        """The first call's finish, which learns the next calls' (:func:`rearranged`)."""
        self.finish = rearranged(self._finish, computed) or self._finish
        return self._finish(computed)


class _Mark:
    """A leaf of a program's results, by where it is among them (:func:`rearranged`)."""

    __slots__ = ("at",)

    def __init__(self, at: str):
        self.at = at


def _glance(x: Any) -> Any:
    """What :meth:`Entry.takes` compares: a JAX array's type, shape, dtype and weak type; a
    dict's, per name, where every value is a JAX array; else None."""
    if isinstance(x, jax.Array):
        return type(x), x.shape, x.dtype, x.weak_type
    if type(x) is dict and x and all(isinstance(v, jax.Array) for v in x.values()):
        return {name: _glance(v) for name, v in x.items()}
    return None


def rearranged(finish: Callable[[Any], Any], computed: Any) -> Callable[[Any], Any] | None:
    """``finish`` (which only rearranges the leaves of what a program returns: it reads no
    value) as one expression that picks ``computed``'s leaves into the dicts, tuples and lists
    it returns, learnt from ``computed``; None where it returns anything else, or ``computed``
    is not such (then ``finish`` itself)."""
    paths, tree = jax.tree_util.tree_flatten_with_path(computed)
    try:
        at = ["c" + "".join(f"[{_literal(getattr(k, 'key', getattr(k, 'idx', None)))}]"
                            for k in path) for path, _ in paths]
        out = finish(tree.unflatten(map(_Mark, at)))
        source = f"lambda c: {_expression(out)}"
    except Exception:  # (it reads a value after all, or builds what is not plain)
        return None
    return eval(source, {})


def _literal(key: Any) -> str:
    if type(key) not in (str, int):
        raise TypeError(f"not a plain key: {key!r}")
    return repr(key)


def _expression(out: Any) -> str:
    kind = type(out)
    if kind is _Mark:
        return out.at
    if out is None:
        return "None"
    if kind is dict:
        return "{" + ", ".join(f"{_literal(k)}: {_expression(v)}" for k, v in out.items()) + "}"
    if kind is tuple:
        return "(" + "".join(f"{_expression(v)}, " for v in out) + ")"
    if kind is list:
        return "[" + ", ".join(_expression(v) for v in out) + "]"
    raise TypeError(f"not plain: {kind.__name__}")


#: Whole programs by what they compute and the identity of the functions they run.
_made: Cache[Any] = Cache("whole programs", 64)


def made_once(make: Callable[[], Any], what: tuple, nodes: Sequence[Node]) -> Any:
    """``make()``, a whole program of ``nodes``, or the one made already for the same ``what``
    (its class, stage, outputs, inputs, mode) and the same functions: packed ones with the same
    content token (each preparation packs anew, and lifts anew what it packs), others the same
    objects (:func:`~daskdag.transport.packing.current`). A call compiled anew runs the
    program compiled already; a function changed in place is another program."""
    parts = [n.fn.token if isinstance(n.fn, Function) else current(n.fn) for n in nodes]
    key = (*what, tuple(p if isinstance(p, str) else id(p) for p in parts))
    hit = _made.get(key)
    # (its functions held weakly: one made for a function since gone is made anew)
    if hit is not None and all((f is not None) if isinstance(p, str) else p is f
                               for p, f in zip(parts, hit.fused.fns)):
        return hit
    return _made.put(key, make())


#: The programs this process received, by token: one sent again (a client lets go of what its
#: recent calls did not use, :mod:`daskdag.running.resident`) runs compiled already.
_received: Cache[WholeGradients] = Cache("whole programs received", 32)


def _receive(token: str, stage: Stage, outputs: tuple, wrt: tuple, nodes: Sequence[Node],
             rows: bool, colours: tuple) -> WholeGradients:
    hit = _received.get(token)
    if hit is None:
        hit = _received.put(token, WholeGradients(stage, outputs, wrt, nodes, rows, colours))
        hit.token = token
    return hit


def fits(stage: Stage, values: dict[str, Any]) -> bool:
    """Whether a whole program of ``stage`` runs with these input ``values`` (see
    :meth:`WholeGradients.__call__`)."""
    return split(tuple(values[d] for d in stage.deps), stage.dep_active()) is not None


@dataclass(frozen=True)
class OneTask:
    """A call that is one task on a cluster, as ``distributed.Client.submit`` takes it:
    ``fn(*args)`` under ``key`` on a worker with the resources ``needs``, its result the call's."""

    key: str
    fn: Callable
    args: tuple
    needs: dict


def one_task(program: WholeGradients, values: dict[str, Any],
             cotangents: dict[str, Any], transport: Transport, place) -> OneTask:
    """The call on a cluster as one task, whose result is ``program``'s
    (:func:`program_task`): each call sends its input ``values`` and ``cotangents``."""
    stage = program.stage
    return program_task(program, stage.name, stage.needs, run_task,
                        [("input", d, values[d]) for d in stage.deps] +
                        [("cotangent", o, cotangents.get(o)) for o, _, _ in program.outputs],
                        transport, place)


#: How :func:`program_task` names a value it cannot pack, by its kind.
WHAT = {"input": "input {!r}", "cotangent": "the cotangent of {!r}"}


def program_task(program: Any, label: str, needs: Any, run: Callable,
                 slots: Sequence[tuple[str, str, Any]], transport: Transport, place,
                 kept: Sequence[tuple] = ()) -> OneTask:
    """``run(program, *values)`` as one task on a cluster: ``program`` (with a ``token``) is
    kept there under its token (``place``), sent by the first call; ``values`` are those of
    ``slots`` (``(kind, name, value)``, None where not given), packed for ``transport``, then
    the cluster's kept values ``kept`` (``(key, fn, payload, needs)``, placed again so that
    they stay). ``label`` names the task, ``needs`` its resources."""
    intake = Intake(TaskGraph(), transport, place)
    held = intake.kept("program", label, program.token, identity, program, needs)
    args = [None if v is None else intake.packed(kind, name, WHAT[kind].format(name), v)
            for kind, name, v in slots]
    args += [place(*spec) for spec in kept]
    return OneTask(key("fwd", label, uuid.uuid4().hex), within,
                   (intake.graph.settings, run, held, *args), dict(needs))


def run_task(program: WholeGradients, *args) -> dict:
    """``program`` run as a task (:func:`one_task`): ``args``, the packed values of the stage's
    deps, then the outputs' cotangents."""
    n = len(program.stage.deps)
    args = tuple(unpack(a) for a in args)
    values = dict(zip(program.stage.deps, args[:n]))
    cotangents = {o: ct for (o, _, _), ct in zip(program.outputs, args[n:]) if ct is not None}
    computed = program(values, cotangents)
    if computed is None:  # (the client checked: fits)
        raise DAGError(f"stage {program.stage.name!r}: an input leaf held constant is not "
                       f"hashable")
    return computed


def _laid_out(x, share: tuple | None, lead: tuple = ()):
    """The gradient of ``x`` from its differentiable leaves' cotangents (``share``; None: zeros;
    ``lead``: stacked over a Jacobian's rows), as :func:`daskdag.graph.tasks.gradient` makes it."""
    leaves, treedef = jax.tree.flatten(x)
    flat = iter(share if share is not None else
                [jnp.zeros((*lead, *jnp.shape(leaf)), jnp.result_type(leaf))
                 for leaf in leaves if is_differentiable(leaf)])
    return treedef.unflatten([_typed(next(flat), leaf) if is_differentiable(leaf) else None
                              for leaf in leaves])


def _typed(grad, leaf):
    dtype = jnp.result_type(leaf)
    return grad if grad.dtype == dtype else grad.astype(dtype)
