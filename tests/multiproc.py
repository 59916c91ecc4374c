"""The test suite's name for :mod:`cpmeta.testing` (the one multi-rank helper; its docstring says
what a run does). Test modules import it by name (``tests/`` is on ``sys.path`` under pytest)::

    from multiproc import run_ranks
"""

from __future__ import annotations

from cpmeta.testing import FAIL_GRACE_S, RankFailure, RankGroup, free_port, run_ranks, spawn_ranks

__all__ = ["run_ranks", "spawn_ranks", "RankGroup", "RankFailure", "free_port", "FAIL_GRACE_S"]
