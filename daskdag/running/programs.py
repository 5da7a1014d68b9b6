"""Programs: a call compiled once and run at every call that fits it, in JAX's ``jit`` ->
``Compiled`` idiom, for as long as nothing it relies on has changed.

Compiling a call of a DAG with inputs like ``x`` and its options (:func:`compile`) checks and
plans the DAG, groups its stages, packs functions, traces nodes for a mode or a sparsity
pattern, and builds the call's graph or the whole call as one XLA program: a :class:`Program`,
whose inputs a call's inputs, cotangents, tangents or directions are, never its structure.

What a program relies on, and how a call checks it:

- the DAG: each entry, its function and options by identity, its deps and resources by value;
- the inputs' structure, shapes and dtypes (:func:`daskdag.model.leaves.signature`);
- the outputs and the call's options; the settings in effect (``dask.config``'s ``daskdag.*``
  and JAX's that change results, :class:`~daskdag.transport.scope.JaxSettings`);
- the content of the node functions it packed or traced: their fingerprints
  (:mod:`daskdag.transport.fingerprints`), each checked by the check it compiled.

An eager call finds its program by a key of the first four (:data:`PROGRAMS`) and checks the
fingerprints. A prepared function holds its programs itself, per input signature
(:class:`Held`), and asks one whether it is stale (:meth:`Program.stale`) before running it.
Anything new or changed compiles anew, and :func:`compile` says why.
"""

from __future__ import annotations

import logging
import sys
import weakref
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property, partial
from typing import TYPE_CHECKING, Any, Callable, Generic, TypeVar

import dask.config
import dask.local
import dask.multiprocessing
import dask.threaded
from dask.callbacks import Callback

import daskdag.config as config
from daskdag.caches import Cache, register
from daskdag.errors import DAGError
from daskdag.model.implicit import Implicit
from daskdag.model.leaves import signature
from daskdag.model.spec import Node
from daskdag.rules.lifted import Lift
from daskdag.running.cluster import scheduler_address
from daskdag.running.compute import logger
from daskdag.transport import protocol, transports
from daskdag.transport.fingerprints import Fingerprint, fingerprint, holding
from daskdag.transport.packing import Packed
from daskdag.transport.scope import JaxSettings
from daskdag.transport.weak import Weak

if TYPE_CHECKING:
    import distributed

P = TypeVar("P")
_UNSET = object()
#: The programs kept for eager calls, by key (the least recently used out first).
PROGRAMS: Cache = Cache("prepared calls", lambda: config.get("prepared-calls"))
_last: Cache = Cache("the last key per DAG", 256)  # (kind, id(dag)) -> (key, note)
OFF = "prepared calls are off (dask.config daskdag.prepared-calls is 0)"

#: Functions daskdag makes of a DAG's own (packed, lifted): fingerprinted to be packed, not
#: watched, for what they hold is a packed copy of a function watched as it was packed, or the
#: DAG's function itself, called as it is.
MADE = (Packed, Lift)


# -- Where a call runs ---------------------------------------------------------------------

# The names of Dask's local schedulers, as dask.compute(scheduler=...) takes them, to the ones
# daskdag runs (local.SCHEDULERS).
NAMES = {"threads": "threads", "threading": "threads", "sync": "sync",
         "synchronous": "sync", "single-threaded": "sync", "processes": "processes",
         "multiprocessing": "processes"}


def where(client, scheduler) -> tuple[Any, str | None]:
    """Where a call runs: ``(client, None)`` on a cluster, ``(None, local scheduler)`` here
    (``"threads"``, ``"sync"`` or ``"processes"``), as ``dask.compute`` decides: ``scheduler=``
    or ``client=``, then Dask's ``scheduler`` setting, then the default client, else threads."""
    found = _where(client, scheduler)
    if found[0] is not None:  # (a cluster: distributed's serializers for daskdag's objects)
        protocol.with_distributed()
    return found


def in_words(client, local: str | None) -> str:
    """Where a call runs (:func:`where`), in words."""
    if client is None:
        if local == "processes":
            return "Dask's multiprocessing scheduler (processes)"
        return f"this process ({local or 'threads'})"
    address = scheduler_address(client)
    return f"the cluster at {address}" if address else "a cluster"


def alone_here() -> bool:
    """Whether a call given neither client nor scheduler runs on this process's threads
    (:func:`where`) with nothing watching it (:func:`one_program_here`) and nothing to log
    (:mod:`daskdag.running.compute`'s logger at INFO): as one program, if it is one."""
    return _where(None, None) == (None, "threads") and \
        one_program_here(None, "threads", False) and not logger.isEnabledFor(logging.INFO)


def _where(client, scheduler) -> tuple[Any, str | None]:
    if scheduler is None:
        if client is not None:
            return client, None
        setting = dask.config.config.get("scheduler")  # (as dask.config.get reads it)
        if setting is not None:
            return _setting(setting)
        client = active_client()
        return client, None if client is not None else "threads"
    if is_client(scheduler):
        if client is not None and client is not scheduler:
            raise DAGError("client= and scheduler= name two different clients: give one")
        return scheduler, None
    if not isinstance(scheduler, str) or scheduler.lower() not in NAMES:
        raise DAGError(f"scheduler must be one of {sorted(NAMES)} or a distributed.Client, "
                       f"got {scheduler!r}")
    if client is not None:
        raise DAGError(f"scheduler={scheduler!r} runs in this process, but client= names a "
                       f"cluster: give one or the other")
    return None, NAMES[scheduler.lower()]


# Dask's local schedulers' functions, as dask.config.set(scheduler=...) may name them.
_FUNCTIONS = {dask.threaded.get: "threads", dask.local.get_sync: "sync",
              dask.multiprocessing.get: "processes"}


def _setting(setting) -> tuple[Any, str | None]:
    """Where Dask's ``scheduler`` setting runs a call (as ``dask.base.get_scheduler`` reads it)."""
    if isinstance(setting, str):
        name = setting.lower()
        if name in NAMES:
            return None, NAMES[name]
        if name in ("dask.distributed", "distributed"):  # (what a default Client sets)
            client = active_client()
            return client, None if client is not None else "threads"
    elif is_client(setting):
        return setting, None
    elif callable(setting):
        if setting in _FUNCTIONS:
            return None, _FUNCTIONS[setting]
        if is_client(getattr(setting, "__self__", None)):  # a Client's .get
            return setting.__self__, None
    raise DAGError(f"dask.config's scheduler is {setting!r}, which daskdag cannot run a call on: "
                   f"set it to one of {sorted(NAMES)}, 'dask.distributed' or a distributed.Client")


def is_client(obj) -> bool:
    """Whether ``obj`` is a ``distributed.Client`` (none can be while ``distributed`` is not
    imported: it is imported only for a cluster)."""
    module = sys.modules.get("distributed")
    return module is not None and isinstance(obj, module.Client)


def active_client() -> distributed.Client | None:
    """The ``distributed`` client in use, if any (none is ever started here)."""
    module = sys.modules.get("distributed")
    if module is None:  # (no client exists before distributed is imported)
        return None
    # (default_client's own lookup, without the ValueError it raises where there is none: a
    # call here would pay more for that than for all else it does)
    found = getattr(module.client, "_get_global_client", None)
    if found is not None:
        return found()
    try:
        return module.default_client()
    except ValueError:
        return None


def one_program_here(client, local: str | None, progress: bool) -> bool:
    """Whether a call may run as one program in this process
    (:meth:`~daskdag.running.jobs.Job.directly`): no cluster, not Dask's multiprocessing
    scheduler, and nothing watching its graph's tasks (a progress bar, another Dask callback)."""
    return client is None and local != "processes" and not progress and not Callback.active


class Watch:
    """What a program relies on, as it is compiled: ``watch(node name, fn)`` takes a function's
    fingerprint before the program packs or traces it (None: it cannot be taken, and the
    program is not kept); ``hold(fn)``: the function held weakly (when it goes, the program
    goes); ``refuse(why)``: the program serves this call only, and is not kept."""

    def __init__(self) -> None:
        self.watched: list[tuple[str, Any, Fingerprint]] = []
        self.refused: list[str] = []
        self.held: list[Weak] = []
        self._prints: dict[int, Fingerprint | None] = {}  # (each function watched once)

    def hold(self, fn: Any) -> Weak:
        weak = Weak(fn)
        self.held.append(weak)
        return weak

    def __call__(self, name: str, fn: Any) -> Fingerprint | None:
        if id(fn) in self._prints:
            return self._prints[id(fn)]
        print_ = self._prints[id(fn)] = fingerprint(fn, checked=config.get("prepared-calls") > 0)
        if print_ is None:
            self.refuse(f"node {name!r}: its function holds something a fingerprint cannot "
                        f"read (a lock, a file, a generator...)")
        elif not isinstance(fn, MADE):
            self.watched.append((name, fn, print_))
        return print_

    def refuse(self, why: str) -> None:
        self.refused.append(why)


@dataclass(frozen=True, eq=False)
class Program(Generic[P]):
    """A call compiled: the kind's compiled ``value``, the functions whose content it relies on
    (``watched``: ``(node name, function, fingerprint)``), its ``key``, and ``kept``: it may
    serve later calls (False: this call only, and ``why`` says why)."""

    value: P
    watched: tuple[tuple[str, Any, Fingerprint], ...]
    key: tuple | None
    kept: bool = True
    why: str | None = None
    settings_seen: dict = field(default_factory=dict)  # daskdag's dask.config when compiled

    def stale(self, entries: Entries | None = None) -> str | None:
        """Why this program cannot serve a call whose DAG's entries are ``entries`` (None: a
        call whose key found it, which holds them), or None: the entries, the settings, then
        the fingerprints, cheapest first. The one check of whether a program is fresh."""
        if not self.kept:
            return self.why
        if entries is not None:
            if entries.fresh is None:
                entries.fresh = self._fresh(entries)
            if entries.fresh():
                return None
            if not entries.same():
                return entries.why()
        ours = dask.config.config.get("daskdag", {})
        if ours != self.settings_seen or self.key is None or not self.key[-1][0].hold():
            if config.get("prepared-calls") <= 0:
                return OFF
            if self.key is None or settings() != self.key[-1]:
                return _PARTS[5]
        if self._holding():
            return None
        for name, fn, print_ in self.watched:  # (which changed)
            if not print_.holds(fn):
                return (f"node {name!r}: its function changed (what it closes over, a global "
                        f"it uses, or an attribute)")
        return None

    @cached_property
    def _holding(self) -> Callable[[], bool]:
        """Whether every watched function's fingerprint holds, as one check."""
        return holding([(print_, fn) for _, fn, print_ in self.watched])

    def _fresh(self, entries: Entries) -> Callable[[], bool]:
        """:meth:`stale` with ``entries`` as one compiled check: True where it would say None,
        having found nothing changed; False: it says why."""
        if self.key is None:
            return lambda: False
        lines, names = entries.check()
        lines.append('if d_config.config.get("daskdag", d_none) != d_seen: return False')
        names.update(d_config=dask.config, d_none={}, d_seen=self.settings_seen)
        jax_lines, jax_names = self.key[-1][0].check()
        return holding([(print_, fn) for _, fn, print_ in self.watched], lines + jax_lines,
                       {**names, **jax_names})


def compile(kind: str, dag: Any, x: Any, options: tuple, make: Callable[[Watch], P],
            inputs: Any = _UNSET) -> tuple[Program[P], str | None]:
    """The program of a call of ``kind`` on ``dag`` with inputs like ``x`` and ``options``
    (hashable): the one compiled before while it holds, else ``make(watch)`` (:class:`Watch`).
    Returns it and why it was compiled now (None: reused). ``inputs``: what of ``x`` the
    program depends on, as a key (default: :func:`signature` of ``x``; None: no key fits)."""
    key = _key(kind, dag, x, options, inputs)
    if key is None:  # (a malformed DAG or unhashable options: make() says what is wrong)
        why = "its arguments cannot key a prepared call"
        return Program(make(Watch()), (), None, kept=False, why=why), why
    if config.get("prepared-calls") <= 0:  # (none is kept, nor used)
        _remember(kind, dag, key, OFF)
        return Program(make(Watch()), (), key, kept=False, why=OFF), OFF
    hit = PROGRAMS.get(key)
    if hit is not None:
        why = hit.stale()
        if why is None:
            _remember(kind, dag, hit.key, None)
            return hit, None
    else:
        why = _why_new(kind, dag, key)
    watch = Watch()
    value = make(watch)
    if watch.refused:
        note = "; ".join(watch.refused) + ": such a call is prepared anew each time"
        _remember(kind, dag, key, note)
        return Program(value, (), key, kept=False, why=note), why
    made = Program(value, tuple(watch.watched), key,
                   settings_seen=dict(dask.config.config.get("daskdag", {})))
    for weak in watch.held:  # (the ids in the key stay the functions' while it lasts)
        weak.on_gone(partial(_forget, made))
    PROGRAMS.put(key, made)
    _remember(kind, dag, key, None)
    return made, why


def _forget(made: Program) -> None:
    """A function the program ``made`` holds is gone: so is the program, wherever it is."""
    if PROGRAMS is None:  # (the interpreter is shutting down)
        return
    if PROGRAMS.get(made.key) is made:
        PROGRAMS.pop(made.key)
    for held in list(_holders):
        held.drop(made)


class Entries:
    """A DAG's entries as a program was compiled with them, to tell at the next call, without a
    key, whether the DAG is the same: the same entry objects under the same names, with the
    same functions, deps and resources (lists and dicts change in place)."""

    __slots__ = ("dag", "parts", "fresh", "_same")

    def __init__(self, dag: Mapping[str, Any]):
        self.dag = dag
        self.parts = tuple((name, entry, _content(entry)) for name, entry in dag.items())
        #: whether nothing changed since its program was compiled (:meth:`Program.stale`)
        self.fresh: Callable[[], bool] | None = None
        self._same: Callable[[], bool] | None = None

    def same(self) -> bool:
        """Whether the DAG holds the same entries, their deps and resources as they were
        (:meth:`check`, compiled once)."""
        if self._same is None:
            self._same = holding((), *self.check())
        return self._same()

    def check(self) -> tuple[list[str], dict]:
        """Whether the DAG is the same (the same entry objects under the same names, with the
        same deps and resources), as lines of a compiled check, and the names they read
        (:func:`~daskdag.transport.fingerprints.holding`)."""
        lines = [f"if len(d_dag) != {len(self.parts)}: return False"]
        names: dict[str, Any] = {"d_dag": self.dag}
        for k, (name, entry, content) in enumerate(self.parts):
            names.update({f"d_n{k}": name, f"d_e{k}": entry, f"d_c{k}": content,
                          "d_content": _content})
            lines.append(f"if d_dag.get(d_n{k}) is not d_e{k}: return False")
            if type(entry) is tuple:
                if len(entry) == 2:
                    lines.append(f"if d_e{k}[1] != d_c{k}[1]: return False")
            elif isinstance(entry, (Node, Implicit)):
                lines.append(f"if d_e{k}.deps != d_c{k}[0] or d_e{k}.resources != d_c{k}[1]: "
                             f"return False")
            else:
                lines.append(f"if d_content(d_e{k}) != d_c{k}: return False")
        return lines, names

    def why(self) -> str:
        """What changed in the DAG since (:meth:`same` is False)."""
        return _dag_changed({name: (id(entry), content) for name, entry, content in self.parts},
                            {name: (id(entry), _content(entry))
                             for name, entry in self.dag.items()})


def _content(entry) -> tuple:
    """What of a DAG entry can change in place, as values compared in C: a list entry's items,
    deps, resources (copies, as they are now)."""
    if type(entry) is tuple and len(entry) == 2:
        return entry[0], list(entry[1]) if type(entry[1]) is list else entry[1]
    if isinstance(entry, (Node, Implicit)):
        deps, resources = entry.deps, entry.resources
        return (list(deps) if type(deps) is list else deps,
                dict(resources) if type(resources) is dict else resources)
    if isinstance(entry, list):
        return tuple(entry[:1]) + tuple(list(e) if type(e) is list else e for e in entry[1:])
    return (entry,)


class Held:
    """A prepared function's own programs by the signature of its call's inputs (and where it
    runs), the latest :data:`HELD`, each with its :class:`Entries`, as ``jax.jit``'s wrapper
    holds its executables, and the :class:`~daskdag.graph.whole.Entry` of those whose calls
    run as one program here (``entries``), which return what ``shape`` makes of a call's
    results (the prepared function's results). Unused while ``daskdag.prepared-calls`` is 0."""

    __slots__ = ("programs", "entries", "shape", "_latest", "__weakref__")

    def __init__(self, shape: Callable[[Any], Any]) -> None:
        self.programs: OrderedDict[Any, tuple[Program, Entries]] = OrderedDict()
        self.entries: dict[Any, Any] = {}
        self.shape = shape
        self._latest: tuple | None = None  # (the entry that ran last, as held in entries)
        _holders.add(self)

    def get(self, key: Any) -> tuple[Program, Entries] | None:
        if config.get("prepared-calls") <= 0:
            return None
        hit = self.programs.get(key)
        if hit is not None:
            self.programs.move_to_end(key)
        return hit

    def entry(self, x: Any) -> Any:
        """The entry that runs a call with inputs ``x`` and no data in this process, while its
        program is fresh (else None): the one that ran last, when it :meth:`takes` ``x``, else
        the one held by :func:`held_key`."""
        latest = self._latest
        if latest is None or not latest[0].takes(x):
            try:
                latest = self.entries[held_key(transports.IN_PROCESS, x, ())]
            except (KeyError, TypeError):  # (none; inputs that cannot key one)
                return None
            self._latest = latest
        entry, program, dag = latest
        return entry if program.stale(dag) is None else None

    def hold_entry(self, key: Any, entry: Any) -> None:
        """``entry`` runs the calls of the program held by ``key`` (:meth:`entry`)."""
        self.entries[key] = (entry, *self.programs[key])

    def program(self, kind: Any, x: Any, data: tuple, transport: Any
                ) -> tuple[Program, str | None, Any]:
        """The program for a call of ``kind`` (its ``compile``) with inputs like ``x`` and
        ``data``, on ``transport``: the one held while it is fresh, else compiled and held.
        Returns it, why it was compiled (None: held), and what it is held by (None: nothing)."""
        key = held_key(transport, x, data)
        try:
            hit = self.get(key) if key is not None else None
        except TypeError:  # (it does not hash)
            key = hit = None
        stale = hit[0].stale(hit[1]) if hit is not None else None
        if hit is not None and stale is None:
            return hit[0], None, key
        program, why = kind.compile(x, data, transport=transport)
        if hit is not None and why is not None:
            why = stale  # (what changed since this function's own last call)
        if key is not None:
            self.put(key, program, Entries(kind.dag))
        return program, why, key

    def put(self, key: Any, program: Program, entries: Entries) -> None:
        self.entries.pop(key, None)
        self._latest = None
        if not program.kept:
            self.programs.pop(key, None)
            return
        self.programs[key] = (program, entries)
        self.programs.move_to_end(key)
        while len(self.programs) > HELD:
            self.entries.pop(self.programs.popitem(last=False)[0], None)

    def drop(self, program: Program) -> None:
        self._latest = None
        for key, (held, _) in list(self.programs.items()):
            if held is program:
                self.programs.pop(key, None)
                self.entries.pop(key, None)

    def clear(self) -> None:
        self._latest = None
        self.programs.clear()
        self.entries.clear()


def held_key(transport: Any, x: Any, data: tuple) -> tuple | None:
    """What :class:`Held` holds a call's program by: where it runs, the inputs' names and
    :func:`signature`, the data's names; None where they cannot be read (the call says why).
    It may not hash (a leaf that is not hashable): then nothing is held for it."""
    try:
        return (transport.name, frozenset(x) if isinstance(x, Mapping) else None, signature(x),
                tuple(frozenset(d) if isinstance(d, Mapping) else None for d in data))
    except (TypeError, ValueError):
        return None


HELD = 8  # the input signatures a prepared function keeps a program for
_holders: weakref.WeakSet[Held] = weakref.WeakSet()


def _clear_held() -> None:
    for held in list(_holders):
        held.clear()


register("prepared functions' own programs", _clear_held)

#: daskdag's settings that each call reads as it runs: no program depends on them.
PER_CALL = frozenset({"worker-wait", "keep-calls", "tune-workers", "prepared-calls",
                      "reuse-bytes", "sweep-results"})


def settings() -> tuple:
    """The settings a program may depend on, as a key: JAX's that change results (the calling
    thread's :class:`~daskdag.transport.scope.JaxSettings`) and daskdag's (``dask.config``,
    less :data:`PER_CALL`)."""
    ours = dask.config.config.get("daskdag", {})
    return JaxSettings.current(), tuple(sorted(
        (k, repr(v)) for k, v in ours.items() if k not in PER_CALL))


def dag_key(dag: Any) -> tuple | None:
    """The DAG as a key: per entry its name, its functions' identities, its deps, resources and
    options by value; None for what is not a well-formed DAG. (A program goes with its
    functions, so no other function takes an id in its key while it lasts.)"""
    if not isinstance(dag, Mapping):
        return None
    parts = [_entry_key(name, entry) for name, entry in dag.items()]
    return None if any(p is None for p in parts) else tuple(parts)


def _entry_key(name: str, entry: Any) -> tuple | None:
    """One entry's part of :func:`dag_key`: its functions by identity, its deps, options and
    resources by value; None where it is malformed."""
    if isinstance(entry, Node):
        return _options_key(name, entry, (entry.fn, entry.vjp, entry.fwd, entry.bwd, entry.jvp),
                            ())
    if isinstance(entry, Implicit):
        return _options_key(name, entry, (entry.residual, entry.guess, entry.solver,
                                          entry.linear_solver),
                            (Implicit, entry.rtol, entry.atol, entry.maxiter))
    if isinstance(entry, (tuple, list)) and len(entry) == 2:
        fn, deps = entry
        return (name, type(deps), tuple(deps), id(fn)) if isinstance(deps, (list, tuple)) else None
    return None


def _options_key(name: str, entry: Any, functions: tuple, more: tuple) -> tuple | None:
    """A :class:`Node`'s or an :class:`Implicit`'s :func:`_entry_key` (``more``: its kind's
    own options)."""
    deps, resources = entry.deps, entry.resources
    if not isinstance(deps, (list, tuple)) or not (
            resources is None or isinstance(resources, Mapping)):
        return None
    return (name, type(deps), tuple(deps), *map(id, functions), *more, entry.jit, entry.vmap,
            entry.device, entry.remat,
            None if resources is None else tuple(sorted(resources.items())))


def _key(kind: str, dag: Any, x: Any, options: tuple, inputs: Any) -> tuple | None:
    structure = dag_key(dag)
    if structure is None or inputs is None:
        return None
    try:
        key = (kind, structure, frozenset(x) if isinstance(x, Mapping) else None,
               signature(x) if inputs is _UNSET else inputs, options, settings())
        hash(key)
    except (TypeError, ValueError):
        return None
    return key


def _remember(kind: str, dag: Any, key: tuple, note: str | None) -> None:
    """Remember ``key`` as the last of ``dag`` (by id: a DAG dict cannot be held weakly, so
    another one may take its id once it is gone, and be explained by its key)."""
    last = _last.get((kind, id(dag)))
    if last is None or last[0] is not key or last[1] != note:
        _last.put((kind, id(dag)), (key, note))


_PARTS = ("", "the DAG changed", "the inputs given changed", "the inputs' structure, shapes or "
          "dtypes changed", "the outputs or options changed", "a setting changed (dask.config "
          "daskdag.*, or a JAX setting that changes results: jax_enable_x64, "
          "jax_default_matmul_precision...)")


def _why_new(kind: str, dag: Any, key: tuple) -> str:
    """Why ``key`` has no program: first call, or what differs from the last key of the
    same DAG (the entry concerned, when the DAG changed)."""
    last = _last.get((kind, id(dag)))
    if last is None:
        return "first call"
    if last[0] == key:
        return last[1] or ("its preparation was let go (daskdag.prepared-calls, or one of its "
                           "functions went)")
    if not {p[0] for p in last[0][1]} & {p[0] for p in key[1]}:  # (a DAG took a gone one's id)
        return "first call"
    for k, (old, new) in enumerate(zip(last[0], key)):
        if old != new and k == 1:
            return _dag_changed({p[0]: p for p in old}, {p[0]: p for p in new})
        if old != new:
            return _PARTS[k]
    return "first call"


def _dag_changed(before: Mapping, after: Mapping) -> str:
    """What changed in a DAG whose entries were ``before`` and are ``after`` (by name, each
    compared as a value)."""
    for name, entry in after.items():
        if name not in before:
            return f"the DAG changed: node {name!r} was added"
        if before[name] != entry:
            return f"the DAG changed: node {name!r} was replaced or its deps changed"
    gone = [name for name in before if name not in after]
    return f"the DAG changed: node(s) {gone} removed" if gone else "the DAG changed"
