"""For every test of the repository, the fences of README.md and docs/ included: JAX with four
CPU devices, and a fence that needs a program this machine lacks is skipped, saying which, as
the tests that need it are."""

import os
import shutil

import pytest

# Four CPU devices for JAX, here and in the cluster workers the tests start (they inherit the
# environment), so that placement on devices is tested on any machine; set before JAX starts.
_DEVICES = "--xla_force_host_platform_device_count=4"
if _DEVICES not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_DEVICES}".strip()

# program -> what a fence that needs it calls
NEEDS = {"dot": ".visualize("}
INSTALL = {"dot": "graphviz's `dot` program is not installed (apt-get install graphviz)"}


def pytest_collection_modifyitems(config, items):
    missing = {program: INSTALL[program] for program in NEEDS if shutil.which(program) is None}
    for item in items:
        code = getattr(item, "code", None)  # (pytest-markdown-docs' fences carry their source)
        for program, reason in missing.items():
            if isinstance(code, str) and NEEDS[program] in code:
                item.add_marker(pytest.mark.skip(reason=reason))


def pytest_markdown_docs_globals():
    """A fence runs as a saved script does: ``__name__`` is ``"__main__"``, so the code under
    ``if __name__ == "__main__":`` (a cluster's creation) runs too."""
    return {"__name__": "__main__"}
