"""In-process async rollouts with true overlap: the engine keeps generating through the trainer's forward and
backward on one copy of the weights, and pauses (between two of its steps) only for the optimizer step.

Why it is exact (docs/async.md, "Overlap"): the engine runs on an `EngineView` (engine/model_view.py), its own module
object over the training parameters' storage, which the trainer's train mode, checkpointing, hooks and attention
implementation never reach; forward and backward only read the weights. The optimizer step writes them, so
`begin_weight_update` / `end_weight_update` bracket it with the pause/apply/resume the rollout server uses
(`inflight_update.py`): each in-flight request records where the new version starts, then continues over its KV.

Invariants: outside an optimizer step the engine may run at any time and reads the current weights (or, with
`bf16`/`fp16`, generation-dtype copies refreshed inside the pause); every token carries the version that sampled it;
the trainer's module, mode and config are never written here; `stop` hard-stops and leaves no engine thread. On CUDA
the engine runs on its own stream, ordered against the trainer's (`engine/engine_stream.py`). Refused: sharded
parameters (ZeRO-3, FSDP: `model_view.SHARDED_REFUSAL` points to rollout servers). DDP and LoRA work (DDP's hooks sit
on its wrapper and autograd, not on the view; a LoRA view aliases adapters and base weights).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from ..engine import _upstream, guards
from ..engine.engine_stream import EngineStream
from ..engine.model_view import EngineView
from .engine_backend import LocalEngineBackend
from .inflight_update import paused_for_weight_update

logger = logging.getLogger(__name__)

__all__ = ["OverlapEngineBackend"]


@dataclass(eq=False, repr=False)
class OverlapEngineBackend(LocalEngineBackend):
    """The trainer's CB engine on a view of the training module, running except during optimizer steps.

    Args:
        generator, module, num_generations, max_prompt_len: as for `LocalEngineBackend`.
        engine_threads: CPU: the engine's intra-op threads (`None`: the caller's count); the trainer keeps its own.
    """

    generates_between_takes = True

    engine_threads: int | None = None

    def __post_init__(self) -> None:
        self.view = EngineView(self.module)  # `ValueError` for sharded parameters
        self.stream = EngineStream.for_device(self.view.module.device)  # CUDA: the engine's own stream; CPU: None
        if self.engine_threads is not None:  # runs on the engine's thread only: the trainer never runs the view
            self.view.module.register_forward_pre_hook(_ThreadCap(self.engine_threads))
        self._weights: contextlib.ExitStack | None = None  # generation-dtype copies applied to the view
        self._update: contextlib.ExitStack | None = None  # the pause held across an optimizer step
        self._close_priority = 0  # at exit, stop the running engine before generators are closed
        guards.close_at_exit(self)

    def start(self, capacity_groups: int) -> None:
        """Build the engine on the view, sized for every group that may be in flight; it runs from here on."""
        if self.manager is not None:
            return
        with guards.deferred_interrupts():
            self._apply_generation_weights()  # the engine (and its KV cache dtype) is built on these weights
            try:
                adopt = self.stream.adopt if self.stream is not None else None
                with _intra_op_threads(self.engine_threads):
                    workload, share = self.workload(capacity_groups), self.share_prefixes
                    self.manager = self.generator.engine_for(self.view.module, workload, adopt, share)
            except BaseException:
                self._restore_training_weights()
                raise

    def begin_weight_update(self, new_version: int) -> None:
        """Pause the engine between two steps and mark `new_version` on every request in flight (held until
        `end_weight_update`: the optimizer writes the weights meanwhile)."""
        if self.manager is None or self._update is not None:
            return
        stack = contextlib.ExitStack()
        stack.enter_context(paused_for_weight_update(self.manager, self._groups, new_version))
        if self.stream is not None:
            self.stream.before_weight_write()  # the engine's queued kernels finish before the optimizer writes
        self._update = stack

    def end_weight_update(self) -> None:
        """Check the view still reads the training tensors, refresh the generation copies, resume the engine."""
        stack, self._update = self._update, None
        if stack is None:
            return
        with stack:
            self.view.check_aliased()
            self._restore_training_weights()
            self._apply_generation_weights()  # copy_ into the kept copies: same addresses, new values
            if self.stream is not None:
                self.stream.after_weight_write()  # before the resume: the engine reads the new weights

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Hold the engine between two of its steps for the block, with no weight update (no version marked): work that
        should not share the cores with generation (an evaluation of the policy, a checkpoint) runs alone, and the
        engine resumes its requests over their KV cache afterwards. Nests with the optimizer-step pause. No engine or a
        stopped one: the block runs at once."""
        manager = self.manager
        if manager is None or not manager.is_running():
            yield
            return
        with manager.pause():  # returns once the loop sits between two steps (as `inflight_update` relies on)
            yield

    def stop(self) -> None:
        """Hard-stop the engine (its thread has exited on return); in-flight groups are abandoned. Interrupt-safe."""
        with guards.deferred_interrupts():
            manager = self.manager
            if manager is not None:
                _upstream.request_hard_stop(manager)  # before the pause is released: at most one more batch runs
            update, self._update = self._update, None
            try:
                if update is not None:
                    update.close()
                if manager is not None and self.stream is not None:
                    _upstream.wait_for_thread_exit(manager, timeout=60.0)
                    self.stream.synchronize()  # before the cache and copies return to the allocator
                self.generator.close()
            finally:
                self.manager = None
                self._groups.clear()
                self._restore_training_weights()

    def _close_at_exit(self) -> None:
        if self.manager is not None:
            self.stop()

    def _apply_generation_weights(self) -> None:
        """Point the view (never the training module) at the generator's generation-dtype copies (a no-op without
        `cast_dtype` / `cast_lm_head_to_fp32`)."""
        if self._weights is None:
            stack = contextlib.ExitStack()
            stack.enter_context(self.generator.generation_weights(self.view.module))
            self._weights = stack

    def _restore_training_weights(self) -> None:
        if self._weights is not None:
            stack, self._weights = self._weights, None
            stack.close()


class _ThreadCap:
    """A forward pre-hook on the view: at most `threads` intra-op threads on the thread running it (the engine's).

    torch's intra-op count is per thread in practice (measured: a thread that set 1 runs its matmuls on 1 thread while
    the main thread keeps 2), but a new thread takes the count published last at its first parallel op, which may
    come after the trainer restored its own; and setting a count publishes it for threads started later."""

    def __init__(self, threads: int) -> None:
        self.threads = threads

    def __call__(self, *_: object) -> None:
        if torch.get_num_threads() > self.threads:
            torch.set_num_threads(self.threads)


@contextlib.contextmanager
def _intra_op_threads(threads: int | None) -> Iterator[None]:
    """Build the engine reading `threads` as the caller's count (`_upstream_patches` caps each step at
    it); the caller (the trainer) gets its own count back."""
    if threads is None:
        yield
        return
    own = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(own)  # also what threads started from now on take
