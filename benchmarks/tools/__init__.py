"""Standalone scripts beside the benchmarks, not scenarios of ``python -m benchmarks``: each says in
its docstring how it is run (``accelerator_check.py``: ``python benchmarks/tools/accelerator_check.py``
on a host with a GPU or TPU; ``worker_malloc.py``: ``python -m benchmarks.tools.worker_malloc``)."""
