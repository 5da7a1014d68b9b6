"""A small disk for tests of what a full one does: a size-limited tmpfs, where the machine lets
a test mount one (else the test is skipped, saying why)."""

import contextlib
import subprocess

import pytest


@contextlib.contextmanager
def small_tmpfs(directory, size: str):
    """``directory`` (made) as a tmpfs of ``size`` (``"64k"``) while the context lasts."""
    directory.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs",
                           str(directory)], capture_output=True, text=True)
    if made.returncode:
        pytest.skip(f"cannot mount a size-limited tmpfs here: {made.stderr.strip()}")
    try:
        yield directory
    finally:
        subprocess.run(["umount", "-l", str(directory)], capture_output=True)
