"""daskdag.sweeps."""
