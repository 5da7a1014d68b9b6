r"""A DAG for the command line (``daskdag run`` / ``daskdag sweep``): the seed
question's DAG.

    x -> A -> B -> C -> D
              B -> E

    python -c "import numpy as np; \
        np.savez('in.npz', x=np.arange(1, 6, dtype='float32'))"
    daskdag run examples/cli_dag.py:dag --inputs in.npz --outputs D,E --out res.npz
    python -c "import numpy as np; \
        np.savez('items.npz', x=np.random.rand(100, 5).astype('float32') + 1)"
    daskdag sweep examples/cli_dag.py:dag --inputs items.npz --outputs D,E \
        --out sweep.npz

Run as a script, it does the first two commands in a temporary directory, with
``python -m daskdag.cli``, and compares RESULT.npz with plain JAX
(``jax.value_and_grad``); exits 1 if they disagree.
"""

import jax.numpy as jnp


def x_to_A(x):
    return jnp.sin(x) * 2.0


def A_to_B(A):
    return A ** 2 + 1.0


def B_to_C(B):
    return jnp.cumsum(B) / 3.0


def C_to_D(C):
    return jnp.sum(jnp.log(C))


def B_to_E(B):
    return jnp.sum(jnp.sqrt(B) * jnp.arange(B.shape[0]))


dag = {"A": (x_to_A, ["x"]), "B": (A_to_B, ["A"]), "C": (B_to_C, ["B"]),
       "D": (C_to_D, ["C"]), "E": (B_to_E, ["B"])}

composed = {"D": lambda x: C_to_D(B_to_C(A_to_B(x_to_A(x)))),
            "E": lambda x: B_to_E(A_to_B(x_to_A(x)))}


if __name__ == "__main__":
    import os
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    import jax
    import numpy as np

    # this checkout's daskdag, not another one
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    with tempfile.TemporaryDirectory() as d:
        x = np.arange(1, 6, dtype=np.float32)
        np.savez(Path(d) / "in.npz", x=x)
        cmd = [sys.executable, "-m", "daskdag.cli", "run", f"{__file__}:dag",
               "--inputs", str(Path(d) / "in.npz"), "--outputs", "D,E",
               "--out", str(Path(d) / "res.npz")]
        print("$ daskdag", " ".join(cmd[3:]), flush=True)
        code = subprocess.run(cmd, env=env).returncode
        if code:
            sys.exit(code)
        res = dict(np.load(Path(d) / "res.npz"))
    worst = 0.0
    for o in ("D", "E"):
        value, grad = jax.value_and_grad(composed[o])(jnp.asarray(x))
        worst = max(worst, float(np.max(np.abs(res[f"{o}.value"] - value))),
                    float(np.max(np.abs(res[f"{o}.grad.x"] - grad))))
    ok = worst <= 1e-5
    print(f"RESULT.npz {'agrees' if ok else 'DISAGREES'} with plain JAX "
          f"(max |diff| {worst:.2e})")
    sys.exit(0 if ok else 1)
