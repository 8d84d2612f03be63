"""The trainers' rollout state: everything the CB path keeps between calls, in one object with named fields.

Why one object: the trainer is TRL's, so every attribute we set on it shares a namespace with TRL's and transformers'
own. Keeping ours in `RolloutState` (`trainer.rollout_state`, created by `RolloutStateMixin` on first use, whatever
`__init__` ran) makes the state readable at a glance and leaves one trl_cb name on the trainer.

Invariants: each field has one writer, `WRITERS` names it (tests/unit/trainers/test_rollout_state.py checks every
assignment in `trainers/`); `sampling_logprobs` is written only by the generation call
(`ContinuousBatchingTrainerMixin._cb_generate`, a new object each round) and read by the scoring of the same batch
(`_cb_score`: the value if it changed during TRL's scoring), which hands it on to the IS correction as an argument.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..importance_sampling import ImportanceSamplingStats
from ..rollouts.async_core import AsyncRolloutSource
from ..rollouts.generator import ContinuousBatchingGenerator
from ..rollouts.rollout_groups import RolloutGroup, TokenValues

if TYPE_CHECKING:  # the serving modules need the `serve` extra (requests)
    import torch

    from ..serving.client import RolloutClient
    from ..serving.weight_sync import WeightSender
    from .tool_turns import ToolTurns

__all__ = [
    "WRITERS",
    "AsyncRolloutState",
    "DeferredCorrection",
    "ImportanceSamplingState",
    "RemoteRolloutState",
    "RolloutState",
    "RolloutStateMixin",
]


#: Who writes each part of `RolloutState` (a module of `trainers/`, or `module.function`); a part's own fields, and
#: those of the dataclasses it holds, have the same writer.
WRITERS: dict[str, str] = {
    "generator": "mixin",
    "sampling_logprobs": "mixin._cb_generate",
    "async_rollouts": "async_bridge",
    "remote": "remote",
    "importance_sampling": "is_correction",
}


@dataclass
class AsyncRolloutState:
    """`cb_async_generation` (written by `trainers/async_bridge.py` only)."""

    #: The running async rollouts: built at the first training step that needs them, `None` once stopped.
    source: AsyncRolloutSource | None = None
    #: The finished groups taken for the step being scored (`None` outside a scoring).
    step_groups: list[RolloutGroup] | None = None
    #: Stream position the next source starts from (advanced when a source stops; set from a checkpoint on resume).
    stream_start: int = 0
    #: The training dataset's longest prompt, in tokens (scanned once; the async engine is sized for it).
    longest_prompt: int | None = None
    #: With tools or environments: the trainer's side of multi-turn rollouts (built with the source).
    turns: ToolTurns | None = None


@dataclass
class RemoteRolloutState:
    """`cb_server_urls` (written by `trainers/remote.py` only). Client and senders live on the main process."""

    connected: bool = False
    client: RolloutClient | None = None
    senders: list[WeightSender] = field(default_factory=list)
    #: Each sender's server weight dtype, in `senders`' order.
    server_dtypes: list[torch.dtype | None] = field(default_factory=list)
    #: `global_step` of the last weight push (sync mode pushes once per optimizer step).
    pushed_step: int | None = None
    #: The last weight version pushed (0: none yet).
    weight_version: int = 0


@dataclass
class DeferredCorrection:
    """One generation batch whose IS correction waits for the loss forwards of its micro-batches."""

    mode: str  # "train" or "eval": where its metrics are logged
    parts_left: int  # micro-batches still to come
    stats: ImportanceSamplingStats | None = None  # merged over the micro-batches done so far


@dataclass
class ImportanceSamplingState:
    """Deferred IS corrections (written by `trainers/is_correction.py` only)."""

    #: Generation batches registered so far (the next batch's id).
    batches: int = 0
    pending: dict[int, DeferredCorrection] = field(default_factory=dict)


@dataclass
class RolloutState:
    """The per-trainer rollout state (see the module docstring for who writes what)."""

    #: The trainer's persistent in-process generator (built at the first round, closed at the end of `train`).
    generator: ContinuousBatchingGenerator | None = None
    #: The last round's sampler-side policy logprobs, one row per completion (lists, or fp32 tensors from a server);
    #: kept until the next round replaces it.
    sampling_logprobs: list[TokenValues] | None = None
    async_rollouts: AsyncRolloutState = field(default_factory=AsyncRolloutState)
    remote: RemoteRolloutState = field(default_factory=RemoteRolloutState)
    importance_sampling: ImportanceSamplingState = field(default_factory=ImportanceSamplingState)


class RolloutStateMixin:
    """Owns `rollout_state`: the one place it is created. The trainer mixins (and test doubles built from them
    without TRL's `__init__`) reach it through this property."""

    @property
    def rollout_state(self) -> RolloutState:
        state = self.__dict__.get("_rollout_state")
        if state is None:
            state = self.__dict__["_rollout_state"] = RolloutState()
        return state
