"""The body of `triton_decode`'s kernel: a plain function that `triton_decode._kernel` jits (see there for what it
computes and why). Imports Triton: import this module only where Triton is installed."""

import triton.language as tl

__all__ = ["paged_decode_kernel"]


def paged_decode_kernel(
    Q, NewK, NewV, K, V, Out, BlockTable, CuSeqLensK,  # noqa: N803 - pointers, Triton's convention
    stride_qr, stride_qh, stride_nkr, stride_nkh, stride_nvr, stride_nvh,
    stride_kp, stride_kt, stride_kh, stride_vp, stride_vt, stride_vh,
    stride_or, stride_oh, stride_br, max_pages, write_trash, scale,
    N_REP: tl.constexpr, BLOCK_H: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,  # noqa: N803
    DV: tl.constexpr, BLOCK_DV: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,  # noqa: N803
    HALF_DOTS: tl.constexpr,  # noqa: N803
):  # fmt: skip
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq_len = tl.load(CuSeqLensK + row + 1) - tl.load(CuSeqLensK + row)  # keys of this row, the new one included
    rep = tl.arange(0, BLOCK_H)
    heads = kv_head * N_REP + rep  # the query heads of this KV head
    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    q = tl.load(
        Q + row * stride_qr + heads[:, None] * stride_qh + d[None, :],
        mask=(rep[:, None] < N_REP) & (d[None, :] < D),
        other=0.0,
    )  # (BLOCK_H, BLOCK_D)
    new_k = tl.load(NewK + row * stride_nkr + kv_head * stride_nkh + d, mask=d < D, other=0.0)  # (BLOCK_D,)
    new_v = tl.load(NewV + row * stride_nvr + kv_head * stride_nvh + dv, mask=dv < DV, other=0.0)  # (BLOCK_DV,)

    # 1) the new key and value into the cache at position seq_len - 1 (a padding row: the write-trash row); nothing in
    #    this kernel reads them back from there
    last = tl.maximum(seq_len - 1, 0)
    last_page = tl.load(BlockTable + row * stride_br + last // PAGE).to(tl.int64)
    page = tl.where(seq_len > 0, last_page, write_trash // PAGE)
    slot = tl.where(seq_len > 0, last % PAGE, write_trash % PAGE)
    tl.store(
        K + page * stride_kp + slot * stride_kt + kv_head * stride_kh + d, new_k.to(K.dtype.element_ty), mask=d < D
    )
    tl.store(
        V + page * stride_vp + slot * stride_vt + kv_head * stride_vh + dv, new_v.to(V.dtype.element_ty), mask=dv < DV
    )

    # 2) online softmax, started from the new key (held in registers, as the cache holds it), then the cached keys
    new_k = new_k.to(K.dtype.element_ty).to(tl.float32)
    m = tl.sum(q.to(tl.float32) * new_k[None, :], axis=1) * scale  # (BLOCK_H,)
    total = tl.full((BLOCK_H,), 1.0, dtype=tl.float32)
    acc = tl.zeros((BLOCK_H, BLOCK_DV), dtype=tl.float32) + new_v.to(V.dtype.element_ty).to(tl.float32)[None, :]
    past = seq_len - 1
    for first in range(0, past, BLOCK_N):
        offs = first + tl.arange(0, BLOCK_N)
        valid = offs < past
        page_index = offs // PAGE
        pages = tl.load(BlockTable + row * stride_br + page_index, mask=valid & (page_index < max_pages), other=0)
        pages = pages.to(tl.int64)
        slots = offs % PAGE
        k = tl.load(
            K + pages[:, None] * stride_kp + slots[:, None] * stride_kt + kv_head * stride_kh + d[None, :],
            mask=valid[:, None] & (d[None, :] < D),
            other=0.0,
        )  # (BLOCK_N, BLOCK_D)
        v = tl.load(
            V + pages[:, None] * stride_vp + slots[:, None] * stride_vt + kv_head * stride_vh + dv[None, :],
            mask=valid[:, None] & (dv[None, :] < DV),
            other=0.0,
        )  # (BLOCK_N, BLOCK_DV)
        if HALF_DOTS:  # tensor cores, float32 accumulation (products of half-precision values are exact in float32)
            scores = tl.dot(q, tl.trans(k))
        else:
            scores = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        scores = tl.where(valid[None, :], scores * scale, float("-inf"))  # (BLOCK_H, BLOCK_N) float32
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(scores - m_new[:, None])
        total = total * alpha + tl.sum(p, axis=1)
        if HALF_DOTS:  # the probabilities as two half-precision terms: ~16 mantissa bits, not the 8 (bf16) of one
            p_high = p.to(v.dtype)
            p_low = (p - p_high.to(tl.float32)).to(v.dtype)
            acc = acc * alpha[:, None] + tl.dot(p_high, v) + tl.dot(p_low, v)
        else:
            acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
        m = m_new
    out = acc / total[:, None]
    out_mask = (rep[:, None] < N_REP) & (dv[None, :] < DV)
    tl.store(
        Out + row * stride_or + heads[:, None] * stride_oh + dv[None, :], out.to(Out.dtype.element_ty), mask=out_mask
    )
