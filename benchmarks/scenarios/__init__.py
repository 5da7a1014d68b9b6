"""The benchmark scenarios, one module each."""
