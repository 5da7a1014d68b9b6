"""Sweeps: one DAG over many inputs, in chunks, on threads, devices or a cluster; a layer above
the core, which knows nothing of it. Its modules are listed in docs/design.md.

May import: every layer below it (:mod:`daskdag.durable` and under). In: a spec, input values
with a leading item axis. Out: ``{output: (value, {input: grad})}`` stacked over the items.
"""
