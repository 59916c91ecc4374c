"""``prepare_prompt``: prefill / chunked-prefill ``InputMetadata`` on the CPU, two compiled calls.

docs/design.md sections 4, 10 and 17. Rows are query rows in varlen order; per-ratio fields are dicts keyed
by ``str(ratio)``. The sizes of a prompt step depend on the data, so the build is the reference engine's two
passes (:mod:`.prompt_njit`): ``prompt_count`` checks the bounds and counts (load segments,
compressed rows per ratio, the widest block table, YoCo's kept rows); the arena layout of those
sizes is generated from the field table (``cpmeta/fields.py``) and cached per (config, sizes);
``prompt_fill`` writes every field into the arena's bytes. The compressed KV of a sequence is
loaded into one contiguous buffer per ratio with ``max(1, seqlen_k // n)`` rows per sequence;
``ks``/``ke`` and ``kv_ca_index_offset_len`` index that buffer, the SWA pivots index the buffer
``[history: n_seq * W rows ; this chunk's new keys: total_q rows]``.

Worked example (W = 4, ratio 4, one sequence ``seqlen_q = 3``, ``seqlen_k = 9``, so q_start 6):
positions ``6, 7, 8``; loaded compressed rows ``max(1, 9 // 4) = 2`` so ``ks["4"] = [0, 0, 0]``,
``ke["4"] = [1, 2, 2]``; compressed rows written this chunk: c in ``[6 // 4, 9 // 4) = [1, 2)``
-> ``positions_c["4"] = [4]``; SWA pivots of row j = 0 (pos 6, sees 3..6): history part starts
at slot 3 - (6 - 4) = 1 -> ``(P0, P1, P2, P3) = (1, 3, 4, 1)``.
"""

from __future__ import annotations

from typing import Any, Optional, Union

import numpy as np
import torch

from ..buffers import ArenaLayout, HostArena, OutputBuffers, alloc
from ..cache import BoundedCache, IdentityCache
from ..config import MetadataConfig
from ..fields import PROMPT, OutputSpec, step_outputs
from ..jit import error_slot, warmer
from ..metadata import FIELDS, InputMetadata
from ..state.batch import BatchInput, SequenceBatch, as_sequence_batch
from .common_njit import ngram_table, raise_common
from .int_ops import check_int32
from .prompt_njit import (
    CNT_MAX_K, CNT_MAX_Q, CNT_RATIOS, CNT_SEG_SWA, CNT_T, CNT_TOTAL_C, CNT_WIDTH, E_CU_COMPRESSED_K, E_PIVOTS,
    E_TABLE_ID, count_slots, field_offsets, prompt_consts, prompt_count, prompt_fill,
)

__all__ = ["prepare_prompt", "prompt_fields", "SEQ_BLOCK_TABLE_PAD"]

#: Fill value of ``seq_block_tables`` past a sequence's own blocks (never a real block id).
SEQ_BLOCK_TABLE_PAD: int = -1

Out = Union[dict[str, torch.Tensor], OutputBuffers, None]

_NP = {torch.int32: np.int32, torch.bool: np.bool_}

#: The batch arrays' dtype the kernels are compiled for (``from_sequences`` and ``BatchState``
#: make it; a batch of other int arrays is converted).
_I64 = np.dtype(np.int64)


class _Plan:
    """One arena layout of a config's prompt build: the layout, the kernel's field offsets and
    ``(field, keys, arena names)`` of every tensor field, in field-table order."""

    __slots__ = ("layout", "fo", "entries")

    def __init__(self, layout: ArenaLayout, fo: np.ndarray,
                 entries: list[tuple[str, Optional[tuple[str, ...]], tuple[str, ...]]]) -> None:
        self.layout, self.fo, self.entries = layout, fo, entries


class _Consts:
    """What every prompt build of one config reads: the kernel constants, the field specs, and
    the plans per (shape sizes, with Engram rows)."""

    __slots__ = ("k", "specs", "ncnt", "plans", "shape_slots")

    def __init__(self, cfg: MetadataConfig) -> None:
        self.k = prompt_consts(cfg)
        self.specs = step_outputs(FIELDS, cfg, PROMPT)
        self.ncnt = count_slots(cfg)
        self.plans: BoundedCache[tuple[Any, ...], _Plan] = BoundedCache(64)
        #: the counted sizes that set a shape (what :func:`_shape` reads): a plan's key. The
        #: others (the sum and maxima of the lengths, each ratio's loaded rows) are values, which
        #: change every step of a chunked prefill while the shapes stay.
        self.shape_slots = [CNT_T, CNT_WIDTH, CNT_SEG_SWA, CNT_TOTAL_C] + [
            CNT_RATIOS + 3 * a + j for a in range(len(cfg.ca_ratios)) for j in (0, 1)]


_CONSTS: IdentityCache[MetadataConfig, _Consts] = IdentityCache(64)


def _shape(spec: OutputSpec, a: int, sizes: list[int]) -> tuple[int, ...]:
    """Concrete shape of ``spec`` (its ``a``-th ratio for a per-ratio field) from the counted sizes."""
    dims = []
    for d in spec.shape:
        if not isinstance(d, str):
            dims.append(d)
            continue
        if d == "total_q":
            dims.append(sizes[CNT_T])
        elif d == "n_seq+1":
            dims.append(sizes[-1] + 1)
        elif d == "n_seq":
            dims.append(sizes[-1])
        elif d == "rows_n":
            dims.append(sizes[CNT_RATIOS + 3 * a])
        elif d == "num_segments":
            dims.append(sizes[CNT_SEG_SWA] if spec.keys is None else sizes[CNT_RATIOS + 3 * a + 1])
        elif d == "max_table_len":
            dims.append(sizes[CNT_WIDTH])
        elif d == "total_q_c":
            dims.append(sizes[CNT_TOTAL_C])
        else:  # pragma: no cover - a new symbol in the field table
            raise AssertionError(f"{spec.name}: unknown prompt dim {d!r}")
    return tuple(dims)


def _make_plan(c: _Consts, cfg: MetadataConfig, sizes: list[int], ngram: bool) -> _Plan:
    """The arena layout of one prompt build: every tensor of ``step_outputs(FIELDS, cfg, PROMPT)``
    (per-ratio fields one entry per ratio, ``"ks.4"``), shapes from the counted ``sizes``
    (``cnt`` then ``n_seq``). Example: plain config, 2 sequences of 3 rows, tables of 1 block ->
    positions (6,), ..., cu_seqlens_q (3,), seq_block_tables (2, 1)."""
    spec_list: list[tuple[str, tuple[int, ...], torch.dtype]] = []
    entries: list[tuple[str, Optional[tuple[str, ...]], tuple[str, ...]]] = []
    for spec in c.specs:
        if spec.name == "ngram_token_ids" and not ngram:
            continue
        if spec.keys is None:
            spec_list.append((spec.name, _shape(spec, 0, sizes), spec.dtype))
            entries.append((spec.name, None, (spec.name,)))
        else:
            names = tuple(f"{spec.name}.{key}" for key in spec.keys)
            ca = [str(r) for r in cfg.ca_ratios]
            for key, name in zip(spec.keys, names):
                spec_list.append((name, _shape(spec, ca.index(key), sizes), spec.dtype))
            entries.append((spec.name, spec.keys, names))
    layout = ArenaLayout(spec_list)
    return _Plan(layout, field_offsets(layout, cfg), entries)


def _raise(err: np.ndarray, cfg: MetadataConfig) -> None:
    """The named ``ValueError`` of a kernel's error code (the messages of the numpy builder)."""
    raise_common(err, cfg)
    code, i, v, lim = (int(x) for x in err)
    if code == E_PIVOTS:
        check_int32("kv_swa_full_index_pivots", v,
                    f"n_seq ({i}) * window_size ({cfg.window_size}) + total_q ({lim})")
    elif code == E_CU_COMPRESSED_K:
        n = cfg.ca_ratios[i]
        check_int32(f"cu_compressed_seqlens_k.{n}", v, f"sum over sequences of max(1, seqlen_k // {n})")
    elif code == E_TABLE_ID:
        raise ValueError(f"seqs[{i}].block_table: expected block ids in [0, 2**31 - 1]")
    raise AssertionError(f"prompt kernel: unknown error code {code}")  # pragma: no cover


def prepare_prompt(seqs: BatchInput, cfg: MetadataConfig, *, out: Out = None) -> InputMetadata:
    """Build prompt (prefill chunk) ``InputMetadata`` (CPU tensors; pinned when CUDA is available).

    Args:
        seqs: one ``SequenceMetadata`` per sequence (``token_ids`` holds at least ``seqlen_k``
            tokens, no drafts), or the same as a prompt ``SequenceBatch`` (bit-identical
            result). Bad input raises ``ValueError`` naming ``seqs[i].field``.
        cfg: the engine's ``MetadataConfig``.
        out: ``None`` (one new arena per call); a dict of preallocated tensors keyed by
            flattened path (``"positions"``, ``"ks.4"``, ``"load_segments_ca.4"``, ...), filled
            in place, missing ones allocated and stored, a shape/dtype mismatch a ``ValueError``;
            or an :class:`~cpmeta.buffers.OutputBuffers` (e.g. :class:`cpmeta.OutputArenas`:
            one arena per batch shape, refilled by every call with that shape).

    Returns every prompt field of docs/design.md section 4: common fields ([total_q] rows),
    ``positions_c[n]`` / ``slot_mapping_store_ca[n]`` [sum n_cq], ``cu_compressed_seqlens_q[n]`` /
    ``cu_compressed_seqlens_k[n]`` [n_seq+1], ``state_block_idx`` [n_seq], ``total_k_swa``,
    ``load_segments_swa`` / ``load_segments_ca[n]`` [num_segments, 4], ``total_k_compressed[n]``,
    ``ks[r]`` / ``ke[r]`` [total_q], ``kv_ca_index_offset_len[n]`` [total_q, 2],
    ``kv_swa_full_index_pivots`` [total_q, 4], ``seq_block_tables`` [n_seq, max len(block_table)]
    (whole tables, -1 padded), and with ``yoco_keep_tokens`` set the YoCo fields of its mode
    (section 10). Decode-only fields are ``None``, and so are the fields of a feature the config
    switches off (docs/design.md section 14): without compressed KV (``ca_ratios == ()``) every per-ratio field;
    without the sliding-window state cache (``window_size == 0``) ``slot_mapping_store_swa``,
    ``state_block_idx``, ``total_k_swa``, ``load_segments_swa`` and ``kv_swa_full_index_pivots``.
    Int32 overflow of any total, offset or slot raises ``ValueError`` before anything is written.
    """
    return InputMetadata(**prompt_fields(as_sequence_batch(seqs, cfg, is_prompt=True), cfg, out))


def prompt_fields(sb: SequenceBatch, cfg: MetadataConfig, out: Out = None, *, ngram: bool = True
                  ) -> dict[str, Any]:
    """Every prompt field of a validated prompt batch (:func:`prepare_prompt`'s work) as kwargs;
    ``ngram=False`` leaves ``ngram_token_ids`` out (``cpmeta.prepare_prompt_cp`` builds one
    rank's rows of it)."""
    if out is not None and not isinstance(out, (dict, OutputBuffers)):
        raise TypeError(f"out: expected None, a dict of tensors or an OutputBuffers (e.g. cpmeta.OutputArenas), "
                        f"got {type(out).__name__}")
    c = _CONSTS.get(cfg)
    if c is None:
        c = _CONSTS.put(cfg, _Consts(cfg))
    n = len(sb)
    sq, sk, st, vs, nt, tok, tok_off, comp, comp_off, bt, bt_off = (  # one dtype: one compiled kernel
        a if a.dtype == _I64 else a.astype(np.int64) for a in (
            sb.seqlen_q, sb.seqlen_k, sb.state_id, sb.swa_valid_start, sb.num_tokens, sb.tokens, sb.token_offsets,
            sb.compressed, sb.compressed_offsets, sb.block_tables, sb.block_table_offsets))
    cnt = np.empty(c.ncnt, np.int64)
    err = error_slot()
    if prompt_count(sq, sk, st, vs, nt, bt, bt_off, c.k, cnt, err):
        _raise(err, cfg)
    sizes = cnt.tolist()
    sizes.append(n)
    key = (*[sizes[i] for i in c.shape_slots], n, ngram)
    plan = c.plans.get(key)
    if plan is None:
        plan = c.plans.put(key, _make_plan(c, cfg, sizes, ngram))
    arena = out.arena(plan.layout) if isinstance(out, OutputBuffers) else \
        HostArena(plan.layout) if out is None else None
    raw = arena.raw.numpy() if arena is not None else np.empty(plan.layout.nbytes, np.uint8)
    if prompt_fill(sq, sk, st, vs, sb.is_placeholder, nt, tok, tok_off, comp, comp_off, bt, bt_off, c.k, ngram_table(cfg), cnt,
                   raw, plan.fo, err):
        _raise(err, cfg)
    f: dict[str, Any] = {
        "is_prompt": True, "num_seqs": n, "total_q": sizes[CNT_T], "max_seqlen_q": sizes[CNT_MAX_Q],
        "max_seqlen_k": sizes[CNT_MAX_K],
    }
    if arena is not None:
        take = arena.take
        for name, keys, names in plan.entries:
            f[name] = take(name)[0] if keys is None else {k: take(a)[0] for k, a in zip(keys, names)}  # type: ignore[index]
    else:  # the caller's dict: its tensors (made on the first call), copied from the filled bytes
        assert isinstance(out, dict)
        fields = plan.layout.fields
        for name, keys, names in plan.entries:
            got = {}
            for a in names:
                start, size, shape, _, dtype = fields[a]
                t, dst = alloc(out, a, shape, dtype)
                np.copyto(dst, raw.view(_NP[dtype])[start:start + size].reshape(shape))
                got[a] = t
            f[name] = got[name] if keys is None else {k: got[a] for k, a in zip(keys, names)}
    if cfg.has_swa:
        f["total_k_swa"] = n * cfg.window_size
    if cfg.has_compressed_kv:
        f["total_k_compressed"] = {str(r): sizes[CNT_RATIOS + 3 * a + 2] for a, r in enumerate(cfg.ca_ratios)}
    if cfg.yoco_keep_tokens is not None and cfg.yoco_mode == "compact":
        f["yoco_consumer_total_q"] = sizes[CNT_TOTAL_C]
    return f


@warmer
def _warm() -> None:
    """The compiled passes (:mod:`.prompt_njit`) once, through :func:`prepare_prompt`: the
    compressed-KV config with YoCo compact, one sequence (q 3, k 9, state 2)."""
    cfg = MetadataConfig.compressed_swa(block_size=16, window_size=4, swa_block_size=4, max_model_len=64,
                                        yoco_keep_tokens=2)
    i64 = np.int64
    one = np.array([0, 1], i64)
    sb = SequenceBatch(is_prompt=True, seqlen_q=np.array([3], i64), seqlen_k=np.array([9], i64),
                       state_id=np.array([2], i64), swa_valid_start=np.zeros(1, i64),
                       is_placeholder=np.zeros(1, np.bool_), num_tokens=np.array([9], i64),
                       block_tables=np.array([7], i64), block_table_offsets=one,
                       tokens=np.arange(3, dtype=i64), token_offsets=np.array([0, 3], i64),
                       compressed=np.zeros(0, i64), compressed_offsets=np.zeros(2, i64), lookback=0)
    prepare_prompt(sb, cfg)
