"""The step protocol (issue 38, items 1, 2 and 4) on real gloo ranks: no call ever returns another
step's data, a failed send poisons nothing, and every path makes the same checks.

Every frame carries its step number; every rank knows which step it holds. A failure between "the
driver starts step k" and "every rank holds step k" ends with the same named error on every rank
(the driver sends the followers an abort frame for step k) and the next call works, in step:

- the driver's own bad input caught by the engine (a dict instead of the schema's class, a numpy
  array or an int in a tensor field, ``broadcast_tensor_dict`` given a non-dict);
- a follower that passes an object by mistake (its ``ValueError`` consumes its step);
- a send that fails after its layout was first used (a meta tensor) or that the driver refuses
  before writing a byte (a values block over ``MAX_VALUES_BYTES``): the layout is not poisoned;
- ``persistent_outputs=True`` refuses a frame that re-declares a fixed dim exactly like the packed
  path (frames crafted as in tests/test_wire_fuzz.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import pytest
import torch

from multiproc import run_ranks
from test_broadcast_multirank import _expect_same, _random_case

pytestmark = pytest.mark.timeout(240)


def _outcome(fn: Any) -> tuple[str, Any]:
    """``("ok", result)`` or ``(the error's builtin class, message)`` (a ``LayoutError`` is a
    ``ValueError``: the followers raise the builtin class the driver's error is)."""
    try:
        return "ok", fn()
    except Exception as e:  # noqa: BLE001 - the test compares what every rank saw
        return next(c.__name__ for c in type(e).__mro__ if c.__module__ == "builtins"), str(e)


# ---- item 1: a caught driver-side error is the same named error on every rank ----------------

def _bad_inputs(md: Any) -> list[tuple[str, Any]]:
    import numpy as np

    return [("a dict instead of InputMetadata", {"positions": md.positions}),
            ("a numpy array in a tensor field", md.replace(positions=np.arange(md.total_q, dtype=np.int32))),
            ("an int in a tensor field", md.replace(positions=7))]


def _driver_errors(rank: int, world: int) -> list[list[str]]:
    import cpmeta

    seen = []
    with cpmeta.MetadataBroadcaster(src=0, timeout=30) as bc:
        cfg, md = _random_case(38, 1, False)
        for what, bad in _bad_inputs(md):
            cfg2, good = _random_case(38, len(seen) + 2, False)
            kind, msg = _outcome(lambda: bc.broadcast(bad if rank == 0 else None))
            assert kind != "ok", f"rank {rank}: {what}: the step was returned ({msg!r:.200})"
            if rank != 0:
                assert "step" in msg and f"rank {rank}" in msg and "refused this step" in msg, msg
            got = bc.broadcast(good if rank == 0 else None)  # the next call: in step
            _expect_same(good, got, cfg2, f"rank {rank}: the step after {what}")
            seen.append([what, kind, msg if rank == 0 else msg.split("refused this step: ", 1)[1]])
    return seen


def test_a_caught_driver_error_is_the_same_named_error_on_every_rank_then_in_step() -> None:
    out = run_ranks(_driver_errors, 3, timeout=200)
    for drv, *fols in zip(*out):  # the same error class on every rank, the driver's message
        for f in fols:
            assert f[:2] == drv[:2] and f[2].endswith(drv[2]), (drv, f)
    assert [k for _, k, _ in out[0]] == ["TypeError", "ValueError", "ValueError"], out[0]


def _follower_error(rank: int, world: int) -> list[str]:
    import cpmeta

    seen = []
    with cpmeta.MetadataBroadcaster(src=0, timeout=30) as bc:
        for i in range(4):
            cfg, md = _random_case(39, i, i % 2 == 0)
            if rank == 1 and i == 1:  # passes an object by mistake
                with pytest.raises(ValueError, match="only src=0 passes metadata"):
                    bc.broadcast(md)
                seen.append("refused")
                continue
            got = bc.broadcast(md if rank == 0 else None)
            _expect_same(md, got, cfg, f"rank {rank} step {i}")
            seen.append("same")
    return seen


def test_a_follower_passing_an_object_gets_a_value_error_and_stays_in_step() -> None:
    out = run_ranks(_follower_error, 2, timeout=200)
    assert out == [["same"] * 4, ["same", "refused", "same", "same"]], out


def _tensor_dict_errors(rank: int, world: int) -> list[str]:
    from cpmeta.broadcast import broadcast_tensor_dict, close_tensor_dict_channels

    seen = []
    try:
        for i in range(3):
            d = {"ids": torch.arange(4 + i), "n": i}
            bad = i == 1
            kind, got = _outcome(lambda: broadcast_tensor_dict(
                ([("ids", d["ids"])] if bad else d) if rank == 0 else None))
            if bad:
                assert kind != "ok", f"rank {rank}: a refused step was returned: {got!r:.200}"
                seen.append(kind)
            else:
                assert kind == "ok", (kind, got)
                assert got["n"] == i and torch.equal(got["ids"], d["ids"]), (rank, i, got)
                seen.append("same")
    finally:
        close_tensor_dict_channels()
    return seen


def test_tensor_dict_driver_error_is_the_same_named_error_on_every_rank() -> None:
    out = run_ranks(_tensor_dict_errors, 2, timeout=200)
    assert out[0] == out[1] == ["same", "TypeError", "same"], out


# ---- item 2: a failed send poisons nothing; the driver checks before it writes a byte ----------

@dataclass
class NamedStep:
    """Any dataclass (``schema=``): a tensor and a list of names (its values block can be large)."""

    ids: Optional[torch.Tensor] = None
    names: Optional[list[str]] = None


def _failed_sends(rank: int, world: int) -> list[str]:
    import cpmeta
    from cpmeta.broadcast.wire import MAX_VALUES_BYTES

    seen = []
    with cpmeta.MetadataBroadcaster(src=0, timeout=30) as bc:
        cfg, md = _random_case(40, 1, False)
        meta = md.replace(positions=torch.empty(md.positions.shape, dtype=md.positions.dtype, device="meta"))
        kind, msg = _outcome(lambda: bc.broadcast(meta if rank == 0 else None))
        assert kind != "ok", f"rank {rank}: a meta tensor was broadcast ({msg!r:.200})"
        seen.append(kind)
        for i in range(2):  # the same layout, real tensors: every rank gets it
            got = bc.broadcast(md if rank == 0 else None)
            _expect_same(md, got, cfg, f"rank {rank}: the layout after a failed send, step {i}")
    with cpmeta.MetadataBroadcaster(src=0, timeout=30, schema=NamedStep) as bc:
        big = NamedStep(torch.arange(5), ["x" * 1000] * (MAX_VALUES_BYTES // 1000 + 1))
        kind, msg = _outcome(lambda: bc.broadcast(big if rank == 0 else None))
        if rank == 0:
            assert kind == "ValueError" and "MAX_VALUES_BYTES" in msg, (kind, msg)
        seen.append(kind)
        for n in (3, 4):
            step = NamedStep(torch.arange(n), ["a", "b"])
            got = bc.broadcast(step if rank == 0 else None)
            assert torch.equal(got.ids, step.ids) and got.names == ["a", "b"], (rank, got)
    return seen


def test_a_failed_send_does_not_poison_its_layout() -> None:
    out = run_ranks(_failed_sends, 2, timeout=200)
    assert out[0] == out[1], out  # the same named error on both ranks, then in step
    assert out[0][1] == "ValueError", out


# ---- item 4: one set of checks for every path ---------------------------------------------------

def test_persistent_outputs_refuses_a_redeclared_fixed_dim_like_the_packed_path() -> None:
    """A sealed frame of a persistent driver (its builder's arena copied whole) whose ``[n, 2]``
    / ``[n, 4]`` tensor is re-declared ``[2n, 1]`` / ``[2n, 2]`` (same bytes, crcs recomputed) is
    refused naming the field, and the follower then takes the real frame."""
    from cpmeta.broadcast.schema import INPUT_METADATA
    from reliability_wire import loopback, receive
    from test_wire_fuzz import _redeclared, compare, payloads

    refused = 0
    with loopback() as make:
        drv = make(0, False, True)
        for name, md in payloads():
            if not name.startswith("decode-"):
                continue
            drv.broadcast(md)
            drv.broadcast(md)
            first, later = drv._objects.frames[-2:]
            for what, field, bad in _redeclared(first):
                if "reshaped" not in what or not INPUT_METADATA.specs[field.split(".")[0]].fixed:
                    continue  # (block_tables [n, 4]: its width is the config's, not the schema's)
                fol = make(1, False, True)
                with pytest.raises(RuntimeError) as e:
                    receive(fol, bad)
                msg = str(e.value)
                assert "rank 1" in msg and field in msg and "fixes" in msg, (name, what, msg)
                assert compare(md, receive(fol, first)) == "equal", (name, what)
                assert compare(md, receive(fol, later)) == "equal", (name, what)
                refused += 1
    assert refused >= 2, refused
