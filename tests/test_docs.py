"""The documentation: the MkDocs site builds with ``--strict`` (every page in the nav exists,
every link and anchor resolves, every ``:::`` API entry renders), README.md stays at most
8 KB, the API page lists every public name, the front pages share the demo's DAG and show what
it prints, cluster snippets run as saved scripts, and a fence that draws is skipped without
graphviz's ``dot``.

Every ```python fence of README.md, docs/ and daskdag's docstrings also runs, each as a test of
its own: pytest-markdown-docs, set up in pyproject.toml (``--markdown-docs``, ``testpaths``).
"""

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# The docs extra (pyproject.toml): distribution -> a module it provides.
DOCS_EXTRA = {"mkdocs": "mkdocs", "mkdocs-material": "material",
              "mkdocstrings[python]": "mkdocstrings_handlers.python"}


def _missing_docs_packages() -> list[str]:
    missing = []
    for dist, module in DOCS_EXTRA.items():
        try:
            found = importlib.util.find_spec(module) is not None
        except ImportError:  # a parent package missing
            found = False
        if not found:
            missing.append(dist)
    return missing


@pytest.mark.timeout(300)
@pytest.mark.subprocess
def test_site_builds_strict(tmp_path):
    missing = _missing_docs_packages()
    if missing:
        pytest.skip(f"the docs extra is not installed ({', '.join(missing)} missing): "
                    f"pip install -e '.[docs]'")
    site = tmp_path / "site"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file",
         str(ROOT / "mkdocs.yml"), "--site-dir", str(site)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout}\n{proc.stderr}"
    assert (site / "index.html").is_file()
    assert (site / "api" / "calls" / "index.html").is_file()
    pages = {p.relative_to(site).as_posix(): p.read_text() for p in site.rglob("*.html")}
    # No raw Sphinx role: docstrings cross-reference as mkdocstrings does ([`name`][daskdag.name]).
    raw = {page: sorted(set(re.findall(r":(?:func|class|meth|mod|data|attr|exc):", text)))
           for page, text in pages.items()}
    assert not {p: r for p, r in raw.items() if r}, raw
    # Nothing loaded from the web when a page is viewed: no remote script, stylesheet or font,
    # and no mermaid block (Material's bundle would fetch mermaid.js for one).
    remote = {page: re.findall(r'<(?:script|link)[^>]*(?:src|href)="(https?://[^"]+)"', text)
              for page, text in pages.items()}
    assert not {p: r for p, r in remote.items() if r}, remote
    assert not [page for page, text in pages.items() if 'class="mermaid"' in text]
    bundle = "\n".join(p.read_text() for p in (site / "assets").rglob("*.js"))
    assert "fonts.googleapis" not in "".join(pages.values()) + bundle


@pytest.mark.subprocess
def test_diagrams_are_their_dot_sources_drawn():
    """Each diagram of the docs is an SVG committed beside its graphviz source; drawn again
    (where ``dot`` is installed), it holds the same labels."""
    folder = ROOT / "docs" / "diagrams"
    sources = sorted(folder.glob("*.dot"))
    assert sources and all(s.with_suffix(".svg").is_file() for s in sources)
    dot = shutil.which("dot")
    if dot is None:
        pytest.skip("graphviz's `dot` program is not installed (apt-get install graphviz)")
    for source in sources:
        drawn = subprocess.run([dot, "-Tsvg", str(source)], capture_output=True, text=True,
                               check=True, timeout=60).stdout
        labels = lambda svg: sorted(re.findall(r"<text[^>]*>([^<]*)</text>", svg))  # noqa: E731
        assert labels(drawn) == labels(source.with_suffix(".svg").read_text()), source.name


def test_readme_is_at_most_8_kb():
    size = (ROOT / "README.md").stat().st_size
    assert size <= 8192, (f"README.md is {size} bytes, over 8 KB (8192 bytes): "
                          f"move the details to a page of docs/")


def test_code_blocks_fit_a_1280_px_window():
    """Code-block lines of README.md and docs/, and the examples/ scripts the gallery shows
    whole, are at most 88 characters: docs/stylesheets/extra.css sizes code so that 88 fit the
    content column at 1280 px (checked in headless Chromium), and a longer line is cut off."""
    long = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        inside = False
        for n, line in enumerate(page.read_text().splitlines(), 1):
            if line.lstrip().startswith("```"):
                inside = not inside
            elif inside and len(line) > 88:
                long.append(f"{page.relative_to(ROOT)}:{n}")
    for script in sorted((ROOT / "examples").glob("*.py")):
        long += [f"{script.relative_to(ROOT)}:{n}"
                 for n, line in enumerate(script.read_text().splitlines(), 1) if len(line) > 88]
    assert not long, f"code lines over 88 characters: {long}"


def test_api_page_lists_every_public_name():
    import daskdag

    entries = {line.split()[1].rsplit(".", 1)[-1]
               for page in sorted((ROOT / "docs" / "api").glob("*.md"))
               for line in page.read_text().splitlines()
               if line.startswith("::: daskdag.")}
    missing = sorted(set(daskdag.__all__) - entries)
    assert not missing, f"docs/api/ has no '::: daskdag.NAME' entry for {missing}"


@pytest.mark.timeout(300)
@pytest.mark.subprocess
def test_a_fence_that_draws_is_skipped_where_dot_is_missing():
    """On a machine without graphviz's ``dot`` (a fresh one, following README's Quick start),
    the docs' fences that draw a graph are skipped, saying why, as the tests that draw are:
    none fails (the root conftest.py)."""
    path = os.pathsep.join(d for d in os.environ.get("PATH", "").split(os.pathsep)
                           if not (Path(d) / "dot").exists())
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                          "docs/guides/lazy.md"], cwd=ROOT, env={**os.environ, "PATH": path},
                         capture_output=True, text=True, timeout=280)
    assert out.returncode == 0, out.stdout[-3000:]
    assert "graphviz's `dot` program is not installed" in out.stdout
    assert " skipped" in out.stdout.splitlines()[-1]


def _cluster_fences() -> list:
    """``(page, line, code)`` of every runnable ```python fence of README.md and docs/ that
    starts a ``LocalCluster``."""
    found = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        lines = page.read_text().splitlines()
        k = 0
        while k < len(lines):
            if lines[k].strip() == "```python":
                end = lines.index("```", k + 1)
                code = "\n".join(lines[k + 1:end])
                if "LocalCluster(" in code:
                    found.append((page.relative_to(ROOT).as_posix(), k + 1, code))
                k = end
            k += 1
    return found


@pytest.mark.cluster
@pytest.mark.timeout(300)
@pytest.mark.parametrize("page, line, code", _cluster_fences(),
                         ids=[f"{p}:{n}" for p, n, _ in _cluster_fences()])
def test_every_cluster_snippet_runs_as_a_saved_script(page, line, code, tmp_path):
    """A snippet that starts a cluster, saved as a script and run with ``python``, as a user
    would: process workers import the script again (``spawn``), which only a script whose
    cluster starts under ``if __name__ == "__main__":`` survives."""
    script = tmp_path / "snippet.py"
    script.write_text(code + "\n")
    out = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True,
                         text=True, timeout=280)
    assert out.returncode == 0, f"{page}:{line}\n{out.stderr[-3000:]}"


FRONT_PAGES = ("README.md", "docs/index.md", "docs/getting-started.md")


def _shown_outputs() -> list:
    """``(page, line, code, shown)`` for each ```python fence of the front pages followed, a
    paragraph later, by a ```text fence: what running it prints (a continuation fence runs
    after the fences before it)."""
    found = []
    for page in FRONT_PAGES:
        lines = (ROOT / page).read_text().splitlines()
        code, k = "", 0
        while k < len(lines):
            head = lines[k].strip()
            if head in ("```python", "```{.python continuation}"):
                end = lines.index("```", k + 1)
                body = "\n".join(lines[k + 1:end])
                code = (code + "\n" + body) if "continuation" in head else body
                after = next((j for j in range(end + 1, min(end + 6, len(lines)))
                              if lines[j].startswith("```")), None)
                if after is not None and lines[after].strip() == "```text":
                    shown = "\n".join(lines[after + 1:lines.index("```", after + 1)])
                    found.append((page, k + 1, code, shown))
                k = end
            k += 1
    return found


def _numbers(text: str) -> list[float]:
    return [float(t) for t in re.findall(r"-?\d+(?:\.\d*)?(?:e[-+]?\d+)?", text)]


@pytest.mark.parametrize("page, line, code, shown", _shown_outputs(),
                         ids=[f"{p}:{n}" for p, n, _, _ in _shown_outputs()])
@pytest.mark.subprocess
def test_front_pages_show_what_their_example_prints(page, line, code, shown, tmp_path):
    """README, the home page and Getting started share one DAG (examples/seed_dag.py's), and
    each shows what its example prints."""
    script = tmp_path / "example.py"
    script.write_text(code + "\n")
    out = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    printed, expected = _numbers(out.stdout), _numbers(shown)
    assert len(printed) == len(expected), (out.stdout, shown)
    assert all(abs(a - b) <= 1e-5 * max(1.0, abs(b)) for a, b in zip(printed, expected)), \
        (out.stdout, shown)


def test_front_pages_share_the_demo_s_dag():
    """The functions each front page defines are examples/seed_dag.py's (its E included)."""
    pages = {page: (ROOT / page).read_text() for page in (*FRONT_PAGES, "examples/seed_dag.py")}
    for page, text in pages.items():
        for line in ("jnp.tanh(x) * 2.0", "jnp.outer(A, A) + jnp.eye(A.shape[0])",
                     "jnp.linalg.solve(B, jnp.ones(B.shape[0]))", "jnp.sum(C ** 2)",
                     "return jnp.log(jnp.trace(B))"):
            assert line in text, (page, line)
    assert len(_shown_outputs()) == len(FRONT_PAGES)


def test_the_site_shows_the_package_s_version():
    import daskdag

    assert f"daskdag {daskdag.__version__}," in (ROOT / "mkdocs.yml").read_text()


def _layout(line: str) -> str:
    """``line`` with each number replaced by ``#``: its layout."""
    return re.sub(r"-?\d+(?:\.\d*)?(?:e[-+]?\d+)?", "#", line)


@pytest.mark.timeout(150)
@pytest.mark.subprocess
def test_make_demo_prints_what_the_front_pages_show():
    """``make demo`` runs examples/seed_dag.py as a script; what it prints starts with the lines
    each front page shows its example printing, laid out the same, with the same numbers."""
    recipe = re.search(r"^demo:.*\n((?:\t.*\n)+)", (ROOT / "Makefile").read_text(), re.M)
    assert recipe is not None and recipe.group(1).split() == ["$(PY)", "examples/seed_dag.py"]
    out = subprocess.run([sys.executable, "examples/seed_dag.py"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    printed = out.stdout.splitlines()
    shown = _shown_outputs()
    assert [page for page, *_ in shown] == list(FRONT_PAGES)
    for page, _, _, block in shown:
        lines = block.splitlines()
        head = printed[:len(lines)]
        assert list(map(_layout, head)) == list(map(_layout, lines)), (page, out.stdout, block)
        got, want = _numbers("\n".join(head)), _numbers(block)
        assert len(got) == len(want) and all(
            abs(a - b) <= 1e-5 * max(1.0, abs(b)) for a, b in zip(got, want)), (page, out.stdout)
    assert "agrees with plain JAX" in printed[-1], out.stdout


def _named_results() -> list:
    """``(page, code, expressions)``: for each front page, its example (as
    :func:`_shown_outputs` has it) and the ``res...`` expressions its prose names in ``code
    spans``."""
    found = []
    for page, _, code, _ in _shown_outputs():
        prose = re.sub(r"^```.*?^```", "", (ROOT / page).read_text(), flags=re.M | re.S)
        spans = re.findall(r"`(res\b[^`]*)`", prose)
        if spans:
            found.append((page, code, spans))
    return found


@pytest.mark.parametrize("page, code, spans", _named_results(),
                         ids=[p for p, _, _ in _named_results()])
@pytest.mark.subprocess
def test_front_pages_name_what_their_example_returns(page, code, spans, tmp_path):
    """Each ``res...`` expression a front page's prose names (``res["D"].info``) evaluates
    after its example: ``compute_grads`` of a list of outputs returns a dict, so ``res.info``
    would not."""
    script = tmp_path / "example.py"
    script.write_text(code + f"\nfor expression in {spans!r}:\n    eval(expression)\n")
    out = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, (page, spans, out.stderr[-3000:])


def test_the_front_pages_name_a_result():
    """(The test above has something to check.)"""
    assert any(page == "README.md" for page, _, _ in _named_results())
