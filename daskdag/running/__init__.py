"""Running a call's graph: here, on Dask's local schedulers, or on a ``distributed`` cluster.

- :mod:`~daskdag.running.programs`: a call compiled once (a
  :class:`~daskdag.running.programs.Program`), kept for the next calls while nothing it relies
  on changes, and the programs a prepared function holds;
- :mod:`~daskdag.running.jobs`: the kinds of call, a call of a program ready to run, now or as
  a Dask collection, :class:`~daskdag.CallInfo`, how it was computed, and how a program's
  calls on a cluster spread or run in one task (:class:`~daskdag.running.jobs.Spreading`);
- :mod:`~daskdag.running.compute`: where a call runs, computing its graph there, what tasks on
  workers tell their client while they run, and what is logged of each call;
- :mod:`~daskdag.running.reuse`: the nodes whose values a program keeps from one call to the
  next, reused while their inputs are the same;
- :mod:`~daskdag.running.local`: the threaded scheduler of a local call (and what it reads of
  it that Dask does not document), a prepared call's graph built once
  (:class:`~daskdag.running.local.Template`), and a cluster call's graph run whole in one task
  (:class:`~daskdag.running.local.GraphInOneTask`);
- :mod:`~daskdag.running.lazy`: a call as a Dask collection (:class:`~daskdag.Call`);
- :mod:`~daskdag.running.cluster`: what a cluster must offer (workers, resources, versions);
- :mod:`~daskdag.running.resident`: a call's inputs and nodes kept on the cluster for the next;
- :mod:`~daskdag.running.workers`: the worker plugin that tunes malloc.

May import: every layer below: :mod:`daskdag.errors`, :mod:`daskdag.config`,
:mod:`daskdag.cancel`, :mod:`daskdag.caches`, :mod:`daskdag.transport`, :mod:`daskdag.model`,
:mod:`daskdag.rules`, :mod:`daskdag.graph`. In: a graph and where to run it. Out: its computed
values, or the error that stopped it, with nothing left running.
"""
