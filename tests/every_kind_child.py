"""A stored call of tests/test_every_kind.py, in a process of its own, to be SIGKILLed while its
head waits for the flag file: ``python every_kind_child.py KIND FORM RUNS FLAG STORE
[SCHEDULER]`` (no scheduler: threads)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1]))

from tests.test_every_kind import P, call, make_dag  # noqa: E402

if __name__ == "__main__":
    kind, form, runs, flag, store, *address = sys.argv[1:]
    client = None
    if address and address[0]:
        import distributed

        client = distributed.Client(address[0])
    call(kind, form, make_dag(runs, flag), P, client, store=store)
    sys.exit("the call finished: it was to wait for the flag")
