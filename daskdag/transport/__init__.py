"""What crosses a process boundary, and how.

Its modules are listed in docs/design.md ("How it works"); each one's docstring says what it
holds.

May import: :mod:`daskdag.errors`, :mod:`daskdag.config`, :mod:`daskdag.cancel`,
:mod:`daskdag.caches`. In: Python objects. Out: bytes and frames, tokens, sizes.
"""
