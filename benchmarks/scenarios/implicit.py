"""Scenario: implicit and coupled nodes, on Sellar's two-discipline problem of
``examples/sellar.py``, against OpenMDAO's own model of it.

The model (``examples/sellar.py``): two disciplines that depend on each other, declared as
one ``daskdag.coupled`` group (Newton's method, derivatives by the implicit function theorem),
an objective and two constraints, of a design of 3 variables; every node ``jit=True``. OpenMDAO's
model: its Sellar disciplines with analytic partials in a cycle group (``NewtonSolver``,
``DirectSolver``), ``ExecComp`` objective and constraints.

Two cases:

evaluation:    one design's values and Jacobians, at a new design each call: ``daskdag`` is a
               prepared ``daskdag.value_and_jacobian`` called again (its preparation reused;
               mode ``"auto"``); ``daskdag_eager`` the same DAG with eager nodes (the group's
               solve still compiled once); ``openmdao`` is ``set_val`` + ``run_model`` +
               ``compute_totals``, what its driver pays per iteration.
optimisation:  SciPy's SLSQP from (5, 2, 1) to the optimum: ``daskdag`` a new DAG and prepared
               call each time (its first call prepares and compiles: a cold start) under
               ``scipy.optimize.minimize``; ``daskdag_again`` the same prepared call each time
               (an optimiser run again on the same model: its programs compiled before);
               ``openmdao`` a new problem's ``run_driver`` (set up before timing) under
               ``ScipyOptimizeDriver``, the same tolerance.

Every method's values and Jacobians (evaluation) and optimum (optimisation) are checked against
the other's before timing. Medians; the methods timed interleaved.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import asdict, dataclass

import numpy as np

import daskdag

from .. import common
from .repeat_calls import float64

TITLE = "Implicit and coupled nodes: Sellar's problem against OpenMDAO"
DESCRIPTION = "a coupled group (Sellar's problem) against OpenMDAO's Newton and compute_totals"
CLUSTERS = None  # in this process


@dataclass(frozen=True)
class Config:
    reps: int  # timed repetitions of each case's methods
    inner: int  # evaluations per timed sample


FULL = Config(reps=7, inner=50)
QUICK = Config(reps=3, inner=10)


def _dag(m, jit: bool) -> dict:
    """The example's DAG, its nodes ``jit`` or eager."""
    group = daskdag.coupled({"y1": (m.discipline1, ["design", "y2"]),
                             "y2": (m.discipline2, ["design", "y1"])},
                            guess={"y1": 1.0, "y2": 1.0}, name="disciplines", jit=jit)
    return {**group, "obj": daskdag.Node(m.objective, ["design", "y1", "y2"], jit=jit),
            "con": daskdag.Node(m.constraints, ["y1", "y2"], jit=jit)}


def _designs(n: int) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [np.array([2.0, 0.5, 0.5]) + 0.1 * rng.standard_normal(3) for _ in range(n)]


def evaluation_case(m, cfg: Config) -> dict:
    prob = m.openmdao_problem()
    prob.run_model()

    def openmdao(d):
        prob.set_val("z", d[:2])
        prob.set_val("x", d[2])
        prob.run_model()
        totals = prob.compute_totals(["obj", "con1", "con2"], ["z", "x"])
        obj = np.concatenate([totals["obj", "z"], totals["obj", "x"]], axis=1)[0]
        con = np.concatenate([np.concatenate([totals[c, "z"], totals[c, "x"]], axis=1)
                              for c in ("con1", "con2")])
        return {"obj": float(prob.get_val("obj")[0]),
                "con": np.array([prob.get_val("con1")[0], prob.get_val("con2")[0]])}, \
            {"obj": obj, "con": con}

    prepared = {"daskdag": daskdag.value_and_jacobian(_dag(m, True), ["obj", "con"],
                                                      wrt=["design"]),
                "daskdag_eager": daskdag.value_and_jacobian(_dag(m, False), ["obj", "con"],
                                                            wrt=["design"])}
    runs = {**prepared, "openmdao": openmdao}
    designs = _designs(cfg.inner)
    for d in designs[:2]:  # (warm-up, and the check)
        want = openmdao(d)
        for name, f in prepared.items():
            got = f(d)
            worst = max(common.worst_difference(got[k], want[k]) for k in (0, 1))
            if worst > 1e-8:
                raise AssertionError(f"{TITLE}: {name} disagrees with OpenMDAO at {d}: {worst}")

    def loop(f):
        return lambda: [f(d) for d in designs]

    times = common.interleaved({n: loop(f) for n, f in runs.items()}, cfg.reps,
                               label="evaluation: ")
    per_call = {n: [t / cfg.inner for t in ts] for n, ts in times.items()}
    return common.case("evaluation", {"designs": cfg.inner}, per_call,
                       {"daskdag/openmdao": ("daskdag", "openmdao"),
                        "daskdag_eager/openmdao": ("daskdag_eager", "openmdao")},
                       baseline="openmdao",
                       solves=dict(prepared["daskdag"].info.solves))


def optimisation_case(m, cfg: Config) -> dict:
    found: dict = {}
    times: dict[str, list[float]] = {"daskdag": [], "daskdag_again": [], "openmdao": []}
    again = daskdag.value_and_jacobian(_dag(m, True), ["obj", "con"], wrt=["design"])
    m.optimise(again)  # (its first optimisation: it prepares and compiles)
    for rep in range(cfg.reps):
        for name in ("daskdag", "daskdag_again", "openmdao")[::(-1) ** rep]:
            if name.startswith("daskdag"):
                start = time.perf_counter()
                f = again if name == "daskdag_again" else daskdag.value_and_jacobian(
                    _dag(m, True), ["obj", "con"], wrt=["design"])
                out, calls, _ = m.optimise(f)
                times[name].append(time.perf_counter() - start)
                found[name] = {"optimum": float(out.fun), "iterations": int(out.nit),
                               "calls": calls}
            else:
                prob = m.openmdao_problem()  # (set up outside the timing)
                start = time.perf_counter()
                prob.run_driver()
                times[name].append(time.perf_counter() - start)
                result = prob.driver._scipy_optimize_result  # (SciPy's, as the driver got it)
                found[name] = {"optimum": float(prob.get_val("obj")[0]),
                               "iterations": int(result.nit), "calls": int(prob.driver.iter_count)}
        print(f"  optimisation: rep {rep + 1}/{cfg.reps}: " + ", ".join(
            f"{n} {t[-1] * 1e3:.1f} ms" for n, t in times.items()), flush=True)
    gap = abs(found["daskdag"]["optimum"] - found["openmdao"]["optimum"])
    if gap > 1e-5 or abs(found["daskdag"]["optimum"] - m.PUBLISHED["obj"]) > 1e-5:
        raise AssertionError(f"{TITLE}: optima differ: {found} (published {m.PUBLISHED['obj']})")
    return common.case("optimisation (SLSQP)", {"variables": 3, "constraints": 2}, times,
                       {"daskdag/openmdao": ("daskdag", "openmdao"),
                        "daskdag_again/openmdao": ("daskdag_again", "openmdao")},
                       baseline="openmdao",
                       runs=found, published=m.PUBLISHED["obj"])


def run(quick: bool, clients: dict) -> dict:
    cfg = QUICK if quick else FULL
    m = common.example("sellar")
    print(f"{TITLE}", flush=True)
    with float64(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*nonlinear solver that computes gradients")
        cases = [evaluation_case(m, cfg), optimisation_case(m, cfg)]
    return {"title": TITLE, "config": asdict(cfg), "cases": cases,
            "description": "Median seconds: per evaluation (a design's values and Jacobians), "
                           "and per optimisation (SLSQP from the same start to the published "
                           "optimum, obj 3.18339). Values, Jacobians and optima agree between "
                           "the methods to 1e-8 (evaluation) and 1e-5 (optimum).",
            "targets": []}
