"""daskdag.running."""
