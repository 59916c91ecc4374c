"""``prepare_prompt_cp`` (issue 30 item 3): one rank's zigzag share built for that rank.

It must equal ``prepare_for_mirror_cp(prepare_prompt(seqs, cfg), rank, cp_size)`` field for
field (``metadata_diff``: dtype, shape, bytes, aliasing) on every rank, for random configs
(Engram with image sentinels, compressed ids and a lookup table, or off; compressed KV; SWA;
YoCo), random prompt batches (chunks with history, placeholders) and CP sizes 1-4, and on the
array input (a ``SequenceBatch`` from a ``BatchState``). The per-row kernel itself
(``ngram_of_rows``) is checked against the whole-batch look-back gathered by row index, pad rows
included, on prompt and decode batches.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from hypothesis import given, settings

from strategies import prompt_cases, random_config, random_decode_batch, random_prompt_batch


def _check(cfg, seqs, cp_size: int) -> None:
    import cpmeta
    import cpmeta.cp
    import cpmeta.diff

    full = cpmeta.prepare_prompt(seqs, cfg)
    for r in range(cp_size):
        want = cpmeta.prepare_for_mirror_cp(full, r, cp_size)
        got = cpmeta.cp.prepare_prompt_cp(seqs, cfg, r, cp_size)
        assert cpmeta.diff.metadata_diff(want, got, cfg=cfg) == [], (r, cp_size)


@settings(max_examples=40, deadline=None)
@given(case=prompt_cases(), cp=__import__("hypothesis").strategies.integers(1, 4))
def test_random_batches_equal_the_mirror_of_the_full_build(case, cp: int) -> None:
    cfg, seqs = case
    _check(cfg, seqs, cp)


@pytest.mark.parametrize("seed", range(6))
def test_engram_heavy_batches(seed: int) -> None:
    rng = random.Random(seed)
    cfg = random_config(rng, max_ngram_size=rng.choice([2, 3, 5]))
    _check(cfg, random_prompt_batch(rng, cfg, n_seqs=rng.randint(1, 5)), rng.randint(2, 4))


def test_array_input_from_a_batch_state() -> None:
    import cpmeta
    import cpmeta.cp
    import cpmeta.diff
    from cpmeta.launch.scheduler import default_config

    cfg = default_config(max_model_len=2048)
    st = cpmeta.BatchState(cfg, 4)
    rng = np.random.default_rng(2)
    for i, n in enumerate((700, 300, 1200)):
        toks = rng.integers(1, 999, n)
        toks[n // 2] = cfg.image_token_id  # an image span inside the prompt
        st.add_request(i, toks, list(range(10 * i, 10 * i + cpmeta.blocks_needed(n, cfg))), i,
                       compressed_token_ids=rng.integers(0, 99, n // 3))
    for chunk in ((256, 200, 256), (256, 100, 512)):  # the second chunk reads look-back history
        b = st.prompt_batch(np.arange(3), np.array(chunk), num_placeholders=1)
        _check(cfg, b, 3)


@pytest.mark.parametrize("is_prompt", [True, False])
def test_ngram_of_rows_is_the_gathered_look_back(is_prompt: bool) -> None:
    from cpmeta.builders.common_njit import ngram_of_rows
    from cpmeta.state.batch import as_sequence_batch
    import cpmeta

    rng = random.Random(9)
    for _ in range(20):
        cfg = random_config(rng, max_ngram_size=rng.randint(1, 5))
        seqs = (random_prompt_batch if is_prompt else random_decode_batch)(rng, cfg, n_seqs=rng.randint(1, 5))
        full = (cpmeta.prepare_prompt if is_prompt else cpmeta.prepare_decode)(seqs, cfg).ngram_token_ids
        sb = as_sequence_batch(seqs, cfg, is_prompt=is_prompt)
        rows = np.array([-1] + list(range(full.shape[0]))[::-3] + [-1, 0], np.int64)
        got, err = np.full((len(rows), cfg.max_ngram_size), 7, np.int32), np.zeros(4, np.int64)
        table = cfg.ngram_lookup
        tab = np.zeros(0, np.int64) if table is None else table.to(torch.int64).numpy()
        img = cfg.image_token_id
        code = ngram_of_rows(*(a.astype(np.int64) for a in (sb.seqlen_q, sb.seqlen_k, sb.tokens, sb.token_offsets,
                                                            sb.compressed, sb.compressed_offsets)),
                             rows, cfg.ngram_pad_token, -1 if img is None else img, img is not None, tab,
                             table is not None, got, err)
        assert code == 0 and err[0] == 0
        want = np.where((rows >= 0)[:, None], full.numpy()[np.maximum(rows, 0)], 0)
        assert np.array_equal(got, want), (cfg, rows)
