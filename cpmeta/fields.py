"""The field table: what each ``InputMetadata`` field is, declared once where the field is declared.

Every field of :class:`cpmeta.metadata.InputMetadata` carries dataclass field metadata under
:data:`KEY` (``"cpmeta"``): a :class:`FieldInfo` with its dtype, rank, symbolic shape, ratio set,
feature switches, step kinds, the stage that fills it, and whether it is full-order or per-rank
after the CP mirror (the model: vLLM v1's ``InputBatch`` / ``BlockTable``, which declare the arrays
they own once). The declaration reads::

    positions: Optional[Tensor] = tensor_field(torch.int32, ("total_q",), order=RANK, pad=0)
    klen: TDict = tensor_field(torch.int32, ("total_q",), ratios=SPARSE, features=(COMPRESSED_KV,),
                               steps=DECODE_ONLY, consumer_clear=True)

Everything that used to restate the field list is generated from the table (:func:`field_table`):
the host decode builder's arena and the in-place decode's device buffers and row views
(:func:`step_outputs`), ``get_clean_list`` (:func:`derived_fields`), the expansions the CP mirror
gathers (:func:`mirror_gathered_derived`), the YoCo consumer view (:func:`consumer_swaps`,
:func:`consumer_cleared`), the YoCo field lists (:func:`fields_with`) and the order of the ratio
sets in the staging header (:func:`staged_ratios`). The broadcast schema reads ``.dtype`` and
``.ndim`` (``None`` = not fixed) to check a layout's tensors once.

Shape symbols: ``total_q``, ``n_seq``, ``n_seq+1``, ``rows`` (``total_q``, or ``cp_mirror_len``
once mirrored), ``rows_n`` (compressed rows of ratio n), ``num_segments``, ``max_table_len``,
``width_n``, ``cp_mirror_len``, ``total_q_c``, ``contrib_pad_len``, ``table_width`` (decode
``block_tables``' columns: the batch's widest row, its longest table, rounded up to 16 columns,
or the columns of a caller's fixed buffer; at most ``max_num_blocks``); config dims ``W``
(``window_size``), ``max_num_blocks``, ``max_ngram_size``; and literal ints. Worked example:
``block_tables`` is ``("total_q", "table_width")``; a decode step of 256 rows whose longest table
holds 9 blocks resolves it to ``(256, 16)``; ``klen`` with sparse ratios ``(4, 8)`` is
stacked ``[2, 256]`` under keys ``("4", "8")``.

This module imports torch and :mod:`cpmeta.cache` only (config values are read by attribute).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Mapping, NamedTuple, Optional, Union

import torch

from .cache import IdentityCache

__all__ = [
    "KEY", "FieldInfo", "tensor_field", "value_field", "field_table", "FieldTable",
    "COMMON", "COMPRESSED_KV", "SWA", "ENGRAM", "YOCO_MASK", "YOCO_COMPACT", "CP",
    "PROMPT", "DECODE", "BOTH", "PROMPT_ONLY", "DECODE_ONLY", "FULL", "RANK",
    "BUILD", "DERIVE", "MIRROR", "CA", "SPARSE", "DENSE", "RATIO_ORDER",
    "feature_on", "ratios_of", "staged_ratios", "OutputSpec", "step_outputs", "present_fields", "stacked_fields",
    "derived_fields", "fields_with", "mirror_gathered_derived", "consumer_swaps", "consumer_cleared",
]

#: Key of the dataclass field metadata that holds a field's :class:`FieldInfo`.
KEY = "cpmeta"

# feature switches (a field lives only while all of its switches are on; none = every config)
COMMON = "common"
COMPRESSED_KV = "compressed_kv"  # ca_ratios non-empty
SWA = "swa"  # window_size > 0 (the sliding-window state cache)
ENGRAM = "engram"  # max_ngram_size > 0
YOCO_MASK = "yoco_mask"  # yoco_keep_tokens set, yoco_mode "mask"
YOCO_COMPACT = "yoco_compact"  # yoco_keep_tokens set, yoco_mode "compact"
CP = "cp"  # added by prepare_for_mirror_cp (never by a builder)

# step kinds
PROMPT, DECODE = "prompt", "decode"
BOTH = frozenset((PROMPT, DECODE))
PROMPT_ONLY = frozenset((PROMPT,))
DECODE_ONLY = frozenset((DECODE,))

# order after the CP mirror: the same on every rank, or this rank's own rows / values
FULL, RANK = "full", "rank"

# who fills the field: the builders, compute_attn_info, or prepare_for_mirror_cp
BUILD, DERIVE, MIRROR = "build", "derive", "mirror"

# ratio sets a per-ratio dict is keyed by (docs/design.md section 3), and their order wherever they are concatenated
CA, SPARSE, DENSE = "ca", "sparse", "dense"
RATIO_ORDER: tuple[str, ...] = (CA, SPARSE, DENSE)

_CFG_DIMS = {"W": "window_size", "max_num_blocks": "max_num_blocks", "max_ngram_size": "max_ngram_size"}

Dim = Union[str, int]


@dataclass(frozen=True, slots=True)
class FieldInfo:
    """One field of the table (see the module docstring for the shape symbols).

    ``dtype`` / ``ndim``: of the tensor (of each entry of a per-ratio dict); ``None`` for value
    fields (``ndim`` None = rank not fixed). ``shape``: symbolic dims per step kind (``shape`` for
    every step unless ``prompt_shape`` overrides it). ``ratios``: ``CA`` / ``SPARSE`` / ``DENSE``
    for a per-ratio dict keyed by that ratio set, ``None`` otherwise. ``features``: the switches
    that must all be on (``()`` = every config). ``steps``: which step kinds carry it. ``stage``:
    ``BUILD`` / ``DERIVE`` (``compute_attn_info``) / ``MIRROR`` (``prepare_for_mirror_cp``).
    ``order``: ``FULL`` (full row order, equal on every CP rank) or ``RANK`` (this rank's rows or
    values once mirrored). ``pad``: the value of pad rows where the mirror gathers the field.
    ``replaces``: on a ``yoco_consumer_*`` field, the field it stands in for in the consumer view;
    ``consumer_clear``: the consumer view sets the field to ``None`` (re-expanded on its rows).
    """

    dtype: Optional[torch.dtype]
    ndim: Optional[int]
    shape: tuple[Dim, ...] = ()
    prompt_shape: Optional[tuple[Dim, ...]] = None
    ratios: Optional[str] = None
    features: tuple[str, ...] = ()
    steps: frozenset[str] = BOTH
    stage: str = BUILD
    order: str = FULL
    pad: Optional[Union[int, bool]] = None
    replaces: Optional[str] = None
    consumer_clear: bool = False

    def __post_init__(self) -> None:
        if self.ratios not in (None, *RATIO_ORDER):
            raise ValueError(f"ratios: expected one of {RATIO_ORDER} or None, got {self.ratios!r}")
        if not self.steps or not self.steps <= BOTH:
            raise ValueError(f"steps: expected a non-empty subset of {sorted(BOTH)}, got {sorted(self.steps)}")
        if self.order not in (FULL, RANK) or self.stage not in (BUILD, DERIVE, MIRROR):
            raise ValueError(f"order / stage: got {self.order!r} / {self.stage!r}")
        if self.prompt_shape is not None and len(self.prompt_shape) != len(self.shape):
            raise ValueError(f"prompt_shape {self.prompt_shape}: expected the rank of shape {self.shape}")

    def shape_for(self, step: str) -> tuple[Dim, ...]:
        """Symbolic shape of the tensor (of each dict entry) in a ``step`` (``PROMPT`` / ``DECODE``)."""
        return self.prompt_shape if step == PROMPT and self.prompt_shape is not None else self.shape

    @property
    def derived(self) -> bool:
        return self.stage == DERIVE


def tensor_field(dtype: torch.dtype, shape: tuple[Dim, ...], *, prompt_shape: Optional[tuple[Dim, ...]] = None,
                 ratios: Optional[str] = None, features: tuple[str, ...] = (), steps: frozenset[str] = BOTH,
                 stage: str = BUILD, order: str = FULL, pad: Optional[Union[int, bool]] = None,
                 replaces: Optional[str] = None, consumer_clear: Optional[bool] = None) -> Any:
    """A tensor field (``None`` by default): ``dataclasses.field`` carrying its :class:`FieldInfo`.
    Derived fields are cleared by the consumer view unless ``consumer_clear`` says otherwise."""
    info = FieldInfo(dtype, len(shape), tuple(shape), prompt_shape, ratios, tuple(features), frozenset(steps),
                     stage, order, pad, replaces, stage == DERIVE if consumer_clear is None else consumer_clear)
    return dataclasses.field(default=None, metadata={KEY: info})


def value_field(*, ratios: Optional[str] = None, features: tuple[str, ...] = (), steps: frozenset[str] = BOTH,
                stage: str = BUILD, order: str = FULL, replaces: Optional[str] = None) -> Any:
    """A value field (scalar, or a per-ratio dict of ints; ``None`` by default): no dtype, no rank."""
    info = FieldInfo(None, None, (), None, ratios, tuple(features), frozenset(steps), stage, order, None, replaces)
    return dataclasses.field(default=None, metadata={KEY: info})


#: ``name -> FieldInfo`` of one dataclass, in declaration order (read-only).
FieldTable = Mapping[str, FieldInfo]


_TABLES: IdentityCache[type, FieldTable] = IdentityCache(16)


def field_table(cls: type) -> FieldTable:
    """The table of a dataclass whose every field was declared with :func:`tensor_field` /
    :func:`value_field` (``TypeError`` naming the first field without one). Cached per class;
    works on any such class (a test builds one with an extra field)."""
    hit = _TABLES.get(cls)
    return hit if hit is not None else _TABLES.put(cls, _make_table(cls))


def _make_table(cls: type) -> FieldTable:
    table: dict[str, FieldInfo] = {}
    for f in dataclasses.fields(cls):
        info = f.metadata.get(KEY)
        if not isinstance(info, FieldInfo):
            raise TypeError(f"{cls.__name__}.{f.name}: declared without a FieldInfo (use tensor_field / value_field)")
        table[f.name] = info
    return MappingProxyType(table)


def feature_on(feature: str, cfg: Any) -> bool:
    """Whether ``cfg`` (a ``MetadataConfig``) switches ``feature`` on for the builders."""
    if feature == COMPRESSED_KV:
        return bool(cfg.has_compressed_kv)
    if feature == SWA:
        return bool(cfg.has_swa)
    if feature == ENGRAM:
        return cfg.max_ngram_size > 0
    if feature in (YOCO_MASK, YOCO_COMPACT):
        return cfg.yoco_keep_tokens is not None and cfg.yoco_mode == feature[len("yoco_"):]
    if feature == CP:
        return False
    raise ValueError(f"feature: unknown switch {feature!r}")


def ratios_of(cfg: Any, ratio_set: str) -> tuple[int, ...]:
    """The ratios of ``ratio_set`` in config order. Example: dense (4,), sparse (4, 8) -> ``CA``: (4, 8)."""
    if ratio_set == CA:
        return tuple(cfg.ca_ratios)
    if ratio_set == SPARSE:
        return tuple(cfg.sparse_compress_ratios)
    if ratio_set == DENSE:
        return tuple(cfg.dense_compress_ratios)
    raise ValueError(f"ratio_set: expected one of {RATIO_ORDER}, got {ratio_set!r}")


def staged_ratios(cfg: Any) -> tuple[int, ...]:
    """Every ratio set concatenated in :data:`RATIO_ORDER` (the staging header's ratio words).
    Example: dense (4,), sparse (4, 8) -> ``(4, 8, 4, 8, 4)`` (ca, then sparse, then dense)."""
    return tuple(r for s in RATIO_ORDER for r in ratios_of(cfg, s))


def present_fields(table: FieldTable, cfg: Any, step: str, *, derived: bool = False) -> tuple[str, ...]:
    """Fields a builder of ``step`` fills for ``cfg`` (``derived=True``: and ``compute_attn_info``)."""
    stages = (BUILD, DERIVE) if derived else (BUILD,)
    return tuple(n for n, i in table.items() if step in i.steps and i.stage in stages
                 and all(feature_on(f, cfg) for f in i.features))


class OutputSpec(NamedTuple):
    """One tensor a builder of a step writes: ``shape`` resolved against the config (batch dims
    ``total_q`` / ``n_seq+1`` stay symbolic); ``keys`` the ratio keys of a per-ratio field (stored
    stacked, ``[len(keys), *shape]``), ``None`` otherwise."""

    name: str
    dtype: torch.dtype
    shape: tuple[Dim, ...]
    keys: Optional[tuple[str, ...]]

    def resolve(self, sizes: Mapping[str, int]) -> tuple[int, ...]:
        """Concrete shape (stacked: with the leading ratio dim) for ``sizes`` such as
        ``{"total_q": 256, "n_seq": 256}``. Example: ``("n_seq+1",)`` -> ``(257,)``."""
        dims = tuple(sizes["n_seq"] + 1 if d == "n_seq+1" else sizes[d] if isinstance(d, str) else d
                     for d in self.shape)
        return dims if self.keys is None else (len(self.keys), *dims)


def step_outputs(table: FieldTable, cfg: Any, step: str) -> tuple[OutputSpec, ...]:
    """Every tensor the builder of ``step`` writes for ``cfg``, in table order, config dims
    resolved. Example: a plain config's decode step -> 9 specs (positions ... block_tables)."""
    out = []
    for name in present_fields(table, cfg, step):
        info = table[name]
        if info.dtype is None:
            continue
        shape = tuple(getattr(cfg, _CFG_DIMS[d]) if isinstance(d, str) and d in _CFG_DIMS else d
                      for d in info.shape_for(step))
        keys = None if info.ratios is None else tuple(str(r) for r in ratios_of(cfg, info.ratios))
        out.append(OutputSpec(name, info.dtype, shape, keys))
    return tuple(out)


def stacked_fields(table: FieldTable, step: str) -> tuple[str, ...]:
    """Per-ratio fields a builder of ``step`` writes (stored stacked in ``out`` buffers)."""
    return tuple(n for n, i in table.items() if step in i.steps and i.stage == BUILD and i.ratios is not None
                 and i.dtype is not None)


def derived_fields(table: FieldTable) -> tuple[str, ...]:
    """Fields ``compute_attn_info`` fills (``get_clean_list``), in table order."""
    return tuple(n for n, i in table.items() if i.derived)


def fields_with(table: FieldTable, feature: str, stage: str = BUILD) -> tuple[str, ...]:
    """Fields switched by ``feature`` and filled by ``stage``. Example: ``YOCO_MASK`` ->
    ``("yoco_mask_swa_index_pivots",)``."""
    return tuple(n for n, i in table.items() if feature in i.features and i.stage == stage)


def mirror_gathered_derived(table: FieldTable) -> dict[str, Union[int, bool]]:
    """Expanded prompt fields the CP mirror gathers when already computed, with their pad value."""
    return {n: i.pad for n, i in table.items()
            if i.derived and i.order == RANK and PROMPT in i.steps and i.pad is not None}


def consumer_swaps(table: FieldTable) -> dict[str, str]:
    """YoCo consumer view: ``field -> yoco_consumer_* field`` that replaces it."""
    return {i.replaces: n for n, i in table.items() if i.replaces is not None}


def consumer_cleared(table: FieldTable) -> tuple[str, ...]:
    """Fields the YoCo consumer view sets to ``None`` (re-expanded on its rows)."""
    return tuple(n for n, i in table.items() if i.consumer_clear)

