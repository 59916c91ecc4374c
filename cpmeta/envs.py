"""The one place where cpmeta reads environment variables (transport has its own envs.py, whose
parsers this module uses; unset or blank means the default).

| variable | meaning | default |
|---|---|---|
| ``CPMETA_TENSOR_PATH`` | how ``MetadataBroadcaster`` moves tensors: ``auto``, ``packed`` (the tensor region inside the frame) or ``collective`` (the frame, then its tensor region as one NCCL/gloo broadcast) | ``auto`` |
| ``CPMETA_CHECKSUM`` | ``1``: the driver stamps a crc32 of every broadcast frame; followers verify it and refuse a frame without one (a mismatch is a ``RuntimeError`` naming the rank). Every rank must set it alike (compared at construction). Costs a few us per step (docs/transport.md) | ``0`` |
| ``CPMETA_PACKED_MAX_BYTES`` | with ``auto`` and a CUDA device, CPU-built payloads up to this many bytes ride inside the object message and each rank copies them to its GPU with one H2D copy (larger ones: one NCCL broadcast) | ``1048576`` |
| ``CPMETA_WARM`` | ``1``: a same-host follower spinning for its next step (after a message, or an announced one: ``begin_step``) replays the last step's frame checks and reads its arena (``cpmeta.broadcast.follower``) or reads the last step frame again with its compiled read (``ReplicatedBatchState.warm``; after a frame over 64 KiB, a prompt step's, only the replay's entry) every ~100 us, read-only, so the step lands on warm caches; ``0``: it only spins | ``1`` |
| ``CPMETA_WARM_JOBS`` | processes ``cpmeta.jit.warm_all()`` compiles the kernels with when numba's cache is cold (``1``: the calling process alone) | this process's CPUs divided by torchrun's ``LOCAL_WORLD_SIZE`` (the ranks of this host, each warming), at most 8 |
| ``CPMETA_TEST_SEED`` | ``cpmeta.testing``: the seed every spawned rank seeds ``random`` and torch with (printed by each run; set it to reproduce one); 0 or unset = a fresh one per run | ``0`` |
| ``CPMETA_TEST_START`` | ``cpmeta.testing``: how rank processes start: ``forkserver`` (forked from one server process that imported torch and cpmeta once: ~0.2 s a rank instead of ~1.5) or ``spawn`` (a fresh interpreter each, always used with ``child_setup``) | ``forkserver`` |

The 1 MiB default comes from ``scripts/bench_broadcast.py --backend nccl --worlds 1`` on an H200
(2026-11-29): packed 331 us vs collective 634 us for decode-64, 512 vs 1002 us for prompt-8k
(593 KB). Multi-GPU runs were not measured; tune it there.
"""

from __future__ import annotations

import os

from cpmeta.transport.envs import env_bool, env_choice, env_int

__all__ = ["tensor_path", "packed_max_bytes", "checksum", "TENSOR_PATHS", "CHECKSUM",
           "testing_seed", "TEST_SEED", "testing_start", "TEST_START", "START_METHODS", "warm",
           "WARM", "warm_jobs", "WARM_JOBS"]

TENSOR_PATHS = ("auto", "packed", "collective")
DEFAULT_PACKED_MAX_BYTES = 1 << 20
TENSOR_PATH = "CPMETA_TENSOR_PATH"
PACKED_MAX_BYTES = "CPMETA_PACKED_MAX_BYTES"
CHECKSUM = "CPMETA_CHECKSUM"
TEST_SEED = "CPMETA_TEST_SEED"
TEST_START = "CPMETA_TEST_START"
START_METHODS = ("forkserver", "spawn")
WARM = "CPMETA_WARM"
WARM_JOBS = "CPMETA_WARM_JOBS"


def tensor_path() -> str:
    """``CPMETA_TENSOR_PATH``: one of :data:`TENSOR_PATHS` (any case; default ``auto``)."""
    return env_choice(TENSOR_PATH, "auto", TENSOR_PATHS)


def packed_max_bytes() -> int:
    """``CPMETA_PACKED_MAX_BYTES``: largest payload ``auto`` packs into the object message (int >= 0)."""
    return env_int(PACKED_MAX_BYTES, DEFAULT_PACKED_MAX_BYTES, minimum=0)


def checksum() -> bool:
    """``CPMETA_CHECKSUM``: stamp (driver) / require (followers) a crc32 on every broadcast frame."""
    return env_bool(CHECKSUM, False)


def warm() -> bool:
    """``CPMETA_WARM``: same-host followers warm up while they spin for the next step (default on)."""
    return env_bool(WARM, True)


def warm_jobs() -> int:
    """``CPMETA_WARM_JOBS``: processes compiling the kernels on a cold cache (``cpmeta.jit.warm_all``).
    Example: 16 CPUs, ``LOCAL_WORLD_SIZE=8`` -> 2."""
    share = len(os.sched_getaffinity(0)) // env_int("LOCAL_WORLD_SIZE", 1, minimum=1)
    return env_int(WARM_JOBS, max(1, min(8, share)), minimum=1)


def testing_seed() -> int:
    """``CPMETA_TEST_SEED``: the seed ``cpmeta.testing`` gives every spawned rank (0 = draw one)."""
    return env_int(TEST_SEED, 0, minimum=0)


def testing_start() -> str:
    """``CPMETA_TEST_START``: how ``cpmeta.testing`` starts rank processes (:data:`START_METHODS`)."""
    return env_choice(TEST_START, "forkserver", START_METHODS)
