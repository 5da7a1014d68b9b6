"""Clusters for daskdag started from Python, on the schedulers of the systems users already run:
Slurm through dask-jobqueue (:mod:`daskdag.deploy.slurm`) and Kubernetes through the
dask-kubernetes operator (:mod:`daskdag.deploy.kubernetes`), secured with the certificates of
``daskdag certs``. The recipes they follow are described in docs/guides/deployment.md.

May import: every layer, and :mod:`daskdag.cli` (its TLS helpers); nothing in daskdag imports
it. Each module imports its cluster library (the ``deploy`` extra) at its top, so only a user
who asks for that module needs it.
"""
