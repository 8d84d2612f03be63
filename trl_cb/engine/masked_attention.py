"""The attention arithmetic both engine attention paths share: padded, masked, GQA-packed, with soft-cap and sinks.

`varlen_attention` (decode buckets, prefill chunks) and `paged_decode` (block-table decode rows) lay out their rows
and keys differently, then attend the same way. Query rows are packed as (rep, token): `n_rep` query heads share one
KV head, so GQA needs no key copy. Without soft-cap or sinks this is one SDPA call (its fused kernels); with either,
the scores are built explicitly (SDPA has no soft-cap, and a sink is one extra logit inside the softmax).
"""

from __future__ import annotations

import torch

__all__ = ["masked_attention"]


def masked_attention(
    query: torch.Tensor,  # (B, Hkv, R, D): R = n_rep x query rows, GQA-packed
    key: torch.Tensor,  # (B, Hkv, L, D)
    value: torch.Tensor,  # (B, Hkv, L, D)
    mask: torch.Tensor | None,  # bool, broadcastable to (B, Hkv, R, L); True = attend
    is_causal: bool,
    scaling: float | None,
    softcap: float | None,
    sinks: torch.Tensor | None,  # (Hkv, n_rep) logits, or None
    n_rep: int,
) -> torch.Tensor:  # (B, Hkv, R, D)
    if softcap is None and sinks is None:
        return torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=mask, is_causal=is_causal, scale=scaling
        )
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    scores = torch.matmul(query, key.transpose(-1, -2)) * scale  # (B, Hkv, R, L)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if is_causal:
        rows, cols = scores.shape[-2:]
        mask = torch.ones(rows, cols, dtype=torch.bool, device=scores.device).tril()
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        b, hkv, r, _ = scores.shape
        sink = sinks.to(scores.dtype)[None, :, :, None].expand(b, hkv, n_rep, r // n_rep)  # rows are (rep, token)
        scores = torch.cat([scores, sink.reshape(b, hkv, r, 1)], dim=-1)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    if sinks is not None:
        probs = probs[..., :-1]
    return torch.matmul(probs, value)
