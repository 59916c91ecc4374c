"""The environment variables ``launch`` reads or sets (STYLE: one registry per package; parsed
by ``transport.envs``'s helpers).

torchrun sets ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE`` and ``TORCHELASTIC_ERROR_FILE`` for every rank;
``python -m cpmeta.launch`` sets :data:`MULTICAST_OFF` and ``OMP_NUM_THREADS`` (unless already set)
before it starts them.
"""

from __future__ import annotations

import os

from cpmeta.transport.envs import env_int, env_str

__all__ = ["local_rank", "local_world_size", "error_file", "set_default", "MULTICAST_OFF"]

#: NVLink multicast stays off on shared multi-GPU hosts (NCCL, PyTorch symmetric memory, NVSHMEM).
MULTICAST_OFF: dict[str, str] = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}


def local_rank() -> int:
    """This rank's index on its host (torchrun's ``LOCAL_RANK``; 0 outside torchrun)."""
    return env_int("LOCAL_RANK", 0, minimum=0)


def local_world_size() -> int:
    """Ranks on this host (torchrun's ``LOCAL_WORLD_SIZE``; 1 outside torchrun)."""
    return env_int("LOCAL_WORLD_SIZE", 1, minimum=1)


def error_file() -> str:
    """Where torchrun wants this rank's exception recorded (``TORCHELASTIC_ERROR_FILE``), or ''."""
    return env_str("TORCHELASTIC_ERROR_FILE", "")


def set_default(name: str, value: str) -> None:
    """Set ``name`` for the ranks about to be started unless the user set it."""
    os.environ.setdefault(name, value)
