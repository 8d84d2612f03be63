"""How a generation round reaches the model: the plain transformers module inside the training wrappers, with whole
parameters, in the generation dtype, put back exactly as it was afterwards.

Invariants: outside `generation_module()` the training module is untouched (wrappers, sharding, dtypes, values,
train/eval mode); inside, the yielded module is the `PreTrainedModel` that owns `init_continuous_batching` (PEFT:
the base model with adapters active). Sharded strategies enter it on every rank together (as the trainers do).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from transformers import PreTrainedModel

from ..engine import sharding
from ..engine.precision import GenerationPrecision

if TYPE_CHECKING:
    from accelerate import Accelerator

__all__ = ["ModelAccess", "plain_module"]


def plain_module(model: torch.nn.Module) -> PreTrainedModel:
    """The transformers model inside a training wrapper (DDP, accelerate) and PEFT, with parameters in place.

    `TypeError` for a model that does not support continuous batching."""
    from accelerate.utils import extract_model_from_parallel

    return _base_transformers_model(extract_model_from_parallel(model))


def _base_transformers_model(model: torch.nn.Module) -> PreTrainedModel:
    """The transformers model that owns `init_continuous_batching`; for PEFT, the base model with adapters active."""
    get_base = getattr(model, "get_base_model", None)
    if callable(get_base) and not hasattr(type(model), "init_continuous_batching"):
        model = get_base()
    if not hasattr(model, "init_continuous_batching"):
        raise TypeError(f"{type(model).__name__} does not support transformers continuous batching.")
    return model


class ModelAccess:
    """Unwrap, gather and cast the training model for one round at a time (arguments: `ContinuousBatchingGenerator`).

    Refuses at construction what cannot be served: ZeRO-3 without gathering for generation."""

    def __init__(
        self,
        model: torch.nn.Module,
        accelerator: Accelerator | None,
        gather_deepspeed3_params: bool,
        gradient_checkpointing_kwargs: dict[str, Any] | None,
        cast_dtype: torch.dtype | None,
        cast_lm_head_to_fp32: bool,
        keep_generation_weights: bool | None = None,
    ) -> None:
        if accelerator is not None and not gather_deepspeed3_params and sharding.zero_stage(accelerator) == 3:
            raise ValueError(
                "ds3_gather_for_generation=False is not supported with continuous batching: the engine's forwards "
                "would run ZeRO-3's per-layer all-gathers from its own thread, out of step across ranks (a hang). "
                "Keep ds3_gather_for_generation=True (the default)."
            )
        self.model = model
        self.accelerator = accelerator
        self.gather_deepspeed3_params = gather_deepspeed3_params
        self.gradient_checkpointing_kwargs = gradient_checkpointing_kwargs
        # Copies of the weights are kept between rounds unless each would be a full copy of a sharded model (or the
        # user chose otherwise: `keep_generation_weights`).
        sharded = sharding.is_sharded(model, accelerator)
        keep_copies = not sharded if keep_generation_weights is None else keep_generation_weights
        self.precision = GenerationPrecision(cast_dtype, cast_lm_head_to_fp32, keep_copies=keep_copies)
        #: Whether the weights the engine reads sit at the same addresses every round: not when they are gathered
        #: (ZeRO-3, FSDP) or copied (per-round generation copies) anew for each round.
        self.stable_weights = not sharded and (keep_copies or cast_dtype is None)
        # Unwrapped once: a training model's wrappers do not change between rounds, and accelerate's unwrapping costs
        # ~0.6 ms a call (it re-reads package metadata: `is_deepspeed_available`), twice a round (issue 28).
        self._lock_key: torch.nn.Module | None = None
        self._unwrapped: torch.nn.Module | None = None

    def lock_key(self) -> torch.nn.Module:
        """What a round's lock is keyed by: the plain transformers model, as the async controller keys it. The wrapper
        itself for a model the engine cannot run (`TypeError`): the round refuses it later, with the reason."""
        if self._lock_key is None:
            try:
                self._lock_key = plain_module(self.model)
            except TypeError:
                self._lock_key = self.model
        return self._lock_key

    @contextlib.contextmanager
    def generation_module(self) -> Iterator[PreTrainedModel]:
        """Yield the plain transformers module with full parameters in the generation dtype; undo on exit."""
        if self.accelerator is not None:
            from trl.distributed import DistributedBackend
            from trl.models.utils import unwrap_model_for_generation

            unwrap = unwrap_model_for_generation(
                self.model,
                self.accelerator,
                gather_deepspeed3_params=self.gather_deepspeed3_params,
                gradient_checkpointing_kwargs=self.gradient_checkpointing_kwargs,
            )
            summon = DistributedBackend(self.accelerator).summon_full_params(self.model, recurse=False)
        else:
            from accelerate.utils import extract_model_from_parallel

            if self._unwrapped is None:
                self._unwrapped = extract_model_from_parallel(self.model)
            unwrap = contextlib.nullcontext(self._unwrapped)
            summon = contextlib.nullcontext()
        with unwrap as unwrapped, torch.no_grad(), summon, sharding.fsdp2_unsharded(unwrapped):
            module = _base_transformers_model(unwrapped)
            # Generation runs on low-precision copies: the training module keeps its dtypes and exact values.
            with self.precision.applied(module):
                was_training = module.training
                try:
                    yield module
                finally:
                    module.train(was_training)

    def generation_weights(self, module: PreTrainedModel) -> contextlib.AbstractContextManager[None]:
        """Point `module`'s tensors at the generation-dtype copies until exit (see `engine/precision.py`)."""
        return self.precision.applied(module)
