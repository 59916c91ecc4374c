"""Random scheduler traces for ``ReplicatedBatchState`` tests: one seed, one sequence of calls.

``drive(target, cfg, rng)`` makes ONE step's calls on ``target`` -- a ``ReplicatedBatchState``
(the driver) or a plain ``BatchState`` (the reference, driven by the same seed): adds (one call
each, or every other step all in one ``add_requests_batch``; prompt,
block table, state id, Engram history, valid start, prefix-cache hits), finishes (one call each,
or every other step all in one ``finish_batch``, in reverse slot order; slots are reused), chunked prefill, decode with MTP drafts (one count for all, per-sequence counts, none),
placeholders, accepted tokens, block growth, Engram ids, moved state ids and valid starts, and
now and then a call the state refuses (which must leave every replica unchanged). It returns
``(is_prompt or None, batch or None)``: the batch of a plain ``BatchState`` at once, ``None``
for a replicated driver (``sync()`` returns it).
"""

from __future__ import annotations

import random
from typing import Any, Optional

import numpy as np

from cpmeta import BatchState, MetadataConfig, blocks_needed

REFUSALS = ("too many blocks", "unknown slot", "prefill decode", "too many tokens")


def _state(target: Any) -> BatchState:
    """The state the trace reads: a ``BatchState`` itself, or the ``.state`` of a replicated
    driver (or of ``launch.strategies.SchedulerTee``, the scheduler's own state)."""
    return target if isinstance(target, BatchState) else target.state


def _blocks(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(0, 50_000) for _ in range(n)]


def _free_state_id(st: BatchState, rng: random.Random, pending: frozenset | set = frozenset()) -> int:
    """A state id no live request holds (requests move between state slots now and then), nor
    one of the ``pending`` adds."""
    used = {int(x) for x in st.state_id[st.active]} | pending
    free = [i for i in range(2 * st.max_seqs) if i not in used]
    return rng.choice(free)


def _result(target: Any, results: Optional[list], name: str, *args: Any) -> None:
    """A call that reports the step's outcome (sampled / accepted tokens): made now, or -- with
    ``results`` a list -- kept there for the caller to make before the next step's calls (an
    engine's order: the forward runs between the spec and its results)."""
    if results is None:
        getattr(target, name)(*args)
    else:
        results.append((name, args))


def drive(target: Any, cfg: MetadataConfig, rng: random.Random, refusals: Optional[list] = None,
          results: Optional[list] = None) -> tuple[Optional[bool], Any]:
    """One step of calls on ``target`` (see the module docstring); ``results``: see
    :func:`_result` (its pending calls, if any, are made first)."""
    st = _state(target)
    if results:
        for name, args in results:
            getattr(target, name)(*args)
        results.clear()
    live = [int(s) for s in np.flatnonzero(st.active)]
    # finishes (their slots are reused by later adds): every other step's as ONE finish_batch call
    done = [s for s in live if rng.random() < 0.06]
    if len(live) % 2:
        target.finish_batch(np.array(done[::-1], np.int64))
    else:
        for s in done:
            target.finish(s)
    live = [int(s) for s in np.flatnonzero(st.active)]
    # adds: every other step's as ONE add_requests_batch call (no draw decides it: same stream)
    batch = len(live) % 2 == 0
    adds: list[tuple] = []
    while len(live) + len(adds) < st.max_seqs - 1 and rng.random() < (0.6 if len(live) + len(adds) < 3 else 0.15):
        n = rng.randint(1, min(300, st.max_tokens // 2))
        toks = [rng.randrange(1, 999) for _ in range(n)]
        comp = [rng.randrange(0, 99) for _ in range(rng.randint(0, n))] if st.max_compressed else []
        add = (f"q{rng.randrange(10**9)}", toks, _blocks(rng, blocks_needed(n, cfg)),
               _free_state_id(st, rng, {a[3] for a in adds}), comp, rng.choice((0, 0, rng.randrange(n))),
               rng.choice((0, 0, rng.randrange(n))))
        if batch:
            adds.append(add)
        else:
            live.append(target.add_request(*add[:4], compressed_token_ids=add[4], swa_valid_start=add[5],
                                           num_computed=add[6]))
    if adds:
        flat = [np.array([x for a in adds for x in a[k]], np.int64) for k in (1, 2, 4)]
        counts = [[len(a[k]) for a in adds] for k in (1, 2, 4)]
        live += target.add_requests_batch([a[0] for a in adds], flat[0], counts[0], flat[1], counts[1],
                                          [a[3] for a in adds], compressed_ids=flat[2], compressed_counts=counts[2],
                                          swa_valid_starts=[a[5] for a in adds],
                                          num_computed=[a[6] for a in adds]).tolist()
    _moves(target, st, live, rng)
    if refusals is not None and rng.random() < 0.1:
        refusals.append(_refused(target, st, live, rng))
    prefill = [s for s in live if st.num_computed[s] < st.prompt_len[s]]
    decoding = [s for s in live if st.num_computed[s] >= st.prompt_len[s]]
    n_ph = int(rng.random() < 0.15)
    if prefill and (not decoding or rng.random() < 0.4):
        slots = rng.sample(prefill, rng.randint(1, len(prefill)))
        lens = [rng.randint(1, int(st.prompt_len[s] - st.num_computed[s])) for s in slots]
        got = target.prompt_batch(np.array(slots), np.array(lens), num_placeholders=n_ph)
        for s in slots:  # the prompt done: its first sampled token
            if st.num_computed[s] >= st.prompt_len[s]:
                _result(target, results, "append_tokens", s, [rng.randrange(1, 999)])
        return True, got
    if not decoding:
        return None, None
    return False, _decode(target, cfg, st, decoding, n_ph, rng, results)


def _moves(target: Any, st: BatchState, live: list[int], rng: random.Random) -> None:
    """Engram ids, moved state ids and valid starts, now and then."""
    for s in live:
        r = rng.random()
        if r < 0.03:
            target.set_state_id(s, _free_state_id(st, rng))
        elif r < 0.06:
            target.set_swa_valid_start(s, rng.randrange(int(st.num_tokens[s]) + 1))
        elif r < 0.10 and st.max_compressed and st.num_compressed[s] < st.max_compressed:
            target.append_compressed(s, [rng.randrange(99)])


def _decode(target: Any, cfg: MetadataConfig, st: BatchState, decoding: list[int], n_ph: int,
            rng: random.Random, results: Optional[list] = None) -> Any:
    mode = rng.randrange(3)  # no drafts / 2 drafts each (one count) / 0-2 drafts each
    pairs = [(s, 0 if mode == 0 else 2 if mode == 1 else rng.randint(0, 2))
             for s in rng.sample(decoding, rng.randint(1, len(decoding)))]
    room = min(st.max_tokens, cfg.max_model_len) - 3  # drafts + accepted tokens must fit
    pairs = [(s, c) for s, c in pairs if st.num_tokens[s] + c < room]
    if not pairs:
        return None
    slots, counts = [s for s, _ in pairs], [c for _, c in pairs]
    for s, c in zip(slots, counts):  # blocks for the drafts' keys
        need = blocks_needed(int(st.num_tokens[s]) + c, cfg)
        have = int(st.num_blocks[s])
        if need > have:
            target.append_blocks(s, _blocks(rng, need - have))
    drafts = np.array([rng.randrange(1, 999) for _ in range(sum(counts))], np.int64)
    if mode == 0:
        got = target.decode_batch(np.array(slots), num_placeholders=n_ph)
    elif mode == 1:
        got = target.decode_batch(np.array(slots), drafts, 2, num_placeholders=n_ph)
    else:
        got = target.decode_batch(np.array(slots), drafts, np.array(counts), num_placeholders=n_ph)
    acc = [rng.randint(1, c + 1) for c in counts]  # accepted drafts + the bonus token
    _result(target, results, "append_tokens_batch", np.array(slots),
            np.array([rng.randrange(1, 999) for _ in range(sum(acc))]),
                               np.array(acc))
    return got


def _refused(target: Any, st: BatchState, live: list[int], rng: random.Random) -> str:
    """A call the state must refuse, changing nothing (returns what was tried)."""
    kind = rng.choice(REFUSALS)
    try:
        if kind == "too many blocks" and live:
            target.append_blocks(live[0], list(range(st.max_blocks + 1)))
        elif kind == "unknown slot":
            target.append_tokens(st.max_seqs + 3, [1])
        elif kind == "prefill decode" and live:
            pre = [s for s in live if st.num_computed[s] < st.prompt_len[s]]
            target.decode_batch(np.array(pre or [st.max_seqs + 1]))
        elif live:
            target.append_tokens(live[-1], [7] * (st.max_tokens + 1 - int(st.num_tokens[live[-1]])))
        else:
            return kind
    except (ValueError, TypeError):
        return kind
    return f"{kind}: accepted"
