"""A CPU stand-in for torch's varlen flash kernel (`torch.nn.attention.varlen.varlen_attn`), written from its
documented semantics, so CPU tests check how trl_cb calls it: packed sequences by `cu_seq_q` / `cu_seq_k`, causal
attention aligned bottom-right (a query sees the keys up to its own position counted from the end), `window_size=(left,
0)` keeping `left` keys before it, grouped-query heads, and the paged form (`block_table` of page ids per sequence,
`seqused_k` keys each). It also checks the caller's promises: `max_q` / `max_k` bound every sequence, int32 offsets.
On a GPU, `trl_cb.engine.cuda_kernels.choose` checks the real kernel against trl_cb's reference instead."""

from __future__ import annotations

import torch


def varlen_attn(
    query: torch.Tensor,  # (Tq, H, D)
    key: torch.Tensor,  # (Tk, Hkv, D), or (pages, page, Hkv, D) with a block table
    value: torch.Tensor,
    cu_seq_q: torch.Tensor,
    cu_seq_k: torch.Tensor | None,
    max_q: int,
    max_k: int,
    *,
    scale: float | None = None,
    window_size: tuple[int, int] = (-1, -1),
    enable_gqa: bool = False,
    seqused_k: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    **unused: object,
) -> torch.Tensor:
    assert cu_seq_q.dtype == torch.int32 and (cu_seq_k is None or cu_seq_k.dtype == torch.int32)
    assert window_size[1] in (0, -1)
    causal = window_size == (-1, 0) or window_size[1] == 0
    left = window_size[0]
    heads, num_kv = query.shape[1], key.shape[-2]
    assert enable_gqa == (heads != num_kv)
    out = torch.zeros(query.shape[0], heads, value.shape[-1], dtype=query.dtype)
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    for b in range(cu_seq_q.numel() - 1):
        q0, q1 = int(cu_seq_q[b]), int(cu_seq_q[b + 1])
        if block_table is not None:
            length = int(seqused_k[b])
            rows = [p for p in block_table[b].tolist() if p >= 0]
            k = key[rows].flatten(0, 1)[:length] if rows else key[:0, 0]
            v = value[rows].flatten(0, 1)[:length] if rows else value[:0, 0]
        else:
            k0, k1 = int(cu_seq_k[b]), int(cu_seq_k[b + 1])
            k, v = key[k0:k1], value[k0:k1]
        len_q, len_k = q1 - q0, k.shape[0]
        assert len_q <= max_q and len_k <= max_k, "max_q / max_k must bound every sequence"
        if len_q == 0 or len_k == 0:
            continue
        k = k.repeat_interleave(heads // num_kv, 1).float()
        v = v.repeat_interleave(heads // num_kv, 1).float()
        scores = torch.einsum("qhd,khd->hqk", query[q0:q1].float(), k) * scale
        pos_q = torch.arange(len_q)[:, None] + (len_k - len_q)
        pos_k = torch.arange(len_k)[None, :]
        allowed = (pos_k <= pos_q) if causal else torch.ones(len_q, len_k, dtype=torch.bool)
        if left >= 0:
            allowed &= pos_k >= pos_q - left
        scores = scores.masked_fill(~allowed, float("-inf"))
        out[q0:q1] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).to(query.dtype)
    return out


def use_fake_flash(monkeypatch) -> None:
    """Give CPU engines the flash kernel choice, served by `varlen_attn` above."""
    import torch.nn.attention.varlen as varlen

    from trl_cb.engine import _upstream, _upstream_cache, cuda_kernels

    monkeypatch.setattr(varlen, "varlen_attn", varlen_attn)

    def choose(manager, model) -> None:
        kernels = cuda_kernels.Kernels(cuda_kernels.FLASH, cuda_kernels.FLASH)
        setattr(manager.batch_processor.cache, _upstream_cache.KERNELS_ATTR, kernels)

    monkeypatch.setattr(_upstream, "choose_cuda_kernel", choose)
