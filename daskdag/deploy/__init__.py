"""Clusters for daskdag started from Python, secured with ``daskdag certs``: Slurm through
dask-jobqueue (:mod:`daskdag.deploy.slurm`), Kubernetes through the dask-kubernetes operator
(:mod:`daskdag.deploy.kubernetes`); see docs/guides/deployment.md.

May import: every layer, and :mod:`daskdag.cli` (its TLS helpers); nothing in daskdag imports
it. Each module imports its cluster library (the ``deploy`` extra) at its top.
"""
