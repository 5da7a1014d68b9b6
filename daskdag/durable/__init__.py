"""Durable stores: one format and one set of rules for the results that outlive a process, a
sweep's (:mod:`daskdag.sweeps.store`) and a call's (:mod:`~daskdag.durable.calls`): a store's
keys and its holder (:mod:`~daskdag.durable.keys`), what it records and the rules every store
keeps (:mod:`~daskdag.durable.identity`).

May import: every layer below it (:mod:`daskdag.running` and under).
"""
