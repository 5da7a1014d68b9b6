"""What crosses a process boundary, and how.

- :mod:`~daskdag.transport.transports`: the three ways a call's graph takes in its values
  (in-process, lazy, cluster), one chosen per call;
- :mod:`~daskdag.transport.packing`: the user's functions and values, pickled by value under
  content tokens (so a cluster need not import the user's code, and an in-place change is seen);
- :mod:`~daskdag.transport.pickler`: how they are pickled (cloudpickle, arrays out of band, the
  user's classes imported or rebuilt where they arrive), and the one place that reaches into
  cloudpickle's internals;
- :mod:`~daskdag.transport.fingerprints`: whose code travels by value, and a function's
  fingerprint: what packing would see of it, compared without pickling it again;
- :mod:`~daskdag.transport.content`: a function's content as tokens by part (code, globals,
  closure, defaults) that do not depend on where its source is written, for durable records;
- :mod:`~daskdag.transport.weak`: how what is kept between calls holds the user's functions
  (weakly);
- :mod:`~daskdag.transport.programs`: a pullback's backward pass as an exported XLA program;
- :mod:`~daskdag.transport.protocol`: Dask's tables (tokens, sizes, serializers), registered in
  one place, each family of daskdag's objects once (:func:`~daskdag.transport.protocol.travels`).

May import: :mod:`daskdag.errors`, :mod:`daskdag.config`, :mod:`daskdag.cancel`,
:mod:`daskdag.caches`. In: Python
objects. Out: bytes and frames, tokens, sizes.
"""
