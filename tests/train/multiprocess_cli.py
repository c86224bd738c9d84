"""``python -m tests.train.multiprocess_cli ARGS``: ``jaxrl-llm ARGS`` for the multi-process
tests, with ``jax.experimental.multihost_utils.process_allgather`` made an error.

That all-gather (which ``multihost_utils.assert_equal`` runs, and ``jax.device_put`` runs for a
host value onto a sharding over every process) returns once the first local device has its
rows, while it may still run on the process's other devices. On CPU the next program's gloo
collectives on those devices can then meet it in another order on each process, and gloo aborts
the run ("op.preamble.length <= op.nbytes ... distributed collective mismatch"): rarely, when a
thread is descheduled at the wrong moment, which is how the two-process async test failed in
the suite now and then. The trainer reads and places global values with
``jaxrl_llm.distributed.gather`` / ``to_host`` / ``put`` instead; running its multi-process
tests through this entry point keeps it so.
"""

from __future__ import annotations

import sys
import traceback


def _refuse(*args, **kwargs):
    where = "".join(traceback.format_stack(limit=8)[:-1])
    raise AssertionError(
        "multihost_utils.process_allgather ran in a multi-process run (directly, through "
        "multihost_utils.assert_equal, or through jax.device_put of a host value onto a "
        "sharding over every process); use jaxrl_llm.distributed.gather / to_host / put, which "
        f"wait for the all-gather on every local device. Called from:\n{where}"
    )


def refuse_process_allgather() -> None:
    """Makes ``multihost_utils.process_allgather`` (and so ``assert_equal``, which looks it up
    in its module) raise, naming the caller."""
    from jax.experimental import multihost_utils

    multihost_utils.process_allgather = _refuse


if __name__ == "__main__":
    refuse_process_allgather()
    from jaxrl_llm.cli import main

    sys.exit(main())
