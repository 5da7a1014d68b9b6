"""Parameter sensitivities of several outputs of an ODE model (diffrax), in one call.

A Lotka-Volterra predator-prey model with four parameters
theta = (alpha, beta, delta, gamma):

    prey'     = alpha * prey - beta * prey * predator
    predator' = delta * prey * predator - gamma * predator

One node solves the ODE with ``diffrax.diffeqsolve`` (saving the trajectory on a grid);
four nodes read what a modeller asks of it:

    theta -> traj -> final      (the state at t = 15: 2 numbers)
                  -> mean_prey  (the time-average of the prey population)
                  -> peak       (the predators' peak)
                  -> loss       (mean squared misfit to observed data)

One ``daskdag.jacobian`` call gives the sensitivities of all of them to the four
parameters, solving the ODE once and pulling the five output rows back through its
adjoint together (one vmapped backward pass), and, with ``wrt=["theta", "traj"]``, each
output's sensitivity to the trajectory itself: where in time the misfit comes from.
Prints them and the largest difference to ``jax.jacrev`` of the composed function; exits
non-zero if they disagree.
"""

import sys
import time

import diffrax
import jax
import jax.numpy as jnp
import numpy as np

import daskdag

TS = jnp.linspace(0.0, 15.0, 151)  # the save grid, and where the data were observed
Y0 = jnp.array([10.0, 5.0])  # initial prey and predators


def vector_field(t, y, theta):
    alpha, beta, delta, gamma = theta
    prey, predator = y
    return jnp.stack([alpha * prey - beta * prey * predator,
                      delta * prey * predator - gamma * predator])


def solve(theta):  # the ODE node: theta -> trajectory, shape (151, 2)
    sol = diffrax.diffeqsolve(
        diffrax.ODETerm(vector_field), diffrax.Tsit5(), t0=TS[0], t1=TS[-1], dt0=0.01,
        y0=Y0, args=theta, saveat=diffrax.SaveAt(ts=TS),
        stepsize_controller=diffrax.PIDController(rtol=1e-6, atol=1e-6),
        max_steps=4096)
    return sol.ys


def final(traj):
    return traj[-1]


def mean_prey(traj):  # trapezoidal time-average over [0, 15]
    prey = traj[:, 0]
    return jnp.trapezoid(prey, TS) / (TS[-1] - TS[0])


def peak(traj):
    return jnp.max(traj[:, 1])


# "Observed" data: the model at other parameters, with 5 % multiplicative noise.
THETA_TRUE = jnp.array([1.1, 0.4, 0.1, 0.4])
DATA = solve(THETA_TRUE) * (
    1.0 + 0.05 * jax.random.normal(jax.random.key(0), (TS.size, 2)))


def loss(traj):
    return jnp.mean((jnp.log(traj) - jnp.log(DATA)) ** 2)


dag = {
    "traj": daskdag.Node(solve, ["theta"], jit=True),
    "final": (final, ["traj"]),
    "mean_prey": (mean_prey, ["traj"]),
    "peak": (peak, ["traj"]),
    "loss": (loss, ["traj"]),
}
OUTPUTS = ["final", "mean_prey", "peak", "loss"]
NAMES = ["alpha", "beta", "delta", "gamma"]


def composed(theta):  # the same model as one JAX function
    traj = solve(theta)
    return {"final": final(traj), "mean_prey": mean_prey(traj), "peak": peak(traj),
            "loss": loss(traj)}


def main() -> int:
    theta = jnp.array([1.0, 0.5, 0.12, 0.5])

    t = time.perf_counter()
    # Reverse mode (diffrax's default adjoint, checkpointed, is reverse-mode only);
    # "traj" in wrt adds each output's sensitivity to the trajectory itself, from the
    # same backward pass.
    jac = daskdag.jacobian(dag, theta, OUTPUTS, wrt=["theta", "traj"], mode="rev")
    took = time.perf_counter() - t

    print(f"{'d output / d':>22}" + "".join(f"{n:>11}" for n in NAMES))
    for o in OUTPUTS:
        rows = np.atleast_2d(np.asarray(jac[o].grad["theta"]))
        for i, row in enumerate(rows):
            label = f"{o}[{'prey predator'.split()[i]}]" if o == "final" else o
            value = np.atleast_1d(np.asarray(jac[o].value))[i]
            print(f"{label:>16} {value:7.3f}" + "".join(f"{g:11.4f}" for g in row))
    # d loss / d trajectory: where the misfit comes from
    ct = np.asarray(jac["loss"].grad["traj"])
    worst_t = int(np.argmax(np.abs(ct).sum(axis=1)))
    print(f"d loss / d traj, shape {ct.shape}, "
          f"is largest at t = {float(TS[worst_t]):.1f}")
    print(f"daskdag.jacobian: {took:.1f} s, the ODE solved once (compilation included)")

    t = time.perf_counter()
    want = composed(theta)
    want_jac = jax.jacrev(composed)(theta)
    print(f"jax.jacrev of the composed function: {time.perf_counter() - t:.1f} s")
    worst = 0.0
    for o in OUTPUTS:
        scale = float(jnp.max(jnp.abs(want_jac[o])))
        worst = max(worst,
                    float(jnp.max(jnp.abs(jac[o].grad["theta"] - want_jac[o]))) / scale,
                    float(jnp.max(jnp.abs(jac[o].value - want[o]))))
    print(f"largest relative difference to jax.jacrev of the composed function (JAX): "
          f"{worst:.2e}")
    return 0 if worst < 1e-4 else 1


if __name__ == "__main__":
    sys.exit(main())
