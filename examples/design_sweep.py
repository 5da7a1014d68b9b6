"""A design sweep with several objectives and their gradients, plotted.

A steel cantilever 2 m long carries 10 kN at its tip. Its rectangular section, width b
and height h (in cm), is the design: a lighter beam costs less, a stiffer one bends
less, and the bending stress must stay under the allowable 160 MPa. For each of 400
designs on a grid, the DAG gives three objectives and the gradient of each with respect
to (b, h):

    design -> section (area, second moment I, section modulus Z) -> mass       (kg)
                                                                 -> deflection (tip, mm)
                                                                 -> stress     (MPa)

``daskdag.sweep_grads`` runs the 400 designs in chunks (every node ``vmap=True``: one
compiled program per chunk) and returns the values, shape (400,), and the gradients,
shape (400, 2). The figure shows the deflection landscape with arrows along
-grad log(deflection) (the direction that stiffens fastest per unit change of b and h),
the mass contours and the stress limit, and the mass-deflection trade-off with the
Pareto front of the designs that meet the stress limit. It is written to the path given
as the first argument (the docs' figure:
``python examples/design_sweep.py docs/gallery/design_sweep.png``), else to
design_sweep.png in the system's temporary folder.
Checks a few designs against ``jax.grad`` of the composed functions; exits non-zero if
they disagree.
"""

import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import matplotlib
import numpy as np

import daskdag

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)
import matplotlib.ticker  # noqa: E402

L, P, E, RHO, ALLOWED = 2.0, 10e3, 210e9, 7850.0, 160.0  # m, N, Pa, kg/m^3, MPa


def section(design):  # design = (b, h) in cm -> (area m^2, I m^4, Z m^3)
    b, h = design[0] / 100, design[1] / 100
    return b * h, b * h**3 / 12, b * h**2 / 6


def mass(sec):
    return RHO * L * sec[0]


def deflection(sec):
    return P * L**3 / (3 * E * sec[1]) * 1e3


def stress(sec):
    return P * L / sec[2] / 1e6


dag = {
    "section": daskdag.Node(section, ["design"], vmap=True),
    "mass": daskdag.Node(mass, ["section"], vmap=True),
    "deflection": daskdag.Node(deflection, ["section"], vmap=True),
    "stress": daskdag.Node(stress, ["section"], vmap=True),
}
OUTPUTS = ["mass", "deflection", "stress"]


# indices of the designs no other design beats on both (lower is better)
def pareto(cost, perf):
    order = np.lexsort((perf, cost))
    front, best = [], np.inf
    for i in order:
        if perf[i] < best:
            front.append(i)
            best = perf[i]
    return np.array(front)


def plot(bs, hs, res, path):
    shape = (hs.size, bs.size)
    d = np.asarray(res["deflection"].value).reshape(shape)
    m = np.asarray(res["mass"].value).reshape(shape)
    s = np.asarray(res["stress"].value).reshape(shape)
    g = (-np.asarray(res["deflection"].grad)
         / np.asarray(res["deflection"].value)[:, None])
    g = g / np.linalg.norm(g, axis=1, keepdims=True)  # unit arrows: direction only
    B, H = np.meshgrid(bs, hs)

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 5), constrained_layout=True)
    cf = ax.contourf(B, H, np.log10(d), levels=20, cmap="viridis")
    fig.colorbar(cf, ax=ax, label="log10 tip deflection (mm)")
    cs = ax.contour(B, H, m, levels=[50, 100, 200, 300, 400], colors="white",
                    linewidths=0.8)
    ax.clabel(cs, fmt="%d kg", fontsize=8)
    ax.contour(B, H, s, levels=[ALLOWED], colors="red", linewidths=2)
    ax.contourf(B, H, s, levels=[ALLOWED, s.max()], colors="none", hatches=["//"])
    step = 2  # every other design's arrow
    ax.quiver(B[::step, ::step], H[::step, ::step],
              g[:, 0].reshape(shape)[::step, ::step],
              g[:, 1].reshape(shape)[::step, ::step],
              color="white", scale=30, width=0.003)
    ax.set(xlabel="width b (cm)", ylabel="height h (cm)",
           title="tip deflection; arrows: -grad log(deflection);\n"
                 "white: mass; red: stress limit (hatched: over it)")

    flat_m, flat_d, flat_s = m.ravel(), d.ravel(), s.ravel()
    ok = flat_s <= ALLOWED
    bx.scatter(flat_m[~ok], flat_d[~ok], s=8, c="lightgrey",
               label=f"stress > {ALLOWED:.0f} MPa")
    bx.scatter(flat_m[ok], flat_d[ok], s=8, c="tab:blue",
               label="meets the stress limit")
    front = np.flatnonzero(ok)[pareto(flat_m[ok], flat_d[ok])]
    bx.plot(flat_m[front], flat_d[front], "o-", c="tab:orange", ms=4,
            label="Pareto front")
    bx.set(xscale="log", yscale="log", xlabel="mass (kg)",
           ylabel="tip deflection (mm)",
           title=f"{bs.size * hs.size} designs: cost against performance")
    bx.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    bx.legend()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return front


def main() -> int:
    path = (Path(sys.argv[1]) if len(sys.argv) > 1
            else Path(tempfile.gettempdir()) / "design_sweep.png")
    bs, hs = np.linspace(2.0, 12.0, 20), np.linspace(5.0, 40.0, 20)
    designs = (np.stack(np.meshgrid(bs, hs), axis=-1).reshape(-1, 2)
               .astype(np.float32))

    t = time.perf_counter()
    res = daskdag.sweep_grads(dag, designs, OUTPUTS)
    print(f"swept {len(designs)} designs, {len(OUTPUTS)} objectives with gradients, "
          f"in {time.perf_counter() - t:.2f} s; "
          f"gradients shaped {res['mass'].grad.shape}")

    path.parent.mkdir(parents=True, exist_ok=True)
    front = plot(bs, hs, res, path)
    shown = path
    print(f"figure written to {shown}; {len(front)} designs on the Pareto front, "
          "e.g.:")
    for i in front[:: max(1, len(front) // 4)]:
        print(f"  b = {designs[i, 0]:5.2f} cm, h = {designs[i, 1]:5.2f} cm: "
              f"mass {res['mass'].value[i]:6.1f} kg, "
              f"deflection {res['deflection'].value[i]:6.2f} mm, "
              f"stress {res['stress'].value[i]:6.1f} MPa")

    worst = 0.0
    for i in [0, 57, 211, len(designs) - 1]:
        for o, f in [("mass", mass), ("deflection", deflection), ("stress", stress)]:
            value, grad = jax.value_and_grad(lambda x: f(section(x)))(
                jnp.asarray(designs[i]))
            worst = max(worst, abs(float(res[o].value[i] - value)) / abs(float(value)),
                        float(jnp.max(jnp.abs(res[o].grad[i] - grad)
                                      / jnp.max(jnp.abs(grad)))))
    print("largest relative difference to jax.grad at 4 designs (JAX): "
          f"{worst:.2e}")
    return 0 if worst < 1e-4 else 1


if __name__ == "__main__":
    sys.exit(main())
