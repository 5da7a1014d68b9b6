"""The package's layering: each module imports only from its own layer or lower ones, at the top
of the module (no import inside a function to break a cycle), and no two modules import each
other, directly or not. The layers, lowest first, as each subpackage's docstring says."""

import ast
import graphlib
from pathlib import Path

import daskdag

ROOT = Path(daskdag.__file__).parent
LAYERS = (
    ("daskdag.errors", "daskdag.config", "daskdag.cancel", "daskdag.caches"),
    ("daskdag.transport",),
    ("daskdag.model",),
    ("daskdag.rules",),
    ("daskdag.graph",),
    ("daskdag.running",),
    ("daskdag.durable",),
    ("daskdag.sweeps",),
    ("daskdag.kinds",),
    ("daskdag.api", "daskdag.checks", "daskdag.prepared"),
    ("daskdag.cli", "daskdag.deploy", "daskdag"),
)


def _modules() -> dict[str, Path]:
    found = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def _layer(module: str) -> int:
    best = None
    for k, names in enumerate(LAYERS):
        for n in names:  # the longest name that holds it
            if (module == n or module.startswith(n + ".")) and (best is None or len(n) > best[1]):
                best = (k, len(n))
    assert best is not None, f"{module} is in no layer of LAYERS"
    return best[0]


def _imports(name: str, path: Path, modules: dict) -> list[tuple[str, int, bool]]:
    """``(imported daskdag module, line, at module level)`` for each import in the module."""
    tree = ast.parse(path.read_text())
    top = {id(n) for n in tree.body}
    for n in tree.body:  # (an `if TYPE_CHECKING:` block at module level is the top too)
        if isinstance(n, ast.If) and ast.unparse(n.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            top |= {id(m) for m in n.body}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against the package
                package = name if path.name == "__init__.py" else name.rpartition(".")[0]
                for _ in range(node.level - 1):
                    package = package.rpartition(".")[0]
                base = f"{package}.{node.module}" if node.module else package
            else:
                base = node.module or ""
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                       for a in node.names]
        elif isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            continue
        if targets == ["daskdag"] and [a.name for a in node.names] == ["__version__"]:
            continue  # (read when asked, so that tests can pretend another version)
        for t in targets:
            if t == "daskdag" or t.startswith("daskdag."):
                out.append((t, node.lineno, id(node) in top))
    return out


def test_imports_follow_the_layers_and_have_no_cycles():
    modules = _modules()
    problems, graph = [], {}
    for name, path in sorted(modules.items()):
        graph[name] = set()
        for target, line, at_top in _imports(name, path, modules):
            where = f"{path.relative_to(ROOT.parent)}:{line}"
            if not at_top:
                problems.append(f"{where}: {name} imports {target} inside a function")
            if _layer(target) > _layer(name):
                problems.append(f"{where}: {name} (layer {_layer(name)}) imports {target} "
                                f"(layer {_layer(target)}), a higher layer")
            if target != name and not name.startswith(target + "."):
                graph[name].add(target)
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as e:
        problems.append(f"import cycle: {' -> '.join(e.args[1])}")
    assert not problems, "\n".join(problems)


def test_no_module_imports_through_the_package_face():
    """``from daskdag import config`` runs back up through ``daskdag/__init__.py`` (the top layer)
    to reach a module of the lowest: a module imports another by its own name
    (``import daskdag.config as config``). ``__version__``, read when asked, is the exception."""
    problems = []
    for path in ROOT.rglob("*.py"):
        if path == ROOT / "__init__.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "daskdag" and not node.level:
                names = [a.name for a in node.names if a.name != "__version__"]
                if names:
                    problems.append(f"{path.relative_to(ROOT.parent)}:{node.lineno}: from "
                                    f"daskdag import {', '.join(names)}")
    assert not problems, "\n".join(problems)


def test_no_module_reaches_into_another_modules_private_names():
    """``from daskdag.x import _name`` and ``x._name`` (``x`` an imported daskdag module) are
    refused: what another module uses is public in the module that holds it."""
    problems = []
    for path in ROOT.rglob("*.py"):
        tree = ast.parse(path.read_text())
        where = path.relative_to(ROOT.parent)
        imported = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("daskdag"):
                for alias in node.names:
                    if alias.name.startswith("_") and not alias.name.startswith("__"):
                        problems.append(f"{where}:{node.lineno}: imports {node.module}.{alias.name}")
                    imported.add(alias.asname or alias.name)
            elif isinstance(node, ast.Import):
                imported.update(a.asname or a.name.split(".")[0] for a in node.names
                                if a.name.startswith("daskdag"))
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id in imported and node.attr.startswith("_")
                    and not node.attr.startswith("__")):
                problems.append(f"{where}:{node.lineno}: uses {node.value.id}.{node.attr}")
    assert not problems, "\n".join(problems)


def test_every_subpackage_says_what_it_holds_and_may_import():
    for init in ROOT.glob("*/__init__.py"):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        assert "May import" in doc, f"{init.relative_to(ROOT.parent)}: its docstring must say what it may import"


def test_only_the_sweeps_know_their_items():
    """The core runs a sweep's chunk as any node of a registered kind: the names of the sweep's
    own classes appear in no module outside :mod:`daskdag.sweeps`."""
    for path in ROOT.rglob("*.py"):
        if path.parent.name == "sweeps":
            continue
        text = path.read_text()
        for name in ("Items", "Chunked"):
            assert name not in text, f"{path.relative_to(ROOT.parent)} names {name}"


def test_no_module_extends_a_lower_layer_but_at_its_named_extension_points():
    """What runs back up the layers, though no import does: a module registering its own code
    into a lower layer's tables, which then calls it. Only the named extension points take
    that: a kind of node's rules (``rules.vjp.register``), a family of objects that crosses
    processes (``transport.protocol.travels``, ``token_kept``) and what ``clear_caches``
    empties (``caches.register``, a ``Cache``); no ``singledispatch`` of a lower layer is
    extended from above (a sweep hands the core its ``PerItem``, a lifted value its seed is
    registered beside ``seed``, in ``rules``)."""
    allowed = {("daskdag.rules.vjp", "register"), ("daskdag.transport.protocol", "travels"),
               ("daskdag.transport.protocol", "token_kept"), ("daskdag.caches", "register"),
               ("daskdag.caches", "Cache"), ("daskdag.caches", "ByObject")}
    modules, problems = _modules(), []
    for name, path in sorted(modules.items()):
        tree = ast.parse(path.read_text())
        origin = {a.asname or a.name: n.module for n in ast.walk(tree)
                  if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("daskdag")
                  for a in n.names}
        for node in ast.walk(tree):  # (a call, or a decorator: @seed.register)
            f = node.func if isinstance(node, ast.Call) else node
            if isinstance(f, ast.Attribute) and f.attr == "register" and \
                    isinstance(f.value, ast.Name) and f.value.id in origin:
                target = (origin[f.value.id], f"{f.value.id}.register")
            elif isinstance(f, ast.Name) and f.id in origin and \
                    f.id in ("register", "travels", "token_kept", "Cache", "ByObject"):
                target = (origin[f.id], f.id)
            else:
                continue
            if _layer(target[0]) < _layer(name) and (target[0], target[1]) not in allowed:
                problems.append(f"{name}: {target[1]} of {target[0]}")
    assert not problems, "\n".join(problems)
