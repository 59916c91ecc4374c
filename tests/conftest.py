"""Reproducible randomness for the whole suite.

Hypothesis profiles (``CPMETA_HYPOTHESIS_PROFILE``, default ``default``):

- ``default``: ``derandomize=True`` -- every run draws the same examples (a failure in CI fails
  the same way on a laptop), ``deadline=None`` (shared 2-core machines), ``print_blob=True``
  (a failure prints the ``@reproduce_failure`` line).
- ``explore``: fresh random examples each run (same deadline and blob); for hunting new bugs,
  e.g. ``CPMETA_HYPOTHESIS_PROFILE=explore pytest tests/test_builders.py``.

Plain ``random`` and torch's global generator are seeded before every test from the test's id
and a base seed (``CPMETA_TEST_SEED``, default :data:`DEFAULT_SEED`; under ``explore`` a fresh
one), so ``random.randrange`` in a test -- and the per-run seed ``multiproc`` draws from it --
repeat from run to run. The seed is printed (pytest shows it for a failed test): re-run with
``CPMETA_TEST_SEED=<base>``.
"""

from __future__ import annotations

import os
import random
import secrets
import sys
import zlib

import pytest
import torch
from hypothesis import settings

PROFILE_ENV = "CPMETA_HYPOTHESIS_PROFILE"
SEED_ENV = "CPMETA_TEST_SEED"  # the same variable multiproc passes to its ranks
DEFAULT_SEED = 20260101
EXPLORE = "explore"

settings.register_profile("default", derandomize=True, deadline=None, print_blob=True)
settings.register_profile(EXPLORE, derandomize=False, deadline=None, print_blob=True)
PROFILE = os.environ.get(PROFILE_ENV, "default") or "default"
settings.load_profile(PROFILE)  # before the test modules build their settings() objects
BASE_SEED = int(os.environ.get(SEED_ENV, "0")) or (
    secrets.randbelow(2**31 - 1) + 1 if PROFILE == EXPLORE else DEFAULT_SEED)


def seed_for(nodeid: str) -> int:
    """Seed of one test: ``BASE_SEED`` mixed with a crc32 of its id (order independent).

    Example: the same id and ``BASE_SEED`` always give the same seed.
    """
    return (BASE_SEED ^ zlib.crc32(nodeid.encode())) % (2**31 - 1) + 1



@pytest.fixture(autouse=True)
def _seed_global_rngs(request: pytest.FixtureRequest) -> None:
    seed = seed_for(request.node.nodeid)
    random.seed(seed)
    torch.manual_seed(seed)
    print(f"[seed] {request.node.nodeid}: {seed} (base {SEED_ENV}={BASE_SEED}, "
          f"hypothesis profile {PROFILE})", file=sys.stderr)


def pytest_report_header(config: pytest.Config) -> str:
    return f"cpmeta: hypothesis profile {PROFILE!r}, base seed {SEED_ENV}={BASE_SEED}"


def pytest_configure(config: pytest.Config) -> None:
    """Compile (or load from the on-disk cache) every compiled kernel once, in the pytest process,
    before any test spawns ranks: spawned processes then load the cache instead of compiling."""
    import cpmeta.jit

    cpmeta.jit.warm_all()

