"""Sweeps: one DAG over many inputs, in chunks, on threads or a cluster; a layer above the
core, which knows nothing of it.

- :mod:`~daskdag.sweeps.planning`: the plan every chunk shares, and the chunk sizes;
- :mod:`~daskdag.sweeps.sweep`: the loop over chunks, in flight, failed items rerun;
- :mod:`~daskdag.sweeps.shared`: the work every item shares (nodes of shared inputs alone),
  run once per sweep;
- :mod:`~daskdag.sweeps.chunked`: a node over a chunk of items (``Chunked``, ``Items``), and its
  rules, registered with :mod:`daskdag.rules.registry`; an item that fails goes on failed
  (``SKIPPED``), the chunk's other items go on;
- :mod:`~daskdag.sweeps.failures`: failed items' errors as a sweep keeps them;
- :mod:`~daskdag.sweeps.engines`: where chunks run (threads, a cluster);
- :mod:`~daskdag.sweeps.results`: the values and gradients stacked over the items;
- :mod:`~daskdag.sweeps.store`: durable sweeps, each chunk's results in a Zarr store as it finishes;
- :mod:`~daskdag.sweeps.identity`: what a durable sweep is, as its store records it, and the
  hash of its items (the format, rules and keys every store shares: :mod:`daskdag.durable`);
- :mod:`~daskdag.sweeps.keys`: :mod:`daskdag.durable.keys` under the sweeps' name;
- :mod:`~daskdag.sweeps.arrays`: sweeps over dask arrays, lazily;
- :mod:`~daskdag.sweeps.progress`: the progress bar over items.

May import: every layer below it (:mod:`daskdag.durable` and under). In: a spec, input values
with a leading item axis. Out: ``{output: (value, {input: grad})}`` stacked over the items.
"""
