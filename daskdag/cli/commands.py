"""The commands ``daskdag run``, ``daskdag sweep`` and ``daskdag certs``, their parser, the DAG
that ``MODULE[:DAG]`` names (a module or a ``.py`` file, and the attribute holding the dict or a
callable returning it), the scheduler that ``--scheduler`` names, and :func:`main`, which maps
what they raise to exit codes (:mod:`daskdag.cli`)."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import json
import os
import sys
import textwrap
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import dask
import numpy as np

import daskdag
from daskdag.cli import (EXIT_CLUSTER, EXIT_CODES, EXIT_INTERRUPTED, EXIT_ITEMS_FAILED, EXIT_NODE,
                         EXIT_OK, EXIT_STORE, EXIT_USAGE, Unreachable, UsageError)
from daskdag.cli.npz import NPZ_LAYOUT, load_npz, result_arrays, save, summary, to_jax
from daskdag.cli.tls import DEFAULT_HOSTS, security, write_certs
from daskdag.errors import ClusterError, DAGError, NodeError, StoreError
from daskdag.model.spec import parse
from daskdag.running.programs import active_client

if TYPE_CHECKING:
    import distributed


TARGET_HELP = ("an importable module (pkg.mod, looked up from the current directory "
               "first, as `python -m` does) or a .py file (path/to/pipeline.py, loaded with its "
               "directory first on sys.path, as `python path/to/pipeline.py` does); DAG is the "
               "attribute holding the dict {name: (fn, [deps])} (dotted: obj.attr), or a "
               "zero-argument callable returning it. Default attribute: dag")


def load_dag(target: str) -> dict:
    """The DAG named by ``MODULE[:DAG]`` (see :data:`TARGET_HELP`), as a dict, not yet validated
    (:func:`daskdag.model.spec.parse` does that); ``UsageError`` naming what was looked for when
    it is not there."""
    # DAG is "dag" where none is given, or what follows the last ":" is no name (C:\dags\p.py).
    module_part, sep, attr = target.rpartition(":")
    if not sep or not all(p.isidentifier() for p in attr.split(".")):
        module_part, attr = target, "dag"
    if module_part.endswith(".py") or "/" in module_part or os.sep in module_part:
        module, where = _exec_file(module_part)
    else:
        module, where = _import_module(module_part), module_part
    return dict(_dag_object(module, where, attr))


def _exec_file(module_part: str) -> tuple[ModuleType, str]:
    """``(module, its resolved path as text)``: the module the file defines, run with its
    directory first on ``sys.path`` (where it stays, as with ``python path/file.py``) and kept
    in ``sys.modules`` (for pickling by value); ``UsageError`` where it is missing or raised."""
    path = Path(module_part).expanduser()
    if not path.is_file():
        raise UsageError(f"no DAG module file {str(path)!r}" + ("" if path.suffix == ".py" else
                         " (a module name is written pkg.mod, a file path/to/file.py)"))
    path = path.resolve()
    name = path.stem if path.stem.isidentifier() else "daskdag_cli_dag"
    if name in sys.modules and getattr(sys.modules[name], "__file__", None) != str(path):
        name = f"daskdag_cli_{abs(hash(str(path)))}"
    sys.path.insert(0, str(path.parent))
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]  # (a .py file)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)  # type: ignore[union-attr]
    except BaseException as e:
        sys.modules.pop(name, None)
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        raise UsageError(f"loading DAG module {str(path)!r} failed: {type(e).__name__}: {e}") from e
    return module, str(path)


def _import_module(module_part: str) -> ModuleType:
    """The module, imported with the current directory first on ``sys.path`` (as ``python -m``
    has it); ``UsageError`` where there is no such module or importing it raised."""
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        return importlib.import_module(module_part)
    except ModuleNotFoundError as e:
        if e.name and (module_part == e.name or module_part.startswith(e.name + ".")):
            raise UsageError(f"no module named {module_part!r} (looked for {e.name!r} on "
                             f"sys.path, the current directory first); for a file write "
                             f"path/to/{module_part.rpartition('.')[2]}.py") from e
        raise UsageError(f"importing DAG module {module_part!r} failed: {e}") from e
    except Exception as e:
        raise UsageError(f"importing DAG module {module_part!r} failed: "
                         f"{type(e).__name__}: {e}") from e


def _dag_object(module: ModuleType, where: str, attr: str) -> Any:
    """The mapping at the (dotted) attribute ``DAG``, or what calling it returns; ``UsageError``
    where there is no such attribute (listing the module's dicts and callables), the call
    raised, or the result is no mapping."""
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            have = sorted(k for k, v in vars(module).items()
                          if not k.startswith("_") and (isinstance(v, Mapping) or callable(v))
                          and not isinstance(v, type(sys)))
            raise UsageError(f"DAG module {where!r} has no attribute {attr!r}" + (
                f"; dicts and callables there: {', '.join(have[:20])}" if have else ""))
        obj = getattr(obj, part)
    if not isinstance(obj, Mapping) and callable(obj):
        try:
            obj = obj()
        except Exception as e:
            raise UsageError(f"{where}:{attr} is callable, but calling it with no arguments "
                             f"failed: {type(e).__name__}: {e}") from e
    if not isinstance(obj, Mapping):
        raise UsageError(f"{where}:{attr} is a {type(obj).__name__}, not the DAG dict "
                         f"{{name: (fn, [deps])}} (nor a zero-argument callable returning it)")
    return obj



def _names(text: str | None, option: str) -> list[str] | None:
    if text is None:
        return None
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise UsageError(f"{option} names nothing: give comma-separated names")
    return names


def _prepare(args: argparse.Namespace, command: str) -> tuple:
    """What ``run`` and ``sweep`` share: ``(--out path, DAG dict, its Spec, outputs, wrt, x,
    cotangents)``, arrays as JAX's; ``UsageError`` for a bad option, module or file,
    ``DAGError`` for a malformed DAG."""
    out = Path(args.out).expanduser()
    if out.is_dir():
        raise UsageError(f"--out {args.out!r} is a directory; name the .npz file to write")
    if not out.parent.is_dir():
        raise UsageError(f"--out {args.out!r}: no directory {str(out.parent)!r}")
    dag = load_dag(args.target)
    spec = parse(dag)
    outputs: list[str] = _names(args.outputs, "--outputs")  # type: ignore[assignment]  # (required)
    wrt = _names(args.wrt, "--wrt")
    for o in outputs:
        if o not in spec.nodes:
            kind = "a free input, not a node" if o in spec.inputs else "not a node of the DAG"
            raise UsageError(f"--outputs names {o!r}, which is {kind}; "
                             f"nodes: {', '.join(spec.nodes)}")
    needed = spec.ancestors(outputs)
    values = load_npz(args.inputs, spec.inputs, "inputs",
                      needed=[i for i in spec.inputs if i in needed], single_ok=True)
    cts = None
    if args.cotangents:
        cts = to_jax(load_npz(args.cotangents, outputs, "cotangents"))
    x = values[spec.inputs[0]] if len(spec.inputs) == 1 else values
    client = active_client() if args.scheduler is None else None
    if client is not None:  # (started by importing the DAG module; a local run would not use it)
        raise UsageError(f"the DAG module started a distributed client ({client}) when imported; "
                         f"daskdag {command} runs locally unless --scheduler is given: pass "
                         f"its address there, or do not start a client at import")
    return out, dag, spec, outputs, wrt, to_jax(x), cts


@contextlib.contextmanager
def connected(args: argparse.Namespace) -> Iterator[distributed.Client | None]:
    """The ``distributed.Client`` that ``--scheduler`` (``--tls``, ``--timeout``) names, closed
    on leaving, or ``None`` for Dask's local threaded scheduler."""
    if args.scheduler is None:
        if args.tls is not None:
            raise UsageError("--tls needs --scheduler (the local scheduler has no connections)")
        yield None
        return
    from distributed import Client

    address, sec = args.scheduler, None
    if args.tls is not None:
        try:
            sec = security(args.tls)
        except FileNotFoundError as e:
            raise UsageError(str(e)) from e
    is_file = address.endswith(".json")
    if is_file:
        path = Path(address).expanduser()
        where, kwargs = f"the scheduler of file {address}", {"scheduler_file": str(path)}
        named = address
        with contextlib.suppress(OSError, ValueError, TypeError, AttributeError):
            named = json.loads(path.read_text()).get("address", "")
    else:
        if args.tls is not None and "://" not in address:
            address = "tls://" + address
        elif args.tls is not None and not address.startswith("tls://"):
            raise UsageError(f"--tls needs a tls:// scheduler address, got {address!r}")
        where, kwargs, named = f"the scheduler at {address}", {"address": address}, address
    if str(named).startswith("tls://") and sec is None:
        from distributed import Security

        if Security().get_connection_args("client").get("ssl_context") is None:
            raise UsageError(f"the scheduler at {named} speaks TLS: give --tls DIR (the files "
                             f"`daskdag certs DIR` wrote), or set TLS in Dask's configuration")
    try:
        client = Client(**kwargs, security=sec, timeout=args.timeout, set_as_default=False)
    except (OSError, TimeoutError) as e:
        if is_file and not path.exists():
            raise Unreachable(f"cannot reach {where}: the file does not exist "
                              f"(waited {args.timeout:g} s for it)") from e
        raise Unreachable(f"cannot reach {where} within {args.timeout:g} s "
                          f"({type(e).__name__}: {e})") from e
    except ValueError as e:
        raise UsageError(f"bad --scheduler {address!r}: {e}") from e
    try:
        yield client
    finally:
        client.close(timeout=10)


def cmd_run(args: argparse.Namespace) -> int:
    out, dag, spec, outputs, wrt, x, cts = _prepare(args, "run")
    # Progress bars and the nodes' prints go to stderr: stdout carries the summary alone.
    with (connected(args) as client, contextlib.redirect_stdout(sys.stderr),
          dask.config.set(scheduler="threads")):
        results = daskdag.compute_grads(dag, x, outputs, wrt=wrt, cotangents=cts, client=client,
                                        progress=args.progress, store=args.store)
    arrays = result_arrays(results, spec.inputs, wrt)
    save(out, arrays)
    if not args.quiet:
        print(summary(arrays, outputs))
        print(f"wrote {out}")
    return EXIT_OK


def cmd_sweep(args: argparse.Namespace) -> int:
    out, dag, spec, outputs, wrt, xs, cts = _prepare(args, "sweep")
    batched = _names(args.batched, "--batched")
    with connected(args) as client, contextlib.redirect_stdout(sys.stderr):
        results = daskdag.sweep_grads(dag, xs, outputs, batched=batched, wrt=wrt, cotangents=cts,
                                      chunk_size=args.chunk_size, client=client,
                                      progress=not args.quiet, errors=args.errors,
                                      store=args.store)
    arrays = result_arrays(results, spec.inputs, wrt)
    failed = {o: sorted(r.failed) for o, r in results.items()}
    if args.errors == "collect":
        for o in outputs:
            arrays[f"{o}.failed"] = np.asarray(failed[o], dtype=np.int64)
    save(out, arrays)
    for o, r in results.items():
        if r.value is None:
            print(f"daskdag sweep: note: no value saved for {o!r} (no item gave one, and its "
                  f"shape could not be traced)", file=sys.stderr)
    if not args.quiet:
        print(summary(arrays, outputs, failed if args.errors == "collect" else None))
        print(f"wrote {out}")
    # item -> its error (the same for every output)
    errors = {item: e for r in results.values() for item, e in r.failed.items()}
    if errors:
        print(f"daskdag sweep: {len(errors)} item{'s' if len(errors) != 1 else ''} failed "
              f"(rows of NaN; indices in <output>.failed):", file=sys.stderr)
        for item in sorted(errors)[:10]:
            print(f"  {(str(errors[item]).splitlines() or [type(errors[item]).__name__])[0]}",
                  file=sys.stderr)
        if len(errors) > 10:
            print(f"  ... and {len(errors) - 10} more", file=sys.stderr)
        return EXIT_ITEMS_FAILED
    return EXIT_OK


# The command line's word for the argument a DAGError names (DAGError.argument).
OPTIONS = {"cotangents": "--cotangents FILE.npz, one key per output"}


def _positive(kind: Callable[[str], Any]) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if v <= 0:
            raise argparse.ArgumentTypeError(f"must be positive, got {text}")
        return v
    return parse


def _command(commands: Any, name: str, brief: str, description: str) -> argparse.ArgumentParser:
    """The parser of ``run`` or ``sweep``, with the options they share."""
    sweep = name == "sweep"
    first, sep, examples = description.partition("\n\n")  # (examples kept as they are)
    p = commands.add_parser(name, help=brief, formatter_class=argparse.RawDescriptionHelpFormatter,
                            epilog=f"{NPZ_LAYOUT}\n\n{EXIT_CODES}",
                            description=textwrap.fill(first, 79) + sep + examples)
    p.add_argument("target", metavar="MODULE[:DAG]", help=TARGET_HELP)
    p.add_argument("--inputs", required=True, metavar="FILE.npz",
                   help="input values, one key per free input of the DAG" +
                        (" (batched ones with a leading item axis)" if sweep else ""))
    p.add_argument("--outputs", required=True, metavar="D,E", help="node names, comma-separated")
    p.add_argument("--wrt", metavar="a,b",
                   help="inputs (or nodes) to differentiate, comma-separated; default: every "
                        + ("batched " if sweep else "given ") + "input with a floating-point leaf")
    p.add_argument("--cotangents", metavar="FILE.npz",
                   help="seeds for outputs that are not real scalars, keyed by output name"
                        + (" (one item's, for every item)" if sweep else ""))
    p.add_argument("--out", required=True, metavar="RESULT.npz", help="where to write the results")
    p.add_argument("--scheduler", metavar="ADDRESS",
                   help="a distributed scheduler: tcp://HOST:8786, tls://HOST:8786, or a scheduler "
                        "file (*.json); default: Dask's local threaded scheduler, in this process")
    p.add_argument("--tls", metavar="DIR", help="TLS files (ca.pem, cert.pem, key.pem) written by "
                   "`daskdag certs DIR`; the address gets tls:// if it has no scheme")
    p.add_argument("--timeout", type=_positive(float), default=30.0, metavar="SECONDS",
                   help="how long to try to reach the scheduler (default 30)")
    p.add_argument("--quiet", "-q", action="store_true",
                   help="print no summary" + (" and no progress bar" if sweep else ""))
    p.add_argument("--traceback", action="store_true", help="print the traceback of errors")
    return p


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(
        prog="daskdag", description="daskdag's command line.", epilog=EXIT_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    top.add_argument("--version", "-V", action="version", version=f"daskdag {daskdag.__version__}")
    commands = top.add_subparsers(dest="command", required=True, metavar="{certs,run,sweep}")
    certs = commands.add_parser(
        "certs", help="write a CA and a certificate/key for a TLS-secured Dask cluster",
        description="Write ca.pem, cert.pem and key.pem (one certificate for scheduler, workers "
                    "and clients, signed by a new CA whose key is discarded) into DIR.")
    certs.add_argument("directory", metavar="DIR")
    certs.add_argument("--host", action="append", default=[], metavar="NAME",
                       help="another host name or IP address for the certificate (repeatable); "
                            f"always included: {', '.join(DEFAULT_HOSTS)}")
    certs.add_argument("--days", type=int, default=365, help="validity in days (default 365)")
    certs.add_argument("--force", action="store_true", help="replace existing files")

    run = _command(
        commands, "run",
        "values and gradients of a DAG's outputs (daskdag.compute_grads) into an .npz",
        "Load the DAG, read its inputs, compute the outputs' values and gradients with "
        "daskdag.compute_grads, each node once, and write them to RESULT.npz; print a summary "
        "(output, value shape, gradient shapes) to stdout. Progress bars and the nodes' prints "
        "go to stderr.\n\n"
        "  daskdag run pipeline.py:dag --inputs in.npz --outputs D,E --out res.npz\n"
        "  daskdag run mypkg.pipe:make_dag --inputs in.npz --outputs D --wrt x \\\n"
        "      --scheduler tls://scheduler:8786 --tls certs/ --out res.npz")
    run.add_argument("--progress", action="store_true",
                     help="show Dask's progress bar over the call's tasks (on stderr)")

    sweep = _command(
        commands, "sweep",
        "the same over many items (daskdag.sweep_grads), with a progress bar",
        "Load the DAG, read the items' inputs (batched inputs with a leading item axis), compute "
        "every item's values and gradients with daskdag.sweep_grads and write them, stacked, to "
        "RESULT.npz. A progress bar over items goes to stderr unless --quiet.\n\n"
        "  daskdag sweep pipeline.py --inputs items.npz --outputs D,E --out res.npz\n"
        "  daskdag sweep pipeline.py --inputs items.npz --batched x --outputs D \\\n"
        "      --errors collect --scheduler scheduler.json --out res.npz")
    sweep.add_argument("--batched", metavar="a,b",
                       help="the inputs that carry the item axis (default: all given); the others "
                            "are shared by every item")
    sweep.add_argument("--chunk-size", type=_positive(int), metavar="N",
                       help="items per chunk (default: daskdag's choice)")
    sweep.add_argument("--errors", choices=("raise", "collect"), default="raise",
                       help="raise: stop at the first failing item (exit 1); collect: keep going, "
                            "save the failed items' indices as <output>.failed, exit 4")

    for p, what, kept, lacking in (
            (run, "call", "each node's result", "runs only the nodes DIR lacks"),
            (sweep, "sweep", "each chunk's results", "computes only what DIR lacks")):
        p.add_argument("--store", metavar="DIR",
                       help=f"keep {kept} in DIR as it finishes; run the same command again to "
                            f"resume a {what} that was cut short (it {lacking}); a DIR holding "
                            f"another {what} exits 5")
    return top


def main(argv: Sequence[str] | None = None) -> int:
    top = parser()
    args = top.parse_args(argv)

    if args.command == "certs":
        try:
            paths = write_certs(args.directory, args.host, days=args.days, force=args.force)
        except FileExistsError as e:
            top.exit(1, f"daskdag certs: {e}\n")
        for p in paths.values():
            print(p)
        return EXIT_OK

    name = f"daskdag {args.command}"

    def fail(code: int, message: str, e: BaseException) -> int:
        if args.traceback:
            traceback.print_exception(e)
        sys.stderr.write(f"{name}: error: {message}\n")
        return code

    try:
        return (cmd_run if args.command == "run" else cmd_sweep)(args)
    except KeyboardInterrupt as e:
        return fail(EXIT_INTERRUPTED, f"interrupted: {e}" if str(e) else "interrupted", e)
    except NodeError as e:  # (its first line, and its hint if any)
        lines = str(e).splitlines()
        hint = [ln for ln in lines[1:] if ln.startswith("Hint:")]
        return fail(EXIT_NODE, "\n".join(lines[:1] + hint[-1:]) + (
            "" if args.traceback else "\n(run with --traceback for the full traceback)"), e)
    except (UsageError, DAGError) as e:
        option = OPTIONS.get(getattr(e, "argument", None) or "")
        return fail(EXIT_USAGE, f"{e}" + (f" (here: {option})" if option else ""), e)
    except ValueError as e:  # (what a node raises is a NodeError: this is daskdag's own word)
        return fail(EXIT_USAGE, f"{e}" + ("" if args.traceback else
                    " (run with --traceback for the traceback)"), e)
    except (Unreachable, ClusterError) as e:
        return fail(EXIT_CLUSTER, str(e), e)
    except StoreError as e:
        return fail(EXIT_STORE, str(e), e)
