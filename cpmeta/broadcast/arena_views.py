"""Small compiled helpers of ``LayoutArena`` (``cpmeta.broadcast.arena``): attribute getters,
the per-layout value setter, and the poison of a retired arena."""

from __future__ import annotations

import operator
from typing import Any

import torch

from .plan import Plan
from .schema import Schema

__all__ = ["tuple_getter", "value_setter", "poison_value"]


def poison_value(dtype: torch.dtype) -> Any:
    """What a retired arena's tensors are filled with (``CPMETA_POISON_ARENAS``): integers their
    dtype's max (an index or a length past any table: indexing with it raises), floats NaN, bools
    True. Example: int32 -> 2147483647, float16 -> nan."""
    if dtype == torch.bool:
        return True
    if dtype.is_floating_point:
        return float("nan")
    return torch.iinfo(dtype).max


def tuple_getter(names: list[str]) -> Any:
    """``f(obj) -> tuple`` of the named attributes (one C call; ``()`` for none)."""
    if not names:
        return lambda obj: ()
    if len(names) == 1:
        get = operator.attrgetter(names[0])
        return lambda obj: (get(obj),)
    return operator.attrgetter(*names)


def value_setter(plan: Plan) -> Any:
    """``f(md, values)`` writing one step's values at the layout's value paths (compiled once)."""
    schema = plan.schema
    assert isinstance(schema, Schema), "persistent outputs hold dataclasses"
    names = schema.field_names
    slots = [(names[pos], sub) for pos, sub in plan.value_slots]
    if all(sub is None for _, sub in slots):
        flat = [n for n, _ in slots]

        def set_flat(md: Any, values: list[Any]) -> None:
            for n, v in zip(flat, values):
                setattr(md, n, v)
        return set_flat

    def set_nested(md: Any, values: list[Any]) -> None:
        for (n, sub), v in zip(slots, values):
            if sub is None:
                setattr(md, n, v)
            else:
                getattr(md, n)[sub] = v
    return set_nested
