"""daskdag.rules."""
