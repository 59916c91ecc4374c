"""``compute_attn_info``: expand offsets and pivots into dense attention indices (docs/design.md section 5).

Runs on whatever device the metadata tensors live on (pure torch ops, no host synchronisation),
fills only fields that are ``None`` (a second call does nothing and allocates nothing), and is
generic over "rows": it expands whatever ``kv_ca_index_offset_len`` / ``kv_swa_full_index_pivots``
/ ``kv_swa_index_offset_len`` hold (full layout, or a YoCo consumer layout). When the metadata is
CP-mirrored (``mirror_cp_index`` set), the per-row parameters are gathered by ``mirror_cp_index``
first and pad rows (index -1) get length 0, which is the same as expanding the full layout and
gathering the expanded rows (pad rows: all -1, ``kv_ca_index_len`` 0) -- the expansion is
row-wise -- but costs only ``cp_mirror_len`` rows of work.
"""

from __future__ import annotations

import logging
from typing import Optional, Protocol, TypeVar

import torch

from ..config import MetadataConfig, check_config
from ..constants import PAD_SLOT_ID

__all__ = ["compute_attn_info", "expand_offset_len", "expand_paged_offset_len", "expand_swa_pivots",
           "expand_swa_ring"]

logger = logging.getLogger(__name__)


class AttnInfoFields(Protocol):
    """The ``InputMetadata`` fields :func:`compute_attn_info` reads and (the last four) fills.

    Typed structurally so this module never imports the container that calls it (docs/design.md
    section 2); mypy checks ``InputMetadata`` against it where ``md.compute_attn_info`` passes ``self``.
    """

    is_prompt: Optional[bool]
    mirror_cp_index: Optional[torch.Tensor]
    block_tables: Optional[torch.Tensor]
    kv_ca_index_offset_len: Optional[dict[str, torch.Tensor]]
    kv_swa_full_index_pivots: Optional[torch.Tensor]
    kv_swa_index_offset_len: Optional[torch.Tensor]
    kv_ca_index: Optional[dict[str, torch.Tensor]]
    kv_ca_index_len: Optional[dict[str, torch.Tensor]]
    kv_swa_full_index: Optional[torch.Tensor]
    kv_swa_index: Optional[torch.Tensor]


_MD = TypeVar("_MD", bound=AttnInfoFields)


def _arange(width: int, like: torch.Tensor) -> torch.Tensor:
    return torch.arange(width, dtype=torch.int32, device=like.device)


def expand_offset_len(off: torch.Tensor, ln: torch.Tensor, width: int) -> torch.Tensor:
    """``[rows, width]`` int32: ``off + arange(width)``, -1 from column ``ln`` on.

    ``off``, ``ln``: [rows] int32. Example: off 5, len 3, width 6 -> ``[5, 6, 7, -1, -1, -1]``.
    """
    ar = _arange(width, off)
    res = torch.empty((off.shape[0], width), dtype=torch.int32, device=off.device)
    torch.add(ar, off[:, None], out=res)
    return res.masked_fill_(ar >= ln[:, None], PAD_SLOT_ID)


def expand_paged_offset_len(
    off: torch.Tensor, ln: torch.Tensor, width: int, block_tables: torch.Tensor, tpb: int
) -> torch.Tensor:
    """Decode ``kv_ca_index``: ``[rows, width]`` int32 slot of each visible compressed key.

    ``p = off + k`` (k < ln) indexes the flattened ``block_tables`` [T, width] in units of
    ``tpb = block_size // n`` compressed tokens: slot ``block_tables.flatten()[p // tpb] * tpb +
    p % tpb``; -1 from column ``ln`` on. Masked columns use ``k = min(k, ln - 1)`` (or 0) so they
    never read outside the row's defined blocks. Example: tpb 32, row 1 of a 4-column table
    ``[.., [9, 4, ..]]``: off = 1*4*32 = 128, ln 40 -> k 0..31 give 288..319, k 32..39 give
    128..135, then -1.
    """
    if block_tables.numel() == 0:  # max_model_len < min ratio: nothing is ever visible
        return torch.full((off.shape[0], width), PAD_SLOT_ID, dtype=torch.int32, device=off.device)
    if off.device.type == "cpu" and bool((off % tpb == 0).all()):  # a host check is free on CPU
        return _expand_paged_aligned(off, ln, width, block_tables, tpb)
    return _expand_paged_generic(off, ln, width, block_tables, tpb)


def _expand_paged_generic(
    off: torch.Tensor, ln: torch.Tensor, width: int, block_tables: torch.Tensor, tpb: int
) -> torch.Tensor:
    """Per-element form of ``expand_paged_offset_len`` (any offset, no host synchronisation)."""
    ar = _arange(width, off)
    last = (ln - 1).clamp_(min=0)
    p = torch.minimum(ar, last[:, None]).add_(off[:, None])  # int32: p < offset bound (checked)
    flat = block_tables.reshape(-1)
    res = flat[torch.div(p, tpb, rounding_mode="floor")].mul_(tpb).add_(p.remainder_(tpb))
    return res.masked_fill_(ar >= ln[:, None], PAD_SLOT_ID)


def _expand_paged_aligned(
    off: torch.Tensor, ln: torch.Tensor, width: int, block_tables: torch.Tensor, tpb: int
) -> torch.Tensor:
    """``expand_paged_offset_len`` when every offset is a multiple of ``tpb`` (always true for
    ``prepare_decode``'s ``i * width * tpb``): column k reads block ``off // tpb + k // tpb``
    at ``k % tpb``, so gather ``[rows, cdiv(width, tpb)]`` block ids and broadcast-add the
    in-block offsets -- one pass over the output instead of a per-element divide and gather.
    Example: tpb 4, off 8, ln 6, blocks ``flat[2:4] = [7, 5]`` -> ``[28, 29, 30, 31, 20, 21, -1, ..]``.
    """
    rows, nbw = off.shape[0], -(-width // tpb)
    flat = block_tables.reshape(-1)
    last_blk = torch.div((ln - 1).clamp_(min=0), tpb, rounding_mode="floor")
    j = torch.minimum(_arange(nbw, off)[None, :], last_blk[:, None])
    blocks = flat[j.add_(torch.div(off, tpb, rounding_mode="floor")[:, None])].mul_(tpb)
    res = (blocks[:, :, None] + _arange(tpb, off)).reshape(rows, nbw * tpb)
    if nbw * tpb != width:
        res = res[:, :width].contiguous()
    return res.masked_fill_(_arange(width, off) >= ln[:, None], PAD_SLOT_ID)


def expand_swa_pivots(piv: torch.Tensor, width: int) -> torch.Tensor:
    """Prompt ``kv_swa_full_index`` [rows, W] int32 from pivots ``(P0, P1, P2, P3)`` [rows, 4].

    ``X[0:P1] = P0 + arange(P1)``, ``X[P1:P1+P3] = P2 + arange(P3)``, ``X[P1+P3:W] = -1``.
    Example: W 6, pivots (10, 2, 40, 3) -> ``[10, 11, 40, 41, 42, -1]``.
    """
    ar = _arange(width, piv)[None, :]
    p0, p1, p2, p3 = (piv[:, i : i + 1] for i in range(4))
    res = torch.where(ar < p1, p0 + ar, p2 + (ar - p1))
    return res.masked_fill_(ar >= p1 + p3, PAD_SLOT_ID)


def expand_swa_ring(off_len: torch.Tensor, width: int, S: int) -> torch.Tensor:
    """Decode ``kv_swa_index`` [rows, W] int32 from ``kv_swa_index_offset_len`` [rows, 2].

    The offset is ``state*S + start``; entry k is ``state*S + (start + k) % S`` for ``k < w``,
    -1 after. Example: S 8, offset 2*8 + 6 = 22, w 4 -> ``[22, 23, 16, 17, -1, ...]``.
    """
    off, w = off_len[:, 0:1], off_len[:, 1:2]
    start = torch.remainder(off, S)
    ar = _arange(width, off_len)[None, :]
    res = torch.remainder(start + ar, S).add_(off - start)
    return res.masked_fill_(ar >= w, PAD_SLOT_ID)


def _gather_rows(x: torch.Tensor, mirror: Optional[torch.Tensor], zero_cols: slice) -> torch.Tensor:
    """Rows of ``x`` picked by ``mirror`` (pad rows -1 -> the ``zero_cols`` columns set to 0)."""
    if mirror is None:
        return x
    valid = (mirror >= 0)[:, None]
    g = x[mirror.clamp(min=0).long()]
    g[:, zero_cols] = torch.where(valid, g[:, zero_cols], torch.zeros_like(g[:, zero_cols]))
    return g


def _check_rows(name: str, t: torch.Tensor, cols: int, window: int = 1) -> None:
    """``md.<name>`` is an integer ``[rows, cols]`` (``cols`` 0: any width; its shape and dtype
    only: no device sync) and, with ``window`` 0, not sliding-window metadata (torch's own errors
    for either named no field)."""
    if t.dim() != 2 or (cols and t.shape[1] != cols) or t.dtype.is_floating_point or t.dtype.is_complex \
            or t.dtype == torch.bool:
        raise ValueError(f"md.{name}: expected an integer tensor [rows, {cols or 'width'}], got {t.dtype} of "
                         f"shape {tuple(t.shape)}")
    if window <= 0:
        raise ValueError(f"md.{name}: sliding-window metadata, but cfg.window_size is 0 (metadata built "
                         "with another config?)")


def _check_paged(name: str, off: torch.Tensor, ln: torch.Tensor, blocks: int, tpb: int) -> None:
    """Decode rows on CPU: every row's keys (``off`` to ``off + ln - 1``, ``off`` alone for an
    empty row) index one of the ``blocks`` entries of ``block_tables`` at ``tpb`` keys a block,
    else a ``ValueError`` naming the field (metadata of a larger block size read past the table:
    torch's index error, a device assert on CUDA, named no field)."""
    if not len(off):
        return
    last = off.long() + (ln.long() - 1).clamp(min=0)
    lo, hi = int(off.min()), int(last.max()) // tpb
    if lo < 0 or hi >= blocks:
        raise ValueError(f"md.{name}: keys reach entry {hi if lo >= 0 else lo // tpb} of md.block_tables' "
                         f"{blocks} at {tpb} keys a block (cfg.block_size / ratio; metadata built with "
                         "another block_size?)")


def compute_attn_info(md: _MD, cfg: MetadataConfig) -> _MD:
    """Fill ``kv_ca_index``, ``kv_ca_index_len``, ``kv_swa_full_index`` (prompt) and
    ``kv_swa_index`` (decode) where they are ``None``; returns ``md`` (modified in place).

    Shapes (int32, on the device of the inputs): ``kv_ca_index[n]`` [rows, width_n] with
    ``width_n = cdiv(max_model_len // n, 128) * 128``; ``kv_ca_index_len[n]`` [rows];
    ``kv_swa_full_index`` [rows, W]; ``kv_swa_index`` [rows, W]. ``rows`` is the number of rows of
    ``kv_ca_index_offset_len`` (decode / unmirrored prompt) or ``cp_mirror_len`` (mirrored).
    Keys of the dicts are the keys of ``kv_ca_index_offset_len`` (an empty dict stays empty).
    A switched-off feature (docs/design.md section 14) has no offsets or pivots, so nothing of it is expanded:
    without compressed KV ``kv_ca_index`` / ``kv_ca_index_len`` stay ``None``, with
    ``window_size == 0`` the SWA indices do; a plain config's metadata is returned unchanged.
    A field of another shape, or metadata whose compressed ratios or sliding window ``cfg`` does
    not have (built with another config), is a ``ValueError`` naming the field.
    """
    check_config(cfg)
    mirror = md.mirror_cp_index
    ol = md.kv_ca_index_offset_len
    if ol is not None and (md.kv_ca_index is None or md.kv_ca_index_len is None):
        for k, v in ol.items():
            if not (isinstance(k, str) and k.isdigit() and int(k) in cfg.ca_ratios):
                raise ValueError(f"md.kv_ca_index_offset_len[{k!r}]: not a compressed ratio of cfg "
                                 f"{cfg.ca_ratios} (metadata built with another config?)")
            _check_rows(f"kv_ca_index_offset_len[{k!r}]", v, 2)
        rows = {k: _gather_rows(v, mirror, slice(1, 2)) for k, v in ol.items()}
        lens = {k: v[:, 1].contiguous() for k, v in rows.items()}
        if md.kv_ca_index_len is None:
            md.kv_ca_index_len = lens
        if md.kv_ca_index is None:
            md.kv_ca_index = {}
            for k, v in rows.items():
                width = cfg.attn_index_width(int(k))
                if md.is_prompt:
                    md.kv_ca_index[k] = expand_offset_len(v[:, 0], lens[k], width)
                else:
                    tpb = cfg.block_size // int(k)
                    bt = md.block_tables
                    if bt is None:  # the builders always fill it; a hand-made metadata may not
                        raise ValueError("md.block_tables: expected decode metadata with kv_ca_index_offset_len "
                                         "to carry block_tables, got None")
                    _check_rows("block_tables", bt, 0)
                    if bt.device.type == "cpu" and bt.numel():  # (a host check is free on CPU)
                        _check_paged(f"kv_ca_index_offset_len[{k!r}]", v[:, 0], lens[k], bt.numel(), tpb)
                    md.kv_ca_index[k] = expand_paged_offset_len(v[:, 0], lens[k], width, bt, tpb)
    W = cfg.window_size
    if md.is_prompt:
        piv = md.kv_swa_full_index_pivots
        if md.kv_swa_full_index is None and piv is not None:
            _check_rows("kv_swa_full_index_pivots", piv, 4, W)
            md.kv_swa_full_index = expand_swa_pivots(_gather_rows(piv, mirror, slice(1, 4, 2)), W)
    else:
        sol = md.kv_swa_index_offset_len
        if md.kv_swa_index is None and sol is not None:
            _check_rows("kv_swa_index_offset_len", sol, 2, W)
            g = _gather_rows(sol, mirror, slice(1, 2))
            md.kv_swa_index = expand_swa_ring(g, W, cfg.swa_block_size)
    return md
