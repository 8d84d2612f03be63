"""The engine's attention (`trl_cb.attention`): exact against per-request dense attention and against teacher forcing.

Two levels: `packed_varlen_attention` against a naive per-request reference on random packed batches (decode rows,
chunked prefill with a past, sliding windows, softcap, sinks, GQA); then whole CB rounds on tiny models with weights
far from uniform (std 0.2), whose sampling logprobs must match one teacher-forced forward within 1e-4 at T=1.0 and
0.7, with a control per feature (the same comparison without the window / soft-cap, or after the wrong prompt, must
differ by >= 0.1). Gemma-2 (soft-cap) fails these on transformers' own `paged|eager`, which drops `softcap`.
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import (
    AttentionInterface,
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma3TextConfig,
    GemmaConfig,
    GenerationConfig,
    GptOssConfig,
    MistralConfig,
    PreTrainedModel,
    Qwen2Config,
)

from tests.model_zoo import SHAPE
from tests.unit.rollouts.test_generator import teacher_forced_logprobs
from trl_cb import ContinuousBatchingGenerator
from trl_cb.engine import varlen_attention as attention
from trl_cb.offline.data import synthetic_gsm8k

# ----------------------------------------------------------------------------------------- the packed function


def _reference(q, k, v, cu_q, cu_k, window, scaling, softcap, sinks):
    """Per-request eager attention with explicit positions (the definition the packed function must meet)."""
    out = torch.empty(q.shape[0], q.shape[1], v.shape[-1])
    n_rep = q.shape[1] // k.shape[1]
    for b in range(len(cu_q) - 1):
        qb = q[cu_q[b] : cu_q[b + 1]].transpose(0, 1)  # (H, Lq, D)
        kb = k[cu_k[b] : cu_k[b + 1]].transpose(0, 1).repeat_interleave(n_rep, 0)  # (H, Lk, D)
        vb = v[cu_k[b] : cu_k[b + 1]].transpose(0, 1).repeat_interleave(n_rep, 0)
        len_q, len_k = qb.shape[1], kb.shape[1]
        scores = qb @ kb.transpose(-1, -2) * scaling
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        pos_q = torch.arange(len_q)[:, None] + (len_k - len_q)
        pos_k = torch.arange(len_k)[None, :]
        allowed = (pos_k <= pos_q) & ((pos_q - pos_k < window) if window else True)
        scores = scores.masked_fill(~allowed, float("-inf"))
        if sinks is not None:
            scores = torch.cat([scores, sinks[:, None, None].expand(-1, len_q, 1)], dim=-1)
        probs = scores.softmax(-1)[..., :len_k]
        out[cu_q[b] : cu_q[b + 1]] = (probs @ vb).transpose(0, 1)
    return out


@pytest.mark.parametrize("split", [False, True], ids=["one-call", "length-buckets"])
@pytest.mark.parametrize("window", [None, 5], ids=["full", "window5"])
@pytest.mark.parametrize("variant", ["plain", "softcap", "sinks"])
@pytest.mark.parametrize("num_kv", [4, 2], ids=["MHA", "GQA"])
def test_packed_attention_matches_per_request_reference(window, variant, num_kv, split, monkeypatch):
    monkeypatch.setattr(attention, "_CALL_COST_SLOTS", 0 if split else 10**9)  # force (or forbid) length buckets
    monkeypatch.setattr(attention._local, "plans", {}, raising=False)
    g = torch.Generator().manual_seed(0)
    # (queries, keys) per request: decodes with short/long pasts, a fresh prefill, a chunk with a past, one equal
    # to the window; keys >= queries always (the queries are the request's last keys).
    lengths = [(1, 1), (1, 9), (1, 3), (6, 6), (4, 11), (1, 5), (3, 3), (2, 14)]
    cu_q, cu_k = [0], [0]
    for len_q, len_k in lengths:
        cu_q.append(cu_q[-1] + len_q)
        cu_k.append(cu_k[-1] + len_k)
    heads, dim = 4, 8
    q = torch.randn(cu_q[-1], heads, dim, generator=g) * 3
    k = torch.randn(cu_k[-1], num_kv, dim, generator=g) * 3
    v = torch.randn(cu_k[-1], num_kv, dim, generator=g)
    softcap = 2.0 if variant == "softcap" else None
    sinks = torch.randn(heads, generator=g) * 2 if variant == "sinks" else None
    got = attention.packed_varlen_attention(
        q, k, v, torch.tensor(cu_q), torch.tensor(cu_k), window, 0.5, softcap, sinks
    )
    want = _reference(q, k, v, cu_q, cu_k, window, 0.5, softcap, sinks)
    assert (got - want).abs().max().item() < 1e-5
    buckets = attention._plan(torch.tensor(cu_q), torch.tensor(cu_k), window, q.device).buckets
    assert (len(buckets) > 1) == split
    # Control: ignoring the feature under test changes the output well beyond the tolerance.
    if window is not None:
        loose = _reference(q, k, v, cu_q, cu_k, None, 0.5, softcap, sinks)
        assert (loose - got).abs().max().item() > 0.1
    if variant != "plain":
        bare = _reference(q, k, v, cu_q, cu_k, window, 0.5, None, None)
        assert (bare - got).abs().max().item() > 0.1


# ---------------------------------------------------------------------------------------- whole CB rounds

_WINDOW = 12  # prompts of 6-21 tokens + up to 24 completion tokens: completions cross the window


def _common(vocab_size: int, tokenizer) -> dict:
    shape = {k: v for k, v in SHAPE.items() if k != "initializer_range"}  # weights are re-drawn by the tests
    return dict(
        vocab_size=vocab_size,
        **shape,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )


def _config(arch: str, tokenizer):
    c = _common(len(tokenizer), tokenizer)
    mixed = ["sliding_attention", "full_attention"] * 2
    if arch == "qwen2":
        return Qwen2Config(**c)
    if arch == "qwen2-swa":  # layer 0 full, layers 1-3 sliding (per-layer mix through max_window_layers)
        return Qwen2Config(**c, use_sliding_window=True, sliding_window=_WINDOW, max_window_layers=1)
    if arch == "mistral":  # every layer sliding, no layer_types
        return MistralConfig(**c, sliding_window=_WINDOW)
    if arch == "gemma2":  # soft-capped attention logits (small cap so that it matters), sliding/full mix
        return Gemma2Config(
            **c,
            sliding_window=_WINDOW,
            attn_logit_softcapping=2.0,
            final_logit_softcapping=None,
            query_pre_attn_scalar=16,
        )
    if arch == "gemma3":
        return Gemma3TextConfig(**c, sliding_window=_WINDOW, query_pre_attn_scalar=16, layer_types=mixed)
    if arch == "gpt_oss":  # attention sinks, sliding/full mix, MoE
        return GptOssConfig(**c, sliding_window=_WINDOW, num_local_experts=4, num_experts_per_tok=2)
    if arch == "gemma":
        return GemmaConfig(**c)
    raise ValueError(arch)


def _far_from_uniform(config) -> PreTrainedModel:
    """Random model with weights at std 0.2 (the default 0.02 is nearly uniform and hides attention errors)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config).eval()
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "sinks" in name:
                    p.normal_(0.0, 1.0)
                elif p.dim() >= 2:
                    p.normal_(0.0, 0.2)
    return model


def _round(model, tokenizer, prompts, temperature: float) -> tuple[list[list[int]], list[list[float]]]:
    cfg = GenerationConfig(
        do_sample=True,
        temperature=temperature,
        top_k=0,
        top_p=1.0,
        max_new_tokens=24,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    # 16 tokens per forward: prompts are prefilled in chunks (queries with a past) next to decoding requests.
    with ContinuousBatchingGenerator(model, cfg, {"max_batch_tokens": 16}) as gen:
        result = gen.generate(prompts, num_generations=2)
    return result.completion_ids, result.logprobs


def _worst(model, prompts, completions, logprobs, temperature: float, shift: int = 0) -> float:
    worst = 0.0
    for i, (completion, lp) in enumerate(zip(completions, logprobs, strict=True)):
        prompt = prompts[(i // 2 + shift) % len(prompts)]
        ref = teacher_forced_logprobs(model, prompt, completion, temperature, 0, 1.0)
        worst = max(worst, (ref - torch.tensor(lp)).abs().max().item())
    return worst


def _without(model: PreTrainedModel, feature: str) -> PreTrainedModel:
    """A copy of `model` with one attention feature switched off (same weights)."""
    clone = copy.deepcopy(model)
    if feature == "window":  # a window longer than any sequence: sliding layers attend like full ones
        clone.config.sliding_window = 10_000
        for layer in clone.model.layers:
            if getattr(layer.self_attn, "sliding_window", None) is not None:
                layer.self_attn.sliding_window = 10_000
    elif feature == "softcap":
        for layer in clone.model.layers:
            layer.self_attn.attn_logit_softcapping = None
    elif feature == "sinks":
        for layer in clone.model.layers:
            layer.self_attn.sinks.data.fill_(-1e4)
    return clone


#: architecture -> the features whose removal the control must detect
_ARCHS = {
    "qwen2": (),
    "qwen2-swa": ("window",),
    "mistral": ("window",),
    "gemma2": ("softcap", "window"),
    "gemma3": ("window",),
    "gpt_oss": ("sinks", "window"),
}


@pytest.mark.parametrize("temperature", [1.0, 0.7], ids=["T1", "T0.7"])
@pytest.mark.parametrize("arch", list(_ARCHS))
def test_cb_logprobs_match_teacher_forcing(arch, temperature, tokenizer, monkeypatch):
    model = _far_from_uniform(_config(arch, tokenizer))
    training_impl = model.config._attn_implementation
    prompts = [tokenizer(r["prompt"])["input_ids"][: 6 + 5 * i] for i, r in enumerate(synthetic_gsm8k(4, seed=3))]
    calls = []
    plan = attention._plan
    monkeypatch.setattr(attention, "_plan", lambda *a: calls.append(1) or plan(*a))

    completions, logprobs = _round(model, tokenizer, prompts, temperature)

    assert calls, "the engine did not run trl_cb's attention"
    assert model.config._attn_implementation == training_impl, "training attention not restored"
    longest = max(len(prompts[i // 2]) + len(c) for i, c in enumerate(completions))
    if "window" in _ARCHS[arch]:
        assert longest > _WINDOW + 8, "no sequence crossed the sliding window: the test would not check it"
    worst = _worst(model, prompts, completions, logprobs, temperature)
    assert worst <= 1e-4, f"{arch}: max |CB logprob - teacher-forced| = {worst}"
    # Controls: the same comparison is sensitive to the prompt and to each feature.
    assert _worst(model, prompts, completions, logprobs, temperature, shift=1) >= 0.1
    for feature in _ARCHS[arch]:
        gap = _worst(_without(model, feature), prompts, completions, logprobs, temperature)
        assert gap >= 0.1, f"{arch}: removing {feature} changes logprobs by only {gap}; the test cannot see it"


def test_registration_adds_a_key_and_changes_no_existing_implementation():
    before = {name: AttentionInterface._global_mapping[name] for name in ("sdpa", "paged|eager")}
    attention.register()
    attention.register()  # idempotent
    assert AttentionInterface._global_mapping[attention.ATTENTION_NAME] is attention.varlen_paged_attention
    assert {name: AttentionInterface._global_mapping[name] for name in before} == before


@pytest.mark.parametrize("arch", ["qwen2", "mistral"])
def test_forward_outside_the_engine_matches_sdpa(arch, tokenizer):
    """A forward outside the engine (a training forward beside an async engine) under our name: with a padding mask it
    is sdpa itself; without one, causality, the sliding window and packed sequences are honoured."""
    model = _far_from_uniform(_config(arch, tokenizer))
    ids = torch.randint(3, len(tokenizer), (2, 30))  # longer than the window
    mask = torch.ones_like(ids)
    mask[0, :4] = 0  # left padding
    packed = torch.cat([ids[0, :18], ids[1, :12]])[None]
    positions = torch.cat([torch.arange(18), torch.arange(12)])[None]
    with torch.no_grad():
        padded_ref = model(input_ids=ids, attention_mask=mask).logits
        plain_ref = model(input_ids=ids).logits
        parts_ref = torch.cat([model(input_ids=ids[:1, :18]).logits, model(input_ids=ids[1:, :12]).logits], dim=1)
        attention.register()
        model.set_attn_implementation(attention.ATTENTION_NAME)
        padded = model(input_ids=ids, attention_mask=mask).logits
        plain = model(input_ids=ids).logits
        parts = model(input_ids=packed, position_ids=positions).logits
    assert torch.equal(padded[mask.bool()], padded_ref[mask.bool()])
    assert (plain - plain_ref).abs().max().item() < 1e-4
    assert (parts - parts_ref).abs().max().item() < 1e-4
    with torch.no_grad():  # control: the same tokens as one sequence (packing ignored) differ
        unpacked = model(input_ids=packed).logits
    assert (unpacked - parts_ref).abs().max().item() > 0.1


def test_other_models_unaffected(tokenizer):
    """Building an engine on one model changes no other model's attention."""
    model = _far_from_uniform(_config("qwen2", tokenizer))
    other = _far_from_uniform(_config("gemma", tokenizer))
    impl = other.config._attn_implementation
    prompts = [tokenizer(r["prompt"])["input_ids"] for r in synthetic_gsm8k(2, seed=1)]
    cfg = GenerationConfig(do_sample=True, top_k=0, max_new_tokens=4, eos_token_id=tokenizer.eos_token_id)
    with ContinuousBatchingGenerator(model, cfg) as gen:
        gen.generate(prompts)
        assert other.config._attn_implementation == impl


def _sdpa_flags() -> tuple[bool, bool, bool, bool]:
    c = torch.backends.cuda
    return c.cudnn_sdp_enabled(), c.flash_sdp_enabled(), c.mem_efficient_sdp_enabled(), c.math_sdp_enabled()


def test_engine_attention_skips_cudnn_sdpa_on_cuda_only():
    """cuDNN attention builds a graph per new shape and every engine step brings new shapes (89% of an H100 bf16 step,
    `varlen_attention.engine_sdpa_backends`): on CUDA the engine runs without it, and torch's flags come back."""
    before = _sdpa_flags()
    assert before[0], "torch's default enables cuDNN attention; without it this test shows nothing"
    with attention.engine_sdpa_backends(torch.device("cuda")):
        assert _sdpa_flags() == (False, True, True, True)
    assert _sdpa_flags() == before
    with attention.engine_sdpa_backends(torch.device("cpu")):
        assert _sdpa_flags() == before  # control: CPU calls keep torch's choice
    torch.backends.cuda.enable_math_sdp(False)  # a user's own choices stay, and a flag already off stays off
    torch.backends.cuda.enable_cudnn_sdp(False)
    try:
        with attention.engine_sdpa_backends(torch.device("cuda")):
            assert _sdpa_flags() == (False, True, True, False)
        assert _sdpa_flags() == (False, True, True, False)
    finally:
        torch.backends.cuda.enable_math_sdp(before[3])
        torch.backends.cuda.enable_cudnn_sdp(before[0])
    assert _sdpa_flags() == before


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_bf16_round_never_calls_sdpa_with_cudnn_enabled(tokenizer, monkeypatch):
    """Every SDPA call of a bf16 CB round on CUDA runs with cuDNN attention off, and the round is exact to bf16
    teacher forcing's level (max gap under 0.1 nat on weights far from uniform)."""
    model = _far_from_uniform(_config("qwen2", tokenizer)).to("cuda", torch.bfloat16)
    sdpa, seen = torch.nn.functional.scaled_dot_product_attention, []

    def recording(*args, **kwargs):
        seen.append(torch.backends.cuda.cudnn_sdp_enabled())
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording)
    prompts = [tokenizer(r["prompt"])["input_ids"] for r in synthetic_gsm8k(4, seed=1)]
    completions, logprobs = _round(model, tokenizer, prompts, 1.0)
    assert seen and not any(seen), f"{sum(seen)} of {len(seen)} SDPA calls ran with cuDNN attention enabled"
    assert _worst(model, prompts, completions, logprobs, 1.0) < 0.1
