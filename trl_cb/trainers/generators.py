"""The trainers' one generator construction site: a `ContinuousBatchingGenerator` from a trainer's model and config.

Why one function: the synchronous round (`mixin.py`) and the in-process async rollouts (`async_bridge.py`) each keep a
generator, and two call sites drifted apart (the async one lost the accelerator, `ds3_gather_for_generation` and
`gradient_checkpointing_kwargs`). With the accelerator the generator tells sharded parameters (ZeRO-3, FSDP1) from
local ones, which decides whether generation copies are kept and whether the engine's weights stay at stable
addresses (decode graphs); with it and the other two it unwraps the model the way TRL does for generation.

Invariant: every generator a trainer builds gets the same arguments from the same config fields.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from ..rollouts.generator import ContinuousBatchingGenerator

if TYPE_CHECKING:
    from accelerate import Accelerator
    from transformers import GenerationConfig

__all__ = ["build_generator", "generator_options"]


def generator_options(args: Any, accelerator: Accelerator | None) -> dict[str, Any]:
    """The generator's keyword arguments from a trainer config (`GRPOConfig` / `RLOOConfig`): the engine settings, the
    model access TRL's generation uses (accelerator, ZeRO-3 gathering, gradient-checkpointing kwargs), the generation
    dtype as TRL's CB path picks it (`bf16`/`fp16`, fp32 LM head; on copies of the weights, `engine/precision.py`),
    the copies kept per `cb_keep_generation_weights`, the OpenMP guard and the round timeout."""
    return {
        "continuous_batching_config": args.transformers_continuous_batching_config,
        "accelerator": accelerator,
        "gather_deepspeed3_params": args.ds3_gather_for_generation,
        "gradient_checkpointing_kwargs": args.gradient_checkpointing_kwargs,
        "cast_dtype": torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else None,
        "cast_lm_head_to_fp32": bool(getattr(args, "cast_lm_head_to_fp32", False)),
        "openmp_guard": args.cb_openmp_guard,
        "keep_generation_weights": args.cb_keep_generation_weights,
        "timeout": args.cb_generation_timeout,
    }


def build_generator(
    model: torch.nn.Module, generation_config: GenerationConfig, args: Any, accelerator: Accelerator | None
) -> ContinuousBatchingGenerator:
    """A generator for `model` (the trainer's `model_wrapped`) sampling with the trainer's `generation_config`."""
    return ContinuousBatchingGenerator(model, generation_config, **generator_options(args, accelerator))
