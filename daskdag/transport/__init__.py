"""daskdag.transport."""
