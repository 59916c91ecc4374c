"""Bad calls: ``BatchState``'s step calls and the CP steps every rank runs, given arguments a
careless engine could pass.

- A state driven by random, mostly valid calls (adds, appends, state ids, finishes, prompt and
  decode batches, each batch built), one argument in seven replaced by garbage (a negative or
  huge count, a float, a bool, ``None``, a 2-D or empty array): every call either works or raises
  ``ValueError`` / ``TypeError``, and a refused call leaves every array and map of the state as
  it was.
- Real prompt and decode metadata with one or two of its tensors reshaped, cut, lengthened,
  retyped or given odd values, then ``prepare_for_mirror_cp``, ``cp_kv_read_plan`` and
  ``compute_attn_info`` (under its own config or the other model's): ``ValueError`` /
  ``TypeError`` or a result, never another error (a numba typing error, an ``IndexError``, a
  read past an array's end).

Found this way and fixed (docs/reliability.md, "Found by these tests and fixed"): a decode batch of
no slots with drafts (``IndexError``), ``num_placeholders`` of 2**31 (a 128 GiB allocation), capacities
taken as 1 from ``1.5`` / ``True``, the KV read plan compiling a new signature for a 2-D index
field, the mirror and the attention indices naming no field.
"""

from __future__ import annotations

import copy
import dataclasses
import random
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cpmeta
from cpmeta.launch.scheduler import model_config
from cpmeta.state import BatchState

pytestmark = pytest.mark.timeout(240)

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
MODELS = ("seed", "plain")
_SCRATCH = ("_seen", "_err", "_one", "_one_count", "_add_scratch")  # hold nothing between calls
_GARBAGE = [-1, 10**6, 2**31, 2**63 - 1, 1.5, None, True, "x", np.array([1.5]), np.zeros((2, 2), np.int64),
            np.zeros(0, np.int64), [-3], [2**40]]


def _snapshot(state: BatchState) -> dict[str, Any]:
    return {k: copy.deepcopy(v) for k, v in vars(state).items() if k not in _SCRATCH}


def _same(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    return [k for k in a if (not np.array_equal(a[k], b[k]) if isinstance(a[k], np.ndarray) else a[k] != b[k])]


def _call(rng: random.Random, state: BatchState, n: int) -> tuple[str, list[Any], dict[str, Any]]:
    """One mostly valid call on ``state``'s live requests (an add when none lives)."""
    live = [int(s) for s in np.flatnonzero(state.active)]
    ids = lambda k, hi=5000: np.array([rng.randrange(hi) for _ in range(k)], np.int64)  # noqa: E731
    some = lambda: np.array(rng.sample(live, rng.randint(1, len(live))), np.int64)  # noqa: E731
    k = rng.randrange(12)
    if k <= 1 or not live:
        nt = rng.choice([1, 5, 17, 40])
        name, args = "add_request", [f"q{n}", ids(nt), ids(-(-nt // 16) + rng.choice([0, 1]), 1000), rng.randrange(8)]
        kw: dict[str, Any] = {"num_computed": rng.choice([0, nt, nt - 1])}
    elif k == 2:
        name, args, kw = "append_tokens", [rng.choice(live), ids(rng.choice([1, 2, 3]))], {}
    elif k == 3:
        slots = some()
        counts = np.array([rng.choice([0, 1, 2]) for _ in slots], np.int64)
        name, args, kw = "append_tokens_batch", [slots, ids(int(counts.sum())), counts], {}
    elif k == 4:
        name, args, kw = "append_blocks", [rng.choice(live), ids(rng.choice([1, 2]), 1000)], {}
    elif k == 5:
        name, args, kw = "append_compressed", [rng.choice(live), ids(rng.choice([1, 2]))], {}
    elif k == 6:
        name, args, kw = "set_state_id", [rng.choice(live), rng.randrange(16)], {}
    elif k == 7:
        name, args, kw = "set_swa_valid_start", [rng.choice(live), rng.randrange(40)], {}
    elif k == 8:
        name, args, kw = "finish", [rng.choice(live)], {}
    elif k == 9:
        slots = some()
        lens = np.array([max(1, int(state.num_tokens[s] - state.num_computed[s])) for s in slots], np.int64)
        name, args, kw = "prompt_batch", [slots, lens], {"num_placeholders": rng.choice([0, 0, 1, 3])}
    else:
        slots, d = some(), rng.choice([0, 0, 1, 2])
        name, args, kw = "decode_batch", [slots, ids(d * len(slots)), d], {"num_placeholders": rng.choice([0, 2])}
    if rng.random() < 1 / 7:  # one argument spoiled
        i = rng.randrange(len(args) + len(kw))
        if i < len(args):
            args[i] = rng.choice(_GARBAGE)
        else:
            kw[list(kw)[i - len(args)]] = rng.choice(_GARBAGE)
    return name, args, kw


@SETTINGS
@given(seed=st.integers(0, 2**32 - 1), model=st.sampled_from(MODELS))
def test_state_calls_with_spoiled_arguments(seed: int, model: str) -> None:
    rng, cfg = random.Random(seed), model_config(model)
    state = BatchState(cfg, 8, max_tokens=256)
    for n in range(60):
        name, args, kw = _call(rng, state, n)
        before = _snapshot(state)
        try:
            got = getattr(state, name)(*args, **kw)
        except (ValueError, TypeError):
            changed = _same(before, _snapshot(state))
            assert not changed, f"{name}{tuple(args)!r} {kw!r} was refused but changed {changed}"
            continue
        if name in ("prompt_batch", "decode_batch"):
            try:  # the builders' own checks (a state id past int32, e.g.) are named errors too
                cpmeta.prepare(got, cfg)
            except ValueError:
                pass


def _metadata(model: str) -> tuple[Any, list[Any]]:
    cfg = model_config(model)
    state = BatchState(cfg, 8, max_tokens=800)
    for i in range(4):
        n = 300 + 37 * i
        state.add_request(f"r{i}", list(range(1, n)), list(range(30 * i, 30 * i + 30)), i,
                          num_computed=0 if i < 2 else n - 1)
    prompt = state.prompt_batch(np.array([0, 1]), np.array([250, 130]), num_placeholders=1, advance=False)
    decode = state.decode_batch(np.array([2, 3]), np.array([5, 6, 7, 8]), 2, num_placeholders=1)
    return cfg, [cpmeta.prepare(prompt, cfg), cpmeta.prepare(decode, cfg)]


_MDS = {m: _metadata(m) for m in MODELS}


def _spoil(rng: random.Random, t: torch.Tensor) -> torch.Tensor:
    t = t.clone()
    k = rng.randrange(8)
    if k == 0 and t.numel():
        t.view(-1)[rng.randrange(t.numel())] = rng.choice([-1, -7, 2**30, 10**6, 0, 3])
    elif k == 1 and t.numel():
        t = t.reshape(-1)[:-1]
    elif k == 2:
        t = torch.cat([t.reshape(-1), t.reshape(-1)[:1]])
    elif k == 3:
        t = t.to(rng.choice([torch.int64, torch.int32, torch.float32, torch.bool, torch.int16]))
    elif k == 4 and t.numel() > 1:
        t = t.reshape(-1).flip(0)
    elif k == 5:
        t = t.reshape(-1)[:0]
    elif k == 6 and t.dim() == 1:
        t = t.reshape(1, -1)
    elif k == 7 and t.numel():
        t = t + rng.choice([1, -1, 100])
    return t


@SETTINGS
@given(seed=st.integers(0, 2**32 - 1), model=st.sampled_from(MODELS), prompt=st.booleans())
def test_cp_steps_on_spoiled_metadata(seed: int, model: str, prompt: bool) -> None:
    rng = random.Random(seed)
    cfg, mds = _MDS[model]
    md = mds[0 if prompt else 1]
    names = [f.name for f in dataclasses.fields(md) if isinstance(getattr(md, f.name), torch.Tensor)]
    spoiled = dataclasses.replace(md)
    for name in rng.sample(names, rng.choice([1, 1, 2])):
        setattr(spoiled, name, _spoil(rng, getattr(spoiled, name)))
    c = cfg if rng.random() < 0.8 else _MDS[MODELS[1 - MODELS.index(model)]][0]
    rank, size = rng.choice([(0, 2), (1, 2), (2, 4), (0, 1)])
    for step in (lambda: cpmeta.prepare_for_mirror_cp(spoiled, rank, size),
                 lambda: cpmeta.cp_kv_read_plan(spoiled, c, cp_rank=rank),
                 lambda: dataclasses.replace(spoiled).compute_attn_info(c)):
        try:
            step()
        except (ValueError, TypeError):
            pass
