"""Async rollouts on the trainers' side: an `AsyncRolloutSource` (the async core on the trainer's engine, or on the
rollout servers through `remote.py`) fed from the training dataset, its groups in place of TRL's sampled rows, weight
updates fenced by callbacks, and the prompt stream's position in checkpoints.

Invariants: the source is built at the first training step that needs it, sized for the dataset's longest prompt
(every row validated first, naming the row); each `take` returns exactly `groups_per_step` groups whose rows replace
the sampler's; a resumed run restarts the stream at the checkpoint's saved position (no trained prompt replayed).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint

from ..checks import inputs
from ..configs import default_prefetch_depth, max_staleness_was_set, prefetch_depth_was_set
from ..engine import sharding
from ..engine.model_view import SHARDED_REFUSAL
from ..rollouts.async_controller import AsyncRolloutController
from ..rollouts.async_core import AsyncBounds, AsyncRolloutSource, PromptStream
from ..rollouts.model_access import plain_module
from ..rollouts.multi_turn import with_turns
from ..rollouts.rollout_groups import TokenValues, as_lists
from . import tool_turns, trl_internals
from .tool_turns import ToolTurns

if TYPE_CHECKING:
    from ..rollouts.generator import ContinuousBatchingGenerator
    from ..rollouts.rollout_groups import RolloutGroup
    from .remote import RemoteRollouts

logger = logging.getLogger(__name__)

__all__ = ["ASYNC_STATE_FILE", "AsyncBridge", "default_max_staleness"]

#: Per-process async state saved in each checkpoint directory (the prompt stream's resume position).
ASYNC_STATE_FILE = "trl_cb_async_state-rank{rank}.json"
#: Prompts tokenized per batch when the dataset is scanned for its longest prompt.
_SCAN_BATCH = 256


def default_max_staleness(prefetch_depth: int, optimizer_steps_per_take: float) -> int:
    """The staleness bound that drops nothing by construction when the trainer takes rollouts once every
    `optimizer_steps_per_take` (k) optimizer steps.

    Why: groups are consumed FIFO and the queue holds `prefetch_depth + 1` takes' worth, so a group submitted during
    take j is consumed by take j + prefetch_depth + 1 at the latest, and its first token was sampled at take j or
    later: its staleness is at most (prefetch_depth + 1) * k weight updates; a smaller bound drops groups every step.
    """
    return (prefetch_depth + 1) * max(1, math.ceil(optimizer_steps_per_take))


class _PauseEngineForOptimizerStep(TrainerCallback):
    """The optimizer mutates weights in place: the engine must not run a forward meanwhile."""

    def __init__(self, rollouts: AsyncBridge) -> None:
        self.rollouts = rollouts

    def on_pre_optimizer_step(self, *a: Any, **k: Any) -> None:
        if self.rollouts.source is not None:
            self.rollouts.source.begin_weight_update()

    def on_optimizer_step(self, *a: Any, **k: Any) -> None:
        if self.rollouts.source is not None:
            self.rollouts.source.end_weight_update()


class _SaveAsyncState(TrainerCallback):
    """Write the prompt stream's position into each checkpoint (`Trainer` calls `on_save` right after
    `_save_checkpoint` has written `checkpoint-<global_step>`)."""

    def __init__(self, rollouts: AsyncBridge) -> None:
        self.rollouts = rollouts

    def on_save(self, args: Any, state: Any, control: Any, **k: Any) -> None:
        folder = f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
        self.rollouts.save_state(os.path.join(args.output_dir, folder))


class AsyncBridge:
    """The trainer's async rollouts (a part of `TrainerRollouts`; `cb_async_generation`), the one writer of its
    state: `source` (the running rollouts, built at the first training step that needs them, `None` once stopped),
    `step_groups` (the finished groups taken for the step being scored, `None` outside a scoring), `stream_start`
    (where the next source starts: advanced when a source stops, set from a checkpoint on resume), `longest_prompt`
    (the training dataset's longest prompt in tokens, scanned once: the engine is sized for it) and `turns` (with
    tools or environments: the trainer's side of multi-turn rollouts, built with the source)."""

    def __init__(
        self,
        trainer: Any,
        remote: RemoteRollouts,
        build_generator: Callable[[], ContinuousBatchingGenerator],
    ) -> None:
        self.trainer = trainer
        self.remote = remote
        self.build_generator = build_generator
        self.source: AsyncRolloutSource | None = None
        self.step_groups: list[RolloutGroup] | None = None
        self.stream_start = 0
        self.longest_prompt: int | None = None
        self.turns: ToolTurns | None = None

    def setup(self) -> None:
        """Called at the end of the trainer's `__init__`: refuse unsupported setups early and hook weight updates."""
        trainer = self.trainer
        args = trainer.args
        if not getattr(args, "cb_async_generation", False):
            return
        if getattr(args, "cb_async_overlap", False) and sharding.is_sharded(trainer.model, trainer.accelerator):
            raise ValueError(SHARDED_REFUSAL)
        if not args.cb_server_urls and sharding.is_sharded(trainer.model, trainer.accelerator):
            raise ValueError(
                "cb_async_generation runs the engine on local, unsharded parameters: use a single process or DDP "
                "(ZeRO-3 and FSDP shard parameters between steps), or rollout servers (`cb_server_urls`)."
            )
        if getattr(trainer, "tools", None) and trainer.accelerator.num_processes > 1:
            raise ValueError(
                "cb_async_generation with tools or environments runs on one process (each sample's tool loop and "
                "environment live beside the rollout producer); use one process, or sync mode for several."
            )
        depth = self.prefetch_depth()
        if depth != args.cb_async_prefetch_depth:  # as TRL's trainers override a field: args show what runs
            logger.info(
                "Async rollouts with tools: cb_async_prefetch_depth set to %d (unset; %d without tools).",
                depth,
                args.cb_async_prefetch_depth,
            )
            args.cb_async_prefetch_depth = depth
        staleness = self.max_staleness()
        if staleness != args.cb_async_max_staleness:  # unset: the bound that drops nothing for this schedule
            logger.info("Async rollouts: cb_async_max_staleness set to %d (unset: drops nothing here).", staleness)
            args.cb_async_max_staleness = staleness
        trainer.add_callback(_PauseEngineForOptimizerStep(self))
        trainer.add_callback(_SaveAsyncState(self))

    def position(self) -> int:
        """Stream position of the first prompt no finished step has consumed (see `PromptStream`)."""
        return self.stream_start + (self.source.consumed_groups if self.source is not None else 0)

    def save_state(self, checkpoint_dir: str) -> None:
        if not os.path.isdir(checkpoint_dir):
            logger.warning("No checkpoint directory %s: async rollout state not saved.", checkpoint_dir)
            return
        state = {"stream_position": self.position(), "seed": self._stream_seed()}
        path = os.path.join(checkpoint_dir, ASYNC_STATE_FILE.format(rank=self.trainer.accelerator.process_index))
        with open(path, "w") as f:
            json.dump(state, f)

    def _load_state(self, checkpoint_dir: str) -> None:
        path = os.path.join(checkpoint_dir, ASYNC_STATE_FILE.format(rank=self.trainer.accelerator.process_index))
        if not os.path.isfile(path):
            logger.warning(
                "Resuming async rollouts from %s without saved stream state: the prompt stream restarts.",
                checkpoint_dir,
            )
            self.stream_start = 0
            return
        with open(path) as f:
            state = json.load(f)
        if state.get("seed") != self._stream_seed():
            logger.warning("The checkpoint's prompt stream used another seed: its position is applied as is.")
        start = self.stream_start = int(state["stream_position"])
        logger.info("Async rollouts resume the prompt stream at item %d.", start)

    def _stream_seed(self) -> int:
        return self.trainer.args.seed * 1000 + self.trainer.accelerator.process_index

    def _prompt_stream(self, start: int) -> PromptStream:
        """Endless shuffled stream of (dataset row, prompt ids), distinct per process, reproducible from the seed,
        starting at item `start` (a resumed run continues where the checkpoint left off)."""
        dataset = self.trainer.train_dataset

        def fetch(index: int) -> tuple[Any, list[int]]:
            row = dataset[index]
            return row, self._tokenize_rows([row])[0]

        return PromptStream(len(dataset), self._stream_seed(), fetch, start=start)

    def _tokenize_rows(self, rows: list[dict[str, Any]]) -> list[list[int]]:
        """The rows' prompt ids as TRL renders them; with tools, each with its own environment's tools (TRL's own
        tokenizer reads the batch's environments, which a stream item has none of)."""
        turns = self._turns()
        if turns is None:
            return trl_internals.tokenize_prompts(self.trainer, [row["prompt"] for row in rows])
        return [turns.render(turns.prompt_of(row), turns.environment_name(row)) for row in rows]

    def _turns(self) -> ToolTurns | None:
        """The multi-turn side of async rollouts (tools or environments; built once), else None."""
        if self.turns is None and getattr(self.trainer, "tools", None):
            self.turns = ToolTurns(self.trainer, self.trainer.args.cb_async_tool_timeout)
        return self.turns

    def _scan_prompts(self, validate: Callable[[list[list[int]]], None]) -> int:
        """Tokenize and validate every prompt of `train_dataset` (`validate`: the synchronous checks; the error names
        the row) and return the longest prompt's length: the async engine is sized for it, so no row can fail to be
        scheduled later."""
        dataset = self.trainer.train_dataset
        t0 = time.perf_counter()
        longest = 0
        for begin in range(0, len(dataset), _SCAN_BATCH):
            ids = self._tokenize_rows([dataset[i] for i in range(begin, min(begin + _SCAN_BATCH, len(dataset)))])
            try:
                validate(ids)
            except ValueError as err:
                raise ValueError(f"train_dataset rows {begin}..{begin + len(ids) - 1}: {err}") from None
            longest = max(longest, max(len(p) for p in ids))
        logger.info(
            "Scanned %d prompts in %.2fs: the longest has %d tokens.", len(dataset), time.perf_counter() - t0, longest
        )
        return longest

    def controller(self) -> AsyncRolloutSource:
        """The async rollouts, built (and started) the first time a training step needs them: from the rollout
        servers (`remote.py`) or the trainer's own engine, with the same bounds."""
        if self.source is not None:
            return self.source
        trainer = self.trainer
        args = trainer.args
        groups_per_step = args.generation_batch_size // trainer.accelerator.num_processes // trainer.num_generations
        bounds = AsyncBounds(
            prefetch_depth=self.prefetch_depth(),
            max_staleness=self.max_staleness(),
            keep_stale=args.cb_async_keep_stale,
            timeout=args.cb_generation_timeout,
        )
        module = plain_module(trainer.model_wrapped)
        controller: AsyncRolloutSource
        if args.cb_server_urls:
            max_new = int(trainer.generation_config.max_new_tokens)
            cb_config = args.transformers_continuous_batching_config or {}

            def validate(prompts: list[list[int]]) -> None:  # the servers run the trainer's model: same limits
                inputs.validate_prompts(prompts, module, max_new, cb_config)

            def validate_one(prompt: list[int]) -> None:
                validate([prompt])

            if self.longest_prompt is None:
                self.longest_prompt = self._scan_prompts(validate)
            stream = self._prompt_stream(self.stream_start)
            controller = self.remote.async_rollouts(stream, validate_one, groups_per_step, bounds)
        else:
            # Its own generator (the synchronous one may hold an engine for evaluation), built the same way.
            generator = self.build_generator()
            if self.longest_prompt is None:
                self.longest_prompt = self._scan_prompts(lambda ids: generator.validate_prompts(ids, module))
            controller = AsyncRolloutController(
                generator,
                module,
                self._prompt_stream(self.stream_start),
                max_prompt_len=self.longest_prompt + self._turn_context(),
                overlap=args.cb_async_overlap,
                engine_threads=args.cb_async_overlap_engine_threads,
                num_generations=trainer.num_generations,
                groups_per_step=groups_per_step,
                **bounds,
            )
        turns = self._turns()
        if turns is not None:  # each sample's tool loop runs between its turns (rollouts/multi_turn.py)
            core = getattr(controller, "controller", controller)  # servers: the main process's core
            max_turn = int(trainer.generation_config.max_new_tokens)
            with_turns(core, turns.open, args.max_completion_length, args.cb_async_tool_workers, max_turn)
        controller.start()
        self.source = controller
        return controller

    def _turn_context(self) -> int:
        """How much longer than the dataset's prompts a turn's prompt gets: with tools, a later turn's prompt holds
        the completion so far (at most `max_completion_length`)."""
        return int(self.trainer.args.max_completion_length) if self._turns() is not None else 0

    def prefetch_depth(self) -> int:
        """The depth async rollouts run at: the user's `cb_async_prefetch_depth`, or, unset, the default for this
        trainer (with tools or environments `DEFAULT_TOOLS_PREFETCH_DEPTH`: multi-turn staleness <= 1, measured; its
        comment in trl_cb/configs.py). Derived from the unset state, not from the value `setup` wrote into the args:
        a config shared with a trainer without tools still gets that trainer's default."""
        args = self.trainer.args
        if prefetch_depth_was_set(args):
            return args.cb_async_prefetch_depth
        multi_turn = bool(getattr(self.trainer, "tools", None))
        return default_prefetch_depth(bool(args.cb_async_overlap), multi_turn=multi_turn)

    def max_staleness(self) -> int:
        """`args.cb_async_max_staleness`, or (unset) the bound that drops nothing for this schedule: rollouts are
        taken once every `steps_per_generation * num_iterations / gradient_accumulation_steps` optimizer steps."""
        args = self.trainer.args
        if max_staleness_was_set(args):
            return args.cb_async_max_staleness
        steps_per_take = args.steps_per_generation * self.trainer.num_iterations / args.gradient_accumulation_steps
        return default_max_staleness(self.prefetch_depth(), steps_per_take)

    def take(self, inputs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Replace the sampler's rows by those of finished groups; keep the groups for `_generate_single_turn`."""
        trainer = self.trainer
        controller = self.controller()
        num_groups = len(inputs) // trainer.num_generations
        if num_groups != controller.groups_per_step:
            raise RuntimeError(
                f"Async rollouts expected {controller.groups_per_step} groups per step, got {num_groups}."
            )
        with trl_internals.profiling_context(trainer, "trl_cb.async_wait"):
            groups, metrics = controller.take(num_groups)
        for name, value in metrics.as_dict().items():
            trl_internals.log_metric(trainer, "train", name, value)
        self.step_groups = groups
        return [group.row for group in groups for _ in range(trainer.num_generations)]

    def completions(self, prompt_ids: list[list[int]]) -> tuple[list[list[int]], list[TokenValues]]:
        """The taken groups' completion ids (as lists: TRL decodes and pads them) and policy logprobs (lists, or
        tensors from a rollout server's binary answers: converted only where TRL needs lists, `mixin.py`)."""
        groups, G = self.step_groups, self.trainer.num_generations
        if groups and groups[0].conversations is not None:  # multi-turn: TRL's first call sees the first turns
            return tool_turns.first_turns(groups, prompt_ids)
        expected = [g.prompt_ids for g in groups for _ in range(G)]
        if [list(p) for p in prompt_ids] != expected:
            raise RuntimeError("Async rollouts are out of step with the prompts TRL tokenized.")
        completion_ids = as_lists([c for g in groups for c in g.completion_ids])
        logprobs = [lp for g in groups for lp in g.policy_logprobs]
        return completion_ids, logprobs

    def tool_loop(self) -> tuple[Any, ...] | None:
        """What TRL's `_tool_call_loop` returns for the taken groups (their loops ran during the rollout), or None
        outside an async multi-turn scoring."""
        groups = self.step_groups
        if not groups or groups[0].conversations is None:
            return None
        return tool_turns.tool_loop_results(groups)

    @contextlib.contextmanager
    def replay(self) -> Iterator[None]:
        """Around TRL's scoring of the taken groups: their environments replayed (`tool_turns.replay_environments`),
        then given back to the pool; the step's groups are dropped on exit, whatever happened (`take` set them)."""
        groups = self.step_groups
        try:
            if not groups or groups[0].conversations is None:
                yield
                return
            try:
                with tool_turns.replay_environments(self.trainer, groups, self.trainer.num_generations):
                    yield
            finally:
                self.turns.release([c for group in groups for c in group.conversations])
        finally:
            self.step_groups = None

    def active(self) -> bool:
        return bool(getattr(self.trainer.args, "cb_async_generation", False) and self.trainer.model.training)

    def resume(self, resume_from_checkpoint: str | bool | None) -> None:
        """Before `train`: continue the prompt stream from the checkpoint training resumes from."""
        args = self.trainer.args
        if getattr(args, "cb_async_generation", False) and resume_from_checkpoint:
            checkpoint = resume_from_checkpoint
            if isinstance(checkpoint, bool):  # as `Trainer.train` resolves it
                checkpoint = get_last_checkpoint(args.output_dir)
            if checkpoint is not None:
                self._load_state(checkpoint)

    def stop(self) -> None:
        """Hard-stop the controller (in-flight groups are abandoned); the next one continues the stream."""
        if self.source is not None:
            self.source.stop()
            self.stream_start = self.position()
            self.source = None
        if self.turns is not None:
            self.turns.close()
            self.turns = None
