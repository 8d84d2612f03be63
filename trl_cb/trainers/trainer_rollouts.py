"""`TrainerRollouts`: the trainer's one rollout component, whatever runs the rollouts.

Why a component: the trainer is TRL's, and its subclass should read top to bottom like TRL's generation section.
Everything the CB path keeps between calls and does lives here, built once per trainer (`trainer.rollouts`), with the
surface the trainer's hooks call: `generate` one step's completions (and their sampler-side logprobs), `score` a batch
(TRL's scoring, then the IS correction), `compute_loss` (a deferred correction applied in TRL's loss forward),
`tool_loop`, `sync_servers`, `resume` and `close`. Its parts, each the one writer of its own fields: the in-process
`generator` and the round's `sampling_logprobs` (here), `async_rollouts` (async_bridge.py), `remote` (remote.py) and
`importance_sampling` (is_correction.py). The parts read the trainer (`args`, `accelerator`, `model`, ...) but never
write it; only `AsyncBridge.setup` registers callbacks and writes the prefetch depth that runs into its args.

Invariant: `sampling_logprobs` is written only by `generate` (a new object each round) and read by `score` for the
same batch (the value if it changed during TRL's scoring), which hands it to the IS correction as an argument.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from ..engine import guards
from ..rollouts.generator import ContinuousBatchingGenerator
from ..rollouts.rollout_groups import TokenValues
from ..upstream_warnings import quiet_trl_gradient_checkpointing
from . import trl_internals
from .async_bridge import AsyncBridge
from .generators import build_generator
from .is_correction import ImportanceSamplingCorrection, padded_sampling_logps
from .remote import RemoteRollouts

__all__ = ["TrainerRollouts"]


class TrainerRollouts:
    """The rollouts of one trainer (`trainer.rollouts`); see the module docstring. `per_token_loss`: GRPO's loss is
    per token (the IS weight may be (B, T)), RLOO's per sequence."""

    def __init__(self, trainer: Any, per_token_loss: bool) -> None:
        self.trainer = trainer
        self.per_token_loss = per_token_loss
        #: The persistent in-process generator (built at the first round, closed at the end of `train`).
        self.generator: ContinuousBatchingGenerator | None = None
        #: The last round's sampler-side policy logprobs, one row per completion (lists, or fp32 tensors from a
        #: server); kept until the next round replaces it.
        self.sampling_logprobs: list[TokenValues] | None = None
        self.remote = RemoteRollouts(trainer)
        self.async_rollouts = AsyncBridge(trainer, self.remote, self._new_generator)
        self.importance_sampling = ImportanceSamplingCorrection(trainer, per_token_loss)

    def _new_generator(self) -> ContinuousBatchingGenerator:
        trainer = self.trainer
        return build_generator(trainer.model_wrapped, trainer.generation_config, trainer.args, trainer.accelerator)

    def sync_generator(self) -> ContinuousBatchingGenerator:
        """The trainer's one synchronous generator, built at the first round and kept across steps."""
        if self.generator is not None and self.generator.model is not self.trainer.model_wrapped:
            # The training wrapper changed (e.g. eval before train, then accelerate.prepare): new generator.
            self.generator.close()
            self.generator = None
        if self.generator is None:
            self.generator = self._new_generator()
        return self.generator

    def generate(self, prompt_ids: list[list[int]]) -> tuple[list[list[int]], list[TokenValues]]:
        """Completions (lists) and their sampler-side policy logprobs (`GenerationResult.policy_logprobs`: what TRL's
        trainer computes, so the IS weight compares like with like; lists, or tensors from a server's binary answer)
        for TRL's prompt list (each prompt repeated per sample): the async groups taken for this step, a round on
        the rollout servers, or a round on the trainer's own engine."""
        if self.async_rollouts.step_groups is not None:
            completion_ids, logprobs = self.async_rollouts.completions(prompt_ids)
        elif self.trainer.args.cb_server_urls:
            completion_ids, logprobs = self.remote.generate(prompt_ids)
        else:
            generator = self.sync_generator()
            with trl_internals.profiling_context(self.trainer, "trl_cb.generate"):
                result = generator.generate(prompt_ids, num_generations=1)
            completion_ids, logprobs = result.completion_ids, result.policy_logprobs
        self.sampling_logprobs = logprobs
        return completion_ids, logprobs

    @quiet_trl_gradient_checkpointing()  # TRL's generation/scoring helpers call transformers' deprecated names
    def score(
        self, inputs: list[dict[str, Any]], trl_score: Callable[[list[dict[str, Any]]], dict[str, Any]]
    ) -> dict[str, Any]:
        """TRL's scoring (`trl_score`) of `inputs` (or, in async mode, of finished groups), then the IS correction.
        GRPO's sampling logprobs enter the batch as one padded tensor (`sampling_per_token_logps`, as TRL names it)
        built here from the rows (tensors from a server's binary answer, or lists), not from per-token lists TRL
        would pad itself."""
        if self.async_rollouts.active():
            inputs = self.async_rollouts.take(inputs)
        before = self.sampling_logprobs
        with self.async_rollouts.replay():  # multi-turn: the groups' environments, as the rollout left them
            output = self.importance_sampling.trl_score(functools.partial(trl_score, inputs))
        # This batch's: `generate` (the one writer) put a new object there during TRL's scoring, else no CB round
        sampled = self.sampling_logprobs if self.sampling_logprobs is not before else None
        if self.per_token_loss and sampled is not None and "sampling_per_token_logps" not in output:
            # GRPO: the sampler's logprobs TRL would have padded from lists (its loss reads them, e.g. for OPSM)
            output["sampling_per_token_logps"] = padded_sampling_logps(output, sampled)
        self.importance_sampling.correct(output, sampled)
        return output

    def compute_loss(self, inputs: dict[str, Any], trl_loss: Callable[[], torch.Tensor]) -> torch.Tensor:
        """TRL's loss (`trl_loss()`), with a deferred IS correction applied in its forward (`is_correction.py`)."""
        return self.importance_sampling.compute_loss(inputs, trl_loss)

    def tool_loop(self) -> tuple[Any, ...] | None:
        """What TRL's `_tool_call_loop` returns in async multi-turn scoring (the loops ran during the rollout), else
        None: TRL runs its own loop."""
        return self.async_rollouts.tool_loop()

    def sync_servers(self) -> int:
        """Connect to the rollout servers, push this step's weights unless pushed already, and return the version
        they now serve. A collective."""
        return self.remote.sync()

    def resume(self, resume_from_checkpoint: str | bool | None) -> None:
        """Before `train`: async rollouts continue their prompt stream from the checkpoint's saved position."""
        self.async_rollouts.resume(resume_from_checkpoint)

    def close(self) -> None:
        """Stop async rollouts and the generator (hard stop: nothing in flight is generated); interrupt-safe."""
        with guards.deferred_interrupts():
            self.async_rollouts.stop()
            self.remote.close()
            generator, self.generator = self.generator, None
            if generator is not None:
                generator.close()
