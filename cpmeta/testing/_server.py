"""Imported once by the fork server of :mod:`cpmeta.testing.ranks` (its preload list), never by a
rank: every cpmeta kernel compiled or loaded from numba's cache (:func:`cpmeta.jit.warm_all`), so
each rank forked from the server starts with them in memory and neither loads nor compiles one.
Example: ``tests/test_replicate.py`` and ``tests/test_broadcast_multirank.py`` (48 tests, 2-core
VM, 2026-12-06): 100-115 s with ranks loading their kernels, 66-70 s forked from a warm server.

The warm-up runs as if no GPU existed: a host arena pins its memory when one does, which starts
CUDA, and a process forked from one that started CUDA cannot use it. The ranks ask again."""

import torch

import cpmeta.buffers
import cpmeta.jit

is_available, torch.cuda.is_available = torch.cuda.is_available, lambda: False
try:
    cpmeta.jit.warm_all()
finally:
    torch.cuda.is_available = is_available
    cpmeta.buffers.pin_host_memory.cache_clear()
