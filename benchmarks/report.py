"""The runner's results as Markdown tables and PNG plots.

In:  the dict the runner writes to ``latest.json`` (``{"machine", "run", "clusters",
     "scenarios": {name: {"title", "config", "cases": [...], "targets": [...]}}, "skipped"}``;
     each case as ``common.case`` makes it, each target as ``common.targets`` does).
Out: ``markdown(results)``, a string; ``plots(results, folder)``, the PNG files written.

Scenarios with a section of their own here get their own tables and plot; any other scenario
gets the generic ones: each case's methods' medians, its ratios, a bar plot of the medians.
Every scenario's section also says where each method ran (which cluster, default or tuned,
from the method's suffix: ``_1w``, ``_2w``, ``_2w_tuned``; a method without one ran in this
process, unless the scenario's optional ``"where": {method: text}`` says where) and lists its
targets, met or not.
"""

from __future__ import annotations

import re
from pathlib import Path

# Each scenario's methods in the order its table shows them.
K_HEADS = ("naive", "hand_written", "jax_jit_all", "daskdag_threads", "daskdag_2w",
           "daskdag_2w_tuned", "torch")
OVERHEAD = ("noop_threads", "noop_2w", "jax_loop", "dask_threads", "daskdag_threads", "dask_2w",
            "daskdag_2w", "daskdag_2w_tuned")
SWEEPS = ("loop", "sweep_threads", "sweep_1w", "sweep_2w", "sweep_2w_tuned", "sweep_vmap_2w",
          "jit_vmap")
RATIO_RULE = ("Every ratio `a/b` is `a`'s median time over `b`'s, both timed interleaved in the "
              "same run: below 1, `a` took less time than `b` (portable's `shipped/...` are "
              "ratios of bytes).")


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


def _baseline(case: dict) -> float:
    """The median seconds of the method the case's scenario compares the others with."""
    return case["methods"][case["baseline"]]["median_s"]


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def _columns(cases: list[dict], order: tuple[str, ...] = ()) -> list[str]:
    """The methods present in ``cases``: those of ``order`` first, in its order, then any
    others in the order they first appear."""
    present = list(dict.fromkeys(m for c in cases for m in c["methods"]))
    return [m for m in order if m in present] + [m for m in present if m not in order]


def _ratio_table(cases: list[dict], labels: list[str] | None = None) -> str:
    labels = labels or list(dict.fromkeys(r for c in cases for r in c["ratios"]))
    rows = [[c["case"]] + [f"{c['ratios'][r]:.2f}" if r in c["ratios"] else "–" for r in labels]
            for c in cases]
    return _table(["case", *labels], rows)


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
                     f"{better}; {t['source']}{was}): **{verdict}**")
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
                         t["source"] + (f" (was {t['was']})" if t.get("was") else "")])
    if not rows:
        return None
    return ("Targets of this run (each a ratio of median times, see the rule above):\n\n"
            + _table(["scenario", "case", "ratio", "target", "measured", "met?", "from"], rows))


# --- The scenarios' sections --------------------------------------------------------------------

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
    ratios = [r for r in ("daskdag_threads/hand_written", "naive/daskdag_threads",
                          "daskdag_2w/daskdag_threads", "daskdag_2w_tuned/daskdag_threads",
                          "daskdag_threads/torch", "daskdag_threads/jax_jit_all")
              if any(r in c["ratios"] for c in cases)]
    parts = [head, _table(["case", *cols], rows), _ratio_table(cases, ratios)]
    if "bytes_per_call" in s:
        parts.append(bytes_section(s["bytes_per_call"]))
    return "\n\n".join(parts)


def bytes_section(b: dict) -> str:
    """The bytes sent per call (``k_heads.bytes_per_call``) and whether the goal holds."""
    calls = [("first call", "first"), ("repeated, weights unchanged", "repeat"),
             ("after one weight changed in place", "after_change"),
             ("repeated after that", "repeat_after_change")]
    rows = [[label, nbytes(b[k]["daskdag"]), nbytes(b[k]["to_scheduler"]), str(b[k]["messages"])]
            for label, k in calls if k in b]
    head = (f"Bytes sent per call, {b['case']}, on the {b['cluster']} cluster (a model with "
            f"fresh weights): `placed by daskdag` is what daskdag counted as sent to keep on the "
            f"cluster (as its log says, logger `daskdag`), `client → scheduler` what distributed's client wrote "
            f"to the scheduler (its batched stream's byte count: every graph, kept values "
            f"included). One weight matrix is {nbytes(b['weight'])}, all of them "
            f"{nbytes(b['weights'])}, x {nbytes(b['x'])}.")
    repeat, change = b["repeat"], b["after_change"]
    resent = repeat["daskdag"] > 0 or repeat["to_scheduler"] >= b["weight"]
    sent_change = change["daskdag"] >= b["weight"] and change["to_scheduler"] >= b["weight"]
    goal = (f"Goal (issue 11), no weights re-sent on a repeated call: "
            f"**{'not met' if resent else 'met'}** ({nbytes(repeat['daskdag'])} placed, "
            f"{nbytes(repeat['to_scheduler'])} to the scheduler). The changed weight is sent "
            f"again after the in-place change: **{'yes' if sent_change else 'no'}**.")
    return "\n\n".join([head, _table(["call", "placed by daskdag", "client → scheduler",
                                      "messages"], rows), goal])


def overhead(s: dict) -> str:
    cases = s["cases"]
    cols = _columns(cases, OVERHEAD)
    ratios = [r for r in ("daskdag_threads/dask_threads", "daskdag_2w/dask_2w",
                          "daskdag_2w_tuned/dask_2w") if any(r in c["ratios"] for c in cases)]

    def cell(c, m):
        return f"{c['methods'][m]['us_per_node']:.0f}" if m in c["methods"] else "–"

    rows = [[c["case"]] + [cell(c, m) for m in cols]
            + [f"{c['ratios'][r]:.2f}" if r in c["ratios"] else "–" for r in ratios]
            for c in cases]
    head = (f"Microseconds per node (median of {s['config']['reps']} runs / N) for one scalar "
            f"output's value and gradient; `dask_*` is the same arithmetic as a hand-written "
            f"Dask graph, `noop_*` that graph's shape with tasks that do nothing: the "
            f"scheduler's own cost. `daskdag_2w/dask_2w` is the tiny-node chain's headline on "
            f"distributed.")
    return head + "\n\n" + _table(["case", *cols, *ratios], rows)


def sweeps(s: dict) -> str:
    c, *more = s["cases"]
    cols = _columns([c], SWEEPS)
    loop = _baseline(c)
    cfg = s["config"]
    vector_reps = (f" ({cfg['vector_reps']} for `jit_vmap` and `sweep_vmap_2w`, timed "
                   f"interleaved in a loop of their own)" if "vector_reps" in cfg else "")
    head = (f"N = {cfg['items']} items of x float32[{cfg['rows']}, {cfg['width']}], two outputs, "
            f"chunks of {cfg['chunk_size']}; eager nodes with Python control flow, except "
            f"`sweep_vmap_2w` and `jit_vmap` (the jittable variant). Median of {cfg['reps']} "
            f"runs{vector_reps}. `loop / method` is the loop's time over the method's: above 1, "
            f"the method is faster than the loop.")
    rows = [[m, seconds(c["methods"][m]["median_s"]), f"{loop / c['methods'][m]['median_s']:.2f}"]
            for m in cols]
    parts = [head, _table(["method", "median", "loop / method"], rows), _ratio_table([c])]
    if more:  # the vectorized sweep over more items (sweeps.vectorized_at_scale)
        parts.append("The vectorized sweep over more items, with its default chunks: part of "
                     "what the cluster adds to the program is a fixed cost per sweep.")
        parts.append(_table(["case", "jit_vmap", "sweep_vmap_2w", "sweep_vmap_2w / jit_vmap"], [
            [m["case"], seconds(m["methods"]["jit_vmap"]["median_s"]),
             seconds(m["methods"]["sweep_vmap_2w"]["median_s"]),
             f"{m['ratios']['sweep_vmap_2w/jit_vmap']:.2f}"] for m in more]))
    return "\n\n".join(parts)


def portable(s: dict) -> str:
    cases = s["cases"]
    head = ("A pullback serialized in one process and called in another: median times in this "
            "process, bytes shipped against the residuals, and on the default 2-worker cluster "
            "(`2w`) a one-node DAG whose backward task runs on the other worker (`moved`) "
            "against the same DAG on one worker (`one_step`); the receiving worker compiles "
            "each backward program once and then finds it in its cache.")
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


def scale_out(s: dict) -> str:
    """A column per cluster shape: each case's efficiencies (ideal / median), the ratio to its
    baseline, the spread of the branch tasks; then the wide and deep tails, broken into their
    parts; then the medians per case."""
    cfg = s["config"]
    shapes: dict[str, dict] = {}
    for c in s["cases"]:
        kind, shape = c["case"].split(", ", 1)
        shapes.setdefault(shape, {})[kind] = c
    names = list(shapes)

    def eff(kind, m):
        def cell(d):
            c = d.get(kind)
            return f"{c['methods'][m]['efficiency']:.2f}" if c and m in c["methods"] else "–"
        return cell

    def ratio(kind, r):
        def cell(d):
            c = d.get(kind)
            return f"{c['ratios'][r]:.2f}" if c and r in c.get("ratios", {}) else "–"
        return cell

    def spread(kind, m):
        def cell(d):
            calls = (((d.get(kind) or {}).get("branch_tasks") or {}).get(m) or {}).get("calls", [])
            calls = [k for k in calls if sum(k["per_worker"])]
            return ", ".join(f"{max(k['per_worker'])}/{min(k['per_worker'])}" for k in calls) or "–"
        return cell

    rows = [("wide: daskdag", eff("wide", "daskdag")),
            ("wide: hand_written (folded)", eff("wide", "hand_written")),
            ("wide: daskdag / hand_written", ratio("wide", "daskdag/hand_written")),
            ("wide: tail, daskdag / hand_written", ratio("wide", "tail_ratio")),
            ("wide: branches per worker, daskdag", spread("wide", "daskdag")),
            ("wide: branches per worker, hand_written", spread("wide", "hand_written")),
            ("deep: daskdag", eff("deep", "daskdag")),
            ("deep: two_phase", eff("deep", "two_phase")),
            ("deep: daskdag / two_phase", ratio("deep", "daskdag/two_phase")),
            ("deep: tail, daskdag / two_phase", ratio("deep", "tail_ratio")),
            ("deep: branches per worker, daskdag", spread("deep", "daskdag")),
            ("deep: branches per worker, two_phase", spread("deep", "two_phase")),
            ("sweeps: daskdag", eff("sweeps", "daskdag")),
            ("sweeps: delayed", eff("sweeps", "delayed")),
            ("sweeps: daskdag / delayed", ratio("sweeps", "daskdag/delayed"))]
    table = _table(["", *names], [[label, *(cell(shapes[n]) for n in names)]
                                   for label, cell in rows])
    head = ("For each shape (`W=k`: k single-thread workers; `wxt`: w workers of t threads), a "
            "default process `LocalCluster` that the scenario starts (one at a time; start-up "
            "took " + ", ".join(f"{float(t):.0f} s for {w}" for w, t in
                                 s.get("cluster_start_s", {}).items())
            + f"). W = slots (workers x threads). wide: {cfg['branches_per_slot']}W branches "
            f"that each wait {cfg['wide_wait_s']:g} s, summed by one scalar head, against the "
            f"folded hand-written graph (one `value_and_grad` task per branch, one sum); deep: "
            f"{cfg['layers']} layers of {cfg['branches_per_slot']}W branches that each wait "
            f"{cfg['deep_wait_s']:g} s, fan-in between layers, two outputs, against the "
            f"two-phase hand-written graph (forward tasks keeping each node's `jax.vjp`, "
            f"backward tasks pulling back, pinned round-robin); sweeps: "
            f"{cfg['items_per_slot']}W items that each wait {cfg['item_wait_s'] * 1e3:g} ms, "
            f"`sweep_grads` against `dask.delayed` over the same chunks. Efficiency = ideal / "
            f"median of {cfg['reps']} runs, the ideal being the waiting spread evenly over the W "
            f"slots: 1 is perfect. Branches per worker: for each timed call, the most and the "
            f"fewest branch (forward) tasks one worker ran; even is "
            f"{cfg['branches_per_slot']} per thread ({cfg['layers']} times that for deep).")
    tails = []
    for kind, base in (("wide", "hand_written"), ("deep", "two_phase")):
        tail_rows = []
        for n in names:
            c = shapes[n].get(kind)
            for m in ("daskdag", base):
                entry = _median_call(c, m)
                if entry is None:
                    continue
                parts = "; ".join(
                    f"`{what}` x{p['tasks']} {p['start_s'] * 1e3:+.0f}..{p['end_s'] * 1e3:+.0f} ms"
                    f" (compute {p['compute_s'] * 1e3:.0f}, transfer {p['transfer_s'] * 1e3:.0f})"
                    for what, p in entry.get("tail", {}).items())
                tail_rows.append([n, m, seconds(entry["before_first_s"]),
                                  seconds(entry["branches_s"]), seconds(entry["after_last_s"]),
                                  parts or "–", seconds(entry.get("return_s", 0.0))])
        tails.append(
            f"The {kind} case's median call: before the first branch, the branches, and the "
            f"tail after the last branch's end, in its parts: each kind of task that ran after "
            f"that end (daskdag's by key kind; the hand-written graph's by function), when the "
            f"first of them started and the last ended relative to it, and their compute and "
            f"transfer time summed; `return`: from the last task's end to the call's end.\n\n"
            + _table(["shape", "method", "before", "branches", "tail", "tail's parts",
                      "return"], tail_rows))

    def med(c, m):
        return seconds(c["methods"][m]["median_s"]) if m in c["methods"] else "–"

    case_rows = []
    for c in s["cases"]:
        base = next(m for m in c["methods"] if m != "daskdag")
        r = f"daskdag/{base}"
        floor = seconds(c["cpu_floor_s"]) if "cpu_floor_s" in c else "–"
        case_rows.append([c["case"], med(c, "daskdag"), f"{med(c, base)} (`{base}`)",
                          seconds(c["ideal_s"]),
                          f"{c['ratios'][r]:.2f}" if r in c["ratios"] else "–",
                          str(c["params"].get("chunk_size", "–")), floor])
    cases = ("Median times per case; `CPU floor` (sweeps): the delayed method's own JAX work "
             "per item, without the waiting, timed in this process, times N over the "
             "machine's cores, a bound the waiting does not set.\n\n"
             + _table(["case", "daskdag", "baseline", "ideal", "daskdag / baseline", "chunk",
                       "CPU floor"], case_rows))
    return "\n\n".join([head, table, *tails, cases])


def _median_call(c: dict | None, m: str) -> dict | None:
    """Of a case's timed calls of method ``m``, the one with the median time (its timeline)."""
    calls = [k for k in (((c or {}).get("branch_tasks") or {}).get(m) or {}).get("calls", [])
             if "branches_s" in k]
    if not calls:
        return None
    return sorted(calls, key=lambda k: k["before_first_s"] + k["branches_s"]
                  + k["after_last_s"])[len(calls) // 2]


def tiny_nodes(s: dict) -> str:
    """The seed DAG per call, then the layered DAGs per node."""
    cfg = s["config"]
    seed = [c for c in s["cases"] if c["params"].get("dag") == "seed"]
    layered = [c for c in s["cases"] if "nodes" in c["params"]]
    parts = []
    if seed:
        parts.append(f"The seed question's DAG (A, B, C, D, E on float32[5]) on Dask's threaded "
                     f"scheduler against the question's own `jax.vjp` plumbing; median of "
                     f"{cfg['seed_reps']} samples of {cfg['seed_inner']} calls each, per call.")
        parts.append(_table(["case", "daskdag_threads", "hand_written",
                             "daskdag_threads/hand_written"],
                            [[c["case"], seconds(c["methods"]["daskdag_threads"]["median_s"]),
                              seconds(c["methods"]["hand_written"]["median_s"]),
                              f"{c['ratios']['daskdag_threads/hand_written']:.2f}"]
                             for c in seed]))
    if layered:
        parts.append("Layered random DAGs of N tiny nodes (`sin(a) * 0.5 + b * 0.5` on "
                     "float32[4], layers of 50, two parents each in the layer before), one "
                     "scalar output: microseconds per node (median / N) on Dask's threaded "
                     "scheduler and for the same VJP plumbing in a plain loop (`jax_loop`). "
                     "`per_node_largest/per_node_1000`: daskdag's cost per node at the largest "
                     "N over its cost per node at N = 1,000 (flat: 1); `jax_loop`'s own, "
                     "for comparison. Repetitions: "
                     + ", ".join(f"{r} at N={n}" for n, r in zip(cfg["nodes"], cfg["reps"])) + ".")

        def ratio(c, r):
            return f"{c['ratios'][r]:.2f}" if r in c["ratios"] else "–"

        parts.append(_table(
            ["case", "daskdag_threads µs/node", "jax_loop µs/node", "daskdag_threads/jax_loop",
             "per_node_largest/per_node_1000", "jax_loop's", "daskdag_threads median"],
            [[c["case"], f"{c['methods']['daskdag_threads']['us_per_node']:.0f}",
              f"{c['methods']['jax_loop']['us_per_node']:.0f}",
              ratio(c, "daskdag_threads/jax_loop"), ratio(c, "per_node_largest/per_node_1000"),
              ratio(c, "jax_loop: per_node_largest/per_node_1000"),
              seconds(c["methods"]["daskdag_threads"]["median_s"])] for c in layered]))
    return "\n\n".join(parts)


def generic(s: dict) -> str:
    """Any scenario: each case's methods' medians, then its ratios."""
    cases = s["cases"]
    cols = _columns(cases)
    rows = [[c["case"]] + [seconds(c["methods"][m]["median_s"]) if m in c["methods"] else "–"
                           for m in cols] for c in cases]
    reps = s.get("config", {}).get("reps")
    head = s.get("description") or f"Median seconds{f' of {reps} runs' if reps else ''}."
    parts = [head, _table(["case", *cols], rows)]
    if any(c.get("ratios") for c in cases):
        parts.append(_ratio_table(cases))
    return "\n\n".join(parts)


def repeat_calls(s: dict) -> str:
    """The generic tables, then what the cluster loop sent per step and what SLSQP did."""
    parts = [generic(s)]
    cases = {c["case"]: c for c in s["cases"]}
    loop = cases.get("cluster loop")
    if loop and "bytes_per_step" in loop:
        b = loop["bytes_per_step"]
        parts.append(
            f"Cluster loop, each step after the first: {b['to_scheduler']:,.0f} bytes to the "
            f"scheduler in {b['messages']:.0f} messages (distributed's count), and "
            f"{b['placed_by_daskdag']:,.0f} bytes placed by daskdag: the parameters "
            f"({loop['params']['parameters_bytes']} bytes) and the task graph, which carries "
            f"the nodes' packed functions inline ({b['node_functions_inline']:,} bytes: each "
            f"under 64 KiB, so the tasks that take them can go to any worker); no input, node "
            f"or residual is sent again.")
    opt = next((c for c in s["cases"] if c["case"].startswith("optimisation")), None)
    if opt and "runs" in opt:
        runs = opt["runs"]
        parts.append("SLSQP on the stepped cantilever: " + "; ".join(
            f"`{m}` {r['iterations']} iterations, {r['calls']} calls, {r['seconds']:.2f} s, "
            f"volume {r['optimum']:,.2f} cm³" for m, r in runs.items())
            + f" (optima within {opt['optimum_gap']:.1e} of each other, relatively).")
    return "\n\n".join(parts)


SECTIONS = {"k_heads": k_heads, "overhead": overhead, "sweeps": sweeps, "portable": portable,
            "scale_out": scale_out, "tiny_nodes": tiny_nodes, "repeat_calls": repeat_calls}


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
    """The report; ``images``: the folder, relative to where the Markdown will be read, of the
    PNGs to show (none if None)."""
    run = results["run"]
    clusters = results.get("clusters", {})
    out = [f"Measured with `{run['command']}` ({run['mode']}) on {run['started'][:10]}, in "
           f"{run['wall_s'] / 60:.1f} min, on: {machine_line(results)}.", RATIO_RULE]
    if run.get("note"):  # how the run was made, where it was not one invocation
        out.insert(1, run["note"])
    if clusters:
        out.append(clusters_paragraph(clusters))
    head = summary(results)
    if head:
        out.append(head)
    for name, why in results.get("skipped", {}).items():
        out.append(f"Scenario `{name}` skipped: {why}.")
    for n, (name, s) in enumerate(results["scenarios"].items(), 1):
        out.append(f"### {n}. {s['title']}")
        out.append(SECTIONS.get(name, generic)(s))
        out.append(where_line(_columns(s["cases"]), clusters, s.get("where")))
        block = _targets_block(s)
        if block:
            out.append(block)
        if images is not None:
            out.append(f"![{s['title']}]({images}/{name}.png)")
    return "\n\n".join(out) + "\n"


# --- Plots ---------------------------------------------------------------------------------------

def _color(m: str, order: tuple[str, ...]) -> str:
    return f"C{order.index(m) % 10}" if m in order else "gray"


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
            ax.bar(xs, ys, width, label=m, color=_color(m, K_HEADS))
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
            have = [c for c in mine if m in c["methods"]]
            ax.plot([c["params"]["nodes"] for c in have],
                    [c["methods"][m]["us_per_node"] for c in have], marker="o", label=m,
                    color=_color(m, OVERHEAD))
        _log(ax.xaxis)
        _log(ax.yaxis)
        ax.set_xlabel("nodes")
        ax.set_ylabel("µs per node (log)")
        ax.set_title(shape)
    ax_row[-1].legend(fontsize=8)


def _sweeps_plot(s: dict, ax_row) -> None:
    c = s["cases"][0]  # (the vectorized case at scale is in the text report only)
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


def _generic_plot(s: dict, ax_row) -> None:
    """Each case's methods' medians, as grouped bars."""
    cases = s["cases"]
    cols = _columns(cases)
    (ax,) = ax_row
    width = 0.8 / max(len(cols), 1)
    for j, m in enumerate(cols):
        ys = [c["methods"][m]["median_s"] if m in c["methods"] else 0 for c in cases]
        ax.bar([i + j * width for i in range(len(cases))], ys, width, label=m)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(cases))], [c["case"] for c in cases])
    _log(ax.yaxis)
    ax.set_ylabel("median seconds (log)")
    ax.legend(fontsize=7)


def _scale_out_plot(s: dict, ax_row) -> None:
    ax, tail_ax = ax_row
    shapes = list(dict.fromkeys(c["case"].split(", ", 1)[1] for c in s["cases"]))
    lines = [("wide", "daskdag"), ("wide", "hand_written"), ("deep", "daskdag"),
             ("deep", "two_phase"), ("sweeps", "daskdag"), ("sweeps", "delayed")]
    for j, (kind, m) in enumerate(lines):
        pts = [(shapes.index(c["case"].split(", ", 1)[1]), c["methods"][m]["efficiency"])
               for c in s["cases"] if c["case"].startswith(kind) and m in c["methods"]]
        if pts:
            ax.plot(*zip(*pts), marker="o", label=f"{kind}: {m}", color=f"C{j // 2}",
                    linestyle="-" if m == "daskdag" else "--")
    ax.axhline(1, color="black", linewidth=0.8)
    ax.axhline(0.85, color="gray", linewidth=0.8, linestyle=":", label="target (0.85)")
    ax.set_xticks(range(len(shapes)), shapes)
    ax.set_ylim(0, 1.1)
    ax.set_xlabel("cluster shape")
    ax.set_ylabel("efficiency (ideal / median)")
    ax.set_title("efficiency")
    ax.legend(fontsize=7)
    width = 0.2
    for j, (kind, base) in enumerate((("wide", "hand_written"), ("deep", "two_phase"))):
        for k, m in enumerate(("daskdag", base)):
            pts = []
            for i, shape in enumerate(shapes):
                c = next((c for c in s["cases"] if c["case"] == f"{kind}, {shape}"), None)
                entry = _median_call(c, m)
                if entry is not None:
                    pts.append((i + (2 * j + k - 1.5) * width, entry["after_last_s"]))
            if pts:
                tail_ax.bar(*zip(*pts), width=width, label=f"{kind}: {m}", color=f"C{j}",
                            alpha=1.0 if m == "daskdag" else 0.5)
    tail_ax.set_xticks(range(len(shapes)), shapes)
    tail_ax.set_xlabel("cluster shape")
    tail_ax.set_ylabel("seconds after the last branch")
    tail_ax.set_title("the tail (median call)")
    tail_ax.legend(fontsize=7)


def _tiny_nodes_plot(s: dict, ax_row) -> None:
    seed_ax, ax = ax_row
    layered = [c for c in s["cases"] if "nodes" in c["params"]]
    for j, m in enumerate(("daskdag_threads", "jax_loop")):
        ax.plot([c["params"]["nodes"] for c in layered],
                [c["methods"][m]["us_per_node"] for c in layered], marker="o", label=m,
                color=f"C{j}")
    _log(ax.xaxis)
    ax.set_ylim(bottom=0)
    ax.set_xlabel("nodes N")
    ax.set_ylabel("µs per node")
    ax.set_title("layered random DAGs")
    ax.legend(fontsize=8)
    seed = [c for c in s["cases"] if c["params"].get("dag") == "seed"]
    if seed:
        ms = ("daskdag_threads", "hand_written")
        seed_ax.bar(ms, [seed[0]["methods"][m]["median_s"] * 1e3 for m in ms],
                    color=["C0", "C1"])
        seed_ax.set_ylabel("ms per call")
        seed_ax.set_title("seed DAG")


def _log(axis) -> None:
    """A log scale labelled in plain numbers (2, 5, 10, not 2×10⁰)."""
    from matplotlib.ticker import FuncFormatter

    getattr(axis.axes, f"set_{axis.axis_name}scale")("log")
    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    axis.set_minor_formatter(FuncFormatter(  # 2 and 5 of each decade
        lambda v, _: f"{v:g}" if f"{v:e}"[0] in "25" else ""))


PLOTS = {"k_heads": (_k_heads_plot, 2), "overhead": (_overhead_plot, 2),
         "sweeps": (_sweeps_plot, 1), "portable": (_portable_plot, 1),
         "scale_out": (_scale_out_plot, 2), "tiny_nodes": (_tiny_nodes_plot, 2)}


def plots(results: dict, folder: Path) -> list[Path]:
    """One PNG per scenario in ``folder``; the paths written."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for name, s in results["scenarios"].items():
        draw, panels = PLOTS.get(name, (_generic_plot, 1))
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
