"""A coupled two-discipline design optimisation: Sellar's problem, the textbook
case of multidisciplinary design (OpenMDAO's tutorial), solved by SciPy's SLSQP
with daskdag's gradients.

Two disciplines depend on each other (a cycle): discipline 1 computes y1 from y2,
discipline 2 computes y2 from y1. ``daskdag.coupled`` declares them as one group,
solved together by Newton's method at every call and differentiated by the
implicit function theorem (one linear solve per call, never through the
iterations)::

    design (z1, z2, x) -> [ y1 = z1^2 + z2 + x - 0.2 y2 ] -> obj, con
                          [ y2 = sqrt(y1) + z1 + z2     ]

    obj = x^2 + z2 + y1 + exp(-y2),  con = (3.16 - y1, y2 - 24) <= 0

Minimise obj over -10 <= z1 <= 10, 0 <= z2 <= 10, 0 <= x <= 10, from (5, 2, 1).
The published optimum (Sellar et al. 1996): obj = 3.18339 at z = (1.9776, 0),
x = 0, with y1 = 3.16 (its constraint active) and y2 = 3.7553.

``daskdag.value_and_jacobian`` gives the objective's and constraints' values and
Jacobians in one call per design. The optimum is checked against the published
one, and the Jacobians at the optimum against plain JAX's: ``jax.jacrev`` through
200 fixed-point iterations of the disciplines. When OpenMDAO is
installed, its own model of the problem (its Sellar disciplines with analytic
partials, Newton on the cycle, ``ScipyOptimizeDriver``'s SLSQP) runs too, and
the two are timed side by side: daskdag's first optimisation compiles its
programs, a second one from the same start reuses them. Prints the comparison;
exits non-zero if it fails.
"""

import functools
import os

os.environ.setdefault("JAX_ENABLE_X64", "1")  # (before jax: SLSQP works in float64)

import sys  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from scipy.optimize import minimize  # noqa: E402

import daskdag  # noqa: E402

START = np.array([5.0, 2.0, 1.0])  # z1, z2, x
BOUNDS = [(-10.0, 10.0), (0.0, 10.0), (0.0, 10.0)]
PUBLISHED = {"obj": 3.18339395, "design": np.array([1.97763888, 0.0, 0.0]), "y1": 3.16,
             "y2": 3.75527777}


def discipline1(d, y2):
    return d[0] ** 2 + d[1] + d[2] - 0.2 * y2


def discipline2(d, y1):
    return jnp.sqrt(y1) + d[0] + d[1]


def objective(d, y1, y2):
    return d[2] ** 2 + d[1] + y1 + jnp.exp(-y2)


def constraints(y1, y2):  # each <= 0 where feasible
    return jnp.stack([3.16 - y1, y2 - 24.0])


dag = {  # (every function traceable: each node jitted, the group's solve with its node)
    **daskdag.coupled({"y1": (discipline1, ["design", "y2"]),
                       "y2": (discipline2, ["design", "y1"])},
                      guess={"y1": 1.0, "y2": 1.0}, name="disciplines", jit=True),
    "obj": daskdag.Node(objective, ["design", "y1", "y2"], jit=True),
    "con": daskdag.Node(constraints, ["y1", "y2"], jit=True),
}


def optimise(evaluate):
    """SLSQP from START with ``evaluate(design) -> (values, jacobians)``, called
    once per design it tries (SLSQP asks for the objective, the constraints and
    their Jacobians separately): its result, the calls made and its seconds."""
    @functools.lru_cache(maxsize=1)
    def at(design: bytes):
        return evaluate(np.frombuffer(design))

    def part(which, name, sign=1.0):  # (which: 0 values, 1 Jacobians)
        def get(x):
            return sign * np.asarray(at(np.asarray(x, float).tobytes())[which][name])
        return get

    start = time.perf_counter()
    out = minimize(x0=START, method="SLSQP", bounds=BOUNDS, fun=part(0, "obj"),
                   jac=part(1, "obj"), options={"maxiter": 100, "ftol": 1e-10},
                   constraints=[{"type": "ineq",  # (SciPy's: >= 0)
                                 "fun": part(0, "con", -1.0),
                                 "jac": part(1, "con", -1.0)}])
    return out, at.cache_info().misses, time.perf_counter() - start


def plain_jax():
    """The reference: the disciplines iterated 200 times (Gauss-Seidel), under
    ``jax.jacrev``: JAX differentiates through every iteration."""
    def outputs(d):
        def iteration(_, y):
            y1 = discipline1(d, y[1])
            return y1, discipline2(d, y1)

        y1, y2 = jax.lax.fori_loop(0, 200, iteration, (1.0, 1.0))  # (a scan: 200 steps)
        return {"obj": objective(d, y1, y2), "con": constraints(y1, y2)}
    both = jax.jit(lambda d: (outputs(d), jax.jacrev(outputs)(d)))
    return lambda d: both(jnp.asarray(d))


def openmdao_problem():
    """OpenMDAO's own model of the problem: its Sellar disciplines with analytic
    partials in a cycle group (Newton, direct linear solves), ``ExecComp``
    objective and constraints, its ``ScipyOptimizeDriver`` running SLSQP with the
    same tolerance."""
    import openmdao.api as om
    from openmdao.test_suite.components.sellar import (SellarDis1withDerivatives,
                                                       SellarDis2withDerivatives)

    prob = om.Problem(reports=False)
    model = prob.model
    cycle = model.add_subsystem("cycle", om.Group(), promotes=["*"])
    cycle.add_subsystem("d1", SellarDis1withDerivatives(),
                        promotes=["x", "z", "y1", "y2"])
    cycle.add_subsystem("d2", SellarDis2withDerivatives(), promotes=["z", "y1", "y2"])
    cycle.nonlinear_solver = om.NewtonSolver(solve_subsystems=False, iprint=-1,
                                             maxiter=50, atol=1e-10, rtol=1e-10)
    cycle.linear_solver = om.DirectSolver()
    model.add_subsystem("obj_cmp", om.ExecComp("obj = x**2 + z[1] + y1 + exp(-y2)",
                                               z=np.zeros(2), x=0.0), promotes=["*"])
    model.add_subsystem("con_cmp1", om.ExecComp("con1 = 3.16 - y1"), promotes=["*"])
    model.add_subsystem("con_cmp2", om.ExecComp("con2 = y2 - 24.0"), promotes=["*"])
    model.add_design_var("z", lower=np.array([-10.0, 0.0]),
                         upper=np.array([10.0, 10.0]))
    model.add_design_var("x", lower=0.0, upper=10.0)
    model.add_objective("obj")
    model.add_constraint("con1", upper=0.0)
    model.add_constraint("con2", upper=0.0)
    prob.driver = om.ScipyOptimizeDriver(optimizer="SLSQP", tol=1e-10, maxiter=100,
                                         disp=False)
    prob.setup()
    prob.set_val("z", START[:2])
    prob.set_val("x", START[2])
    prob.set_val("y1", 1.0)
    prob.set_val("y2", 1.0)
    return prob


def run_openmdao():
    """OpenMDAO's optimum (obj, design) and its seconds, or None without OpenMDAO."""
    try:
        prob = openmdao_problem()
    except ImportError:
        return None
    with warnings.catch_warnings():  # (that its Newton group is atomic to relevance)
        warnings.filterwarnings("ignore", message=".*solver that computes gradients")
        start = time.perf_counter()
        prob.run_driver()
        seconds = time.perf_counter() - start
    design = np.concatenate([prob.get_val("z"), prob.get_val("x")])
    return float(prob.get_val("obj")[0]), design, seconds


def main() -> int:
    f = daskdag.value_and_jacobian(dag, ["obj", "con"], wrt=["design"])
    out, calls, seconds = optimise(f)
    values, jacobians = f(out.x)
    solution = daskdag.compute_grads(dag, out.x, ["y1", "y2"])
    y1, y2 = float(solution["y1"].value), float(solution["y2"].value)
    print(f"daskdag + SLSQP: obj {out.fun:.6f} at z = ({out.x[0]:.5f}, "
          f"{out.x[1]:.5f}), x = {out.x[2]:.5f}")
    print(f"   y1 = {y1:.5f}, y2 = {y2:.5f}; {out.message}")
    print(f"   {out.nit} iterations, {calls} calls, {seconds:.2f} s "
          f"(the first call compiles)")
    (solve,) = f.info.solves["disciplines"]
    print(f"   the last call: {f.info.mode}, prepared before: {f.info.prepared}; "
          f"Newton: {solve['iterations']} iterations, |R| {solve['residual']:.1e}")
    again, _, seconds_again = optimise(f)
    print(f"   again from the start, compiled: {seconds_again:.3f} s, "
          f"obj {again.fun:.6f}")
    print(f"published:       obj {PUBLISHED['obj']:.6f} at z = (1.97764, 0), x = 0; "
          f"y1 = 3.16, y2 = 3.75528")

    _, want = plain_jax()(out.x)
    worst = max(float(np.max(np.abs(np.asarray(jacobians[k]) - np.asarray(want[k]))))
                for k in want)
    print(f"the Jacobians at the optimum against plain JAX's: {worst:.1e}")

    openmdao = run_openmdao()
    if openmdao is not None:
        obj, design, om_seconds = openmdao
        print(f"OpenMDAO:        obj {obj:.6f} at z = ({design[0]:.5f}, "
              f"{design[1]:.5f}), x = {design[2]:.5f}; {om_seconds:.3f} s")
        print(f"   daskdag / OpenMDAO: {seconds_again / om_seconds:.2f} compiled, "
              f"{seconds / om_seconds:.1f} with the first call's compiling")
    checks = {"SLSQP converged": bool(out.success),
              "the published optimum": abs(out.fun - PUBLISHED["obj"]) < 1e-5
              and np.allclose(out.x, PUBLISHED["design"], atol=1e-4)
              and abs(y1 - PUBLISHED["y1"]) < 1e-6 and abs(y2 - PUBLISHED["y2"]) < 1e-5,
              "Jacobians as plain JAX's": worst < 1e-8,
              "the same optimum again": abs(again.fun - out.fun) < 1e-12,
              "OpenMDAO's optimum too": openmdao is None
              or abs(openmdao[0] - out.fun) < 1e-5}
    failed = [name for name, ok in checks.items() if not ok]
    print("FAILED: " + ", ".join(failed) if failed else "all checks passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
