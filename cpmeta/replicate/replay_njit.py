"""A step frame's runs replayed in ONE compiled call per batch spec: appends, finishes, adds, specs.

:func:`replay` walks the frame's runs from run ``r`` and applies, with the state room's own
kernels (``append_rows``, ``gather_step``, ``finish_rows``, ``add_rows``: the code
``BatchState``'s calls run), every run of appended tokens, blocks or Engram ids -- and, with
``book`` (the caller found every added id new), every run of finished and added requests on the
free list as a stack (``BatchState.free_stack``; an add must take the slot the driver's took, the
stack's hand-out order; the caller books the request ids, ``BatchState.book_replayed``) -- and
gathers the next batch spec's ``SequenceBatch`` arrays. A typical decode step (``TOK``, ``BLK``,
``SPEC``) is then one call where the ``BatchState`` replay of :mod:`cpmeta.replicate.apply` made
three, each through its Python argument checks (the replay's share of a follower's step after an
idle gap is mostly those), and a prompt step with finishes and adds one too.

It returns to Python (:mod:`cpmeta.replicate.apply`) at

- a batch spec gathered: status :data:`S_SPEC`, the batch's buffer, placeholder mask and
  whether the gather vouched for it (the caller wraps them as the ``SequenceBatch``), its step
  check rows written (what ``batch_check`` computes, so the follower compares without another call);
- a run it leaves to Python (``SID``, ``SVS``, an unknown run; ``ADD`` and ``FIN`` without
  ``book``): :data:`S_RUN`;
- ANY refusal (a column read past its end, a code of a state kernel, an add in another slot
  than the driver's, an argument the Python call would refuse): :data:`S_RUN` too, with ``err``
  filled. Nothing of that run is written (every kernel checks before it writes), so the caller replays the run
  through the ``BatchState`` call, which raises the named error -- one table of messages.
- the end of the runs: :data:`S_END`.

Columns are cursors into ONE int64 buffer (the frame's region): ``at[c]`` the next entry of
column ``c``, ``end[c]`` its end (indices of :data:`cpmeta.replicate.ops.COLUMNS`).
"""

from __future__ import annotations

import numpy as np

from ..base_njit import copy_from0
from ..jit import kernel, warmer
from ..state.requests_njit import add_rows, finish_rows
from ..state.state_njit import (K_BLOCKS, K_COMPRESSED, K_TOKENS, M_BLOCKS, M_COMPRESSED, M_FIRST_BAD, M_TOKENS,
                                MAX_PLACEHOLDERS, append_rows, gather_step, gathered_parts)
from ..builders.decode_njit import decode_fill_if
from .digest_njit import seq_digests
from .ops import ADD, BLK, CMP, COLUMNS, FIN, SPEC, SPEC_WORDS, TOK

__all__ = ["replay", "replay_decode", "S_END", "S_SPEC", "S_RUN"]

S_END, S_SPEC, S_RUN = 0, 1, 2
_TOK_SLOTS, _BLK_SLOTS, _CMP_SLOTS = COLUMNS.index("tok_slots"), COLUMNS.index("blk_slots"), COLUMNS.index("cmp_slots")
_SPEC_SLOTS = COLUMNS.index("spec_slots")
_FIN_SLOTS, _ADD_META, _ADD_TOKENS = COLUMNS.index("fin_slots"), COLUMNS.index("add_meta"), COLUMNS.index("add_tokens")


@kernel
def _fits(at: np.ndarray, end: np.ndarray, c: int, k: int) -> bool:
    """``k`` more entries of column ``c`` exist (no ``at + k`` that could wrap past int64)."""
    return 0 <= k <= end[c] - at[c]


@kernel
def _add_run(k: int, buf: np.ndarray, at: np.ndarray, end: np.ndarray, stack: np.ndarray, nfree: np.ndarray,
             scratch: np.ndarray, meta: np.ndarray, active: np.ndarray, token_ids: np.ndarray,
             block_table: np.ndarray, compressed: np.ndarray, p: np.ndarray, err: np.ndarray) -> bool:
    """An ``ADD`` run of ``k`` requests with the state's ``add_rows``, when each takes the slot
    the driver's did (the free list's hand-out order: ``stack``'s last first) and its counts
    are ``>= 0`` within the flat columns; ``False`` with nothing written otherwise. ``scratch``
    [7 * max_seqs]: the rows as the kernel takes them (slots, scalars [3, k], three counts)."""
    if k < 0 or k > nfree[0] or not _fits(at, end, _ADD_META, 7 * k):
        return False
    rows = buf[at[_ADD_META]:at[_ADD_META] + 7 * k]
    sc = scratch[:7 * k]
    t0, t1, t2 = 0, 0, 0
    for i in range(k):
        if rows[7 * i] != stack[nfree[0] - 1 - i]:
            return False
        n0, n1, n2 = rows[7 * i + 4], rows[7 * i + 5], rows[7 * i + 6]
        if n0 < 0 or n1 < 0 or n2 < 0 or n0 > end[_ADD_TOKENS] - at[_ADD_TOKENS] - t0 or \
                n1 > end[_ADD_TOKENS + 1] - at[_ADD_TOKENS + 1] - t1 or n2 > end[_ADD_TOKENS + 2] - at[_ADD_TOKENS + 2] - t2:
            return False
        t0, t1, t2 = t0 + n0, t1 + n1, t2 + n2
        for j in range(7):
            sc[j * k + i] = rows[7 * i + j]
    toks = buf[at[_ADD_TOKENS]:at[_ADD_TOKENS] + t0]
    blocks = buf[at[_ADD_TOKENS + 1]:at[_ADD_TOKENS + 1] + t1]
    comp = buf[at[_ADD_TOKENS + 2]:at[_ADD_TOKENS + 2] + t2]
    if add_rows(sc[:k], toks, sc[4 * k:5 * k], blocks, sc[5 * k:6 * k], comp, sc[6 * k:], sc[k:4 * k].reshape(3, k), meta,
                active, token_ids, block_table, compressed, p, err):
        return False
    nfree[0] -= k
    at[_ADD_META] += 7 * k
    at[_ADD_TOKENS] += t0
    at[_ADD_TOKENS + 1] += t1
    at[_ADD_TOKENS + 2] += t2
    return True


@kernel
def replay(r: int, runs: np.ndarray, buf: np.ndarray, at: np.ndarray, end: np.ndarray, spec: np.ndarray,
           si: int, meta: np.ndarray, active: np.ndarray, token_ids: np.ndarray, block_table: np.ndarray,
           compressed: np.ndarray, p: np.ndarray, mark: np.ndarray, err: np.ndarray, check: np.ndarray,
           crow: int, lookback: int, book: bool, stack: np.ndarray, nfree: np.ndarray, scratch: np.ndarray
           ) -> tuple[int, int, int, int, np.ndarray, np.ndarray, bool]:
    """Apply runs from ``r`` (``runs`` [r, 2] = (code, entries)); ``spec`` the specs' words
    (:data:`~cpmeta.replicate.ops.SPEC_WORDS` each), ``si`` the next one's index.

    A gathered batch's step check (:func:`cpmeta.replicate.digest.batch_check`: a header row
    ``[is_prompt, n_seq, lookback, 0]``, then :func:`~cpmeta.replicate.digest_njit.seq_digests`)
    goes to ``check[crow:]`` when it fits (rows the caller sized from the spec words).

    Returns ``(status, r, si, crow, batch buffer, placeholder mask, vouched)``: ``r`` the run to
    resume at (:data:`S_SPEC`: the one after the spec; :data:`S_RUN`: the run Python takes),
    ``crow`` the next check row (unchanged when the batch's rows did not fit), the buffer and
    mask empty unless :data:`S_SPEC`. ``err[0]`` is nonzero only when a kernel of the state
    room refused the run (Python's replay names it either way)."""
    empty = np.zeros(0, np.int64)
    no_ph = np.zeros(0, np.bool_)
    err[0] = 0
    n_runs = runs.shape[0]
    while r < n_runs:
        code, k = runs[r, 0], runs[r, 1]
        if code == TOK or code == BLK or code == CMP:
            c = _TOK_SLOTS if code == TOK else _BLK_SLOTS if code == BLK else _CMP_SLOTS
            if not (_fits(at, end, c, k) and _fits(at, end, c + 1, k)):
                return S_RUN, r, si, crow, empty, no_ph, False
            slots = buf[at[c]:at[c] + k]
            counts = buf[at[c + 1]:at[c + 1] + k]
            tot, room = 0, end[c + 2] - at[c + 2]
            for i in range(k):
                if counts[i] < 0 or counts[i] > room - tot:  # refused (Python names it), never wraps
                    return S_RUN, r, si, crow, empty, no_ph, False
                tot += counts[i]
            flat = buf[at[c + 2]:at[c + 2] + tot]
            # ONE call site, every argument a variable: the specialization Python's calls compiled
            kind, rows, have = K_TOKENS, token_ids, meta[M_TOKENS]
            if code == BLK:
                kind, rows, have = K_BLOCKS, block_table, meta[M_BLOCKS]
            elif code == CMP:
                kind, rows, have = K_COMPRESSED, compressed, meta[M_COMPRESSED]
            rc = append_rows(kind, slots, flat, counts, rows, have, active, mark, meta[M_FIRST_BAD], p, err)
            if rc:
                return S_RUN, r, si, crow, empty, no_ph, False
            at[c] += k
            at[c + 1] += k
            at[c + 2] += tot
            r += 1
        elif code == FIN and book:  # the state's finish_batch: slots live and distinct, then reset
            if not _fits(at, end, _FIN_SLOTS, k) or nfree[0] + k > stack.shape[0]:
                return S_RUN, r, si, crow, empty, no_ph, False
            slots = buf[at[_FIN_SLOTS]:at[_FIN_SLOTS] + k]
            if finish_rows(slots, meta, active, mark, err):
                return S_RUN, r, si, crow, empty, no_ph, False
            copy_from0(stack[nfree[0]:nfree[0] + k], slots)  # the free list takes them in order
            nfree[0] += k
            at[_FIN_SLOTS] += k
            r += 1
        elif code == ADD and book:
            if not _add_run(k, buf, at, end, stack, nfree, scratch, meta, active, token_ids, block_table,
                            compressed, p, err):
                return S_RUN, r, si, crow, empty, no_ph, False
            r += 1
        elif code == SPEC and k == 1 and si + SPEC_WORDS <= spec.shape[0]:
            is_prompt, n_ph, advance, uniform = spec[si], spec[si + 1], spec[si + 2], spec[si + 3]
            ns, nl, nd = spec[si + 4], spec[si + 5], spec[si + 6]
            c = _SPEC_SLOTS
            if n_ph < 0 or n_ph > MAX_PLACEHOLDERS or not (
                    _fits(at, end, c, ns) and _fits(at, end, c + 1, nl) and _fits(at, end, c + 2, nd)):
                return S_RUN, r, si, crow, empty, no_ph, False
            slots = buf[at[c]:at[c] + ns]
            lens = buf[at[c + 1]:at[c + 1] + nl]
            drafts = buf[at[c + 2]:at[c + 2] + nd]
            prompt = is_prompt != 0
            adv = prompt and advance != 0
            k_all, q, d = -1, lens, empty  # prompt: BatchState.prompt_batch(slots, lens, n_ph, advance)
            if not prompt:  # BatchState.decode_batch with the recorded draft count(s) (recorder.decode_spec)
                d = drafts
                if uniform >= 0:
                    k_all, q = uniform, empty
                elif uniform == -1 and nl == ns:
                    k_all, q = -1, lens
                elif uniform < -1 and nd == 0:
                    k_all, q = 0, empty
                else:
                    return S_RUN, r, si, crow, empty, no_ph, False
            g, ph, ok = gather_step(prompt, slots, q, k_all, d, n_ph, adv, meta, active, token_ids, block_table,
                                    compressed, p, mark, err)
            if g.shape[0] == 0:  # refused (a batch of no rows still has its offsets)
                return S_RUN, r, si, crow, empty, no_ph, False
            at[c] += ns
            at[c + 1] += nl
            at[c + 2] += nd
            n = ph.shape[0]
            if crow + 1 + n <= check.shape[0]:  # the batch's check rows (the driver's batch_check)
                check[crow, 0], check[crow, 1] = 1 if prompt else 0, n
                check[crow, 2], check[crow, 3] = lookback, 0
                sq, sk, sid, svs, nt, bt, bt_off, tok, tok_off, comp, comp_off = gathered_parts(g, n)
                seq_digests(check[crow + 1:crow + 1 + n], sq, sk, nt, sid, svs, ph, tok, tok_off, comp, comp_off,
                            bt, bt_off)
                crow += 1 + n
            return S_SPEC, r + 1, si + SPEC_WORDS, crow, g, ph, ok
        else:
            return S_RUN, r, si, crow, empty, no_ph, False
    return S_END, r, si, crow, empty, no_ph, False


@kernel
def replay_decode(r: int, runs: np.ndarray, buf: np.ndarray, at: np.ndarray, end: np.ndarray, spec: np.ndarray,
                  si: int, meta: np.ndarray, active: np.ndarray, token_ids: np.ndarray, block_table: np.ndarray,
                  compressed: np.ndarray, p: np.ndarray, mark: np.ndarray, err: np.ndarray, check: np.ndarray,
                  crow: int, lookback: int, book: bool, stack: np.ndarray, nfree: np.ndarray, scratch: np.ndarray,
                  k: np.ndarray, table: np.ndarray, raw: np.ndarray, fo: np.ndarray, shape: np.ndarray,
                  ferr: np.ndarray, info: np.ndarray, code: np.ndarray
                  ) -> tuple[int, int, int, int, np.ndarray, np.ndarray, bool]:
    """:func:`replay`, and when it gathered a decode batch it vouched for, that batch's metadata
    in the same call: :func:`~cpmeta.builders.decode_njit.decode_fill_if` into the arena of
    the shape last built with its rows and sequences (``k`` .. ``info``: ``cpmeta.builders.decode_sink.DecodeSink.args``; its
    return in ``code[0]``, -1 when it did not fill). A follower's decode step is then ONE
    compiled call from its frame's columns to its metadata. Returns what :func:`replay` does."""
    status, r, si, crow, g, ph, ok = replay(r, runs, buf, at, end, spec, si, meta, active, token_ids, block_table,
                                            compressed, p, mark, err, check, crow, lookback, book, stack, nfree,
                                            scratch)
    if status == S_SPEC and ok and spec[si - SPEC_WORDS] == 0:
        sq, sk, sid, _, _, bt, bt_off, tok, tok_off, comp, comp_off = gathered_parts(g, ph.shape[0])
        code[0] = decode_fill_if(sq, sk, sid, ph, tok, tok_off, comp, comp_off, bt, bt_off, lookback, k, table, raw,
                                 fo, shape, ferr, info)
    return status, r, si, crow, g, ph, ok


@warmer
def _warm() -> None:
    """Compile / load :func:`replay` on a two-slot state: one token run, one decode spec."""
    from ..state import BatchState
    from ..config import MetadataConfig

    st = BatchState(MetadataConfig(dense_compress_ratios=(), sparse_compress_ratios=(), window_size=0), 2)
    s = st.add_request(0, [1, 2], [0], 0)
    runs = np.array([[TOK, 1], [SPEC, 1]], np.int64)
    n = len(COLUMNS)
    buf = np.array([s, 1, 7, s], np.int64)
    at, end = np.zeros(n, np.int64), np.zeros(n, np.int64)
    at[_TOK_SLOTS:_TOK_SLOTS + 3] = [0, 1, 2]
    end[_TOK_SLOTS:_TOK_SLOTS + 3] = [1, 2, 3]
    at[_SPEC_SLOTS:_SPEC_SLOTS + 3] = 3
    end[_SPEC_SLOTS] = 4
    end[_SPEC_SLOTS + 1:_SPEC_SLOTS + 3] = 3
    spec = np.array([0, 0, 1, -2, 1, 0, 0], np.int64)
    replay(0, runs, buf, at, end, spec, 0, *st.kernel_arrays(), np.zeros((2, 4), np.int64), 0, st.lookback,
           True, *st.free_stack())
    from ..buffers import OutputArenas
    from ..builders.decode_sink import DecodeSink

    at[_TOK_SLOTS:_TOK_SLOTS + 3] = [0, 1, 2]  # the same step again: one more token, the fused build
    at[_SPEC_SLOTS:_SPEC_SLOTS + 3] = 3
    sink = DecodeSink(st.cfg, OutputArenas())
    replay_decode(0, runs, buf, at, end, spec, 0, *st.kernel_arrays(), np.zeros((2, 4), np.int64), 0, st.lookback,
                  True, *st.free_stack(), *sink.refresh())
    batch = st.decode_batch(np.array([st.add_request(1, [1, 2], [0], 0, num_computed=2)]))
    sink.fill(batch)  # built (the first of its shape), then filled by DecodeSink.fill's one kernel call
    sink.fill(batch)
