"""What crosses a process boundary, and how.

- :mod:`~daskdag.transport.packing`: the user's functions and values, pickled by value under
  content tokens (so a cluster need not import the user's code, and an in-place change is seen);
- :mod:`~daskdag.transport.programs`: a pullback's backward pass as an exported XLA program;
- :mod:`~daskdag.transport.protocol`: Dask's tables (tokens, sizes, serializers), registered in
  one place, each family of daskdag's objects once (:func:`~daskdag.transport.protocol.travels`).

May import: :mod:`daskdag.errors`, :mod:`daskdag.config`, :mod:`daskdag.cancel`. In: Python
objects. Out: bytes and frames, tokens, sizes.
"""
