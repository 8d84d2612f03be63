"""Forked samples' request states copied field by field instead of through a generic `deepcopy`.

Why: transformers forks each of a prompt's G-1 extra samples with `RequestState.fork`, which starts with
`copy.deepcopy(state)`: a generic walk that copies every prompt token one object at a time (~27 µs for a 16-token
prompt, ~1 µs more per prompt token). A round of 512 rows forks 448 states, ~12 ms of engine time
(docs/benchmark-log.md). `copy_state` returns what `deepcopy` returns (a new state whose fields are equal and share no
mutable object with the original, aliases between fields kept) in a few list copies: lists and sets of atomic values
(the token, logprob and timestamp lists) are copied whole, atomic values and enums shared as `deepcopy` shares them,
anything else goes to `deepcopy`. Upstream's `fork` still runs (ids, timestamps, its own list copies); only its
`deepcopy(self)` reaches `copy_state`, through a `__deepcopy__` set on the states about to be forked for the duration
of `update_batch` (where forks happen) and removed after (`with_fast_fork`, composed by `_upstream_patches`).
Upstream surface (tests/unit/test_contracts.py): `RequestState.fork` calls `deepcopy(self)`, a plain dataclass
(`__dict__`, no `__deepcopy__`); `scheduler._requests_to_fork` lists the states `update_batch` forks.
"""

from __future__ import annotations

import copy
import enum
from collections.abc import Callable
from typing import Any

__all__ = ["copy_state", "with_fast_fork"]

_HOOK = "__deepcopy__"  # the instance attribute `copy.deepcopy` looks up before its generic path
_ATOMIC = frozenset({int, float, bool, str, bytes, type(None)})  # what `deepcopy` returns as is


def copy_state(state: Any, memo: dict[int, Any] | None = None) -> Any:
    """`copy.deepcopy(state)` for a `__dict__` object whose fields are mostly atomic values and lists of them."""
    memo = {} if memo is None else memo
    new = type(state).__new__(type(state))
    memo[id(state)] = new
    fields = {}
    for name, value in state.__dict__.items():
        if name == _HOOK:
            continue
        kind = type(value)
        if kind in _ATOMIC or isinstance(value, enum.Enum):
            fields[name] = value
        elif id(value) in memo:  # an alias of an object copied already: the copy keeps the alias
            fields[name] = memo[id(value)]
        elif kind in (list, set) and set(map(type, value)) <= _ATOMIC:
            fields[name] = memo[id(value)] = kind(value)
        elif kind is tuple and set(map(type, value)) <= _ATOMIC:
            fields[name] = value  # `deepcopy` returns a tuple of atomic values itself
        else:
            fields[name] = copy.deepcopy(value, memo)
    new.__dict__.update(fields)
    return new


def with_fast_fork(scheduler: Any, update: Callable[[], None]) -> Callable[[], None]:
    """The batch processor's `update_batch` (`update`) with the states it forks copied by `copy_state`."""

    def update_batch() -> None:
        forking = list(scheduler._requests_to_fork)
        if not forking:
            return update()
        for state in forking:
            state.__dict__[_HOOK] = lambda memo, state=state: copy_state(state, memo)
        try:
            return update()
        finally:
            for state in forking:
                state.__dict__.pop(_HOOK, None)

    return update_batch
