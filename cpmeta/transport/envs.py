"""Environment variables of the transport package (the ONLY module here that reads ``os.environ``).

Every variable is read at call time (not import time), so tests can set it per process; unset
or empty (after stripping blanks) means the default.

The typed parsers :func:`env_str`, :func:`env_bool`, :func:`env_int`, :func:`env_float` and
:func:`env_choice` are the one place the project parses environment variables: ``cpmeta.envs``
and ``launch.envs`` use them too. Bad values raise ``ValueError("NAME: expected ..., got ...")``.
Beside them, the constructors' shared argument checks, whose defaults come from here or from the
process group: :func:`resolve_timeout`, :func:`resolve_group`, :func:`resolve_device`,
:func:`is_int`, :func:`check_flags`, :func:`agree_settings`.

| variable | meaning | default |
|---|---|---|
| ``CPMETA_FORCE_REMOTE`` | ``1``: ObjectChannel sends every follower's bytes over the gloo group (no shared memory) | ``0`` |
| ``CPMETA_TRANSPORT_TIMEOUT`` | seconds setup, or a message in flight, may take before ``TimeoutError`` (a follower waits for the NEXT message as long as the driver lives); default of every ``timeout=`` (``timeout=None``: no bound) | ``300`` |
| ``CPMETA_SHM_SLOT_SIZE`` | bytes per shared-memory ring slot | ``65536`` |
| ``CPMETA_SHM_NUM_SLOTS`` | slots per ring | ``64`` |
| ``CPMETA_SHM_SPIN_US`` | microseconds a reader spins before blocking in ``FUTEX_WAIT``; unset = automatic (spin only when every ring process can have its own core) | auto |
| ``CPMETA_MAX_MESSAGE_BYTES`` | largest message the codec decodes / a ring reader accepts | ``1073741824`` |
| ``CPMETA_HOST_ID`` | this process's host identity (ranks with the same id try the shared-memory ring, the others use the process group); unset = hostname + kernel boot id | unset |
"""

from __future__ import annotations

import math
import numbers
import os
from typing import TYPE_CHECKING, Any, Mapping, Optional, Sequence, Union

if TYPE_CHECKING:
    import torch

__all__ = [
    "FORCE_REMOTE",
    "TRANSPORT_TIMEOUT",
    "SHM_SLOT_SIZE",
    "SHM_NUM_SLOTS",
    "SHM_SPIN_US",
    "MAX_MESSAGE_BYTES",
    "HOST_ID",
    "force_remote",
    "transport_timeout",
    "shm_slot_size",
    "shm_num_slots",
    "shm_spin_us",
    "max_message_bytes",
    "host_id",
    "ENV_TIMEOUT",
    "Timeout",
    "resolve_timeout",
    "resolve_group",
    "is_int",
    "agree_settings",
    "check_flags",
    "resolve_device",
    "wait_seconds",
    "env_str",
    "env_bool",
    "env_int",
    "env_float",
    "env_choice",
]

FORCE_REMOTE = "CPMETA_FORCE_REMOTE"
TRANSPORT_TIMEOUT = "CPMETA_TRANSPORT_TIMEOUT"
SHM_SLOT_SIZE = "CPMETA_SHM_SLOT_SIZE"
SHM_NUM_SLOTS = "CPMETA_SHM_NUM_SLOTS"
SHM_SPIN_US = "CPMETA_SHM_SPIN_US"
MAX_MESSAGE_BYTES = "CPMETA_MAX_MESSAGE_BYTES"
HOST_ID = "CPMETA_HOST_ID"

DEFAULT_TIMEOUT_S = 300.0
DEFAULT_SLOT_SIZE = 64 * 1024
DEFAULT_NUM_SLOTS = 64
DEFAULT_MAX_MESSAGE_BYTES = 1 << 30
FOREVER_S = 10 * 365 * 86400.0  # what "no timeout" becomes where an API needs a number (10 years)
MAX_HOST_ID_BYTES = 200  # a host id travels in a fixed 256-byte field (transport._dist)
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


# ---------------------------------------------------------------------- parsers


def _raw(name: str) -> Optional[str]:
    """The stripped value of ``name``, or None when it is unset or blank."""
    value = os.environ.get(name, "").strip()
    return value or None


def _bad(name: str, expected: str, raw: str) -> ValueError:
    return ValueError(f"{name}: expected {expected}, got {raw!r}")


def env_str(name: str, default: str) -> str:
    """``name`` exactly as set (not stripped), or ``default`` when unset."""
    return os.environ.get(name, default)


def env_bool(name: str, default: bool) -> bool:
    """``name`` as a flag: 1/true/yes/on or 0/false/no/off (any case); unset or blank = default.

    Example: ``CPMETA_CHECKSUM=Yes`` -> True; ``CPMETA_CHECKSUM=maybe`` -> ``ValueError(
    "CPMETA_CHECKSUM: expected 0/1/true/false, got 'maybe'")``.
    """
    raw = _raw(name)
    if raw is None:
        return default
    if raw.lower() in _TRUE:
        return True
    if raw.lower() in _FALSE:
        return False
    raise _bad(name, "0/1/true/false", raw)


def env_int(name: str, default: int, *, minimum: Optional[int] = None) -> int:
    """``name`` as an int (>= ``minimum`` when given); unset or blank = default.

    Example: ``env_int("CPMETA_SHM_NUM_SLOTS", 64, minimum=1)`` with the variable set to ``-3``
    -> ``ValueError("CPMETA_SHM_NUM_SLOTS: expected an int >= 1, got '-3'")``.
    """
    raw = _raw(name)
    if raw is None:
        return default
    expected = "an int" if minimum is None else f"an int >= {minimum}"
    try:
        value = int(raw)
    except ValueError:
        raise _bad(name, expected, raw) from None
    if minimum is not None and value < minimum:
        raise _bad(name, expected, raw)
    return value


def env_float(name: str, default: float, *, minimum: Optional[float] = None,
              positive: bool = False) -> float:
    """``name`` as a float, >= ``minimum`` when given, > 0 when ``positive``; unset or blank =
    default. Example: ``env_float("CPMETA_TRANSPORT_TIMEOUT", 300.0, positive=True)`` with the
    variable set to ``soon`` -> ``ValueError("CPMETA_TRANSPORT_TIMEOUT: expected a float > 0,
    got 'soon'")``.
    """
    raw = _raw(name)
    if raw is None:
        return default
    expected = "a float" + (" > 0" if positive else "" if minimum is None else f" >= {minimum:g}")
    try:
        value = float(raw)
    except ValueError:
        raise _bad(name, expected, raw) from None
    if (minimum is not None and value < minimum) or (positive and value <= 0):
        raise _bad(name, expected, raw)
    return value


def env_choice(name: str, default: str, choices: Sequence[str]) -> str:
    """``name`` lower-cased, one of ``choices``; unset or blank = default.

    Example: ``env_choice("CPMETA_TENSOR_PATH", "auto", ("auto", "packed", "collective"))`` with
    the variable set to ``Packed`` -> ``"packed"``; set to ``nccl`` -> ``ValueError(
    "CPMETA_TENSOR_PATH: expected one of ('auto', 'packed', 'collective'), got 'nccl'")``.
    """
    raw = _raw(name)
    if raw is None:
        return default
    if raw.lower() not in choices:
        raise _bad(name, f"one of {tuple(choices)}", raw)
    return raw.lower()


# ---------------------------------------------------------------------- the variables


def force_remote() -> bool:
    """``CPMETA_FORCE_REMOTE``: force the process-group path for every follower."""
    return env_bool(FORCE_REMOTE, False)


def transport_timeout() -> float:
    """``CPMETA_TRANSPORT_TIMEOUT`` in seconds (a finite float > 0: ``inf`` / ``nan`` are refused;
    ``timeout=None`` on a constructor is how a caller asks for no bound)."""
    value = env_float(TRANSPORT_TIMEOUT, DEFAULT_TIMEOUT_S, positive=True)
    if not math.isfinite(value) or value > FOREVER_S:
        raise _bad(TRANSPORT_TIMEOUT, "a finite float > 0 (at most ten years)", str(_raw(TRANSPORT_TIMEOUT)))
    return value


class _EnvTimeout:
    """Type of :data:`ENV_TIMEOUT` (one instance)."""

    def __repr__(self) -> str:
        return "ENV_TIMEOUT"


#: Default of every transport ``timeout=`` argument: ``CPMETA_TRANSPORT_TIMEOUT``, read when the
#: object is built. ``None`` means no bound at all; a number is that many seconds.
ENV_TIMEOUT = _EnvTimeout()
Timeout = Union[float, None, _EnvTimeout]


def resolve_timeout(value: Timeout, name: str = "timeout") -> Optional[float]:
    """A constructor's ``timeout=`` as seconds, or None (wait forever), checked at once.

    ``ENV_TIMEOUT`` -> ``CPMETA_TRANSPORT_TIMEOUT`` (300.0 unset); ``None`` -> None; ``2`` ->
    2.0; ``0``, ``-1``, ``float('inf')``, ``float('nan')``, ``True``, ``"5"`` or more than ten years
    (``FOREVER_S``; ``2**63`` overflowed the platform's ``time_t``) -> ``ValueError("timeout:
    expected a finite number of seconds > 0 (at most 315360000: ten years), or None to wait
    forever, got inf")``.
    """
    if value is ENV_TIMEOUT:
        return transport_timeout()
    if value is None:
        return None
    if (isinstance(value, bool) or not isinstance(value, numbers.Real)
            or not math.isfinite(float(value)) or not 0 < float(value) <= FOREVER_S):
        raise ValueError(f"{name}: expected a finite number of seconds > 0 (at most {FOREVER_S:.0f}: ten "
                         f"years), or None to wait forever, got {value!r}")
    return float(value)


def check_flags(**flags: object) -> None:
    """Each flag is a bool or None (a constructor's switches: ``checksum="no"`` would be on), else
    ``TypeError`` naming it; checked before the constructor's first collective."""
    for name, v in flags.items():
        if v is not None and type(v) is not bool:
            raise TypeError(f"{name}: expected a bool (or None for the default), got {v!r}")


def is_int(v: object) -> bool:
    """``v`` is an int -- a rank, a count, a byte limit (a numpy integer counts; a bool or a tensor
    does not: a tensor's ``in`` test over the ranks was an ambiguous-truth error)."""
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def agree_settings(agree: object) -> dict[str, Any]:
    """A channel's ``agree=`` as a dict: ``None`` (none) or a mapping of str setting names to
    scalars (None, bool, int, float, str: what every member's setup record carries and compares),
    else ``TypeError`` naming it (a tensor was torch's ambiguous truth, a numpy value the codec's
    refusal at the setup)."""
    if agree is None:
        return {}
    if not isinstance(agree, Mapping):
        raise TypeError(f"agree: expected a mapping of setting names to scalars, got {type(agree).__name__}")
    for k, v in agree.items():
        if type(k) is not str or not (v is None or type(v) in (bool, int, float, str)):
            raise TypeError(f"agree[{k!r}]: expected a str setting name and a scalar (None, bool, int, "
                            f"float or str), got {type(v).__name__}")
    return dict(agree)


def resolve_group(group: object) -> Any:
    """A constructor's ``group=``: a ``torch.distributed`` process group, ``None`` for the
    default (WORLD) group, else ``TypeError`` naming it (a wrong object failed later in torch's
    own lookups, with a ``KeyError`` of that object)."""
    import torch.distributed as dist  # (this module is torch-free otherwise)

    if group is None:
        return dist.group.WORLD
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group: expected a torch.distributed ProcessGroup or None, got {type(group).__name__}")
    return group


def resolve_device(device: object, group: object) -> "torch.device":
    """A constructor's ``device=`` as a ``torch.device``: None -> the current CUDA device for an
    NCCL ``group``, else the CPU; a CPU or CUDA device this process has, else ``ValueError``
    naming it (torch's own errors came later, from a pinned buffer or a device query)."""
    import torch
    import torch.distributed as dist

    if device is None:
        nccl = "nccl" in str(dist.get_backend(group)).lower()  # type: ignore[arg-type]
        return torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    try:
        d = torch.device(device)  # type: ignore[call-overload]
    except (RuntimeError, TypeError):
        d = None
    if d is None or d.type not in ("cpu", "cuda"):
        raise ValueError(f"device: expected a CPU or CUDA device ('cpu', 'cuda:0', a torch.device), got {device!r}")
    n = torch.cuda.device_count() if d.type == "cuda" else 0
    if d.type == "cuda" and (n == 0 or (d.index or 0) >= n):
        raise ValueError(f"device: {d}, but this process sees {n} CUDA device(s)")
    return d


def wait_seconds(timeout: Optional[float]) -> float:
    """``timeout`` for an API that needs a number of seconds (a ``timedelta``, a thread join, a
    deadline): itself, or ``FOREVER_S`` (ten years) for None. ``wait_seconds(None) == 315360000.0``."""
    return FOREVER_S if timeout is None else timeout


def shm_slot_size() -> int:
    """``CPMETA_SHM_SLOT_SIZE`` in bytes."""
    return env_int(SHM_SLOT_SIZE, DEFAULT_SLOT_SIZE, minimum=1)


def shm_num_slots() -> int:
    """``CPMETA_SHM_NUM_SLOTS``."""
    return env_int(SHM_NUM_SLOTS, DEFAULT_NUM_SLOTS, minimum=1)


def shm_spin_us() -> Optional[float]:
    """``CPMETA_SHM_SPIN_US`` in microseconds (float >= 0): None = automatic; 0 disables spinning."""
    if _raw(SHM_SPIN_US) is None:
        return None
    return env_float(SHM_SPIN_US, 0.0, minimum=0.0)


def max_message_bytes() -> int:
    """``CPMETA_MAX_MESSAGE_BYTES``: decode / ring-read size limit."""
    return env_int(MAX_MESSAGE_BYTES, DEFAULT_MAX_MESSAGE_BYTES, minimum=1)


def host_id() -> Optional[str]:
    """``CPMETA_HOST_ID`` (stripped), or None when unset: the name of the host this process runs
    on, for the same-host test (docs/transport.md, "Host identity"). Ranks with equal ids try
    the shared-memory ring (and fall back to the process group if they cannot attach); ranks
    with different ids always use the process group. At most 200 bytes (UTF-8).

    Example: ``CPMETA_HOST_ID=node-3`` -> ``"node-3"``; 300 characters -> ``ValueError(
    "CPMETA_HOST_ID: expected at most 200 bytes (UTF-8), got '...'")``.
    """
    raw = _raw(HOST_ID)
    if raw is not None and len(raw.encode("utf-8", "surrogateescape")) > MAX_HOST_ID_BYTES:
        raise _bad(HOST_ID, f"at most {MAX_HOST_ID_BYTES} bytes (UTF-8)", raw)
    return raw
