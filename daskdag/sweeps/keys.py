"""A durable sweep's store as keys: :mod:`daskdag.durable.keys`, which sweeps and calls share."""

from daskdag.durable.keys import Keys, group, is_zarr, keys_of

__all__ = ["Keys", "group", "is_zarr", "keys_of"]
