"""A constrained design optimisation: SciPy's SLSQP on a DAG, with the objective's and
the constraints' Jacobians from one prepared daskdag call per design.

A stepped cantilever (Vanderplaats' classic): a beam 500 cm long in 5 segments, each of
rectangular section b_i x h_i (cm), carries 50 kN at its tip. Minimise its volume,
keeping the bending stress in each segment under 14,000 N/cm^2, the tip deflection under
2.5 cm and each segment's height at most 20 times its width; 1 <= b_i <= 40 and
5 <= h_i <= 100.

    design -> section (I per segment) -> stress (per segment) -> stress margin
              |                       -> tip (deflection, by segment) -> tip margin
              -> volume
              -> aspect margin

``daskdag.value_and_jacobian`` makes the DAG a function of the design that returns every
output's value and Jacobian in one call (each node run once per design); SLSQP asks for
the objective, the constraints and their Jacobians separately, so the call is made once
per design it tries and its results shared. The first call prepares; every later one
reuses that (its ``info.prepared``). It runs on Dask's threads, then on a two-worker
cluster, and both optima are checked against the same SLSQP run on plain JAX
(``jax.jacrev`` of the composed function). Prints the comparison; exits non-zero if it
fails.
"""

import os

# (before jax: SLSQP works in float64, workers too)
os.environ.setdefault("JAX_ENABLE_X64", "1")

import sys  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from scipy.optimize import minimize  # noqa: E402

import daskdag  # noqa: E402

SEGMENTS, LENGTH, LOAD, E = 5, 500.0, 50_000.0, 2.0e7  # -, cm, N, N/cm^2
STRESS_MAX, TIP_MAX, ASPECT_MAX = 14_000.0, 2.5, 20.0
SEGMENT = LENGTH / SEGMENTS
BOUNDS = [(1.0, 40.0)] * SEGMENTS + [(5.0, 100.0)] * SEGMENTS  # b_1..b_5, h_1..h_5
START = np.array([5.0] * SEGMENTS + [40.0] * SEGMENTS)


def second_moment(design):  # I_i = b_i h_i^3 / 12
    b, h = design[:SEGMENTS], design[SEGMENTS:]
    return b * h ** 3 / 12.0


def volume(design):
    return jnp.sum(design[:SEGMENTS] * design[SEGMENTS:]) * SEGMENT


def stress(design, inertia):  # at the root end of each segment: M c / I
    moment = LOAD * (LENGTH - SEGMENT * jnp.arange(SEGMENTS))
    return moment * (design[SEGMENTS:] / 2.0) / inertia


def tip(inertia):  # slope and deflection carried segment by segment, root to tip
    slope = deflection = 0.0
    for i in range(SEGMENTS):
        start = SEGMENT * i
        # M(x) = P (L - x) over the segment: integrate M / EI twice, from its start
        rise = LOAD / (E * inertia[i]) * (
            LENGTH * SEGMENT - (2 * start * SEGMENT + SEGMENT ** 2) / 2)
        drop = LOAD / (E * inertia[i]) * (
            LENGTH * SEGMENT ** 2 / 2 - (3 * start * SEGMENT ** 2 + SEGMENT ** 3) / 6)
        deflection = deflection + slope * SEGMENT + drop
        slope = slope + rise
    return deflection


dag = {
    "inertia": daskdag.Node(second_moment, ["design"], jit=True),
    "volume": daskdag.Node(volume, ["design"], jit=True),
    "stress": daskdag.Node(stress, ["design", "inertia"], jit=True),
    "tip": daskdag.Node(tip, ["inertia"], jit=True),
    "stress_margin": daskdag.Node(lambda s: 1.0 - s / STRESS_MAX, ["stress"], jit=True),
    "tip_margin": daskdag.Node(lambda d: jnp.atleast_1d(1.0 - d / TIP_MAX), ["tip"],
                               jit=True),
    "aspect_margin": daskdag.Node(
        lambda x: ASPECT_MAX * x[:SEGMENTS] / x[SEGMENTS:] - 1.0, ["design"], jit=True),
}
MARGINS = ["stress_margin", "tip_margin", "aspect_margin"]  # each >= 0 when feasible


class Shared:
    """One call per design SLSQP tries, its values and Jacobians shared by the
    objective, the constraints and their Jacobians (which SLSQP asks for separately)."""

    def __init__(self, evaluate):
        self.evaluate, self.x, self.calls = evaluate, None, 0

    def __call__(self, x):
        if self.x is None or not np.array_equal(x, self.x):
            self.values, self.jacobians = self.evaluate(np.array(x))
            self.x, self.calls = np.array(x), self.calls + 1
        return self.values, self.jacobians

    def problem(self):
        def column(name, scale=1.0):
            return lambda x: np.asarray(self(x)[0][name]) * scale

        def rows(name, scale=1.0):
            return lambda x: np.asarray(self(x)[1][name]) * scale

        # (the volume in units of 10^5 cm^3: SLSQP wants an objective of order one)
        return dict(fun=column("volume", 1e-5), jac=rows("volume", 1e-5),
                    constraints=[{"type": "ineq", "fun": column(m), "jac": rows(m)}
                                 for m in MARGINS])


def optimise(evaluate):
    shared = Shared(evaluate)
    start = time.perf_counter()
    out = minimize(x0=START, method="SLSQP", bounds=BOUNDS,
                   options={"maxiter": 200, "ftol": 1e-9}, **shared.problem())
    return out, shared.calls, time.perf_counter() - start


def plain_jax():
    """The same functions composed, with jax.jacrev: the reference."""
    def outputs(x):
        inertia = second_moment(x)
        s = stress(x, inertia)
        return {"volume": volume(x), "stress_margin": 1.0 - s / STRESS_MAX,
                "tip_margin": jnp.atleast_1d(1.0 - tip(inertia) / TIP_MAX),
                "aspect_margin": ASPECT_MAX * x[:SEGMENTS] / x[SEGMENTS:] - 1.0}
    both = jax.jit(lambda x: (outputs(x), jax.jacrev(outputs)(x)))
    return lambda x: both(jnp.asarray(x))


def report(label, out, calls, seconds, info=None):
    b, h = out.x[:SEGMENTS], out.x[SEGMENTS:]
    how = "" if info is None else f" ({info.mode}, prepared before: {info.prepared})"
    print(f"{label}{how}:")
    print(f"   volume {out.fun * 1e5:,.0f} cm^3 after {out.nit} iterations, "
          f"{calls} calls, {seconds:.2f} s")
    print("   b = " + " ".join(f"{v:5.2f}" for v in b)
          + " cm;  h = " + " ".join(f"{v:6.2f}" for v in h) + " cm")


def main() -> int:
    reference, ref_calls, ref_seconds = optimise(plain_jax())
    report("plain JAX (jax.jit of jax.jacrev)", reference, ref_calls, ref_seconds)
    print("   ", reference.message)

    on_threads = daskdag.value_and_jacobian(dag, ["volume", *MARGINS])
    threads, calls, seconds = optimise(on_threads)
    report("daskdag on threads", threads, calls, seconds, on_threads.info)

    from distributed import Client, LocalCluster

    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                      dashboard_address=None) as cluster, Client(cluster) as client:
        on_cluster = daskdag.value_and_jacobian(dag, ["volume", *MARGINS],
                                                client=client)
        clustered, calls, seconds = optimise(on_cluster)
        report("daskdag on a 2-worker cluster", clustered, calls, seconds,
               on_cluster.info)

    x = threads.x  # the Jacobians at the optimum, against plain JAX's
    values, jacobians = on_threads(x)
    want_values, want_jacobians = plain_jax()(x)
    worst = max(float(np.max(np.abs(np.asarray(jacobians[k])
                                    - np.asarray(want_jacobians[k])))
                      / (1.0 + float(np.max(np.abs(np.asarray(want_jacobians[k]))))))
                for k in want_jacobians)
    print("largest relative difference of the Jacobians to JAX's at the optimum: "
          f"{worst:.2e}")
    optima = [abs(r.fun - reference.fun) / reference.fun for r in (threads, clustered)]
    print(f"optima against plain JAX's: {optima[0]:.1e} (threads), "
          f"{optima[1]:.1e} (cluster)")
    # (SLSQP's path is sensitive: Jacobians that differ in their last bit, as two
    # programs' may, can take it through other points to the same optimum within its
    # tolerance)
    feasible = min(float(np.min(np.asarray(values[m]))) for m in MARGINS)
    print(f"least margin at the optimum: {feasible:.1e} (>= 0: every constraint holds)")
    checks = {"every run converged": all(r.success
                                         for r in (reference, threads, clustered)),
              "Jacobians as JAX's": worst < 1e-8,
              "the same optimum": max(optima) < 1e-4,
              "feasible": feasible > -1e-6,
              "calls after the first reused its preparation": on_threads.info.prepared
              and on_cluster.info.prepared}
    failed = [name for name, ok in checks.items() if not ok]
    print("FAILED: " + ", ".join(failed) if failed else "all checks passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
