"""``--verify`` without followers touching the scheduler: per-field digests, all-gathered.

Only the driver (rank 0) owns the scheduler and its sequences. Each step under ``--verify``:

1. the driver rebuilds the batch independently (a second ``prepare_prompt``/``prepare_decode``
   call on the same sequences) and, for every rank ``r``, the mirror that rank should hold
   (``prepare_for_mirror_cp(rebuild, r, W)``); it digests every field of each and broadcasts
   the table ``expected[W, CHECKS, F]`` (int64);
2. every rank digests what it actually holds (the received metadata, its YoCo consumer view,
   its own mirror and that mirror's consumer view) -> ``actual[CHECKS, F]``, all-gathered;
3. every rank compares all of ``actual`` with ``expected`` and raises the SAME
   :class:`VerifyError` (naming rank, check and fields), so all ranks stop together.

A field digest is 64 bits of BLAKE2b over the field's name, and for each tensor its dtype,
shape and raw bytes (dict fields: every key in order; scalars: their ``repr``); the last column
digests the aliasing (which paths share one tensor). Equal digests = bit-identical fields up to
a 2**-64 collision chance per field; the followers' own work (receive, mirror) is independent of
the driver's reference computation.
"""

from __future__ import annotations

import hashlib
from typing import Any, Optional

import torch

from cpmeta.metadata import InputMetadata

from . import comm

__all__ = ["VerifyError", "CHECKS", "metadata_digest", "verify_step"]

#: What each rank is checked on, in table order.
CHECKS: tuple[str, ...] = ("broadcast metadata", "YoCo consumer view", "mirrored metadata",
                           "mirrored YoCo consumer view")
_FIELDS = InputMetadata.field_names()
_WIDTH = len(_FIELDS) + 1  # + aliasing


class VerifyError(RuntimeError):
    """A received or mirrored field differs from the driver's reference."""


def _feed(h: Any, v: Any) -> None:
    if isinstance(v, torch.Tensor):
        t = v.detach().cpu().contiguous()
        h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    elif isinstance(v, dict):
        h.update(f"D{len(v)}".encode())
        for k, x in v.items():
            h.update(f"K{k}".encode())
            _feed(h, x)
    else:
        h.update(f"S{v!r}".encode())


def _as_int64(h: Any) -> int:
    return int.from_bytes(h.digest(), "little", signed=True)


def metadata_digest(md: Optional[InputMetadata]) -> torch.Tensor:
    """[F + 1] int64: one digest per ``InputMetadata`` field, then one of the aliasing (0s for None)."""
    out = torch.zeros(_WIDTH, dtype=torch.int64)
    if md is None:
        return out
    for i, name in enumerate(_FIELDS):
        h = hashlib.blake2b(name.encode(), digest_size=8)
        _feed(h, getattr(md, name))
        out[i] = _as_int64(h)
    groups: dict[int, list[str]] = {}
    for path, v in md.to_flatten_dict().items():
        if isinstance(v, torch.Tensor):
            groups.setdefault(id(v), []).append(path)
    h = hashlib.blake2b(b"aliasing", digest_size=8)
    h.update(repr(sorted(g for g in groups.values() if len(g) > 1)).encode())
    out[-1] = _as_int64(h)
    return out


def _views(md: Optional[InputMetadata], mine: Optional[InputMetadata]) -> torch.Tensor:
    """[CHECKS, F + 1]: digests of md, its consumer view, mine, its consumer view."""
    def consumer(x: Optional[InputMetadata]) -> Optional[InputMetadata]:
        return x.get_consumer_view() if x is not None and x.yoco_consumer_positions is not None else None

    return torch.stack([metadata_digest(x) for x in (md, consumer(md), mine, consumer(mine))])


def expected_table(local: InputMetadata, world: int, mirror: bool, attn_info_cfg: Any) -> torch.Tensor:
    """Driver only: [W, CHECKS, F + 1] from its independent rebuild ``local``."""
    import cpmeta

    rows = []
    for r in range(world):
        ref = None
        if mirror and local.is_prompt:
            ref = cpmeta.prepare_for_mirror_cp(local, r, world)
            if attn_info_cfg is not None:
                ref.compute_attn_info(attn_info_cfg)
        rows.append(_views(local, ref))
    return torch.stack(rows)


def verify_step(
    step: int, rank: int, world: int, device: torch.device, got: InputMetadata,
    mine: Optional[InputMetadata], expected: Optional[torch.Tensor],
) -> None:
    """Collective (every rank calls it every verified step; ``expected`` given on rank 0 only).

    Example, W=2: rank 0 passes ``expected_table(rebuild, 2, ...)``, rank 1 passes ``None``;
    both end with the same verdict (return, or the same ``VerifyError``).
    """
    shape = (world, len(CHECKS), _WIDTH)
    if rank != 0:
        expected = torch.empty(shape, dtype=torch.int64)
    elif expected is None:
        raise ValueError("expected: rank 0 passes the driver's expected_table, got None")
    table = comm.broadcast(expected.to(device))
    actual = _views(got, mine).to(device)
    gathered = comm.all_gather(actual)
    bad = []
    for r, act in enumerate(gathered):
        diff = (act != table[r]).nonzero().cpu().tolist()
        for c in sorted({c for c, _ in diff}):
            names = [(_FIELDS + ("<aliasing>",))[f] for cc, f in diff if cc == c]
            bad.append(f"rank {r}: {CHECKS[c]} differs from the driver's rebuild in {names[:8]}")
    if bad:
        raise VerifyError(f"step {step}: " + "; ".join(bad))
