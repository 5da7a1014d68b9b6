"""daskdag.model."""
