"""Durable stores: one format and one set of rules for the results that outlive a process,
a sweep's (:mod:`daskdag.sweeps.store`) and a call's (:mod:`~daskdag.durable.calls`).

- :mod:`~daskdag.durable.keys`: a store's keys read, written, synced, and held by one sweep or
  call at a time;
- :mod:`~daskdag.durable.identity`: what a store records of what it holds (each node's content,
  settings, versions), how a stored record differs from a call's, and the hashes checked;
- :mod:`~daskdag.durable.rules`: the rules every store keeps: a location holding something else
  refused, a record that must be the call's (else :class:`~daskdag.StoreError` saying what
  changed), a full disk as a :class:`~daskdag.StoreError`;
- :mod:`~daskdag.durable.calls`: ``compute_grads``, ``jacobian``, ``compute_jvps`` and
  ``compute_hvps`` with ``store=``: each stage's forward result kept as it finishes, by the
  task that computed it, and read back by the same call.

May import: every layer below it (:mod:`daskdag.running` and under). In: what a call or sweep
is, and a location. Out: its store, held while it runs.
"""
