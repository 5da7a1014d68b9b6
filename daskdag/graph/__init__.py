"""daskdag.graph."""
