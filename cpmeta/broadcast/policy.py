"""``PersistentPolicy``: what ``persistent_outputs`` keeps, for how long, and within what budget.

``MetadataBroadcaster(..., persistent_outputs=True)`` keeps an arena for every layout it sees (up
to ``MAX_LAYOUTS`` and ``MAX_ARENA_BYTES``): right for an engine that pads its batches to a few
captured sizes, wrong for chunked prefill, whose layout changes almost every step (each new layout
costs an arena that is never used again). A policy says instead::

    MetadataBroadcaster(..., persistent_outputs=PersistentPolicy(
        max_bytes=64 << 20,     # arena bytes held (host; on CUDA the same again on the device)
        max_layouts=32,         # layouts held; past either bound the least recently used go
        min_repeats=2,          # a layout is persisted from its 2nd step on (1st: fresh tensors)
        kinds=("decode",),      # only decode steps (InputMetadata's is_prompt False) persist
        depth=2))               # two arenas per layout, in turn: overlap with the previous step

A step the policy does not persist gets fresh tensors, exactly as with ``persistent_outputs=False``.
Lifetime of a persisted result: until ``depth`` more broadcasts of the same layout have run; so at
least until the ``depth``-th next ``broadcast`` of any layout (depth 1: "until the next broadcast";
depth 2: "until the broadcast after next"). An evicted arena is dropped, never rewritten: results
already handed out from it stay valid as long as the caller holds them.

Every rank applies its own policy (the driver and the followers may differ; a follower persisting
nothing gets fresh tensors from the same frames).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from .wire import MAX_LAYOUTS

__all__ = ["PersistentPolicy", "MAX_ARENA_BYTES", "STEP_KINDS", "MAX_DEPTH"]

#: Host bytes the persistent arenas of one broadcaster may hold by default; past it the least
#: recently used layouts are dropped (prompt-32k is ~2.4 MB an arena, decode-256 ~180 KB).
MAX_ARENA_BYTES = 1 << 30
#: Step kinds a policy may name (``InputMetadata.is_prompt``: True -> "prompt", False -> "decode").
STEP_KINDS = ("prompt", "decode")
#: Most arenas per layout (deeper pipelines than this keep their own copies).
MAX_DEPTH = 8


@dataclass(frozen=True, slots=True)
class PersistentPolicy:
    """Budget and admission of persistent arenas (module docstring). The defaults are
    ``persistent_outputs=True``: every layout, up to ``MAX_LAYOUTS`` layouts and
    ``MAX_ARENA_BYTES`` bytes, one arena each.

    Args:
        max_bytes: arena bytes held by this broadcaster (each arena counts its tensor region once:
            host bytes; with CUDA the device holds as many again). A layout whose ``depth``
            arenas alone would exceed it is never persisted.
        max_layouts: layouts held (each with up to ``depth`` arenas).
        min_repeats: steps of a layout before it is persisted (1: from its first step).
        kinds: step kinds persisted (a subset of ``STEP_KINDS``), read from the schema's
            ``is_prompt`` field; ``None``: every step. A schema without a bool ``is_prompt``
            field refuses ``kinds``.
        depth: arenas per layout, used in turn; a result stays valid until ``depth`` more
            broadcasts of its layout have run (2: "valid until the broadcast after next").
    """

    max_bytes: int = MAX_ARENA_BYTES
    max_layouts: int = MAX_LAYOUTS
    min_repeats: int = 1
    kinds: Optional[tuple[str, ...]] = None
    depth: int = 1

    def __post_init__(self) -> None:
        for name, low, high in (("max_bytes", 0, None), ("max_layouts", 0, MAX_LAYOUTS),
                                ("min_repeats", 1, None), ("depth", 1, MAX_DEPTH)):
            v = getattr(self, name)
            if type(v) is not int or v < low or (high is not None and v > high):
                bound = f"an int in [{low}, {high}]" if high is not None else f"an int >= {low}"
                raise ValueError(f"PersistentPolicy.{name}: expected {bound}, got {v!r}")
        if self.kinds is not None:
            if isinstance(self.kinds, str) or not isinstance(self.kinds, (tuple, list)) or \
                    not set(self.kinds) <= set(STEP_KINDS):
                raise ValueError(f"PersistentPolicy.kinds: expected a tuple of {STEP_KINDS} or None, "
                                 f"got {self.kinds!r}")
            object.__setattr__(self, "kinds", tuple(self.kinds))

    @classmethod
    def of(cls, value: Any) -> Optional["PersistentPolicy"]:
        """The policy of a ``persistent_outputs=`` argument: ``False``/``None`` -> ``None`` (fresh
        tensors), ``True`` -> the defaults, a policy -> itself."""
        if value is None or value is False:
            return None
        if value is True:
            return cls()
        if isinstance(value, cls):
            return value
        raise TypeError(f"persistent_outputs: expected a bool or a PersistentPolicy, got "
                        f"{type(value).__name__}")
