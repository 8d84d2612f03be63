"""`trl_cb_varlen`: the engine's attention — each query against its own request's paged keys, exact.

Without flash attention, transformers' CB engine runs `sdpa` or `paged|eager` over one dense mask spanning every key
of every request in a forward (work grows with the batch, and `paged|eager` drops `softcap`). This implementation reads
the engine's varlen inputs (`cu_seq_lens_q` / `cu_seq_lens_k`) instead: decode rows run as one batched call over a
padded [requests, keys] batch (length-bucketed), prefill chunks per request with a bottom-right-aligned causal (and
window) mask; on CUDA, one call of torch's varlen flash kernel where `cuda_kernels.choose` picked it; block-table
decode steps go to `paged_decode`. Design and measurements: docs/index.md, "The engine's attention".
Exact (tests pin it): causal masking with the request's past, sliding windows, `softcap`, `scaling`, GQA, attention
sinks. Outside an engine (no paged cache) it runs as `sdpa`. `_upstream.switch_to_generation_attention` puts it on the
model only while an engine is built and generating. Upstream surface (tests/unit/test_contracts.py): the engine's
attention kwargs (`cache` up to transformers 5.23, `cu_seq_lens_q`, per-layer-type `cu_seq_lens_k`) and
`PagedAttentionCache.update(...)`, reached through `_upstream_cache.engine_layer` (`ATTENTION_UPDATES_CACHE` there).
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import torch
from transformers import AttentionInterface
from transformers.generation.continuous_batching import PagedAttentionCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from . import _upstream_cache, paged_decode
from .masked_attention import masked_attention

__all__ = ["ATTENTION_NAME", "packed_varlen_attention", "register", "replaces", "varlen_paged_attention"]

#: The public name this implementation is registered under (`model.set_attn_implementation(ATTENTION_NAME)`).
ATTENTION_NAME = "trl_cb_varlen"
#: Dense-mask implementations transformers' CB falls back to without flash; these are the ones we replace.
DENSE_MASK_IMPLEMENTATIONS = ("sdpa", "paged|eager")

_local = threading.local()  # per engine thread: the last few batch plans (layers of one forward share them)
_PLAN_CACHE_SIZE = 4


def engine_sdpa_backends(device: torch.device) -> contextlib.AbstractContextManager[None]:
    """The engine's SDPA calls on `device`: on CUDA without cuDNN attention (other choices left to torch). Why: torch
    prefers it for bf16/fp16 on Hopper and it builds a graph per new shape, which every engine step brings; on an H100
    a 1-layer bf16 step took 62-91 ms against 5.4 ms in fp32, 89% in this module's SDPA call (docs/benchmark-log.md,
    "GPU"). The flag is process-wide, off from entry to exit (~2 µs): an SDPA call of another thread meanwhile (the
    trainer's under `cb_async_overlap`) also skips cuDNN, running another backend of the same maths."""
    return _without_cudnn_sdpa() if device.type == "cuda" else contextlib.nullcontext()


@contextlib.contextmanager
def _without_cudnn_sdpa() -> Iterator[None]:
    if not torch.backends.cuda.cudnn_sdp_enabled():  # already off (the user's choice, or an enclosing call)
        yield
        return
    torch.backends.cuda.enable_cudnn_sdp(False)
    try:
        yield
    finally:
        torch.backends.cuda.enable_cudnn_sdp(True)


def replaces(implementation: str) -> bool:
    """Whether an engine built on `implementation` runs `ATTENTION_NAME` instead: the one rule shared by the engine
    (`_upstream._choose_attention`) and the compatibility check (`checks.model.engine_attention_implementation`).
    Dense-mask implementations are replaced; flash ones are kept (varlen already, soft-cap honoured)."""
    return implementation in DENSE_MASK_IMPLEMENTATIONS


@functools.cache
def register() -> None:
    """Register `ATTENTION_NAME` with transformers, once per process.

    Process-wide on purpose: transformers' attention interfaces are global registries keyed by name and a model picks
    its implementation by name. This adds a trl_cb-only key (it never replaces one), and it stays registered because
    any model may switch to it later (every engine build does)."""
    AttentionInterface.register(ATTENTION_NAME, varlen_paged_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, _mask)


def _mask(*args: object, attention_mask: torch.Tensor | None = None, use_vmap: bool = False, **kwargs: object):
    """`sdpa_mask`, except that no mask is built when there is no padding mask and the mask is plain causal (with
    packing / a window): the engine's forwards never read one (it cost ~6% of an engine step), and a forward outside
    the engine rebuilds causality, packing and the window from `position_ids` / `sliding_window` itself."""
    config = kwargs.get("config")
    if attention_mask is None and not use_vmap and getattr(config, "is_causal", True):
        return None
    return sdpa_mask(*args, attention_mask=attention_mask, use_vmap=use_vmap, **kwargs)


#: Cost of one extra attention call, in padded key slots (one query row x one key): measured on CPU, one call's fixed
#: cost (gathers, sdpa dispatch, scatter) is worth ~1k key slots of a 64-wide model. Decode rows are split into at most
#: `_MAX_BUCKETS` length buckets when that saves more padding than the extra calls cost.
_CALL_COST_SLOTS = 1024
_MAX_BUCKETS = 4


@dataclass
class _Bucket:
    """Single-token requests attended in one padded call."""

    rows: torch.Tensor  # (R,) query token index of each request
    keys: torch.Tensor  # (R, L) index into the packed keys; padded slots repeat a valid key
    mask: torch.Tensor | None  # (R, 1, 1, L) True where the key is attended; None when nothing is padded


@dataclass
class _Plan:
    """Index tensors for one batch layout (one `cu_seq_lens_q`/`cu_seq_lens_k`/window combination)."""

    buckets: list[_Bucket]
    multi: list[tuple[int, int, int, int]]  # (q_start, q_end, k_start, k_end) of each multi-token request
    multi_masks: list[torch.Tensor | None]  # (Lq, Lk) bool, or None for a plain top-left causal square
    device: torch.device
    _grouped: dict[int, list[torch.Tensor | None]] = field(default_factory=dict)

    def masks_for(self, n_rep: int) -> list[torch.Tensor | None]:
        """`multi_masks` for queries packed as (rep, token) rows, `n_rep` query heads per KV head: (n_rep * Lq, Lk),
        built once per plan (every layer of the forward shares it); None still means plain causal (n_rep == 1)."""
        if n_rep == 1:
            return self.multi_masks
        masks = self._grouped.get(n_rep)
        if masks is None:
            masks = []
            for (q0, q1, k0, k1), mask in zip(self.multi, self.multi_masks, strict=True):
                if mask is None:
                    mask = torch.ones(q1 - q0, k1 - k0, dtype=torch.bool, device=self.device).tril()
                masks.append(mask.repeat(n_rep, 1))
            self._grouped[n_rep] = masks
        return masks


def _split(lengths: np.ndarray) -> list[np.ndarray]:
    """Indices of `lengths` (R,) grouped into buckets of similar length: sorted, then the best cut of any bucket is
    made while it saves more padded slots than `_CALL_COST_SLOTS`, up to `_MAX_BUCKETS` buckets. Cutting a sorted
    bucket of longest `L` after its `c`-th element saves `c * (L - lengths[c - 1])` slots: one array op per bucket."""
    order = np.argsort(lengths, kind="stable")
    ordered = lengths[order]
    if ordered[0] == ordered[-1]:  # equal lengths: no cut saves a padded slot
        return [order]
    groups = [(0, len(order))]  # [lo, hi) ranges of `order`
    best_cut: dict[tuple[int, int], tuple[int, int]] = {}  # range -> (gain, cut), computed once per range
    while len(groups) < _MAX_BUCKETS:
        for lo, hi in groups:
            if (lo, hi) not in best_cut and hi - lo > 1:
                saved = np.arange(1, hi - lo) * (ordered[hi - 1] - ordered[lo : hi - 1])  # (n - 1,) per cut
                cut = int(saved.argmax())
                best_cut[(lo, hi)] = (int(saved[cut]) - _CALL_COST_SLOTS, cut + 1)
        gain, i = max(((best_cut[g][0], i) for i, g in enumerate(groups) if g in best_cut), default=(0, -1))
        if gain <= 0:
            break
        lo, hi = groups[i]
        cut = best_cut[(lo, hi)][1]
        groups[i : i + 1] = [(lo, lo + cut), (lo + cut, hi)]
    return [order[lo:hi] for lo, hi in groups]


def _bucket(rows: np.ndarray, starts: np.ndarray, lengths: np.ndarray, device: torch.device) -> _Bucket:
    """(R,) query rows, first key and key count of single-token requests -> their padded key index (and mask)."""
    longest = int(lengths.max())
    offsets = np.arange(longest)[None, :]
    keys = starts[:, None] + np.minimum(offsets, lengths[:, None] - 1)  # (R, L)
    mask = None
    if int(lengths.min()) != longest:
        mask = torch.from_numpy(offsets < lengths[:, None])[:, None, None, :].to(device)  # (R, 1, 1, L)
    return _Bucket(torch.from_numpy(rows).to(device), torch.from_numpy(keys).to(device), mask)


def _plan(cu_q: torch.Tensor, cu_k: torch.Tensor, window: int | None, device: torch.device) -> _Plan:
    """The plan for this layout. Layers of one forward pass the same `cu_seq_lens` tensors: the last plan is reused
    for the same tensor objects at the same version counter (unchanged contents) without reading them to the host
    (a device sync per layer on an accelerator); otherwise the lengths are read and looked up by value."""
    stamp = (cu_q._version, cu_k._version, window, device)
    last = getattr(_local, "last", None)
    if last is not None and last[0] is cu_q and last[1] is cu_k and last[2] == stamp:
        return last[3]
    plan = _plan_for(cu_q, cu_k, window, device)
    _local.last = (cu_q, cu_k, stamp, plan)  # strong references: the ids cannot be reused while memoised
    return plan


def _plan_for(cu_q: torch.Tensor, cu_k: torch.Tensor, window: int | None, device: torch.device) -> _Plan:
    """Array ops over all requests on the host (numpy: ~1 us an op, against ~5-10 us for torch), no per-request Python
    for single-token rows (the bulk of a decode step); multi-token requests (prefill chunks) are planned one by one."""
    q_bounds, k_bounds = (b.cpu().numpy().astype(np.int64) for b in (cu_q, cu_k))  # (B + 1,) each
    key = (q_bounds.tobytes(), k_bounds.tobytes(), window, device)
    cache: dict = getattr(_local, "plans", None) or {}
    _local.plans = cache
    hit = cache.get(key)
    if hit is not None:
        return hit

    len_q, len_k = q_bounds[1:] - q_bounds[:-1], k_bounds[1:] - k_bounds[:-1]  # (B,) each
    # Single-token requests: the query is the request's last key; it sees keys [len_k - window, len_k).
    single = len_q == 1
    pick = slice(None) if single.all() else single  # a decode step (every request single): views, no copies
    rows, starts, lengths = q_bounds[:-1][pick], k_bounds[:-1][pick], len_k[pick]
    if window is not None:
        first = np.maximum(lengths - window, 0)
        starts, lengths = starts + first, lengths - first
    buckets = [_bucket(rows[g], starts[g], lengths[g], device) for g in _split(lengths)] if len(rows) else []

    multi, multi_masks = [], []
    for b in [] if isinstance(pick, slice) else np.flatnonzero(len_q > 1).tolist():  # len_q <= 0: padding
        q0, q1, k0, k1 = int(q_bounds[b]), int(q_bounds[b + 1]), int(k_bounds[b]), int(k_bounds[b + 1])
        len_q_b, len_k_b = q1 - q0, k1 - k0
        multi.append((q0, q1, k0, k1))
        past = len_k_b - len_q_b  # keys before the first query token (bottom-right alignment)
        if past == 0 and (window is None or window >= len_k_b):
            multi_masks.append(None)
            continue
        qi = torch.arange(len_q_b, device=device)[:, None] + past  # key-index of each query's own token
        kj = torch.arange(len_k_b, device=device)[None, :]
        allowed = kj <= qi
        if window is not None:
            allowed &= qi - kj < window
        multi_masks.append(allowed)

    plan = _Plan(buckets, multi, multi_masks, device)
    if len(cache) >= _PLAN_CACHE_SIZE:
        cache.pop(next(iter(cache)))
    cache[key] = plan
    return plan


def _bucket_keys(plan: _Plan, key_index: torch.Tensor | None) -> list[torch.Tensor]:
    """Each bucket's flat key rows in `key`: its packed positions, composed with `key_index` when given. Layers of one
    forward share `key_index` (same tensor, same version): composed once per forward, like the plan."""
    if key_index is None:
        return [bucket.keys.reshape(-1) for bucket in plan.buckets]
    stamp = (key_index._version, plan)
    last = getattr(_local, "last_keys", None)
    if last is not None and last[0] is key_index and last[1] == stamp:
        return last[2]
    composed = [key_index[bucket.keys.reshape(-1)] for bucket in plan.buckets]
    _local.last_keys = (key_index, stamp, composed)  # strong reference: the id cannot be reused while memoised
    return composed


@torch.compiler.disable  # the cache update mutates aliased views; the plan reads host-side lengths
def varlen_paged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,  # (1, H, T, D): every query token of the forward, packed
    key: torch.Tensor,  # (1, Hkv, T, D): their new keys (from 5.24: what the model's `cache.update` returned)
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    s_aux: torch.Tensor | None = None,
    cache: PagedAttentionCache | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """Attention for a CB forward: returns (1, T, H, D) and no weights (see the module docstring)."""
    window = sliding_window if isinstance(sliding_window, int) and sliding_window > 0 else None
    sinks = s_aux if s_aux is not None else getattr(module, "sinks", None)
    if kwargs.get("block_table") is not None:  # a decode step through the block table (graph-safe: `paged_decode`)
        slots = kwargs.get(_upstream_cache.GATHERED_SLOTS_KWARG)
        if slots is not None:  # a latent layer: its keys were gathered from the pages, then expanded by the model
            cu_k = kwargs["cu_seq_lens_k"]  # (`_upstream_cache.latent_block_table_read`)
            rows_first = [x[0].unflatten(1, (-1, slots)).transpose(0, 1) for x in (key, value)]  # (R, H, L, D) each
            out = paged_decode.attend_padded(query[0].transpose(0, 1), *rows_first, cu_k[1:] - cu_k[:-1], scaling)
            return out.unsqueeze(0), None
        table = _upstream_cache.block_table_layer(cache, module, key, value, kwargs)
        return paged_decode.attend(query[0].transpose(0, 1), table, scaling, softcap, sinks).unsqueeze(0), None
    # The engine's keys, its new ones written (by the cache's update here or, from transformers 5.24, in the model)
    layer = _upstream_cache.engine_layer(cache, module, key, value, kwargs)
    if layer is None:
        # Not an engine forward (e.g. a training forward while an async engine holds the shared config).
        causal = kwargs.get("is_causal", getattr(module, "is_causal", True))
        if attention_mask is None and causal and dropout == 0.0:
            return _unpadded_forward(query, key, value, kwargs.get("position_ids"), window, scaling, softcap, sinks)
        if sinks is not None:
            raise ValueError(f"{ATTENTION_NAME} with a padding mask runs as sdpa, which has no attention sinks.")
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, softcap=softcap, **kwargs
        )
    out = packed_varlen_attention(
        query[0].transpose(0, 1),
        layer.key_storage,
        layer.value_storage,
        kwargs["cu_seq_lens_q"],  # type: ignore[arg-type]
        kwargs["cu_seq_lens_k"],  # type: ignore[arg-type]  (this layer's group, selected by the update)
        sliding_window=window,
        scaling=scaling,
        softcap=softcap,
        sinks=sinks,
        key_index=layer.read_index,
        kernel=layer.kernel,
        max_lengths=_max_lengths(kwargs),
    )
    return out.unsqueeze(0), None


def _max_lengths(kwargs: dict) -> tuple[int, int] | None:
    """The engine's host-side longest query and key runs of this layer's group (selected by the cache update)."""
    max_q, max_k = kwargs.get("max_length_q"), kwargs.get("max_length_k")
    return (max_q, max_k) if isinstance(max_q, int) and isinstance(max_k, int) else None


def _flash_packed(
    query: torch.Tensor,  # (T, H, D)
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seq_lens_q: torch.Tensor,
    cu_seq_lens_k: torch.Tensor,
    window: int | None,
    scaling: float | None,
    key_index: torch.Tensor | None,
    max_lengths: tuple[int, int],
) -> torch.Tensor:  # (T, H, Dv)
    """Every request in one call of torch's varlen flash kernel (causal, bottom-right aligned: a request's last query
    is its last key; a window of W keys is flash's `(W - 1, 0)`); no plan, no host read. Grouped-query heads: flash's
    `enable_gqa`, or where this torch's kernel has none (2.11), each KV head repeated for its query heads."""
    from torch.nn.attention.varlen import varlen_attn

    if key_index is not None:
        key, value = key.index_select(0, key_index), value.index_select(0, key_index)
    gqa = {}
    if query.shape[1] != key.shape[1]:
        if _varlen_takes_gqa():
            gqa["enable_gqa"] = True
        else:
            n_rep = query.shape[1] // key.shape[1]
            key, value = key.repeat_interleave(n_rep, 1), value.repeat_interleave(n_rep, 1)
    return varlen_attn(
        query,
        key,
        value,
        cu_seq_lens_q.to(torch.int32),
        cu_seq_lens_k.to(torch.int32),
        max_lengths[0],
        max_lengths[1],
        scale=scaling,
        window_size=(window - 1, 0) if window is not None else (-1, 0),
        **gqa,
    )


@functools.cache
def _varlen_takes_gqa() -> bool:
    """Whether this torch's `varlen_attn` groups query heads itself (`enable_gqa`; torch 2.11's does not)."""
    import inspect

    from torch.nn.attention.varlen import varlen_attn

    return "enable_gqa" in inspect.signature(varlen_attn).parameters


def _unpadded_forward(
    query: torch.Tensor,  # (B, H, Lq, D)
    key: torch.Tensor,  # (B, Hkv, Lk, D), past (if any) then new
    value: torch.Tensor,
    position_ids: object,
    window: int | None,
    scaling: float | None,
    softcap: float | None,
    sinks: torch.Tensor | None,
) -> tuple[torch.Tensor, None]:
    """A forward without padding mask outside the engine: causal per row; sequences packed into one row (position ids
    restarting, no past) attend only within themselves, as `sdpa_mask` would make them."""
    outs = []
    len_q, len_k = query.shape[2], key.shape[2]
    for b in range(query.shape[0]):
        starts = [0]
        if isinstance(position_ids, torch.Tensor) and len_q == len_k:
            pos = position_ids[min(b, position_ids.shape[0] - 1)]
            starts += (torch.nonzero(pos[1:] != pos[:-1] + 1)[:, 0] + 1).tolist()
        cu_q = torch.tensor([*starts, len_q])
        cu_k = cu_q + torch.tensor([0] * len(starts) + [len_k - len_q])
        outs.append(
            packed_varlen_attention(
                query[b].transpose(0, 1), key[b].transpose(0, 1), value[b].transpose(0, 1), cu_q, cu_k,
                window, scaling, softcap, sinks,
            )
        )  # fmt: skip
    return torch.stack(outs), None


def packed_varlen_attention(
    query: torch.Tensor,  # (T, H, D): the forward's query tokens, request after request
    key: torch.Tensor,  # (Tk, Hkv, D): each request's keys (past then new), request after request
    value: torch.Tensor,  # (Tk, Hkv, Dv)
    cu_seq_lens_q: torch.Tensor,  # (B + 1,) request b's queries are query[cu_q[b]:cu_q[b+1]]
    cu_seq_lens_k: torch.Tensor,  # (B + 1,) its keys are key[cu_k[b]:cu_k[b+1]]; its last query is its last key
    sliding_window: int | None = None,
    scaling: float | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,  # (H,) one extra logit per head inside the softmax
    key_index: torch.Tensor | None = None,  # (Tk,): packed key i is key[key_index[i]] (the paged storage's rows)
    kernel: str = "gather",  # `cuda_kernels.choose`'s answer: "flash" runs torch's varlen flash kernel (one call)
    max_lengths: tuple[int, int] | None = None,  # (longest query run, longest key run): flash needs them, host ints
) -> torch.Tensor:  # (T, H, Dv)
    """Causal attention of each request's queries over its own keys only (bottom-right aligned, window-limited).

    With `key_index`, `key` and `value` are the cache's storage and every read is one gather from it."""
    if kernel == "flash" and softcap is None and sinks is None and max_lengths is not None:
        return _flash_packed(query, key, value, cu_seq_lens_q, cu_seq_lens_k, sliding_window, scaling, key_index,
                             max_lengths)  # fmt: skip
    plan = _plan(cu_seq_lens_q, cu_seq_lens_k, sliding_window, query.device)
    bucket_keys = _bucket_keys(plan, key_index)
    num_heads, head_dim = query.shape[1], query.shape[-1]
    num_kv, value_dim = key.shape[1], value.shape[-1]
    n_rep = num_heads // num_kv
    sinks = None if sinks is None else sinks.reshape(num_kv, n_rep)
    out = query.new_empty(query.shape[0], num_heads, value_dim)
    with engine_sdpa_backends(query.device):  # CUDA: never cuDNN attention
        for bucket, flat in zip(plan.buckets, bucket_keys, strict=True):
            rows = bucket.rows.shape[0]
            q = query.index_select(0, bucket.rows).reshape(rows, num_kv, n_rep, head_dim)  # (R, Hkv, n_rep, D)
            k = key.index_select(0, flat).reshape(rows, -1, num_kv, head_dim).transpose(1, 2)  # (R, Hkv, L, D)
            v = value.index_select(0, flat).reshape(rows, -1, num_kv, value_dim).transpose(1, 2)
            o = masked_attention(q, k, v, bucket.mask, False, scaling, softcap, sinks, n_rep)  # (R, Hkv, n_rep, Dv)
            out.index_copy_(0, bucket.rows, o.reshape(rows, num_heads, value_dim))

        for (q0, q1, k0, k1), mask in zip(plan.multi, plan.masks_for(n_rep), strict=True):
            len_q = q1 - q0
            # (Lq, H, D) -> (1, Hkv, n_rep * Lq, D): rows ordered (rep, token), one (Lq, Lk) mask serves every rep
            q = query[q0:q1].reshape(len_q, num_kv, n_rep, head_dim).permute(1, 2, 0, 3)
            q = q.reshape(1, num_kv, -1, head_dim)
            if key_index is None:
                k, v = key[k0:k1], value[k0:k1]
            else:
                k, v = key.index_select(0, key_index[k0:k1]), value.index_select(0, key_index[k0:k1])
            k, v = k.transpose(0, 1)[None], v.transpose(0, 1)[None]  # (1, Hkv, Lk, D)
            o = masked_attention(q, k, v, mask, mask is None, scaling, softcap, sinks, n_rep)  # (1, Hkv, rep*Lq, Dv)
            o = o.reshape(num_kv, n_rep, len_q, value_dim).permute(2, 0, 1, 3)
            out[q0:q1] = o.reshape(len_q, num_heads, -1)
    return out
