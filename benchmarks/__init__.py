"""daskdag's benchmarks: ``python -m benchmarks [--quick]`` runs every scenario (``__main__.py``)."""
