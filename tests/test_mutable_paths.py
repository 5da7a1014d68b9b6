"""A node function reaches a mutable value by some path (a closure cell, a default, a global, an
object's attribute, a dict's or list's item, a module of the user's attribute, a function that
returns what it holds), the value changes between two calls, and the second call must see it:
values and gradients against plain JAX, on threads and on a cluster whose workers cannot import
the user's modules. Property-based (hypothesis, derandomized): the paths are drawn at random.

The user's code lives in modules made here, each with a file of its own outside installed
packages (as a module beside the user's script is), never importable by the cluster's workers.
"""

import itertools
import sys
import threading
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import daskdag

X = jnp.array([0.1, 0.5, -0.3])
BEFORE, AFTER = 1.5, -2.0

# How each hop holds what is inside it, as code reads it (``holder`` + suffix), and how the value
# in it is replaced when it is the innermost.
HOPS = ("module", "object", "dict", "list", "tuple", "closure", "default", "method")
MUTABLE = ("module", "object", "dict", "list", "closure", "default")
REACH = ("closure", "global", "default")
SUFFIX = {"module": ".a", "object": ".a", "dict": '["k"]', "list": "[0]", "tuple": "[0]",
          "closure": "()", "default": "()", "method": ".get()"}

USER_CODE = '''
import jax.numpy as jnp


class Box:
    pass


class Getter:
    def __init__(self, inner):
        self.inner = inner

    def get(self):
        return self.inner


def closure_of(inner):
    def get():
        return inner
    return get


def default_of(inner):
    return lambda held=inner: held
'''

_count = itertools.count()


class UserModules:
    """Modules of the user's, made from source in files under ``folder``, dropped at the end."""

    def __init__(self, folder):
        self.folder, self.names = folder, []

    def make(self, source: str = ""):
        name = f"user_paths_{next(_count)}"
        path = self.folder / f"{name}.py"
        path.write_text(source)
        module = types.ModuleType(name)
        module.__file__ = str(path)
        sys.modules[name] = module
        self.names.append(name)
        exec(compile(source, str(path), "exec"), module.__dict__)
        return module

    def drop(self):
        for name in self.names:
            sys.modules.pop(name, None)


@pytest.fixture
def user_modules(tmp_path):
    made = UserModules(tmp_path)
    try:
        yield made
    finally:
        made.drop()


def reach_by(modules, hops, reach, in_place):
    """A node function that reads the value through ``hops`` (outermost first), reached by
    ``reach``, and ``change()``, which changes the value where the innermost hop holds it."""
    code = modules.make(USER_CODE)
    value = np.array(BEFORE, np.float32) if in_place else BEFORE
    inner = value
    holders = []
    for kind in reversed(hops):
        if kind == "module":
            holder = modules.make()
            holder.a = inner
        elif kind == "object":
            holder = code.Box()
            holder.a = inner
        elif kind == "dict":
            holder = {"k": inner}
        elif kind == "list":
            holder = [inner]
        elif kind == "tuple":
            holder = (inner,)
        elif kind == "closure":
            holder = code.closure_of(inner)
        elif kind == "default":
            holder = code.default_of(inner)
        else:
            holder = code.Getter(inner)
        holders.append(holder)
        inner = holder
    innermost = holders[0]
    read = "held" + "".join(SUFFIX[k] for k in hops)
    body = f"jnp.tanh(x * {read})"
    if reach == "closure":
        source = f"def make(held):\n    return lambda x: {body}\n"
    elif reach == "global":
        source = f"def make(value):\n    global held\n    held = value\n    return node\n\n\n" \
                 f"def node(x):\n    return {body}\n"
    else:
        source = f"def make(value):\n    def node(x, held=value):\n        return {body}\n" \
                 f"    return node\n"
    node = modules.make("import jax.numpy as jnp\n\n\n" + source).make(inner)

    def change():
        if in_place:
            value[...] = AFTER
        elif hops[-1] in ("module", "object"):
            innermost.a = AFTER
        elif hops[-1] == "dict":
            innermost["k"] = AFTER
        elif hops[-1] == "list":
            innermost[0] = AFTER
        elif hops[-1] == "closure":
            innermost.__closure__[0].cell_contents = AFTER
        else:
            innermost.__defaults__ = (AFTER,)
    return node, change


@st.composite
def paths(draw):
    in_place = draw(st.booleans())
    last = st.sampled_from(HOPS if in_place else MUTABLE)  # (an array changes in any holder)
    hops = [*draw(st.lists(st.sampled_from(HOPS), min_size=0, max_size=3)), draw(last)]
    return hops, draw(st.sampled_from(REACH)), in_place, draw(st.booleans())


def expected(scale):
    return jax.value_and_grad(lambda x: jnp.sum(jnp.tanh(x * scale)))(X)


def check_two_calls(node, change, jit, client):
    dag = {"A": daskdag.Node(node, ["x"], jit=jit), "L": (jnp.sum, ["A"])}
    first = daskdag.compute_grads(dag, X, "L", client=client)
    change()
    second = daskdag.compute_grads(dag, X, "L", client=client)
    for res, scale in ((first, BEFORE), (second, AFTER)):
        value, grad = expected(scale)
        np.testing.assert_allclose(res.value, value, rtol=1e-6)
        np.testing.assert_allclose(res.grad, grad, rtol=1e-6)
    if jit or client is not None:  # (a preparation relies on what the function holds)
        assert not second.info.prepared
    third = daskdag.compute_grads(dag, X, "L", client=client)  # nothing changed since
    assert third.info.prepared or "cannot read" in (third.info.why or "")
    np.testing.assert_allclose(third.value, second.value, rtol=1e-6)


@settings(max_examples=60, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(paths())
def test_a_change_by_any_path_is_seen_on_threads(user_modules, path):
    hops, reach, in_place, jit = path
    node, change = reach_by(user_modules, hops, reach, in_place)
    check_two_calls(node, change, jit, None)


@pytest.mark.timeout(600)
@settings(max_examples=12, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(paths())
def test_a_change_by_any_path_is_seen_on_a_cluster(user_modules, cli_client, path):
    hops, reach, in_place, jit = path
    node, change = reach_by(user_modules, hops, reach, in_place)
    check_two_calls(node, change, jit, cli_client)


# -- the cases, by name ------------------------------------------------------------------

@pytest.mark.parametrize("jit", [True, False])
@pytest.mark.parametrize("reach", ["closure", "object"])
def test_a_module_of_the_users_held_by_a_closure_or_an_object(user_modules, reach, jit):
    params = user_modules.make("SCALE = 1.5\n")
    code = user_modules.make(
        "import jax.numpy as jnp\n\n"
        "make = lambda mod: (lambda x: jnp.tanh(x * mod.SCALE))\n\n\n"
        "class Holder:\n"
        "    def __init__(self, mod):\n"
        "        self.mod = mod\n\n"
        "    def __call__(self, x):\n"
        "        return jnp.tanh(x * self.mod.SCALE)\n")
    node = code.make(params) if reach == "closure" else code.Holder(params)

    def change():
        params.SCALE = AFTER
    check_two_calls(node, change, jit, None)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("jit", [True, False])
def test_a_module_held_by_an_object_on_a_cluster(user_modules, cli_client, jit):
    params = user_modules.make("SCALE = 1.5\n")
    code = user_modules.make(
        "import jax.numpy as jnp\n\n\n"
        "class Holder:\n"
        "    def __init__(self, mod):\n"
        "        self.mod = mod\n\n"
        "    def __call__(self, x):\n"
        "        return jnp.tanh(x * getattr(self.mod, 'SCALE'))\n")

    def change():
        params.SCALE = AFTER
    check_two_calls(code.Holder(params), change, jit, cli_client)


def test_a_path_that_cannot_be_read_is_prepared_at_every_call(user_modules):
    """A lock on the way: the fingerprint cannot be taken, so nothing prepared is reused."""
    params = user_modules.make("SCALE = 1.5\n")
    code = user_modules.make(USER_CODE)
    box = code.Box()
    box.a, box.lock = params, threading.Lock()
    node = user_modules.make(
        "import jax.numpy as jnp\n\n"
        "make = lambda box: (lambda x: jnp.tanh(x * box.a.SCALE))\n").make(box)
    dag = {"A": daskdag.Node(node, ["x"], jit=True), "L": (jnp.sum, ["A"])}
    daskdag.compute_grads(dag, X, "L")
    params.SCALE = AFTER
    res = daskdag.compute_grads(dag, X, "L")
    np.testing.assert_allclose(res.value, expected(AFTER)[0], rtol=1e-6)
    assert not res.info.prepared and "cannot read" in res.info.why


def test_an_attribute_read_by_a_name_computed_as_it_runs(user_modules):
    """``getattr(module, name)`` with ``name`` computed: every attribute of the module is watched."""
    params = user_modules.make("SCALE = 1.5\n")
    node = user_modules.make(
        "import jax.numpy as jnp\n\n"
        "def make(mod, first, rest):\n"
        "    return lambda x: jnp.tanh(x * getattr(mod, first + rest))\n").make(params, "SC", "ALE")

    def change():
        params.SCALE = AFTER
    check_two_calls(node, change, True, None)
