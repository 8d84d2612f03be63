"""Cache geometry per layer group (`trl_cb/engine/_upstream_geometry.py`): Gemma 4's per-layer head sizes and
DeepSeek-V3's cached latent (keys and values of different widths) sampled exactly, every other family untouched.

Exactness in float64 (weights of std 0.2, far from uniform) against the model's own teacher-forced forward: G = 4
forked samples of prompts past the 8-token window, prefilled in 16-token chunks beside decoding rows, T = 1.0 and 0.7,
with controls that an error would show: the completions scored after another prompt, and (the latent) the values cut
from the wrong end of their padded pages.
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoConfig, GenerationConfig

from tests.model_zoo import SUPPORTED, WINDOW, tiny_arch_model, tiny_config
from tests.unit.rollouts.test_generator import teacher_forced_logprobs
from trl_cb import ContinuousBatchingGenerator
from trl_cb.checks.model import config_problems
from trl_cb.engine import _upstream_geometry as geometry
from trl_cb.engine._upstream_geometry import PaddedAllocator, SlotShape
from trl_cb.offline.data import synthetic_gsm8k

G = 4
TOLERANCE = 1e-6  # float64, the same path: what every other family meets
CONTROL_GAP = 1e-2
ARCHS = {a.model_type: a for a in SUPPORTED if a.model_type in ("gemma4_text", "deepseek_v3")}


@pytest.fixture(scope="module")
def special_ids(tokenizer) -> dict[str, int]:
    return dict(pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                eos_token_id=tokenizer.eos_token_id)  # fmt: skip


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    """Three prompts of 20 tokens: past the 8-token window before the first sampled token."""
    ids = [tokenizer(r["prompt"])["input_ids"][:20] for r in synthetic_gsm8k(3, seed=5)]
    assert all(len(p) == 20 > 2 * WINDOW for p in ids)
    return ids


def _sample(model, tokenizer, prompts, temperature: float):
    cfg = GenerationConfig(do_sample=True, temperature=temperature, top_k=0, top_p=1.0, max_new_tokens=12,
                           eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)  # fmt: skip
    with ContinuousBatchingGenerator(model, cfg, {"max_batch_tokens": 16}) as gen:
        return gen.generate(prompts, num_generations=G)


def _worst(model, prompts, result, temperature: float, shift: int = 0) -> float:
    worst = 0.0
    for i, (completion, logprobs) in enumerate(zip(result.completion_ids, result.logprobs, strict=True)):
        prompt = prompts[(i // G + shift) % len(prompts)]
        reference = teacher_forced_logprobs(model, prompt, completion, temperature, 0, 1.0)
        worst = max(worst, (reference - torch.tensor(logprobs, dtype=torch.float64)).abs().max().item())
    return worst


def test_each_layer_gets_its_own_slot_shape(tokenizer):
    gemma4 = tiny_config(ARCHS["gemma4_text"], len(tokenizer))
    assert geometry.layer_shapes(gemma4) == [SlotShape(2, 16, 16), SlotShape(1, 32, 32)] * 2
    assert geometry.upstream_shape(gemma4) is None  # upstream cannot read one head size: the reason it failed
    deepseek = tiny_config(ARCHS["deepseek_v3"], len(tokenizer))
    assert geometry.layer_shapes(deepseek) == [SlotShape(1, 16, 8)] * 4  # kv_lora_rank keys, qk_rope_head_dim values
    qwen = AutoConfig.for_model("qwen2", num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                                num_key_value_heads=2)  # fmt: skip
    assert geometry.layer_shapes(qwen) == [geometry.upstream_shape(qwen)] * 2 == [SlotShape(2, 16, 16)] * 2


def test_a_uniform_model_builds_upstreams_cache_untouched(tokenizer):
    """Nothing is patched for a model whose layers all have upstream's shape; the patch is undone after a build."""
    from transformers.generation.continuous_batching import cache as cb_cache

    names = ("ATTN_TYPE_TO_ALLOCATOR", "PagedAttentionMemoryHandler", "find_head_dim", "find_num_key_value_heads")
    before = {name: getattr(cb_cache, name) for name in names}
    qwen = AutoConfig.for_model("qwen2", num_hidden_layers=2, hidden_size=64, num_attention_heads=4)
    with geometry.per_group_geometry(qwen):
        assert all(getattr(cb_cache, name) is before[name] for name in names)
    with geometry.per_group_geometry(tiny_config(ARCHS["gemma4_text"], len(tokenizer))):
        assert all(getattr(cb_cache, name) is not before[name] for name in names)
    assert all(getattr(cb_cache, name) is before[name] for name in names)


def test_layers_cached_together_with_different_shapes_are_refused(tokenizer):
    """Two full-attention layers of different head sizes would share one allocator: refused from the config."""
    arch = ARCHS["gemma4_text"]
    config = tiny_config(arch, len(tokenizer))
    config.per_layer_config = {1: {"head_dim": 32}, 3: {"head_dim": 64}}
    with pytest.raises(ValueError, match="cached together but have different shapes"):
        geometry.group_shape(geometry.layer_shapes(config), [1, 3])
    assert any("different shapes" in p for p in config_problems(config)), config_problems(config)


def test_the_memory_model_counts_each_groups_bytes(tokenizer, special_ids, prompts):
    """The memory model counts a whole-model block's exact bytes: Gemma 4's two 2 x 16 and two 1 x 32 layers."""
    config = tiny_config(ARCHS["gemma4_text"], len(tokenizer))
    page = 8
    expected = page * sum(s.bytes_per_token(torch.float64) for s in geometry.layer_shapes(config))
    assert expected == page * 2 * 8 * (2 * 2 * 16 + 2 * 1 * 32)
    model = tiny_arch_model(ARCHS["gemma4_text"], len(tokenizer), special_ids, dtype=torch.float64)
    cfg = GenerationConfig(do_sample=True, max_new_tokens=4, top_k=0, pad_token_id=tokenizer.pad_token_id)
    with ContinuousBatchingGenerator(model, cfg, {"page_size": page, "num_blocks": 64}) as gen:
        gen.generate(prompts[:1], num_generations=G)
        cache = gen._pool.engine.manager.batch_processor.cache  # noqa: SLF001 - the built cache's geometry
        shapes = {name: (a.num_key_value_heads, a.head_dim) for name, a in cache.cache_allocators.items()}
        assert shapes == {"sliding_attention": (2, 16), "full_attention": (1, 32)}
        # The requested capacity, in whole-model blocks of this geometry, is what was allocated: upstream's count
        # (every layer at the widest slot and the most KV heads) would allocate twice as many sectors.
        assert cache.num_sectors == math.ceil(64 * expected / cache.bytes_per_sector)


@pytest.mark.parametrize("model_type", sorted(ARCHS))
def test_forked_samples_match_teacher_forcing(model_type, tokenizer, special_ids, prompts):
    model = tiny_arch_model(ARCHS[model_type], len(tokenizer), special_ids, dtype=torch.float64)
    for temperature in (1.0, 0.7):
        result = _sample(model, tokenizer, prompts, temperature)
        assert len(result.completion_ids) == G * len(prompts)
        worst = _worst(model, prompts, result, temperature)
        assert worst <= TOLERANCE, f"{model_type} T={temperature}: {worst:.2e}"
        wrong = _worst(model, prompts, result, temperature, shift=1)
        assert wrong >= CONTROL_GAP, f"{model_type}: another prompt moved the logprobs by only {wrong:.2e}"


def test_latent_values_cut_from_their_padded_pages(tokenizer, special_ids, prompts, monkeypatch):
    """Control: DeepSeek-V3's values (8 wide) share 16-wide pages; cut from the wrong end, sampling goes wrong."""
    model = tiny_arch_model(ARCHS["deepseek_v3"], len(tokenizer), special_ids, dtype=torch.float64)
    update = PaddedAllocator.update

    def wrong_end(self, key_states, value_states, layer_idx, read_index, write_index):
        keys, _ = update(self, key_states, value_states, layer_idx, read_index, write_index)
        width, value_width = self.shape.width, self.shape.value_width
        values = torch.index_select(self._kv_token_views[layer_idx][1], 0, read_index)[..., width - value_width :]
        return keys, values if read_index.numel() else value_states

    monkeypatch.setattr(PaddedAllocator, "update", wrong_end)
    result = _sample(model, tokenizer, prompts, 1.0)
    assert _worst(model, prompts, result, 1.0) >= CONTROL_GAP


@pytest.mark.parametrize(
    ("model_type", "unwritten"), [("gemma4_text", False), ("deepseek_v3", False), ("deepseek_v3", True)],
    ids=["gemma4_text", "deepseek_v3", "control-latent-not-written"],
)  # fmt: skip
def test_decode_graphs_on_both_layouts(model_type, unwritten, tokenizer, special_ids, prompts, monkeypatch):
    """With decode graphs on (as on CUDA) both layouts' decode steps replay graphs: Gemma 4's sliding layers read their
    ring of pages and its global layers their pages through block tables, each group's own shape; DeepSeek's latent
    pages are gathered before its layer expands them (no kernel reads them as keys). Float64, exact as above, G = 4
    forked samples past the window; control: a latent step reading its pages without writing its own latent first."""
    from tests.graph_fakes import use_fake_graphs
    from trl_cb.engine import _upstream_cache, decode_graphs

    use_fake_graphs(monkeypatch)
    model = tiny_arch_model(ARCHS[model_type], len(tokenizer), special_ids, dtype=torch.float64)
    cfg = GenerationConfig(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=12,
                           eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)  # fmt: skip
    reads = []
    latent_read = _upstream_cache.latent_block_table_read
    monkeypatch.setattr(_upstream_cache, "latent_block_table_read", lambda *a: reads.append(1) or latent_read(*a))
    if unwritten:
        monkeypatch.setattr(_upstream_cache, "write_new_keys", lambda layer: None)
    with ContinuousBatchingGenerator(model, cfg) as gen:
        result = gen.generate(prompts, num_generations=G)
        graphs = decode_graphs.graphs_of(gen._pool.engine.manager)  # noqa: SLF001 - the engine's graphs
        assert graphs is not None and graphs.replays > 0
    assert bool(reads) == (model_type in geometry.LATENT_FAMILIES)
    worst = _worst(model, prompts, result, 1.0)
    assert worst <= TOLERANCE if not unwritten else worst >= CONTROL_GAP, worst


@pytest.mark.parametrize("kind", ["grpo", "rloo"])
@pytest.mark.parametrize("model_type", sorted(ARCHS))
def test_trainers_train_async_on_both_layouts(kind, model_type, tokenizer, special_ids, tmp_path):
    """Async rollouts (one engine across optimizer steps) on each layout: at lr = 0 the sampler's logprobs equal the
    trainer's (fp32) although samples cross step boundaries; at lr > 0 the weights move and the loss stays finite."""
    from tests.unit.checks.test_compat_matrix import PAIRS, _dataset, _reward, _trainer_args
    from tests.unit.checks.test_compat_matrix import TOLERANCE as FP32_TOLERANCE

    _, trainer_cls = PAIRS[kind]
    for learning_rate in (0.0, 1e-3):
        model = tiny_arch_model(ARCHS[model_type], len(tokenizer), special_ids)
        args = _trainer_args(kind, tmp_path / str(learning_rate), cb_async_generation=True, max_steps=3,
                             learning_rate=learning_rate)  # fmt: skip
        trainer = trainer_cls(model=model, reward_funcs=_reward, args=args, train_dataset=_dataset(),
                              processing_class=tokenizer)  # fmt: skip
        before = [p.detach().clone() for p in trainer.model.parameters()]
        trainer.train()
        logs = [e for e in trainer.state.log_history if "loss" in e]
        assert len(logs) == 3 and all(math.isfinite(e["loss"]) for e in logs)
        moved = any(not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters(), strict=True))
        assert moved is (learning_rate > 0)
        if learning_rate == 0:
            worst = max(e["sampling/sampling_logp_difference/max"] for e in logs)
            assert worst <= FP32_TOLERANCE, f"{model_type} {kind} async: {worst:.2e}"


def test_cuda_kernels_are_checked_per_slot_shape(tokenizer, monkeypatch):
    """On CUDA each distinct slot shape checks the fused kernels; a kernel is used only where every shape agreed,
    and a latent layer (whose attention sees the keys it expanded) keeps the reference. CPU stand-ins for the device
    and the check."""
    import types

    from trl_cb.engine import _upstream, _upstream_cache, cuda_kernels

    asked: list[tuple[int, int]] = []
    verdicts = {16: cuda_kernels.Kernels("flash", "flash"), 32: cuda_kernels.Kernels("flash", cuda_kernels.REFERENCE)}

    def choose(device, dtype, page_size, heads, kv_heads, head_dim, softcap=None, sinks=False):
        asked.append((kv_heads, head_dim))
        return verdicts[head_dim]

    monkeypatch.setattr(cuda_kernels, "choose", choose)
    for model_type, expected in (
        ("gemma4_text", cuda_kernels.Kernels("flash", cuda_kernels.REFERENCE)),
        ("deepseek_v3", None),
    ):
        asked.clear()
        config = tiny_config(ARCHS[model_type], len(tokenizer))
        model = types.SimpleNamespace(device=torch.device("cuda"), dtype=torch.bfloat16, config=config, modules=list)
        cache = types.SimpleNamespace()
        manager = types.SimpleNamespace(
            continuous_batching_config=types.SimpleNamespace(page_size=16),
            batch_processor=types.SimpleNamespace(cache=cache),
        )
        _upstream.choose_cuda_kernel(manager, model)
        assert getattr(cache, _upstream_cache.KERNELS_ATTR, None) == expected, model_type
        assert sorted(asked) == ([(1, 32), (2, 16)] if expected else [])
