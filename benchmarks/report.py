"""The runner's results as Markdown tables and PNG plots.

In:  the dict the runner writes to ``latest.json`` (``{"machine", "run", "clusters",
     "scenarios": {name: {"title", "config", "cases": [...]}}}``; each case as
     ``common.case`` makes it).
Out: ``markdown(results)``, a string; ``plots(results, folder)``, the PNG files written.
"""

from __future__ import annotations

from pathlib import Path

# Each scenario's methods in the order its table shows them; its ratios likewise.
K_HEADS = ("naive", "hand_written", "jax_jit_all", "compute_grads", "cluster_2w", "torch")
OVERHEAD = ("noop_threads", "noop_2w", "jax_loop", "dask_threads", "daskdag_threads", "dask_2w",
            "daskdag_2w")
SWEEPS = ("loop", "sweep_threads", "sweep_1w", "sweep_2w", "sweep_vmap_2w", "jit_vmap")
PORTABLE_TIMES = ("local_call", "serialize_first", "serialize_cached", "deserialize_first",
                  "call_after_first", "deserialize_cached", "call_cached")


def seconds(s: float) -> str:
    if s >= 1:
        return f"{s:.2f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.1f} ms"
    return f"{s * 1e6:.0f} µs"


def _baseline(case: dict) -> float:
    """The median seconds of the method the case's scenario compares the others with."""
    return case["methods"][case["baseline"]]["median_s"]


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def _columns(cases: list[dict], order: tuple[str, ...]) -> list[str]:
    present = {m for c in cases for m in c["methods"]}
    return [m for m in order if m in present]


def machine_line(results: dict) -> str:
    m = results["machine"]
    parts = [m["platform"], f"{m['cpu_count']} CPUs ({m['processor']})", f"Python {m['python']}",
             f"jax {m['jax']}", f"dask {m['dask']}", f"distributed {m['distributed']}",
             f"torch {m['torch'] or 'not installed'}"]
    return ", ".join(parts)


def k_heads(s: dict) -> str:
    cases = s["cases"]
    cols = _columns(cases, K_HEADS)
    def cell(c, m):
        if m not in c["methods"]:
            return "–"
        t, base = c["methods"][m]["median_s"], _baseline(c)
        return f"{seconds(t)} ({t / base:.2f}×)"

    rows = [[c["case"]] + [cell(c, m) for m in cols] for c in cases]
    cfg = s["config"]
    head = (f"Trunk of {cfg['depth']} nodes `tanh(h @ W)` on {cfg['width']}×{cfg['width']} float32, "
            f"K cheap heads; median of {cfg['reps']} runs, in parentheses relative to "
            f"`hand_written` (the seed question's VJP plumbing). PyTorch: {s['torch']}.")
    ratios = ["compute_grads/hand_written", "naive/compute_grads", "torch/compute_grads",
              "cluster_2w/compute_grads", "jax_jit_all/compute_grads"]
    ratio_rows = [[c["case"]] + [f"{c['ratios'][r]:.2f}" if r in c["ratios"] else "–"
                                 for r in ratios] for c in cases]
    return "\n\n".join([head, _table(["case", *cols], rows), _table(["case", *ratios], ratio_rows)])


def overhead(s: dict) -> str:
    cases = s["cases"]
    cols = _columns(cases, OVERHEAD)
    ratios = ["daskdag_threads/dask_threads", "daskdag_2w/dask_2w"]
    rows = [[c["case"]] + [f"{c['methods'][m]['us_per_node']:.0f}" for m in cols]
            + [f"{c['ratios'][r]:.2f}" for r in ratios] for c in cases]
    head = (f"Microseconds per node (median of {s['config']['reps']} runs / N) for one scalar "
            f"output's value and gradient; `dask_*` is the same arithmetic as a hand-written "
            f"Dask graph, `noop_*` that graph's shape with tasks that do nothing: the "
            f"scheduler's own cost.")
    return head + "\n\n" + _table(["case", *cols, *ratios], rows)


def sweeps(s: dict) -> str:
    (c,) = s["cases"]
    cols = _columns([c], SWEEPS)
    loop = _baseline(c)
    cfg = s["config"]
    head = (f"N = {cfg['items']} items of x float32[{cfg['rows']}, {cfg['width']}], two outputs, "
            f"chunks of {cfg['chunk_size']}; eager nodes with Python control flow, except "
            f"`sweep_vmap_2w` and `jit_vmap` (the jittable variant). Median of {cfg['reps']} runs.")
    rows = [[m, seconds(c["methods"][m]["median_s"]), f"{loop / c['methods'][m]['median_s']:.2f}"]
            for m in cols]
    targets = ", ".join(f"{k} = {c['ratios'][k]:.2f} (target ≥ {t}: "
                        f"{'met' if s['targets_met'][k] else 'not met'})" for k, t in s["targets"].items())
    return "\n\n".join([head, _table(["method", "median", "loop / method"], rows), targets + "."])


def portable(s: dict) -> str:
    cases = s["cases"]
    head = ("A pullback serialized in one process and called in another: median times in this "
            "process, bytes shipped against the residuals, and on the 2-worker cluster a "
            "one-node DAG whose backward task runs on the other worker (`moved`) against the "
            "same DAG on one worker (`one_step`); the receiving worker compiles each backward "
            "program once and then finds it in its cache.")
    rows = []
    for c in cases:
        t = {k: v["median_s"] for k, v in c["methods"].items()}
        b = c["bytes"]
        rows.append([c["case"], seconds(t["local_call"]), seconds(t["serialize_first"]),
                     seconds(t["serialize_cached"]),
                     seconds(t["deserialize_first"] + t["call_after_first"]),
                     seconds(t["deserialize_cached"] + t["call_cached"]),
                     f"{b['shipped'] / 1024:.1f}", f"{b['residuals'] / 1024:.1f}",
                     f"{c['ratios']['shipped/residual']:.2f}",
                     f"{c['ratios']['moved/one_step']:.2f}",
                     "{compiled} / {cache_hits}".format(**c["cluster"]["programs_on_b"])])
    return head + "\n\n" + _table(
        ["kind", "local call", "serialize (export)", "serialize (cached)",
         "deserialize+call (compile)", "deserialize+call (cached)", "shipped KiB",
         "residuals KiB", "shipped/residual", "moved/one_step", "compiled / cache hits"], rows)


SECTIONS = {"k_heads": k_heads, "overhead": overhead, "sweeps": sweeps, "portable": portable}


def markdown(results: dict, images: str | None = None) -> str:
    """The report; ``images``: the folder, relative to where the Markdown will be read, of the
    PNGs to show (none if None)."""
    run = results["run"]
    out = [f"Measured with `{run['command']}` ({run['mode']}) on {run['started'][:10]}, in "
           f"{run['wall_s'] / 60:.1f} min, on: {machine_line(results)}. Cluster methods use a "
           f"process `LocalCluster` of single-threaded workers, each pinned to one core.",
           "Every ratio compares methods timed interleaved in that same run."]
    for n, (name, s) in enumerate(results["scenarios"].items(), 1):
        out.append(f"### {n}. {s['title']}")
        out.append(SECTIONS[name](s))
        if images is not None and name in PLOTS:
            out.append(f"![{s['title']}]({images}/{name}.png)")
    return "\n\n".join(out) + "\n"


# --- Plots ---------------------------------------------------------------------------------------

def _k_heads_plot(s: dict, ax_row) -> None:
    cases = s["cases"]
    for ax, mode in zip(ax_row, ("eager", "jit")):
        mine = [c for c in cases if c["params"]["mode"] == mode]
        cols = _columns(mine, K_HEADS)
        width = 0.8 / len(cols)
        for j, m in enumerate(cols):
            xs = [i + j * width for i in range(len(mine))]
            ys = [c["methods"][m]["median_s"] / _baseline(c)
                  if m in c["methods"] else 0 for c in mine]
            ax.bar(xs, ys, width, label=m, color=f"C{K_HEADS.index(m)}")
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(mine))],
                      [f"K={c['params']['K']}" for c in mine])
        _log(ax.yaxis)
        ax.axhline(1, color="black", linewidth=0.8)
        ax.set_title(f"{mode} nodes")
        ax.set_ylabel("time / hand_written (log)")
        ax.legend(fontsize=7, loc="upper left")


def _overhead_plot(s: dict, ax_row) -> None:
    for ax, shape in zip(ax_row, ("chain", "fan_out")):
        mine = [c for c in s["cases"] if c["params"]["shape"] == shape]
        for m in _columns(mine, OVERHEAD):
            ax.plot([c["params"]["nodes"] for c in mine],
                    [c["methods"][m]["us_per_node"] for c in mine], marker="o", label=m,
                    color=f"C{OVERHEAD.index(m)}")
        _log(ax.xaxis)
        _log(ax.yaxis)
        ax.set_xlabel("nodes")
        ax.set_ylabel("µs per node (log)")
        ax.set_title(shape)
    ax_row[-1].legend(fontsize=8)


def _sweeps_plot(s: dict, ax_row) -> None:
    (c,) = s["cases"]
    cols = _columns([c], SWEEPS)
    loop = _baseline(c)
    (ax,) = ax_row
    ax.barh(cols, [loop / c["methods"][m]["median_s"] for m in cols])
    ax.axvline(1, color="black", linewidth=0.8)
    _log(ax.xaxis)
    ax.set_xlabel("speed-up over the loop (log)")
    ax.set_title(f"{c['case']}")


def _portable_plot(s: dict, ax_row) -> None:
    cases = s["cases"]
    bars = {"local call": lambda t: t["local_call"],
            "deserialize+call (cached)": lambda t: t["deserialize_cached"] + t["call_cached"],
            "deserialize+call (compile)": lambda t: t["deserialize_first"] + t["call_after_first"],
            "serialize (export)": lambda t: t["serialize_first"]}
    (ax,) = ax_row
    width = 0.8 / len(bars)
    for j, (label, f) in enumerate(bars.items()):
        ys = [f({k: v["median_s"] * 1e3 for k, v in c["methods"].items()}) for c in cases]
        ax.bar([i + j * width for i in range(len(cases))], ys, width, label=label)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(cases))], [c["case"] for c in cases])
    _log(ax.yaxis)
    ax.set_ylabel("ms (log)")
    ax.legend(fontsize=8)


def _log(axis) -> None:
    """A log scale labelled in plain numbers (2, 5, 10, not 2×10⁰)."""
    from matplotlib.ticker import FuncFormatter

    getattr(axis.axes, f"set_{axis.axis_name}scale")("log")
    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    axis.set_minor_formatter(FuncFormatter(  # 2 and 5 of each decade
        lambda v, _: f"{v:g}" if f"{v:e}"[0] in "25" else ""))


PLOTS = {"k_heads": (_k_heads_plot, 2), "overhead": (_overhead_plot, 2),
         "sweeps": (_sweeps_plot, 1), "portable": (_portable_plot, 1)}


def plots(results: dict, folder: Path) -> list[Path]:
    """One PNG per scenario in ``folder``; the paths written."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for name, s in results["scenarios"].items():
        draw, panels = PLOTS[name]
        fig, axes = plt.subplots(1, panels, figsize=(6 * panels, 4), squeeze=False)
        draw(s, list(axes[0]))
        fig.suptitle(f"{s['title']} ({results['run']['mode']} run, "
                     f"{results['machine']['cpu_count']} CPUs)")
        fig.tight_layout()
        path = folder / f"{name}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written
