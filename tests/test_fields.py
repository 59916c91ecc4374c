"""The field table (``cpmeta.fields``, declared on ``InputMetadata``) against what the code builds.

On random configs and batches (prompt, decode, after ``compute_attn_info``, after the CP mirror,
YoCo mask and compact): the fields present are exactly those the table switches on, every tensor
has the table's dtype and rank, decode tensors have the shapes the table's rule resolves to, and
per-rank fields (``order=RANK``) hold this rank's rows after the mirror while full-order ones keep
the full layout. A wrong table entry fails here before it can mislead a generated layout.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

import cpmeta
from cpmeta.fields import (
    CP, DECODE, FULL, MIRROR, PROMPT, RANK, FieldInfo, feature_on, field_table, present_fields, staged_ratios, step_outputs,
)
from cpmeta.metadata import FIELDS, InputMetadata
from strategies import random_config, random_decode_batch, random_prompt_batch


def _present(md: InputMetadata) -> set[str]:
    return {n for n in md.field_names() if getattr(md, n) is not None}


def _tensors(md: InputMetadata) -> dict[str, list[torch.Tensor]]:
    """Field -> its tensors (a dict field: every entry)."""
    out: dict[str, list[torch.Tensor]] = {}
    for name in md.field_names():
        v = getattr(md, name)
        if isinstance(v, torch.Tensor):
            out[name] = [v]
        elif isinstance(v, dict) and all(isinstance(x, torch.Tensor) for x in v.values()):
            out[name] = list(v.values())
    return out


def _check_types(md: InputMetadata) -> None:
    for name, ts in _tensors(md).items():
        info = FIELDS[name]
        assert info.dtype is not None, f"{name}: a value field holds a tensor"
        for t in ts:
            assert t.dtype == info.dtype and t.dim() == info.ndim, (name, t.dtype, t.dim(), info)
    for name in _present(md) - set(_tensors(md)):
        v = getattr(md, name)
        assert FIELDS[name].dtype is None or v == {}, f"{name}: a tensor field holds {v!r}"


def test_every_field_is_declared_with_a_field_info() -> None:
    assert set(FIELDS) == set(InputMetadata.field_names())
    assert all(isinstance(i, FieldInfo) for i in FIELDS.values())
    assert all((i.dtype is None) == (i.ndim is None) for i in FIELDS.values())
    for name, info in FIELDS.items():  # a consumer field replaces an existing field of the same kind
        if info.replaces is not None:
            assert info.replaces in FIELDS and (FIELDS[info.replaces].dtype is None) == (info.dtype is None), name
    with pytest.raises(TypeError, match="declared without a FieldInfo"):
        import dataclasses

        field_table(dataclasses.make_dataclass("Bare", [("x", int, dataclasses.field(default=0))]))


@pytest.mark.parametrize("seed", range(12))
def test_table_predicts_fields_dtypes_and_decode_shapes(seed: int) -> None:
    rng = random.Random(seed)
    cfg = random_config(rng)
    pre = cpmeta.prepare_prompt(random_prompt_batch(rng, cfg), cfg)
    dec_seqs = random_decode_batch(rng, cfg, max_drafts=2)
    dec = cpmeta.prepare_decode(dec_seqs, cfg)
    assert _present(pre) == set(present_fields(FIELDS, cfg, PROMPT))
    assert _present(dec) == set(present_fields(FIELDS, cfg, DECODE))
    width = min(-(-max(len(s.block_table) for s in dec_seqs) // 16) * 16, cfg.max_num_blocks)  # the widest row
    sizes = {"total_q": dec.total_q, "n_seq": dec.num_seqs, "table_width": width}
    for spec in step_outputs(FIELDS, cfg, DECODE):  # the generated decode outputs have these shapes
        v = getattr(dec, spec.name)
        want = spec.resolve(sizes)
        if spec.keys is None:
            assert tuple(v.shape) == want, spec
        else:
            assert tuple(v) == spec.keys and all(tuple(x.shape) == want[1:] for x in v.values()), spec
    for md in (pre, dec):
        _check_types(md)
        md.compute_attn_info(cfg)
        _check_types(md)
    assert _present(pre) == set(present_fields(FIELDS, cfg, PROMPT, derived=True))
    assert _present(dec) == set(present_fields(FIELDS, cfg, DECODE, derived=True))


def _rows(t: Any) -> set[int]:
    ts = list(t.values()) if isinstance(t, dict) else [t]
    return {int(x.shape[0]) for x in ts}


@pytest.mark.parametrize("mode", ["mask", "compact"])
@pytest.mark.parametrize("seed", range(4))
def test_table_order_after_the_mirror_and_yoco(mode: str, seed: int) -> None:
    rng = random.Random(100 + seed)
    cfg = random_config(rng, yoco_keep_tokens=rng.choice([1, 4, 9]), yoco_mode=mode)
    md = cpmeta.prepare_prompt(random_prompt_batch(rng, cfg, whole_prompt=True), cfg).compute_attn_info(cfg)
    assert _present(md) == set(present_fields(FIELDS, cfg, PROMPT, derived=True))
    mine = cpmeta.prepare_for_mirror_cp(md, 1, 2)
    _check_types(mine)
    assert _present(mine) - _present(md) == {  # the mirror adds its fields (YoCo's only on compact metadata)
        n for n, i in FIELDS.items() if i.stage == MIRROR and all(f == CP or feature_on(f, cfg) for f in i.features)}
    n_rows = {name: _rows(getattr(mine, name)) for name in _tensors(mine)}
    for name, rows in n_rows.items():
        info = FIELDS[name]
        if info.shape_for(PROMPT)[:1] in (("total_q",), ("rows",)):
            want = mine.cp_mirror_len if info.order == RANK else md.total_q
            assert rows <= {want}, (name, rows, want)
    assert {n for n in n_rows if FIELDS[n].order == RANK} >= {"positions", "mirror_cp_index"}
    assert FIELDS["input_ids"].order == FULL and _rows(mine.input_ids) == {md.total_q}


def test_staged_ratio_order() -> None:
    cfg = cpmeta.MetadataConfig.compressed_swa(dense_compress_ratios=(4,), sparse_compress_ratios=(4, 8))
    assert staged_ratios(cfg) == (4, 8, 4, 8, 4)  # ca (4, 8), sparse (4, 8), dense (4,)


def _table_with_extra_fields() -> Any:
    """InputMetadata's table plus three fields declared the one way a field is declared: a decode
    row field, a per-ratio decode field, and a derived prompt field the CP mirror gathers."""
    import dataclasses

    from cpmeta.fields import COMPRESSED_KV, DECODE_ONLY, DENSE, DERIVE, PROMPT_ONLY, SWA, tensor_field

    base = [(f.name, f.type, dataclasses.field(default=None, metadata=f.metadata))
            for f in dataclasses.fields(InputMetadata)]
    extra = [
        ("extra_rows", "Optional[Tensor]", tensor_field(torch.int32, ("total_q", 3), features=(SWA,),
                                                        steps=DECODE_ONLY)),
        ("extra_per_ratio", "TDict", tensor_field(torch.int32, ("total_q",), ratios=DENSE,
                                                  features=(COMPRESSED_KV,), steps=DECODE_ONLY)),
        ("extra_derived", "TDict", tensor_field(torch.int32, ("rows",), ratios=DENSE, features=(COMPRESSED_KV,),
                                                steps=PROMPT_ONLY, stage=DERIVE, order=RANK, pad=-1)),
    ]
    return field_table(dataclasses.make_dataclass("WithExtra", base + extra, slots=True))


def test_one_table_edit_reaches_every_generated_layout() -> None:
    """docs/build.md, "A new field": the table entry alone puts a field into the host decode arena,
    the ``out=`` stacked schema, the in-place decode's device buffers and row views, the derived
    list, the CP mirror's gathered expansions and the consumer view's cleared fields. (Computing
    its values is the builder's and the kernels' part; declaring it is one edit.)"""
    from cpmeta.builders.decode import _make_decode_layout
    from cpmeta.fields import consumer_cleared, derived_fields, mirror_gathered_derived, stacked_fields
    from cpmeta.gpu.decode_buffers import make_buffers, row_specs

    table = _table_with_extra_fields()
    cfg = cpmeta.MetadataConfig.compressed_swa(dense_compress_ratios=(4, 8), sparse_compress_ratios=(4,))
    lay = _make_decode_layout(cfg, 5, 3, 4, table)
    assert lay.fields["extra_rows"][2] == (5, 3) and lay.fields["extra_per_ratio"][2] == (2, 5)
    assert "extra_per_ratio" in lay.stacked and "extra_per_ratio" in stacked_fields(table, DECODE)
    rows, _ = row_specs(cfg, table)
    assert rows["extra_rows"] == ((3,), torch.int32, None) and rows["extra_per_ratio"][2] == ("4", "8")
    out: dict[str, torch.Tensor] = {}
    bufs, views = make_buffers(out, cfg, 3, 5, torch.device("cpu"), table)
    assert tuple(bufs["extra_rows"].shape) == (5, 3) and tuple(views["extra_per_ratio"]) == ("4", "8")
    assert "extra_derived" in derived_fields(table) and mirror_gathered_derived(table)["extra_derived"] == -1
    assert "extra_derived" in consumer_cleared(table)
    plain = cpmeta.MetadataConfig(block_size=16, window_size=0, dense_compress_ratios=(), sparse_compress_ratios=())
    assert "extra_rows" not in _make_decode_layout(plain, 5, 3, 4, table).fields  # its feature is off
    assert "extra_rows" not in _make_decode_layout(cfg, 5, 3, 4).fields  # the real table has no such field
