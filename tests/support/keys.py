"""daskdag's task keys read apart, as the tests look at them."""


def key_kind(key) -> str:
    """The kind of a daskdag task key, ``fwd:B+C-<token>`` -> ``fwd`` (``bwd``, ``val``,
    ``grad``, ``jvp``, ``tan``, ``input``, ``node``, ...); ``""`` for another key."""
    head = str(key).partition("-")[0]
    return head.partition(":")[0] if ":" in head else ""


def key_label(key) -> str:
    """What a daskdag task key names: ``fwd:B+C-<token>`` -> ``B+C`` (a stage's nodes);
    ``bwd:B+C[D+E]-<token>`` -> ``B+C`` (and :func:`key_outputs` -> ``D+E``)."""
    return str(key).rpartition("-")[0].partition(":")[2].partition("[")[0]


def key_outputs(key) -> str:
    """The bracketed part of a daskdag key's label: a backward task's outputs, a gradient's
    input (``grad:D[x]-<token>`` -> ``x``)."""
    return str(key).rpartition("-")[0].partition("[")[2].rstrip("]")
