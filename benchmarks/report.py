"""The runner's results as Markdown tables and PNG plots.

In:  the dict the runner writes to ``latest.json`` (``{"machine", "run", "clusters",
     "scenarios": {name: {"title", "config", "cases": [...], "targets": [...]}}, "skipped"}``;
     each case as ``common.case`` makes it, each target as ``common.targets`` does).
Out: ``markdown(results)``, a string; ``plots(results, folder)``, the PNG files written.

The report shows the results' scenarios in their order (the order they ran in). A scenario's
module in ``benchmarks/scenarios/`` may declare its own section and plot (``section``, ``plot``
and ``PLOT_AXES``: ``scenarios/__init__.py``), drawn with the helpers here (``table``,
``columns``, ``ratio_table``, ``seconds``, ``nbytes``, ``color``, ``log_axis``); any other
scenario gets the generic ones (:func:`generic`, :func:`generic_plot`): each case's methods'
medians, its ratios, a bar plot of the medians.
Every scenario's section also says where each method ran (which cluster, default or tuned,
from the method's suffix: ``_1w``, ``_2w``, ``_2w_tuned``; a method without one ran in this
process, unless the scenario's optional ``"where": {method: text}`` says where) and lists its
targets, met or not.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

from . import scenarios

RATIO_RULE = ("Every ratio `a/b` is `a`'s median time over `b`'s, both timed interleaved in the "
              "same run: below 1, `a` took less time than `b`")


def ratio_rule() -> str:
    """:data:`RATIO_RULE`, with the scenarios' own ``RATIO_NOTE`` (ratios of other things)."""
    notes = [m.RATIO_NOTE for m in map(scenarios.load, scenarios.NAMES)
             if m is not None and getattr(m, "RATIO_NOTE", None)]
    return RATIO_RULE + (f" ({'; '.join(notes)})" if notes else "") + "."


def _declared(name: str, attr: str):
    """What scenario ``name``'s module declares as ``attr``, or None (no such scenario module,
    or no such declaration)."""
    return getattr(scenarios.load(name), attr, None)


def seconds(s: float) -> str:
    if s >= 1:
        return f"{s:.2f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.1f} ms"
    return f"{s * 1e6:.0f} µs"


def nbytes(n: float) -> str:
    if n >= 2 ** 20:
        return f"{n / 2 ** 20:.2f} MiB"
    if n >= 1024:
        return f"{n / 1024:.1f} KiB"
    return f"{n:.0f} B"


def baseline(case: dict) -> float:
    """The median seconds of the method the case's scenario compares the others with."""
    return case["methods"][case["baseline"]]["median_s"]


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def columns(cases: list[dict], order: tuple[str, ...] = ()) -> list[str]:
    """The methods present in ``cases``: those of ``order`` first, in its order, then any
    others in the order they first appear."""
    present = list(dict.fromkeys(m for c in cases for m in c["methods"]))
    return [m for m in order if m in present] + [m for m in present if m not in order]


def ratio_table(cases: list[dict], labels: list[str] | None = None) -> str:
    labels = labels or list(dict.fromkeys(r for c in cases for r in c["ratios"]))
    rows = [[c["case"]] + [f"{c['ratios'][r]:.2f}" if r in c["ratios"] else "–" for r in labels]
            for c in cases]
    return table(["case", *labels], rows)


def machine_line(results: dict) -> str:
    m = results["machine"]
    parts = [m["platform"], f"{m['cpu_count']} CPUs ({m['processor']})", f"Python {m['python']}",
             f"jax {m['jax']}", f"dask {m['dask']}", f"distributed {m['distributed']}",
             f"torch {m['torch'] or 'not installed'}"]
    return ", ".join(parts)


# --- Where each method ran, and the targets -------------------------------------------------------

def cluster_of(method: str) -> str | None:
    """The cluster a method ran on, from its name's suffix (``daskdag_2w_tuned`` ->
    ``2w_tuned``, ``sweep_1w`` -> ``1w``), or None: in this process."""
    found = re.search(r"_(\d+w(?:_tuned)?)$", method)
    return found.group(1) if found else None


def _cluster_label(name: str, clusters: dict) -> str:
    c = clusters.get(name, {})
    label = c.get("label") or f"{name} cluster"
    return f"{label} (`{name}`)"


def where_line(methods: list[str], clusters: dict, where: dict | None = None) -> str:
    """Which methods ran where: in this process, on each default cluster, on the tuned one.
    ``where``: the scenario's own ``{method: where it ran}``, for methods that ran elsewhere
    (plain processes, say), which their names cannot say."""
    where = where or {}
    groups: dict[tuple, list[str]] = {}
    for m in methods:
        if m in where:
            key = (1, 0, where[m])
        else:
            c = cluster_of(m)
            key = ((0, 0, "in this process (plain JAX, PyTorch or Dask's threaded scheduler)")
                   if c is None else (2, "tuned" in c, _cluster_label(c, clusters)))
        groups.setdefault(key, []).append(f"`{m}`")
    return "Where each column ran: " + "; ".join(
        f"{k[2]}: {', '.join(v)}" for k, v in sorted(groups.items())) + "."


def target_items(s: dict) -> list[str]:
    """One line per target of the scenario: the measured ratio, the bound, met or not."""
    ts = s.get("targets")
    if not isinstance(ts, list):
        return []
    lines = []
    for t in ts:
        better = "lower is better" if t["op"] == "<=" else "higher is better"
        measured = "–" if t["measured"] is None else f"{t['measured']:.2f}"
        verdict = {True: "met", False: "not met", None: "not measured"}[t["met"]]
        was = f", was {t['was']}" if t.get("was") else ""
        op = "≤" if t["op"] == "<=" else "≥"
        lines.append(f"{t['case']}: `{t['ratio']}` = {measured} (target {op} {t['bound']:g}, "
                     f"{better}{was}): **{verdict}**")
    return lines


def _targets_block(s: dict) -> str | None:
    lines = target_items(s)
    return "Targets:\n\n" + "\n".join(f"- {line}" for line in lines) if lines else None


def summary(results: dict) -> str | None:
    """Every scenario's targets in one table: the run's headline figures."""
    rows = []
    for s in results["scenarios"].values():
        for t in s.get("targets") or []:
            if not isinstance(t, dict):
                continue
            rows.append([s["title"], t["case"], f"`{t['ratio']}`",
                         f"{'≤' if t['op'] == '<=' else '≥'} {t['bound']:g}",
                         "–" if t["measured"] is None else f"{t['measured']:.2f}",
                         {True: "met", False: "not met", None: "not measured"}[t["met"]],
                         str(t.get("was") or "")])
    if not rows:
        return None
    return ("The goals the project set itself, each a ratio of median times (see the rule in "
            "the report), next to what this run measured:\n\n"
            + table(["scenario", "case", "ratio", "target", "measured", "met?", "was"], rows))


# --- At a glance -------------------------------------------------------------------------------

#: The peers the report opens with: ``(peer, the work, scenario, case, ratio (daskdag over the
#: peer), use daskdag when)``, each ratio one the scenario measures.
GLANCE = (
    ("hand-written `jax.vjp` plumbing", "K = 8 heads over a shared trunk, eager nodes",
     "k_heads", "K=8, eager", "daskdag_threads/hand_written",
     "always: the same work, without writing the plumbing"),
    ("`jax.jit` of the composed function", "a small all-`jit` DAG called in a loop",
     "repeat_calls", "seed DAG prepared", "daskdag_jit/jax_jit",
     "not here: a tiny jittable function in one process is fastest under `jax.jit` alone"),
    ("`jax.jit` of the composed function", "a 100-step loop over a trunk on fixed data",
     "shared_work", "loop", "daskdag_loop/jax_jit",
     "a node reads data that does not change between calls: it runs once"),
    ("`jax.vmap`, one process", "256 items over a 1 s shared trunk, `vmap=True` heads",
     "shared_work", "256 items", "daskdag_vmap_2w/jax_vmap",
     "the items outgrow one process, or nodes cannot be vmapped"),
    ("`dask.delayed` by hand", "the same 256 items, eager heads, 2 workers",
     "shared_work", "256 items", "daskdag_2w/delayed_2w",
     "gradients pass through shared nodes: no hand-written graph, the trunk once"),
    ("a hand-written Dask graph", "32 branches of 0.25 s and a head, 8 workers",
     "scale_out", "wide, W=8", "daskdag/hand_written",
     "wide DAGs on a cluster: at parity with the graph you would write"),
    ("a hand-written Dask graph", "1,000 tiny nodes fanned out, 2 workers",
     "overhead", "fan_out, N=1000", "daskdag_2w/dask_2w",
     "many tiny nodes on a cluster: a node is about one task, as in the graph you would write"),
    ("PyTorch", "K = 8 heads over a shared trunk, eager nodes", "k_heads", "K=8, eager",
     "daskdag_threads/torch",
     "your code is JAX: PyTorch's eager CPU kernels are faster on small matrices"),
    ("OpenMDAO `compute_totals`", "a dense model's Jacobian, repeated calls",
     "repeat_calls", "dense", "daskdag/openmdao",
     "an optimiser calls the same model many times"),
    ("OpenMDAO, Newton on a cycle", "Sellar's coupled disciplines: values and Jacobians",
     "implicit", "evaluation", "daskdag/openmdao",
     "coupled or implicit models: solved and differentiated by the implicit function theorem"),
)


def glance_rows(results: dict) -> list[tuple[str, str, float, str]]:
    """``(peer, work, ratio, when)`` of each :data:`GLANCE` row this run measured."""
    rows = []
    for peer, work, name, case, ratio, when in GLANCE:
        s = results["scenarios"].get(name)
        found = next((c for c in (s or {}).get("cases", []) if c["case"] == case), None)
        value = (found or {}).get("ratios", {}).get(ratio)
        if value is not None:
            rows.append((peer, work, value, when))
    return rows


def glance(results: dict, images: str | None) -> str | None:
    """The report's opening: daskdag against its peers on the same work, and when to use it."""
    rows = glance_rows(results)
    if not rows:
        return None
    parts = ["daskdag's time over each peer's on the same work, on this machine, both timed in "
             "the same run (below 1, daskdag was faster; each scenario's section below says "
             "which run, and has every method and figure)."]
    if images is not None:
        parts.append(f"![daskdag against its peers]({images}/glance.png)")
    parts.append(table(["against", "the work", "daskdag / it", "use daskdag when"],
                       [[peer, work, f"{v:.2f}", when] for peer, work, v, when in rows]))
    return "\n\n".join(parts)


def glance_plot(results: dict, ax) -> None:
    rows = glance_rows(results)[::-1]
    ys = list(range(len(rows)))
    ax.barh(ys, [v for _, _, v, _ in rows],  # (green: faster by 10% or more; red: slower)
            color=["C2" if v <= 0.9 else "C3" if v >= 1.1 else "C7" for _, _, v, _ in rows])
    ax.set_yticks(ys, [f"{peer}\n{work}".replace("`", "") for peer, work, _, _ in rows],
                  fontsize=7)
    log_axis(ax.xaxis)
    ax.axvline(1, color="black", linewidth=0.8)
    ax.set_xlabel("daskdag's time / the peer's (log; green: daskdag faster, grey: within 10%)")


# --- The sections ------------------------------------------------------------------------------

def generic(s: dict) -> str:
    """Any scenario without a ``section`` of its own: each case's methods' medians, then its
    ratios."""
    cases = s["cases"]
    cols = columns(cases)
    rows = [[c["case"]] + [seconds(c["methods"][m]["median_s"]) if m in c["methods"] else "–"
                           for m in cols] for c in cases]
    reps = s.get("config", {}).get("reps")
    head = s.get("description") or f"Median seconds{f' of {reps} runs' if reps else ''}."
    parts = [head, table(["case", *cols], rows)]
    if any(c.get("ratios") for c in cases):
        parts.append(ratio_table(cases))
    return "\n\n".join(parts)


def clusters_paragraph(clusters: dict) -> str:
    """What each cluster was, and what daskdag's worker plugin did on it."""
    lines = []
    for name, c in clusters.items():
        line = f"- `{name}`: {c.get('label', c.get('xla_threads_per_worker'))}, `{c['kind']}`"
        plugin = c.get("daskdag_plugin")
        if plugin:
            set_on = sum(1 for p in plugin.values() if p and p.get("applied"))
            line += f"; daskdag's worker plugin tuned malloc on {set_on} of {len(plugin)} workers"
        lines.append(line + ".")
    return ("Clusters (a method's name ends with the cluster it ran on; headline cluster "
            "figures come from the default ones, never from `_tuned`):\n\n" + "\n".join(lines))


def markdown(results: dict, images: str | None = None) -> str:
    """The report: daskdag against its peers at a glance, then the run and its scenarios, each
    saying which run measured it, then the targets; ``images``: the folder, relative to where
    the Markdown will be read, of the PNGs to show (none if None)."""
    run = results["run"]
    clusters = results.get("clusters", {})
    out = []
    opening = glance(results, images)
    if opening:
        out += ["## At a glance", opening]
    out += ["## The scenarios",
            f"Measured with `{run['command']}` ({run['mode']}) on {run['started'][:10]}, in "
            f"{run['wall_s'] / 60:.1f} min, on: {machine_line(results)}.", ratio_rule()]
    if run.get("note"):  # how the run was made, where it was not one invocation
        out.insert(len(out) - 1, run["note"])
    if clusters:
        out.append(clusters_paragraph(clusters))
    for name, why in results.get("skipped", {}).items():
        out.append(f"Scenario `{name}` skipped: {why}.")
    for n, (name, s) in enumerate(results["scenarios"].items(), 1):
        out.append(f"### {n}. {s['title']}")
        own = s.get("run")
        if own:
            out.append(f"From `{own['command']}` on {own['started'][:10]}.")
        out.append((_declared(name, "section") or generic)(s))
        out.append(where_line(columns(s["cases"]), clusters, s.get("where")))
        block = _targets_block(s)
        if block:
            out.append(block)
        if images is not None:
            out.append(f"![{s['title']}]({images}/{name}.png)")
    head = summary(results)
    if head:
        out += ["## Appendix: the targets", head]
    return "\n\n".join(out) + "\n"


# --- Plots ---------------------------------------------------------------------------------------

def color(m: str, order: tuple[str, ...]) -> str:
    return f"C{order.index(m) % 10}" if m in order else "gray"


def generic_plot(s: dict, ax_row) -> None:
    """Any scenario without a ``plot`` of its own: each case's methods' medians as horizontal
    bars, one colour per case, each case with the methods it measured, labelled on the left
    (no legend over the bars), on a log axis that spans whole decades."""
    from matplotlib.ticker import NullFormatter

    (ax,) = ax_row
    rows = generic_rows(s)
    ys = list(range(len(rows)))[::-1]
    ax.barh(ys, [v for _, v, _ in rows], color=[f"C{k % 10}" for _, _, k in rows])
    ax.set_yticks(ys, [label for label, _, _ in rows], fontsize=8)
    log_axis(ax.xaxis)
    values = [v for _, v, _ in rows if v > 0]
    if values:
        lo, hi = math.floor(math.log10(min(values))), math.ceil(math.log10(max(values)) + 1e-9)
        ax.set_xlim(10 ** lo, 10 ** hi)
        if hi - lo > 3:  # (many decades: the 2 and 5 between them would overlap)
            ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("median seconds (log)")


def generic_rows(s: dict) -> list[tuple[str, float, int]]:
    """``(case: method, median seconds, case index)`` of every method of every case."""
    return [(f"{c['case']}: {m}", info["median_s"], k)
            for k, c in enumerate(s["cases"]) for m, info in c["methods"].items()]


def log_axis(axis) -> None:
    """A log scale labelled in plain numbers (2, 5, 10, not 2×10⁰)."""
    from matplotlib.ticker import FuncFormatter

    getattr(axis.axes, f"set_{axis.axis_name}scale")("log")
    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    axis.set_minor_formatter(FuncFormatter(  # 2 and 5 of each decade
        lambda v, _: f"{v:g}" if f"{v:e}"[0] in "25" else ""))


def plots(results: dict, folder: Path) -> list[Path]:
    """One PNG per scenario in ``folder``; the paths written."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    rows = glance_rows(results)
    if rows:
        fig, ax = plt.subplots(figsize=(8, 1.2 + 0.45 * len(rows)))
        glance_plot(results, ax)
        fig.suptitle(f"daskdag against its peers ({results['run']['mode']} run, "
                     f"{results['machine']['cpu_count']} CPUs)")
        fig.tight_layout()
        path = folder / "glance.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    for name, s in results["scenarios"].items():
        draw = _declared(name, "plot")
        panels = (_declared(name, "PLOT_AXES") or 1) if draw else 1
        size = (6 * panels, 4) if draw else (8, max(3.0, 1.4 + 0.24 * len(generic_rows(s))))
        draw = draw or generic_plot
        fig, axes = plt.subplots(1, panels, figsize=size, squeeze=False)
        draw(s, list(axes[0]))
        fig.suptitle(f"{s['title']} ({results['run']['mode']} run, "
                     f"{results['machine']['cpu_count']} CPUs)")
        fig.tight_layout()
        path = folder / f"{name}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written
