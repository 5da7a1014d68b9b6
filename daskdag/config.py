"""daskdag's settings: the defaults in ``daskdag.yaml``, loaded into ``dask.config`` once, as
distributed loads its own. Read them with :func:`get`; set them as any Dask setting
(``dask.config.set({"daskdag.worker-wait": "120s"})``, a YAML file, ``DASK_DASKDAG__...``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import dask.config
import yaml

DEFAULTS = yaml.safe_load((Path(__file__).parent / "daskdag.yaml").read_text())
dask.config.update_defaults(DEFAULTS)


def get(name: str) -> Any:
    """The setting ``daskdag.<name>`` in effect now (its default from ``daskdag.yaml``)."""
    return dask.config.get(f"daskdag.{name}")
