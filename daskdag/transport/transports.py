"""How one call's graph takes in what it does not compute (its inputs and its nodes' functions):
a named family of three, one chosen per call (:func:`for_call`), as ``distributed`` chooses a
serializer family per message.

- :data:`IN_PROCESS`: an eager call on this process's threads. Values and functions go into the
  graph as they are, and every key carries one token of the call (keys need only be unique
  within it): nothing is pickled or hashed, but ``jit=True`` nodes' functions (their compiled
  programs are cached by content).
- :data:`LAZY`: a call not computed yet (:func:`daskdag.grads`), which may run anywhere. Values
  and functions are packed and keys are content tokens, so that calls computed together share
  keys; what cannot be pickled goes as it is, for a local scheduler.
- :data:`CLUSTER`: a call sent to a ``distributed`` cluster. Packed under content tokens as for
  :data:`LAZY`, and everything must pickle: what cannot is a :class:`~daskdag.DAGError` naming it.
"""

from __future__ import annotations

from dataclasses import dataclass

from daskdag.transport.packing import pack_for, pack_function


@dataclass(frozen=True)
class Transport:
    """One way a call's graph takes in its inputs and functions (see the module's docstring).

    Attributes:
        name: ``"in-process"``, ``"lazy"`` or ``"cluster"``.
        packs: values and functions are packed, and keys are content tokens.
        remote: the graph leaves this process, so everything in it must pickle.
    """

    name: str
    packs: bool
    remote: bool

    def pack(self, what: str, obj, hashed: bool = True):
        """``obj`` packed for this transport (:func:`~daskdag.transport.packing.pack_for`);
        ``what`` names it in an error."""
        return pack_for(what, obj, self.remote, hashed=hashed)

    def packs_function(self, jit: bool) -> bool:
        """Whether a node's function is packed: always where the call packs, else for a
        ``jit=True`` node (its compiled programs are cached by content)."""
        return self.packs or jit

    def pack_function(self, what: str, fn, tokens: dict | None = None,
                      prints: dict | None = None):
        """``fn`` packed (:func:`~daskdag.transport.packing.pack_function`)."""
        return pack_function(what, fn, self.remote, tokens, prints)


IN_PROCESS = Transport("in-process", packs=False, remote=False)
LAZY = Transport("lazy", packs=True, remote=False)
CLUSTER = Transport("cluster", packs=True, remote=True)


def for_call(client, lazy: bool = False) -> Transport:
    """The transport of a call to ``client`` (a ``distributed.Client``, or None for this
    process); ``lazy``: the call is not computed yet."""
    if client is not None:
        return CLUSTER
    return LAZY if lazy else IN_PROCESS
