"""The engine forward's model kwargs: no attention-mask construction for a mask trl_cb's attention never reads.

Why: in an engine forward `varlen_attention` reads `cu_seq_lens_q` / `cu_seq_lens_k` and ignores `attention_mask`, but
the model still calls transformers' mask builders (`masking_utils.create_causal_mask` and friends) every step, and
since `varlen_attention` registers a mask function (for forwards outside the engine, which do need one) they run their
preprocessing: a packed-sequence scan of `position_ids` (`find_packed_sequence_indices`: diff, cumsum, a host read)
and the mask function's call, ~0.1 ms of a 1.5 ms decode step at 32 rows (docs/benchmarks.md, issue 28). A 4D
`attention_mask` is returned as-is by every builder (`_preprocess_mask_arguments`' first early exit), so the engine's
forward gets an empty 4D placeholder instead of None. (transformers 5.24 returns at once for the engine's
`PagedAttentionCache` itself: there the placeholder changes nothing.)
Invariant: only engine forwards (the batch processor's `compute_batch`) get it, and only while the model runs
`varlen_attention` (which ignores it there); training forwards and other attention implementations are untouched.
Upstream surface (tests/unit/test_contracts.py): `model_runner.compute_batch(model, batch_data)` with
`batch_data["attention_mask"]` None when the engine built no dense mask; a 4D mask short-circuits the mask builders.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel
from transformers.generation.continuous_batching import ContinuousBatchingManager

from . import debug

__all__ = ["install_no_mask_forward", "placeholder_mask"]


def placeholder_mask(device: torch.device) -> torch.Tensor:
    """(1, 1, 0, 0) bool: 4D, so transformers' mask builders hand it back untouched; empty, so nothing reads it."""
    return torch.empty(1, 1, 0, 0, dtype=torch.bool, device=device)


def install_no_mask_forward(manager: ContinuousBatchingManager, model: PreTrainedModel, attention_name: str) -> bool:
    """Wrap the engine's `compute_batch`: while `model` runs `attention_name`, a step without a dense mask gets
    `placeholder_mask` as its `attention_mask`. Returns whether it was installed (not under
    `TRL_CB_MASK_SKIP=0`, `debug.py`)."""
    if not debug.mask_skip_enabled():
        return False
    runner = manager.batch_processor.model_runner
    compute = runner.compute_batch
    placeholder = placeholder_mask(model.device)
    config = model.config

    def compute_without_mask(module: torch.nn.Module, batch_data: dict) -> None:
        if batch_data.get("attention_mask") is None and config._attn_implementation == attention_name:
            batch_data["attention_mask"] = placeholder
        compute(module, batch_data)

    runner.compute_batch = compute_without_mask
    return True
