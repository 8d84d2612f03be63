"""Decode steps as graphs kept across training steps (`trl_cb.engine.decode_graphs`), on the CPU through a fake graph
backend that replays what a CUDA graph reads (tests/graph_fakes.py): the captured weight tensors.

What must hold: a graphed round samples exactly (teacher forcing, weights far from uniform, truncated sampling with
the policy-logprob recorder); graphs survive optimizer steps (lr > 0, in place) without a re-capture and stay exact;
a parameter whose storage moved is caught before the next round (re-captured, exact), and replaying without that
check is wrong (the control). Where graphs are refused or off is decided by the pool (last tests).
"""

from __future__ import annotations

import copy

import pytest
import torch

from tests.conftest import sampling_config
from tests.fake_flash import use_fake_flash
from tests.graph_fakes import use_fake_graphs
from tests.unit.rollouts.test_generator import teacher_forced_logprobs
from trl_cb import ContinuousBatchingGenerator
from trl_cb.engine import decode_graphs
from trl_cb.engine.decode_graphs import WeightFingerprint
from trl_cb.offline.tiny import tiny_model

G = 3


def _graphs(gen: ContinuousBatchingGenerator) -> decode_graphs.DecodeGraphs | None:
    engine = gen._pool.engine
    return None if engine is None else decode_graphs.graphs_of(engine.manager)


def _worst(model, prompts, result, temperature=1.0, top_k=0, top_p=1.0, policy=False) -> float:
    """Largest gap between the round's logprobs and teacher forcing under `model`'s current weights."""
    worst = 0.0
    logprobs = result.policy_logprobs if policy else result.logprobs
    for i, (completion, lp) in enumerate(zip(result.completion_ids, logprobs, strict=True)):
        prompt = prompts[i // result.num_generations]
        if policy:  # the trainer's quantity: log_softmax(logits / T), no truncation
            ref = teacher_forced_logprobs(model, prompt, completion, temperature, 0, 1.0)
        else:
            ref = teacher_forced_logprobs(model, prompt, completion, temperature, top_k, top_p)
        worst = max(worst, (ref - torch.tensor(lp)).abs().max().item())
    return worst


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"), [(1.0, 0, 1.0), (0.7, 20, 0.9)], ids=["T1", "T0.7-k20-p0.9"]
)
def test_graphed_decode_samples_exactly(sharp_model, tokenizer, prompts, monkeypatch, temperature, top_k, top_p):
    use_fake_graphs(monkeypatch)
    cfg = sampling_config(tokenizer, temperature=temperature, top_k=top_k, top_p=top_p)
    # 16 tokens per forward: prompts are prefilled in chunks next to decoding rows (eager, mixed steps).
    with ContinuousBatchingGenerator(sharp_model, cfg, {"max_batch_tokens": 16}) as gen:
        result = gen.generate(prompts, num_generations=G)
        graphs = _graphs(gen)
    assert graphs is not None and graphs.captures > 0
    assert graphs.replays > graphs.captures, "decode steps must replay their graphs"
    assert graphs.eager_steps > 0, "prefill steps run eagerly"
    assert set(graphs.graphs) <= {1, 2, 4, 8, 16}, "decode steps are padded to powers of two rows"
    assert _worst(sharp_model, prompts, result, temperature, top_k, top_p) < 1e-4
    if top_p < 1.0:  # the recorder's values come out of the replayed graph
        assert _worst(sharp_model, prompts, result, temperature, policy=True) < 1e-4


@pytest.mark.parametrize("family", ["qwen2", "gemma3"], ids=["full-attention", "alternating-window-rings"])
def test_graphs_survive_optimizer_steps(tokenizer, prompts, monkeypatch, family):
    """Ten optimizer steps (lr > 0) between rounds, in place: the same graphs replay the new weights, exactly; also
    with sliding-window rings (Gemma 3's alternating 12-token windows over 4-token pages) kept across the rounds."""
    from tests.unit.engine.test_attention import _config, _far_from_uniform

    use_fake_graphs(monkeypatch)
    if family == "qwen2":
        model, cb_kwargs = tiny_model(tokenizer, eos_logit_bias=4.0, init_std=0.2), {}
    else:
        model, cb_kwargs = _far_from_uniform(_config(family, tokenizer)), {"page_size": 4}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5 if family == "qwen2" else 0.05)
    cfg = sampling_config(tokenizer)
    with ContinuousBatchingGenerator(model, cfg, cb_kwargs) as gen:
        gen.generate(prompts, num_generations=G)
        captured = _graphs(gen).captures
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        for _ in range(10):
            model.train()
            loss = model(torch.tensor([prompts[0]]), labels=torch.tensor([prompts[0]])).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            model.eval()
            result = gen.generate(prompts, num_generations=G)
            assert _worst(model, prompts, result) < 1e-4
        graphs = _graphs(gen)
    moved = max((p.detach() - before[n]).abs().max().item() for n, p in model.named_parameters())
    assert moved > 1e-2, "the weights must change, or the test shows nothing"
    assert graphs.invalidations == 0
    assert graphs.captures <= captured + 2, "in-place updates keep the graphs (a new padded size may still appear)"


def _move_and_change(model: torch.nn.Module) -> None:
    """What a `.to()`, a re-tie or a cast does to a weight: new storage (here also new values)."""
    weight = model.model.layers[0].mlp.down_proj.weight
    weight.data = weight.data.clone() * 1.5


@pytest.mark.parametrize("recheck", [True, False], ids=["recaptured", "control-stale-replay"])
def test_a_moved_weight_is_recaptured_never_replayed_stale(tokenizer, prompts, monkeypatch, caplog, recheck):
    use_fake_graphs(monkeypatch)
    if not recheck:  # the control: without the fingerprint check, a graph replays the old storage
        monkeypatch.setattr(decode_graphs.DecodeGraphs, "check", lambda self, module: False)
    model = tiny_model(tokenizer, eos_logit_bias=4.0, init_std=0.2)
    cfg = sampling_config(tokenizer)
    with ContinuousBatchingGenerator(model, cfg) as gen:
        gen.generate(prompts, num_generations=G)
        _move_and_change(model)
        with caplog.at_level("WARNING", logger="trl_cb.engine.decode_graphs"):
            result = gen.generate(prompts, num_generations=G)
        graphs = _graphs(gen)
    worst = _worst(model, prompts, result)
    if recheck:
        assert graphs.invalidations == 1
        assert "model.layers.0.mlp.down_proj.weight" in caplog.text
        assert worst < 1e-4
    else:
        assert worst > 0.1, "a stale replay must be visible, else this test could not catch a missing re-capture"


def test_fingerprint_names_what_moved(tokenizer):
    model = tiny_model(tokenizer)
    before = WeightFingerprint.of(model)
    assert before.moved(WeightFingerprint.of(model)) == []
    with torch.no_grad():
        model.lm_head.weight.add_(1.0)  # in place: nothing moved
    assert before.moved(WeightFingerprint.of(model)) == []
    model.lm_head.weight.data = model.lm_head.weight.data.to(torch.float64)  # a cast re-allocates
    assert before.moved(WeightFingerprint.of(model)) == ["lm_head.weight"]


# ------------------------------------------------------------------------------------------- where graphs run


def test_cpu_engines_run_eagerly_by_default(model, tokenizer, prompts):
    with ContinuousBatchingGenerator(model, sampling_config(tokenizer)) as gen:
        gen.generate(prompts[:2], num_generations=2)
        assert _graphs(gen) is None
        assert gen._pool.engine.manager.continuous_batching_config.max_blocks_per_request == 0


def test_graphs_are_off_with_history_processors_and_refused_when_asked(model, tokenizer, prompts, monkeypatch):
    """Repetition penalty reads each row's history on the host every step: a replay would reuse a stale one."""
    use_fake_graphs(monkeypatch)
    cfg = sampling_config(tokenizer, repetition_penalty=1.3)
    with ContinuousBatchingGenerator(model, cfg) as gen:
        gen.generate(prompts[:2], num_generations=2)
        assert _graphs(gen) is None
    with pytest.raises(ValueError, match="repetition_penalty"):
        ContinuousBatchingGenerator(model, cfg, {"use_cuda_graph": True})


def test_graphs_are_off_where_weights_move_every_round(model, tokenizer, prompts, monkeypatch):
    use_fake_graphs(monkeypatch)
    cfg = sampling_config(tokenizer)
    with ContinuousBatchingGenerator(model, cfg, keep_generation_weights=False, cast_dtype=torch.bfloat16) as gen:
        gen.generate(prompts[:2], num_generations=2)
        assert _graphs(gen) is None
    gen = ContinuousBatchingGenerator(
        model, cfg, {"use_cuda_graph": True}, keep_generation_weights=False, cast_dtype=torch.bfloat16
    )
    with gen, pytest.raises(ValueError, match="same addresses every round"):
        gen.generate(prompts[:2], num_generations=2)


def test_explicit_off_switch(model, tokenizer, prompts, monkeypatch):
    use_fake_graphs(monkeypatch)
    with ContinuousBatchingGenerator(model, sampling_config(tokenizer), {"use_cuda_graph": False}) as gen:
        gen.generate(prompts[:2], num_generations=2)
        assert _graphs(gen) is None


# ------------------------------------------------------------------------------- the flash kernel's wiring (CPU)


def _count_calls(monkeypatch) -> dict[str, int]:
    """Wrap the fake flash kernel (installed by `use_fake_flash`) to count paged and packed calls."""
    import torch.nn.attention.varlen as varlen

    calls, fake = {"paged": 0, "packed": 0}, varlen.varlen_attn

    def counted(*args, **kwargs):
        calls["paged" if kwargs.get("block_table") is not None else "packed"] += 1
        return fake(*args, **kwargs)

    monkeypatch.setattr(varlen, "varlen_attn", counted)
    return calls


@pytest.mark.parametrize("windowed", [False, True], ids=["full", "sliding-window-ring"])
def test_flash_kernel_calls_sample_exactly(sharp_model, tokenizer, prompts, monkeypatch, windowed):
    """How trl_cb calls torch's flash kernel, checked on the CPU against a stand-in written from its documented
    semantics (tests/fake_flash.py): block-table decode steps (graphed) and packed prefill / mixed steps (eager); a
    sliding-window model's decode steps read its ring of 4-token pages (12-token window) through the kernel."""
    from tests.unit.engine.test_attention import _config, _far_from_uniform

    use_fake_graphs(monkeypatch)
    use_fake_flash(monkeypatch)
    calls = _count_calls(monkeypatch)
    model = _far_from_uniform(_config("mistral", tokenizer)) if windowed else sharp_model
    cb_kwargs = {"max_batch_tokens": 16, **({"page_size": 4} if windowed else {})}
    with ContinuousBatchingGenerator(model, sampling_config(tokenizer), cb_kwargs) as gen:
        result = gen.generate(prompts, num_generations=G)
    assert calls["paged"] > 0 and calls["packed"] > 0, calls
    assert _worst(model, prompts, result) < 1e-4


def test_triton_kernel_is_as_exact_as_the_reference_in_bf16(tokenizer, prompts, monkeypatch):
    """A bf16 engine (weights far from uniform) through the reference kernel, the Triton kernel, and (the control) the
    Triton kernel with its scores scaled wrongly: the logprobs' mean gap to a float32 teacher-forced forward of the
    same bf16 weights is the same for the first two (bf16 activations elsewhere dominate it); the control's is not."""
    import copy

    pytest.importorskip("triton")
    from tests.unit.rollouts.test_generator import teacher_forced_logprobs
    from trl_cb.engine import _upstream, _upstream_cache, cuda_kernels, triton_decode

    use_fake_graphs(monkeypatch)
    model = tiny_model(tokenizer, eos_logit_bias=4.0, init_std=0.2).to(torch.bfloat16)
    truth = copy.deepcopy(model).float()
    real = triton_decode.paged_decode_attention
    mean_gap = {}
    for case, paged, scale in [("reference", "gather", 1.0), ("triton", "triton", 1.0), ("control", "triton", 1.5)]:
        kernels = cuda_kernels.Kernels(cuda_kernels.REFERENCE, paged)
        monkeypatch.setattr(
            _upstream,
            "choose_cuda_kernel",
            lambda manager, model, k=kernels: setattr(manager.batch_processor.cache, _upstream_cache.KERNELS_ATTR, k),
        )
        monkeypatch.setattr(
            triton_decode, "paged_decode_attention", lambda *args, s=scale: real(*args[:-1], args[-1] * s)
        )
        torch.manual_seed(0)
        with ContinuousBatchingGenerator(model, sampling_config(tokenizer), {"max_batch_tokens": 16}) as gen:
            result = gen.generate(prompts[:4], num_generations=G)
        gaps = [
            (teacher_forced_logprobs(truth, prompts[i // G], completion, 1.0, 0, 1.0) - torch.tensor(logprobs)).abs()
            for i, (completion, logprobs) in enumerate(zip(result.completion_ids, result.logprobs, strict=True))
        ]
        mean_gap[case] = torch.cat(gaps).mean().item()
    assert mean_gap["triton"] < 1.25 * mean_gap["reference"], mean_gap
    assert mean_gap["control"] > 2.0 * mean_gap["reference"], mean_gap


@pytest.mark.parametrize("repeat", [True, False], ids=["kv-heads-repeated", "control-not-repeated"])
def test_packed_flash_on_a_torch_without_gqa(sharp_model, tokenizer, prompts, monkeypatch, repeat):
    """torch 2.11's `varlen_attn` has no `enable_gqa`: packed steps repeat each KV head for its query heads and stay
    exact (GQA model: 2 KV heads for 4 query heads); the control hands the kernel the unrepeated heads, as a kernel
    that pairs query head h with KV head h mod Hkv would read them, and is caught."""
    import torch.nn.attention.varlen as varlen

    from trl_cb.engine import _upstream, _upstream_cache, cuda_kernels, varlen_attention

    text = sharp_model.config
    assert text.num_attention_heads != text.num_key_value_heads, "the test needs a GQA model"
    use_fake_graphs(monkeypatch)
    use_fake_flash(monkeypatch)
    kernels = cuda_kernels.Kernels(cuda_kernels.FLASH, cuda_kernels.REFERENCE)  # torch 2.11: no paged flash
    monkeypatch.setattr(
        _upstream,
        "choose_cuda_kernel",
        lambda manager, model: setattr(manager.batch_processor.cache, _upstream_cache.KERNELS_ATTR, kernels),
    )
    fake, calls, takes_gqa = varlen.varlen_attn, [0], varlen_attention._varlen_takes_gqa

    def without_gqa(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, window_size=(-1, -1),
                    seqused_k=None, block_table=None):  # fmt: skip
        if block_table is None:
            calls[0] += 1
            if not repeat:  # the control: the kernel's own grouping, in the wrong order
                n_rep = query.shape[1] // key.shape[1]
                key, value = key.repeat(1, n_rep, 1), value.repeat(1, n_rep, 1)
        gqa = query.shape[1] != key.shape[-2]
        return fake(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale=scale, window_size=window_size,
                    enable_gqa=gqa, seqused_k=seqused_k, block_table=block_table)  # fmt: skip

    monkeypatch.setattr(varlen, "varlen_attn", without_gqa)
    takes_gqa.cache_clear()
    if not repeat:
        monkeypatch.setattr(varlen_attention, "_varlen_takes_gqa", lambda: True)
        monkeypatch.setattr(varlen, "varlen_attn", lambda *a, enable_gqa=False, **k: without_gqa(*a, **k))
    try:
        with ContinuousBatchingGenerator(sharp_model, sampling_config(tokenizer), {"max_batch_tokens": 16}) as gen:
            result = gen.generate(prompts, num_generations=G)
    finally:
        takes_gqa.cache_clear()
    assert calls[0] > 0
    worst = _worst(sharp_model, prompts, result)
    assert worst < 1e-4 if repeat else worst > 0.05, worst


@pytest.mark.parametrize("broken", [False, True], ids=["triton", "control-scale-off"])
def test_triton_kernel_decode_steps_sample_exactly(sharp_model, tokenizer, prompts, monkeypatch, broken):
    """The engine's decode steps through trl_cb's Triton kernel (`triton_decode`, run by Triton's CPU interpreter) as
    `cuda_kernels.choose` picks it where torch reads no block tables: every graphed decode step calls it, and the
    logprobs match teacher forcing; the control scales its scores wrongly and is caught."""
    pytest.importorskip("triton")
    from trl_cb.engine import _upstream, _upstream_cache, cuda_kernels, triton_decode

    use_fake_graphs(monkeypatch)
    kernels = cuda_kernels.Kernels(cuda_kernels.REFERENCE, cuda_kernels.TRITON)
    monkeypatch.setattr(
        _upstream,
        "choose_cuda_kernel",
        lambda manager, model: setattr(manager.batch_processor.cache, _upstream_cache.KERNELS_ATTR, kernels),
    )
    calls, real = [0], triton_decode.paged_decode_attention

    def counted(*args):
        calls[0] += 1
        return real(*args[:-1], args[-1] * (1.5 if broken else 1.0))  # the last argument: the scaling

    monkeypatch.setattr(triton_decode, "paged_decode_attention", counted)
    with ContinuousBatchingGenerator(sharp_model, sampling_config(tokenizer), {"max_batch_tokens": 16}) as gen:
        result = gen.generate(prompts, num_generations=G)
        graphs = _graphs(gen)
    layers = sharp_model.config.num_hidden_layers
    assert calls[0] == layers * (graphs.captures + graphs.replays) > 0, "every graphed decode step runs the kernel"
    worst = _worst(sharp_model, prompts, result)
    assert worst < 1e-4 if not broken else worst > 0.05, worst


@pytest.mark.parametrize("shift", [0, 1], ids=["window", "control-window-off-by-one"])
def test_flash_kernel_window_matches_the_models(tokenizer, prompts, monkeypatch, shift):
    """Sliding windows through the flash kernel (packed steps: sliding layers read no block table): exact, and a window
    one key wider (the control) is caught."""
    from tests.unit.engine.test_attention import _config, _far_from_uniform, _round
    from tests.unit.engine.test_attention import _worst as _worst_shifted

    use_fake_flash(monkeypatch)
    if shift:
        import torch.nn.attention.varlen as varlen

        fake = varlen.varlen_attn

        def wider(*args, window_size=(-1, 0), **kwargs):
            left = window_size[0] + shift if window_size[0] >= 0 else -1
            return fake(*args, window_size=(left, window_size[1]), **kwargs)

        monkeypatch.setattr(varlen, "varlen_attn", wider)
    calls = _count_calls(monkeypatch)
    model = _far_from_uniform(_config("mistral", tokenizer))
    completions, logprobs = _round(model, tokenizer, prompts, 1.0)
    assert calls["packed"] > 0
    worst = _worst_shifted(model, prompts, completions, logprobs, 1.0)
    assert worst < 1e-4 if not shift else worst > 0.1


@pytest.mark.parametrize("softcap", [True, False], ids=["softcap", "control-softcap-dropped"])
def test_graphed_decode_honours_a_soft_cap(tokenizer, prompts, monkeypatch, softcap):
    """A soft-capped model with full attention only (Gemma-2's cap, no sliding layers: block tables on) samples
    exactly through graphed decode steps; the control compares with the same model without its cap."""
    from transformers import AutoModelForCausalLM, Gemma2Config

    from tests.model_zoo import SHAPE

    use_fake_graphs(monkeypatch)
    shape = {k: v for k, v in SHAPE.items() if k != "initializer_range"}
    config = Gemma2Config(
        **shape, vocab_size=len(tokenizer), attn_logit_softcapping=2.0, final_logit_softcapping=None,
        query_pre_attn_scalar=16, layer_types=["full_attention"] * SHAPE["num_hidden_layers"], sliding_window=4096,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.2)
    with ContinuousBatchingGenerator(model, sampling_config(tokenizer)) as gen:
        result = gen.generate(prompts, num_generations=G)
        assert _graphs(gen).replays > 0
    reference = model
    if not softcap:
        reference = copy.deepcopy(model)
        for layer in reference.model.layers:
            layer.self_attn.attn_logit_softcapping = None
    worst = _worst(reference, prompts, result)
    assert worst < 1e-4 if softcap else worst > 0.1


@pytest.mark.parametrize(
    ("page_size", "narrowed"), [(5, False), (4, False), (32, False), (5, True)],
    ids=["ring-3-pages-15-slots", "ring-3-pages-12-slots", "ring-1-page", "control-one-key-dropped"],
)  # fmt: skip
def test_a_sliding_window_ring_decodes_through_graphs_exactly(tokenizer, prompts, monkeypatch, page_size, narrowed):
    """A 12-token window over pages of 5, 4 and 32 tokens (a ring whose last page is part-used, whose pages are exactly
    the window, and one page wider than the window): graphed decode steps write each key at its ring slot and read the
    window's keys, exactly, while sequences wrap the ring several times. Control: reading one key fewer than the
    window (the oldest slot's key dropped) is caught."""
    from tests.unit.engine.test_attention import _WINDOW, _config, _far_from_uniform
    from tests.unit.engine.test_attention import _worst as _worst_of
    from trl_cb.engine import paged_decode

    use_fake_graphs(monkeypatch)
    if narrowed:
        visible = paged_decode.BlockTableLayer.visible.fget
        monkeypatch.setattr(
            paged_decode.BlockTableLayer, "visible", property(lambda layer: visible(layer).clamp(max=_WINDOW - 1))
        )
    cb_kwargs = {"max_batch_tokens": 16, "page_size": page_size}
    model = _far_from_uniform(_config("mistral", tokenizer))
    with ContinuousBatchingGenerator(model, sampling_config(tokenizer, max_new_tokens=24), cb_kwargs) as gen:
        result = gen.generate(prompts, num_generations=2)
        assert _graphs(gen).replays > 0
    completions, logprobs = result.completion_ids, result.logprobs
    assert max(len(prompts[i // 2]) + len(c) for i, c in enumerate(completions)) > 3 * _WINDOW
    worst = _worst_of(model, prompts, completions, logprobs, 1.0)
    assert worst < 1e-4 if not narrowed else worst > 0.1, worst


def test_sliding_window_rings_under_graphs_with_long_prompts_and_top_p(tokenizer, monkeypatch):
    """What users set, through graphed decode steps over sliding-window rings: 1,600-token prompts (prefilled in
    chunks, the ring wrapped ~130 times before the first decode step), T = 0.7 with top-p 0.9, Gemma 3's alternating
    12-token windows over 16-token pages, G = 2. Exact against teacher forcing with the same warpers; control: the
    same tokens scored without the window."""
    from tests.unit.engine.test_attention import _config, _far_from_uniform, _without

    use_fake_graphs(monkeypatch)
    config = _config("gemma3", tokenizer)
    config.max_position_embeddings = 4096
    model = _far_from_uniform(config)
    generator = torch.Generator().manual_seed(0)
    long_prompts = torch.randint(3, len(tokenizer), (2, 1600), generator=generator).tolist()
    cfg = sampling_config(tokenizer, temperature=0.7, top_p=0.9, max_new_tokens=16)
    with ContinuousBatchingGenerator(model, cfg, {"page_size": 16, "max_batch_tokens": 512}) as gen:
        result = gen.generate(long_prompts, num_generations=2)
        assert _graphs(gen).replays > 0
    assert max(len(c) for c in result.completion_ids) > 8
    worst = _worst(model, long_prompts, result, 0.7, 0, 0.9)
    control = _worst(_without(model, "window"), long_prompts, result, 0.7, 0, 0.9)
    assert worst < 1e-4 and control > 0.1, (worst, control)
