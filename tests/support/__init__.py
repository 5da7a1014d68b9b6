"""The tests' harnesses, one module per concern (``tests/conftest.py`` holds only fixtures)."""
