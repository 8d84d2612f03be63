"""A weight update applied to a running engine between two of its steps: the one pause/apply/resume mechanism of
the rollout server (`serving/engine_loop.py`) and of in-process overlap (`overlap.py`).

Invariants: the caller's block runs only while the engine loop sits between two steps (no forward reads a
half-written weight); every request in flight has its generated-token count recorded as the point where the new
version starts (`InFlightGroups.mark_weight_update`), so each token keeps the version that sampled it; on exit the
engine resumes its requests over the KV cache they have (nothing drained, nothing re-prefilled), and its decode graphs
only if every weight is where they read it (`_upstream.check_graphs`). Pauses nest (a server already paused by
`/pause` stays paused).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from ..engine import _upstream
from .rollout_groups import InFlightGroups

__all__ = ["paused_for_weight_update"]


@contextlib.contextmanager
def paused_for_weight_update(
    manager: _upstream.ContinuousBatchingManager | None, groups: InFlightGroups, new_version: int
) -> Iterator[bool]:
    """Pause `manager` between two steps, mark `new_version` on every request of `groups` in flight, and yield whether
    any was (the caller writes the weights in the block); resume on exit. No engine (or a stopped one): nothing runs,
    nothing to mark, the block runs at once."""
    if manager is None or not manager.is_running():
        with torch.no_grad():
            yield False
        return
    with torch.no_grad(), manager.pause():  # returns once the loop sits between two steps
        inflight = bool(groups.pending)
        if inflight:
            groups.mark_weight_update(manager, new_version)
        yield inflight
        _upstream.check_graphs(manager, manager.model)  # a weight written out of place drops the decode graphs
