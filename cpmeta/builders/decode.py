"""``prepare_decode``: decode-step ``InputMetadata`` on the CPU, ONE compiled call (docs/design.md sections 3, 4, 17).

The batch becomes a validated ``SequenceBatch`` (a list through ``from_sequences``; a vouched batch
is not checked again), the arena of its shape is taken from ``out`` (or made), and
:func:`~cpmeta.builders.decode_njit.decode_fill` checks the bounds and writes every field into it;
this module turns its error code into the named ``ValueError`` and hands out the arena's views.
Every field is one row per query row (``total_q = sum(seqlen_q)``; ``seqlen_q = 1 + drafts``).
Worked example (block_size 128, ratio 4, W = S = 128, one sequence ``seqlen_q = 2``,
``seqlen_k = 8``, state 3, table ``[5]``): positions ``[6, 7]``, context_lens ``[7, 8]``,
``klen["4"] = [1, 2]``, row 1 closes compressed token c = 1 -> ``positions_c["4"] = [0, 4]``,
``slot_mapping_store_ca["4"] = [-1, 5 * 32 + 1 = 161]``, SWA window of row 1: ``w = 8``, start
slot ``3 * 128 + 0`` -> ``kv_swa_index_offset_len[1] = (384, 8)``.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import numpy as np
import torch

from ..config import MetadataConfig
from ..cache import BoundedCache, IdentityCache
from ..fields import DECODE, FieldTable, OutputSpec, stacked_fields, step_outputs
from ..metadata import FIELDS, InputMetadata
from ..buffers import ArenaLayout, HostArena, OutputBuffers, get_or_create_stacked, get_or_create_tensor
from ..state.batch import BatchInput, as_sequence_batch
from .common_njit import ngram_table, raise_common
from .decode_njit import E_KV_CA_OFFSET, decode_consts, decode_fill, decode_shape, field_offsets
from .int_ops import check_int32

__all__ = ["prepare_decode", "DECODE_STACKED_FIELDS", "check_decode_out", "raise_decode_error"]

#: The decode ``out=`` schema, shared by ``prepare_decode`` and ``prepare_decode_inplace``: the
#: per-ratio decode fields of the field table live in ONE stacked buffer each, ``out["klen"]`` =
#: ``[n_ratio, total_q]`` (``kv_ca_index_offset_len``: ``[n_ratio, total_q, 2]``), rows in config
#: ratio order of the field's ratio set (``sparse_compress_ratios`` for ``klen``, ``ca_ratios`` for
#: ``positions_c`` and ``slot_mapping_store_ca``, ``dense_compress_ratios`` for
#: ``kv_ca_index_offset_len``); the metadata's dict values are row views of it (``md.klen["4"]``
#: is ``out["klen"][0]``). Every other field is stored under its own name.
DECODE_STACKED_FIELDS: tuple[str, ...] = stacked_fields(FIELDS, DECODE)

logger = logging.getLogger(__name__)

#: ``InputMetadata``'s fields in order (its positional arguments)
_FIELDS: list[str] = list(InputMetadata.__dataclass_fields__)
assert _FIELDS[:5] == ["is_prompt", "num_seqs", "total_q", "max_seqlen_q", "max_seqlen_k"], _FIELDS[:5]

Out = Optional[dict[str, torch.Tensor]]


def _kv_ca_error(cfg: MetadataConfig, T: int, v: int) -> None:
    """The ``kv_ca_index_offset_len`` int32 error of ``T`` rows (the bound ``v``)."""
    check_int32(
        "kv_ca_index_offset_len", v,
        f"total_q ({T}) * max_num_blocks ({cfg.max_num_blocks}, from max_model_len="
        f"{cfg.max_model_len}) * (block_size // min(dense_compress_ratios)) "
        f"({cfg.block_size}//{min(cfg.dense_compress_ratios)})",
    )


class _Target:
    """One arena as the kernel and the metadata see it: its bytes (``raw``, uint8), its tensors
    (whole fields by name; per-ratio fields as ``{ratio: row tensor}``) and the kernel's ``err``
    / ``info`` slots. Made once per arena an :class:`~cpmeta.buffers.OutputArenas` keeps (the
    steady state of an engine loop refills the same arena: measured 2026-12-03 on the 2-core VM,
    re-taking the views cost ~5 us of a ~15 us seed decode-64 build)."""

    __slots__ = ("arena", "raw", "whole", "rows", "err", "info", "values", "row_at")

    def __init__(self, arena: HostArena, shape: "_Shape") -> None:
        self.arena = arena
        self.raw = arena.raw.numpy()
        self.whole = {name: arena.take(name)[0] for name in shape.whole}  # type: ignore[index]
        self.rows = {name: dict(zip(keys, arena.take_rows(name)[0])) for name, keys in shape.rows}  # type: ignore[index]
        self.err, self.info = np.zeros(4, np.int64), np.zeros(2, np.int64)
        # the metadata's fields in order (its scalars set per build: a positional call, no kwargs to match)
        self.values: list[Any] = [self.whole.get(f) for f in _FIELDS]
        self.row_at = [(_FIELDS.index(name), d) for name, d in self.rows.items()]


class _Shape:
    """One batch shape ``(total_q, n_seq, table_width)`` of a config: the :class:`ArenaLayout` (the SAME object
    for the same shape, so :class:`~cpmeta.buffers.OutputArenas` finds its arena), the kernel's
    field offsets and the fields' names (whole tensors; per-ratio rows with their keys)."""

    __slots__ = ("key", "layout", "offsets", "whole", "rows")

    def __init__(self, cfg: MetadataConfig, T: int, n: int, width: int, plan: "_Plan") -> None:
        self.key = (T, n, width)
        lay = self.layout = _make_decode_layout(cfg, T, n, width, specs=plan.specs)
        ratios = plan.ratios
        self.offsets = field_offsets(lay)
        self.whole = tuple(k for k in lay.fields if k not in lay.stacked)
        self.rows = tuple((k, ratios[k]) for k in lay.fields if k in lay.stacked)


class _Plan:
    """What a config's decode builds share: :func:`decode_consts`, its output specs (the field
    table's, ~16 us to derive), its :class:`_Shape` per batch shape (at most 256) and the
    :class:`_Target` of the arenas last filled (at most 8, as many as an
    :class:`~cpmeta.buffers.OutputArenas` keeps by default; each holds its arena alive)."""

    __slots__ = ("consts", "specs", "shapes", "ratios", "targets")

    def __init__(self, cfg: MetadataConfig) -> None:
        self.consts = decode_consts(cfg)
        self.specs = step_outputs(FIELDS, cfg, DECODE)
        self.shapes: BoundedCache[tuple[int, int, int], _Shape] = BoundedCache(256)
        self.targets: BoundedCache[int, _Target] = BoundedCache(8)
        self.ratios = {"klen": tuple(map(str, cfg.sparse_compress_ratios)),
                       "positions_c": tuple(map(str, cfg.ca_ratios)),
                       "slot_mapping_store_ca": tuple(map(str, cfg.ca_ratios)),
                       "kv_ca_index_offset_len": tuple(map(str, cfg.dense_compress_ratios))}

    def shape(self, cfg: MetadataConfig, T: int, n: int, width: int) -> _Shape:
        got = self.shapes.get((T, n, width))
        return got if got is not None else self.shapes.put((T, n, width), _Shape(cfg, T, n, width, self))

    def target(self, arena: HostArena, shape: _Shape) -> _Target:
        """The :class:`_Target` of a caller's arena (made on its first fill)."""
        t = self.targets.get(id(arena))
        return t if t is not None and t.arena is arena else self.targets.put(id(arena), _Target(arena, shape))


#: One :class:`_Plan` per config, keyed by the config's identity (hashing a frozen config builds a
#: tuple of all its fields on every call).
_PLANS: IdentityCache[MetadataConfig, _Plan] = IdentityCache(64)


def _plan(cfg: MetadataConfig) -> _Plan:
    p = _PLANS.get(cfg)
    return p if p is not None else _PLANS.put(cfg, _Plan(cfg))


def _make_decode_layout(cfg: MetadataConfig, T: int, n: int, width: int, table: FieldTable = FIELDS,
                        specs: Optional[tuple[OutputSpec, ...]] = None) -> ArenaLayout:
    """Every decode output (name, shape, dtype), generated from the field table (``table``; a test
    passes one with an extra field): ONE :class:`HostArena` holds them all when the caller passes
    no ``out`` (made once per batch shape, :class:`_Shape`); per-ratio fields are stacked
    ``[n_ratio, ...]``; ``block_tables`` has ``width`` columns. Example: 256 rows, 256 sequences,
    ``MetadataConfig.compressed_swa()``, the longest table 16 blocks -> 16 fields, ~38 KiB
    (block_tables [256, 16] int32 is 16 KiB of it). ``specs``: ``step_outputs(table, cfg,
    DECODE)`` when the caller holds it."""
    specs = step_outputs(table, cfg, DECODE) if specs is None else specs
    sizes = {"total_q": T, "n_seq": n, "table_width": width}
    return ArenaLayout([(s.name, s.resolve(sizes), s.dtype) for s in specs],
                       stacked=[s.name for s in specs if s.keys is not None])


def check_decode_out(out: Out) -> None:
    """Refuse the per-ratio key form (``"klen.4"``) in a decode ``out`` dict (see the module doc)."""
    if not out:
        return
    for key in out:
        name, dot, ratio = key.partition(".")
        if dot and name in DECODE_STACKED_FIELDS:
            raise ValueError(
                f"out[{key!r}]: decode out buffers hold per-ratio fields stacked under {name!r} "
                f"(one [n_ratio, total_q, ...] tensor, ratios in config order), not per-ratio keys"
            )


def _out_kind(out: "Out | OutputBuffers") -> Optional[OutputBuffers]:
    """The one dispatch on ``out``: an :class:`~cpmeta.buffers.OutputBuffers` is returned, a dict
    is checked (:func:`check_decode_out`) and ``None`` returned, anything else is a ``TypeError``."""
    if out is None or isinstance(out, dict):
        check_decode_out(out)
        return None
    if isinstance(out, OutputBuffers):
        return out
    raise TypeError(f"out: expected None, a dict of tensors or an OutputBuffers (e.g. cpmeta.OutputArenas), "
                    f"got {type(out).__name__}")


def prepare_decode(
    seqs: BatchInput, cfg: MetadataConfig, *, out: "Out | OutputBuffers" = None, table_width: Optional[int] = None
) -> InputMetadata:
    """Build decode ``InputMetadata`` (CPU tensors; pinned when CUDA is available).

    Args:
        seqs: one ``SequenceMetadata`` per sequence; ``token_ids`` holds exactly
            ``seqlen_k - seqlen_q + 1`` confirmed tokens and ``draft_tokens`` the ``seqlen_q - 1``
            MTP drafts; or the same as a decode ``SequenceBatch`` (bit-identical result). Bad
            input raises ``ValueError`` naming ``seqs[i].field``.
        cfg: the engine's ``MetadataConfig``.
        out: optional dict of preallocated tensors keyed by field name (``"positions"``, ...;
            per-ratio fields stacked, see :data:`DECODE_STACKED_FIELDS`); matching tensors are
            filled in place, missing ones are allocated and stored in it, a shape/dtype mismatch
            (or a per-ratio key such as ``"klen.4"``) is a ``ValueError``. Or an
            :class:`~cpmeta.buffers.OutputBuffers` (caller-owned memory), e.g. a
            :class:`cpmeta.OutputArenas`: one arena per batch shape, refilled every step (the
            cheapest steady state: no tensor is made per call).
        table_width: ``block_tables``' columns when the caller needs a fixed shape (a CUDA
            graph; the in-place path's ``max_num_blocks``): from the batch's widest row to
            ``max_num_blocks``, else ``ValueError``. Default: the widest row rounded up to 16
            columns (or the columns of ``out["block_tables"]``).

    Returns every decode field of docs/design.md section 4 (int32 indices, bool masks, [total_q] rows):
    common fields, ``state_block_idx`` / ``context_lens`` [total_q], ``klen[r]``,
    ``kv_swa_index_offset_len`` [total_q, 2], ``block_tables`` [total_q, width],
    ``kv_ca_index_offset_len[n]`` [total_q, 2] (offsets ``row * width * (block_size // n)``).
    Prompt-only fields are ``None``, and so are the fields of a feature the config switches off
    (docs/design.md section 14): without compressed KV every per-ratio field; with ``window_size
    == 0`` ``slot_mapping_store_swa``, ``state_block_idx`` and ``kv_swa_index_offset_len``.
    ``width`` is the batch's widest row (a row is its sequence's table: the longest table, cut to
    ``max_num_blocks``) rounded up to a multiple of 16 (``TABLE_WIDTH_ALIGN``, at most
    ``max_num_blocks``; shorter rows -1 padded), so the bytes follow the batch, not
    ``max_model_len``; only a row's first ``blocks_needed(seqlen_k)`` ids are defined; a caller
    that needs a fixed shape (a CUDA graph) passes ``table_width`` or ``out["block_tables"]`` with
    any width from that up to ``max_num_blocks`` (``cdiv(max_model_len, block_size)`` for a plain
    unsharded config).
    Raises ``ValueError`` before writing any field when a needed block id is outside ``[0,
    max_block_id]``, or ``sum(seqlen_k)`` or ``total_q * max_num_blocks * (block_size // min(dense
    ratios))`` exceeds int32.
    """
    arenas = _out_kind(out)
    sb = as_sequence_batch(seqs, cfg, is_prompt=False)
    n = len(sb)
    plan = _plan(cfg)
    seq = [a if a.dtype == _I64 else a.astype(np.int64) for a in (sb.seqlen_q, sb.seqlen_k, sb.state_id)]
    bt_off = sb.block_table_offsets if sb.block_table_offsets.dtype == _I64 else sb.block_table_offsets.astype(np.int64)
    T, widest, width = decode_shape(seq[0], len(sb.tokens), bt_off, sb.lookback, cfg.max_num_blocks)
    if table_width is not None:
        width = _fixed_width("table_width", table_width, widest, cfg)
    elif isinstance(out, dict) and out.get("block_tables") is not None:
        bt = out["block_tables"]
        if not isinstance(bt, torch.Tensor):
            raise TypeError(f"out['block_tables']: expected a tensor, got {type(bt).__name__}")
        width = _fixed_width("out['block_tables']", int(bt.shape[1]) if bt.dim() == 2 else -1, widest, cfg,
                             f"shape {tuple(bt.shape)}")
    shape = plan.shape(cfg, T, n, width)
    tg: Optional[_Target] = None
    if arenas is not None:  # caller-owned memory: the arena it hands out for this batch shape
        tg = plan.target(arenas.arena(shape.layout), shape)
    elif out is None:  # one host allocation for every field
        tg = _Target(HostArena(shape.layout), shape)
    if tg is not None:
        raw, err, info = tg.raw, tg.err, tg.info
    else:  # a caller's dict: the kernel fills scratch bytes, copied into the dict's tensors
        raw, err, info = np.empty(shape.layout.nbytes, np.uint8), np.zeros(4, np.int64), np.zeros(2, np.int64)
    tab = ngram_table(cfg)
    if decode_fill(*seq, sb.is_placeholder,  # type: ignore[call-arg, arg-type]  # one dtype: one compiled kernel
            *[a if a.dtype == _I64 else a.astype(np.int64) for a in (
                sb.tokens, sb.token_offsets, sb.compressed, sb.compressed_offsets, sb.block_tables,
                sb.block_table_offsets)],
            plan.consts, tab, raw, shape.offsets, T, err, info):
        raise_decode_error(err, cfg)
    if tg is not None:
        return _metadata(tg, n, T, info)
    f: dict[str, Any] = {"is_prompt": False, "num_seqs": n, "total_q": T, "max_seqlen_q": int(info[0]),
                         "max_seqlen_k": int(info[1])}
    assert isinstance(out, dict)  # _out_kind: None, a dict or an OutputBuffers
    _into_dict(out, f, raw, shape)
    return InputMetadata(**f)


def _metadata(tg: _Target, n: int, T: int, info: np.ndarray) -> InputMetadata:
    """The metadata of an arena the kernel filled (``info``: its max seqlen_q / seqlen_k)."""
    v = tg.values.copy()
    v[:5] = False, n, T, *info.tolist()  # _FIELDS' first five
    for i, d in tg.row_at:
        v[i] = dict(d)  # the metadata's own dict (a caller may replace its entries)
    return InputMetadata(*v)


#: The batch arrays' dtype the kernel is compiled for (a batch made by ``from_sequences`` or
#: ``BatchState`` has it; others are converted).
_I64 = np.dtype(np.int64)


def _fixed_width(name: str, cols: int, width: int, cfg: MetadataConfig, got: str = "") -> int:
    """A caller's fixed ``block_tables`` width ``cols`` (``table_width`` or the columns of
    ``out["block_tables"]``, e.g. a CUDA graph's buffer): from the batch's widest row ``width`` to
    ``max_num_blocks``, else a ``ValueError`` naming ``name``."""
    if not width <= cols <= cfg.max_num_blocks:
        raise ValueError(
            f"{name}: expected C columns with the batch's widest row ({width} blocks) <= C <= "
            f"max_num_blocks ({cfg.max_num_blocks}), got {got or cols}")
    return cols


def raise_decode_error(err: np.ndarray, cfg: MetadataConfig) -> None:
    """The named ``ValueError`` of a decode kernel's error slot ``err`` (``[code, index, value,
    limit]``; :mod:`.common_njit`, :mod:`.decode_njit`): ``prepare_decode``'s messages, which the
    in-place path's staging writer (``cpmeta.gpu.staging_njit``) raises through this too."""
    raise_common(err, cfg)
    if int(err[0]) == E_KV_CA_OFFSET:
        _kv_ca_error(cfg, int(err[1]), int(err[2]))
    raise AssertionError(f"decode kernel: unknown error code {err.tolist()}")  # pragma: no cover


def _into_dict(out: dict[str, torch.Tensor], f: dict[str, Any], raw: np.ndarray, shape: _Shape) -> None:
    """A caller's ``out`` dict: each field it holds is checked (shape, dtype: ``ValueError`` naming
    it), each it lacks is allocated and stored in it (``get_or_create_tensor`` /
    ``get_or_create_stacked``: per-ratio fields as one stacked ``[n_ratio, ...]`` tensor), and
    filled from the kernel's bytes ``raw``; ``f`` gets the dict's tensors (row views for
    per-ratio fields)."""
    views = {torch.int32: raw.view(np.int32), torch.bool: raw.view(np.bool_)}
    keys = dict(shape.rows)
    for name, (start, size, shp, _, dtype) in shape.layout.fields.items():
        if name in keys:
            t, f[name] = get_or_create_stacked(out, name, keys[name], shp[1:], dtype)
        else:
            t = f[name] = get_or_create_tensor(out, name, shp, dtype)
        np.copyto(t.numpy(), views[dtype][start:start + size].reshape(shp))
