"""Standalone scripts beside the benchmarks, not scenarios of ``python -m benchmarks``: each says in
its docstring how it is run (``gpu_check.py``: ``python benchmarks/tools/gpu_check.py`` on a
machine with a GPU; ``worker_malloc.py``: ``python -m benchmarks.tools.worker_malloc``)."""
