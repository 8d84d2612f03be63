"""Contract tests: the transformers and TRL surface trl_cb relies on (trl_cb/engine/_upstream.py for transformers,
trl_cb/trainers/trl_internals.py for TRL).

Each test names what broke, so an upstream release that moves an API fails here first, cheaply and clearly,
instead of corrupting rollouts or their importance weights.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import threading
import time
import types
from pathlib import Path

import pytest
import torch
import transformers
import trl
from transformers import GenerationConfig
from transformers.generation import ContinuousBatchingConfig
from transformers.generation.continuous_batching import ContinuousBatchingManager
from transformers.generation.continuous_batching.requests import GenerationOutput
from transformers.generation.continuous_batching.utils import WorkloadHints

from tests.conftest import sampling_config
from trl_cb.engine import _upstream, _upstream_sampling
from trl_cb.engine import varlen_attention as attention
from trl_cb.engine._upstream_geometry import SlotShape

ROOT = Path(__file__).resolve().parents[2]


def test_engine_refuses_an_untested_transformers_release(monkeypatch):
    """An untested minor release can change the CB internals and corrupt logprobs silently (5.24.0 did, before
    `_upstream_cache.engine_layer` followed it): the engine refuses it unless the user opts in; pyproject.toml pins
    the same releases."""
    monkeypatch.delenv(_upstream.ALLOW_UNTESTED_ENV, raising=False)
    _upstream.check_transformers_version()  # the installed release is a tested one
    with pytest.raises(RuntimeError, match=r"transformers 5\.25\.0 is installed"):
        _upstream.check_transformers_version("5.25.0")
    monkeypatch.setenv(_upstream.ALLOW_UNTESTED_ENV, "1")
    _upstream.check_transformers_version("5.25.0")
    pin = re.search(r'"transformers>=([\d.]+),<([\d.]+)"', (ROOT / "pyproject.toml").read_text())
    assert pin, "pyproject.toml must pin transformers to a range of minor releases"
    low, high = (tuple(int(x) for x in v.split(".")) for v in pin.groups())
    tested = sorted(tuple(int(x) for x in v.split(".")) for v in _upstream.TESTED_TRANSFORMERS)
    assert low == tested[0] and high == (tested[-1][0], tested[-1][1] + 1), (pin.groups(), tested)


def params(fn) -> list[str]:
    return list(inspect.signature(fn).parameters)


def _manager(
    model, tokenizer, max_new_tokens: int = 4, num_blocks: int = 8, max_batch_tokens: int = 64, requests: int = 1
):
    """A started manager on the tiny model, sized by hand (page size 16)."""
    manager = _upstream.create_manager(
        model,
        sampling_config(tokenizer, max_new_tokens=max_new_tokens),
        ContinuousBatchingConfig(
            return_logprobs=True, num_blocks=num_blocks, max_batch_tokens=max_batch_tokens, page_size=16
        ),
        WorkloadHints(max_prompt_length=40, max_generated_length=max_new_tokens, num_requests=requests),
    )
    assert not manager.is_running(), "create_manager must not start the thread (resume does)"
    _upstream.resume(manager, model)
    return manager


# ------------------------------------------------------------------------------------------------- transformers


def test_cb_config_fields():
    names = {f.name for f in dataclasses.fields(ContinuousBatchingConfig)}
    assert {"return_logprobs", "num_blocks", "max_batch_tokens", "page_size", "max_memory_percent"} <= names
    assert {"allow_block_sharing", "auto_switch_to_flash", "seed"} <= names


def test_manager_public_surface():
    for name in (
        "start",
        "stop",
        "destroy",
        "pause",
        "warmup",
        "is_running",
        "get_result",
        "switch_to_cb_friendly_attn",
    ):
        assert callable(getattr(ContinuousBatchingManager, name, None)), f"ContinuousBatchingManager.{name} is gone"
    assert params(ContinuousBatchingManager.add_request)[:4] == ["self", "input_ids", "request_id", "max_new_tokens"]
    assert "timeout" in params(ContinuousBatchingManager.get_result)


def test_generate_batch_and_init_signatures():
    from transformers.generation.continuous_batching import ContinuousMixin

    assert {"inputs", "generation_config", "continuous_batching_config"} <= set(params(ContinuousMixin.generate_batch))
    assert {"generation_config", "continuous_batching_config", "workload_hints"} <= set(
        params(ContinuousMixin.init_continuous_batching)
    )


def test_generation_output_and_hints_fields():
    names = {f.name for f in dataclasses.fields(GenerationOutput)}
    assert {"request_id", "generated_tokens", "logprobs", "error", "status"} <= names
    assert {"max_prompt_length", "max_generated_length", "num_requests"} <= {
        f.name for f in dataclasses.fields(WorkloadHints)
    }


def test_add_request_reads_num_return_sequences_for_forking(model, tokenizer, prompts):
    """`_upstream.add_forked_request` sets `manager.num_return_sequences` per request; add_request must read it."""
    manager = _manager(model, tokenizer, 4, 32, 128, 4)
    try:
        assert manager.num_return_sequences == 1
        ids = _upstream.add_forked_request(manager, prompts[0], "probe", 3, 4)
        assert ids == ["probe", "probe__child#0", "probe__child#1"]
        got = set()
        while len(got) < 3:
            result = manager.get_result(timeout=10)
            assert result is not None, "forked children never arrived"
            if result.is_finished():
                assert result.error is None and len(result.logprobs) == len(result.generated_tokens) == 4
                got.add(result.request_id)
        assert got == set(ids)
        # Per-request seeds tell the samples apart by these names (the upstream results carry them).
        from trl_cb.engine.request_processors import sample_index

        assert sorted(sample_index(rid) for rid in got) == [0, 1, 2]
        assert _upstream.engine_fatal_error(manager) is None
    finally:
        manager.destroy()


def test_internal_attributes_we_touch(model, tokenizer):
    manager = _manager(model, tokenizer, 4, 8, 64, 1)
    try:
        assert hasattr(manager, "_original_attn_impl"), "attention restore relies on manager._original_attn_impl"
        assert callable(manager.batch_processor.cache.reset), "prefix-cache reset relies on cache.reset()"
        assert hasattr(manager.background_thread_status, "fatal_error")
        _upstream.reset_prefix_cache(manager)  # under pause(), with the loop running
    finally:
        manager.destroy()


def test_sampling_internals_the_policy_logprob_recorder_wraps(model, tokenizer):
    """`install_policy_logprob_recorder` wraps `model_runner._sample(scores, output_ids)` (tokens in
    `output_ids[0, :rows]`) and `inputs_and_outputs.prepare_batch_update()` (`(requests, tokens, logprobs)`), and puts
    a plain `(input_ids, scores)` processor first in the engine's list, which calls it on every sampled row."""
    from transformers.generation.continuous_batching.input_outputs import ContinuousBatchingIOs
    from transformers.generation.continuous_batching.model_runner import ModelRunner

    assert params(ModelRunner._sample)[1:] == ["scores", "output_ids"]
    assert params(ContinuousBatchingIOs.prepare_batch_update) == ["self"]
    assert params(model._get_logits_processor)[:2] == ["generation_config", "input_ids_seq_length"]
    manager = _upstream.create_manager(
        model,
        sampling_config(tokenizer, max_new_tokens=4, top_p=0.9),
        ContinuousBatchingConfig(return_logprobs=True, num_blocks=8, max_batch_tokens=64, page_size=16),
        WorkloadHints(max_prompt_length=40, max_generated_length=4, num_requests=1),
        record_policy_logprobs=True,
    )
    try:
        _upstream.resume(manager, model)
        manager.add_request([5, 6, 7], request_id="r", max_new_tokens=4)
        out = manager.get_result(timeout=30)
        processed, policy = _upstream_sampling.output_logprobs(out)
        assert len(processed) == len(policy) == len(out.generated_tokens) == 4
        assert all(p >= q - 1e-6 for p, q in zip(processed, policy)), "top_p renormalises: processed >= policy"
    finally:
        manager.destroy()


def test_the_race_sampler_writes_what_the_engines_sampler_writes():
    """`_upstream_sampling.race_sample` replaces `ModelRunner._sample(scores, output_ids)`: scores `(1, rows,
    vocab)`, tokens to `output_ids[0, :rows]`, fp32 logprobs bit-cast to int32 in `output_ids[1, :rows]`. Both
    samplers on the same scores: identical outputs where each row has one possible token, and on random rows each
    writes the log-probability of the token it wrote."""
    from transformers.generation.continuous_batching.model_runner import ModelRunner

    runner = ModelRunner.__new__(ModelRunner)  # `_sample` reads only these two attributes
    runner.do_sample, runner.return_logprobs = True, True
    one_hot = torch.full((1, 5, 7), float("-inf"))
    one_hot[0, torch.arange(5), torch.tensor([3, 0, 6, 6, 1])] = 0.0
    random_rows = torch.randn(1, 5, 7, generator=torch.Generator().manual_seed(0))
    for scores in (one_hot, random_rows):
        outs = []
        for sample in (lambda s, o: ModelRunner._sample(runner, s, o), _upstream_sampling.race_sample(True)):
            out = torch.full((2, 8), -1, dtype=torch.int32)
            sample(scores, out)
            assert (out[:, 5:] == -1).all(), "wrote past the step's rows"
            logprobs = out[1, :5].view(dtype=torch.float32)
            expected = torch.log_softmax(scores[0], -1).gather(1, out[0, :5, None].long()).squeeze(1)
            torch.testing.assert_close(logprobs, expected, rtol=0, atol=1e-6)
            outs.append(out)
        if scores is one_hot:
            assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize(("impl", "expected"), [("eager", "paged|eager"), ("sdpa", "sdpa")])
def test_cb_keeps_dense_mask_attention_without_flash(tokenizer, impl, expected):
    """`_upstream.switch_to_generation_attention` replaces exactly these choices of `switch_to_cb_friendly_attn`
    (no flash on this machine) with trl_cb's attention."""
    from trl_cb.offline.tiny import tiny_model

    model = tiny_model(tokenizer)
    model.set_attn_implementation(impl)
    cfg = ContinuousBatchingConfig(return_logprobs=True, num_blocks=8, max_batch_tokens=64, page_size=16)
    manager = model.init_continuous_batching(
        generation_config=sampling_config(tokenizer), continuous_batching_config=cfg
    )
    try:
        assert model.config._attn_implementation == expected
        assert expected in attention.DENSE_MASK_IMPLEMENTATIONS
        assert manager.continuous_batching_config.cuda_graph_booleans == (False, False)
    finally:
        _upstream.restore_training_attention(manager)
    assert model.config._attn_implementation == impl


def test_eager_model_is_switched_and_restored(tokenizer):
    from trl_cb.offline.tiny import tiny_model

    model = tiny_model(tokenizer)
    model.set_attn_implementation("eager")
    manager = _manager(model, tokenizer, 4, 8, 64, 1)
    try:
        assert model.config._attn_implementation == attention.ATTENTION_NAME
        assert manager._original_attn_impl == "eager"
        _upstream.restore_training_attention(manager)
        assert model.config._attn_implementation == "eager"
        _upstream.switch_to_generation_attention(manager, model)
        assert model.config._attn_implementation == attention.ATTENTION_NAME
        _upstream.restore_training_attention(manager)
        assert model.config._attn_implementation == "eager"
    finally:
        manager.destroy()


def test_engine_passes_varlen_inputs_and_builds_no_dense_mask(model, tokenizer):
    """What `trl_cb.attention` relies on: the engine allocates (and fills every step) its dense mask only for
    `sdpa`/`paged|eager` (`attn_mask_is_needed`); every attention call gets the paged `cache`, `cu_seq_lens_q` and
    per-layer-type `cu_seq_lens_k`, which `cache.update(key_states, value_states, layer_idx, kwargs)` narrows to the
    layer's group while it writes the new keys and returns each request's keys, packed."""
    from transformers.generation.continuous_batching.cache import PagedAttentionCache
    from transformers.generation.continuous_batching.utils import attn_mask_is_needed

    assert attn_mask_is_needed(model.config) and model.config._attn_implementation == "sdpa"
    manager = _manager(model, tokenizer, 4, 8, 64, 1)
    try:
        assert model.config._attn_implementation == attention.ATTENTION_NAME
        io = manager.batch_processor.inputs_and_outputs
        assert io.attention_mask is None, "the engine still builds a dense mask for trl_cb's attention"
        kwargs = io.get_model_kwargs()
        assert {"cache", "cu_seq_lens_q", "cu_seq_lens_k", "read_index", "write_index"} <= set(kwargs)
        assert isinstance(kwargs["cu_seq_lens_k"], dict) and kwargs["attention_mask"] is None
        assert params(PagedAttentionCache.update) == ["self", "key_states", "value_states", "layer_idx", "kwargs"]
    finally:
        manager.destroy()


#: Per tested release: whether the engine's attention function writes the paged cache (it receives `cache`), or the
#: model's attention layer does (`cache.update(key, value, layer_idx, kwargs=kwargs)`) before calling it.
ATTENTION_WRITES_CACHE = {"5.23": True, "5.24": False}


def test_who_writes_the_paged_cache_per_release(model, tokenizer, prompts, monkeypatch):
    """transformers 5.24 moved the paged-cache update from the attention functions into the models' attention layers:
    the attention function no longer gets `cache`, only the packed keys and the engine's varlen kwargs. A release
    that moves it again must be added here: `_upstream_cache.engine_layer` branches on `ATTENTION_UPDATES_CACHE`.
    Every engine call of trl_cb's attention took the engine path (none fell through to the non-engine forward, which
    is what 5.24.0 did before: CB logprobs 8.9 nats off), and on 5.24 the one-gather reads still ran."""
    from transformers.generation.continuous_batching.cache import PagedAttentionCache

    from trl_cb import ContinuousBatchingGenerator
    from trl_cb.engine import _upstream_cache

    release = ".".join(transformers.__version__.split(".")[:2])
    assert release in ATTENTION_WRITES_CACHE, f"transformers {release}: who writes the paged cache is unchecked"
    assert _upstream_cache.ATTENTION_UPDATES_CACHE is ATTENTION_WRITES_CACHE[release]
    calls = []
    engine_layer = _upstream_cache.engine_layer

    def spy(cache, module, key, value, kwargs):
        direct = hasattr(key, _upstream_cache._READ_INDEX_ATTR)  # noqa: SLF001 - the 5.24 storage hand-over
        layer = engine_layer(cache, module, key, value, kwargs)
        calls.append((isinstance(cache, PagedAttentionCache), "write_index" in kwargs, direct, layer is not None))
        return layer

    monkeypatch.setattr(_upstream_cache, "engine_layer", spy)
    with ContinuousBatchingGenerator(model, sampling_config(tokenizer, max_new_tokens=6), {"page_size": 16}) as gen:
        gen.generate([p[:20] for p in prompts[:2]], num_generations=2)
    writer = ATTENTION_WRITES_CACHE[release]
    assert calls and all(c[0] is writer and c[1] and c[3] for c in calls), set(calls)
    assert any(c[2] for c in calls) is not writer, "5.24: the model-side update did not hand over the storage"


def test_batch_processor_seeds_global_rng_upstream(model, tokenizer):
    """Why create_manager wraps construction in fork_rng: upstream re-seeds the global RNG when it builds the batch
    processor. If this test starts failing, upstream stopped doing so and the fork_rng can go."""
    cfg = ContinuousBatchingConfig(return_logprobs=True, num_blocks=8, max_batch_tokens=64, page_size=16, seed=5)
    manager = model.init_continuous_batching(
        generation_config=sampling_config(tokenizer), continuous_batching_config=cfg
    )
    try:
        torch.manual_seed(0)
        manager.warmup()
        after = torch.rand(2)
        torch.manual_seed(5)
        assert torch.equal(torch.rand(2), after)
    finally:
        _upstream.restore_training_attention(manager)
        manager.batch_processor = None


class _ForceByHistory:
    """A `HistoryProcessor` forcing token `prompt[0] + tokens generated so far`, recording the histories it saw:
    outputs then show whether row i of the logits really is `histories[i]`'s next-token row."""

    def __init__(self) -> None:
        self.histories: dict[str, list[int]] = {}
        self.targets = torch.empty(0, dtype=torch.long)

    def prepare(self, histories) -> None:
        for h in histories:
            self.histories[h.request_id] = h.tokens()
            assert h.tokens()[: h.prompt_len] == h.tokens(0)[: h.prompt_len]
        self.targets = torch.tensor([h.tokens()[0] + h.num_generated for h in histories], dtype=torch.long)

    def __call__(self, scores: torch.Tensor) -> torch.Tensor:
        forced = torch.full_like(scores, -float("inf"))
        n = self.targets.numel()
        forced[torch.arange(n), self.targets] = 0.0
        forced[n:] = scores[n:]
        return forced


def test_request_processors_see_each_rows_own_history(model, tokenizer):
    """`install_request_processors` relies on: `prepare_tensor_args` gets the requests with a new token in logits-row
    order, right before the forward, with `initial_tokens` / `generated_tokens` up to date (forked children too)."""
    force = _ForceByHistory()
    manager = _upstream.create_manager(
        model,
        sampling_config(tokenizer, max_new_tokens=5),
        ContinuousBatchingConfig(return_logprobs=True, num_blocks=32, max_batch_tokens=64, page_size=16),
        WorkloadHints(max_prompt_length=8, max_generated_length=5, num_requests=6),
        [force],
    )
    _upstream.resume(manager, model)  # create_manager does not start the thread
    prompts = {"a": [10, 4, 5, 6], "b": [50, 7], "c": [90, 8, 9, 10, 11, 12]}
    try:
        expected = {}
        for name, prompt in prompts.items():
            for rid in _upstream.add_forked_request(manager, prompt, name, 2, 5):
                expected[rid] = prompt
        outputs = {}
        while len(outputs) < len(expected):
            result = manager.get_result(timeout=10)
            assert result is not None, "requests never finished"
            if result.is_finished():
                outputs[result.request_id] = result
        for rid, prompt in expected.items():
            completion = list(outputs[rid].generated_tokens)
            assert completion == [prompt[0] + k for k in range(5)], (rid, completion)
            assert outputs[rid].logprobs == [0.0] * 5
            assert force.histories[rid] == prompt + completion[:-1]
    finally:
        manager.destroy()


def test_request_history_after_requeue():
    """A re-queued request folds its generated tokens into `initial_tokens` and keeps the prompt length in
    `_true_initial_tokens`; `_upstream_sampling._request_history` must still report prompt and completion correctly."""
    from transformers.generation.continuous_batching.requests import RequestState

    state = RequestState(request_id="r", initial_tokens=[1, 2, 3], max_new_tokens=8)
    state.generated_tokens = [4, 5]
    requeued = state.create_equivalent_initial_request()
    for s, generated in ((state, 2), (requeued, 2)):
        history = _upstream_sampling._request_history(s)
        assert (history.prompt_len, history.num_generated, history.tokens()) == (3, generated, [1, 2, 3, 4, 5])
        assert history.key is s


def test_engine_drops_repetition_penalty_and_we_notice(model, tokenizer):
    """Why repetition penalty is applied by trl_cb: the engine drops generate()'s processor (it needs whole
    sequences). `create_manager` must refuse a config whose processors the engine does not all keep."""
    cfg = ContinuousBatchingConfig(return_logprobs=True, num_blocks=8, max_batch_tokens=64, page_size=16)
    hints = WorkloadHints(max_prompt_length=8, max_generated_length=4, num_requests=1)
    with pytest.raises(ValueError, match="kept 0 of 1"):
        _upstream.create_manager(
            model, sampling_config(tokenizer, max_new_tokens=4, repetition_penalty=1.3), cfg, hints
        )
    # min_p is kept as-is (trl_cb relies on it being exact), as is every other row-wise warper we mark exact.
    manager = _upstream.create_manager(model, sampling_config(tokenizer, max_new_tokens=4, min_p=0.1), cfg, hints)
    try:
        kept = [type(p).__name__ for p in manager.logit_processor.logits_processor]
        assert kept == ["MinPLogitsWarper"], kept
    finally:
        manager.destroy()


def test_processor_check_compares_types_and_settings_not_counts(model, tokenizer):
    """`check_processors_kept` pairs the engine's processors with generate()'s by type (or per-request type) and
    compares their settings: a processor swapped for another, or kept with another parameter, is refused even when
    the count is the same."""
    cfg = ContinuousBatchingConfig(return_logprobs=True, num_blocks=8, max_batch_tokens=64, page_size=16)
    hints = WorkloadHints(max_prompt_length=8, max_generated_length=4, num_requests=1)
    built = sampling_config(tokenizer, max_new_tokens=4, temperature=0.7, top_p=0.9)
    manager = _upstream.create_manager(model, built, cfg, hints)
    try:
        check = _upstream_sampling.check_processors_kept
        check(manager, model, built)  # what it was built from passes
        with pytest.raises(ValueError, match=r"changed \['top_p'\]"):
            _upstream_sampling.check_processors_kept(
                manager, model, sampling_config(tokenizer, temperature=0.7, top_p=0.8)
            )
        with pytest.raises(ValueError, match="became"):
            _upstream_sampling.check_processors_kept(
                manager, model, sampling_config(tokenizer, temperature=0.7, top_k=5)
            )
        with pytest.raises(ValueError, match=r"changed \['temperature'\]"):
            _upstream_sampling.check_processors_kept(
                manager, model, sampling_config(tokenizer, temperature=0.9, top_p=0.9)
            )
    finally:
        manager.destroy()


def test_generation_config_fields_all_classified():
    """A transformers release adding a GenerationConfig field fails here: classify it in
    `trl_cb/generation_settings.FIELD_RULES` (until then it is refused whenever set)."""
    from trl_cb.checks.generation_settings import FIELD_RULES, OPENAI_FIELDS, Handling

    assert sorted(f for f in GenerationConfig().to_dict() if f not in FIELD_RULES) == []
    assert sorted(f for f in FIELD_RULES if f not in GenerationConfig().to_dict()) == sorted(OPENAI_FIELDS)
    assert all(f not in GenerationConfig().to_dict() for f in OPENAI_FIELDS)  # transformers has not added them
    for name, rule in FIELD_RULES.items():
        assert rule.reason and (rule.handling is Handling.REFUSED or rule.neutral(None)), name


def test_generate_adds_top_k_but_cb_does_not():
    cfg = GenerationConfig(do_sample=True)
    assert cfg.top_k in (None, 50)  # generate() falls back to 50 when unset; we set top_k=0 explicitly for CB


def test_cache_construction_the_per_group_geometry_patches():
    """`engine/_upstream_geometry.py` swaps names the cache module looks up while it builds (behaviour, with a
    control that upstream's build fails on Gemma 4: tests/unit/engine/test_cache_geometry.py)."""
    from transformers.generation.continuous_batching import cache as cb_cache
    from transformers.generation.continuous_batching.cache_allocators.full_attention import (
        FullAttentionCacheAllocator,
    )
    from transformers.models.deepseek_v3 import modeling_deepseek_v3

    init = inspect.getsource(cb_cache.PagedAttentionCache.__init__)
    for looked_up in (
        "ATTN_TYPE_TO_ALLOCATOR[attn_type](index=index, layer_indices=layer_indices, **ca_kwargs)",
        "PagedAttentionMemoryHandler(",
        "find_num_key_value_heads(config)",
        "find_head_dim(config)",
    ):
        assert looked_up in init, looked_up  # fmt: skip
    handler = inspect.getsource(cb_cache.PagedAttentionMemoryHandler.__init__)
    for stored in ("self.bytes_per_block = bytes_per_block", "self.cache_dtype = ", "self.cb_config = "):
        assert stored in handler, stored
    assert params(FullAttentionCacheAllocator.__init__) == [
        "self", "index", "config", "num_key_value_heads", "cache_dtype", "page_size", "layer_indices",
        "allow_block_sharing",
    ]  # fmt: skip
    assert params(FullAttentionCacheAllocator.update) == [
        "self", "key_states", "value_states", "layer_idx", "read_index", "write_index",
    ]  # fmt: skip
    assert "find_head_dim(config)" in inspect.getsource(FullAttentionCacheAllocator.__init__)
    # DeepSeek-V3's layer caches its latent (one head: kv_lora_rank "keys", qk_rope_head_dim "values").
    assert "cache.update(kv_nope, k_rot" in inspect.getsource(modeling_deepseek_v3.DeepseekV3Attention.forward)


def test_engine_cache_layout_we_check_models_against():
    """trl_cb/compat.py compares each model with how the engine lays out its cache: layer types it has allocators
    for, one (KV heads, head size) for every slot, layers grouped from `layer_types` / `sliding_window`."""
    from transformers import MistralConfig, Qwen2Config

    assert _upstream.engine_attention_layer_types() == {"full_attention", "sliding_attention"}
    qwen = Qwen2Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2)
    assert _upstream.engine_cache_geometry(qwen) == [SlotShape(2, 16, 16)] * 2
    assert _upstream.engine_layer_groups(qwen) == {"full_attention": [0, 1]}
    mistral = MistralConfig(num_hidden_layers=2, sliding_window=8)  # no layer_types: all sliding
    assert _upstream.engine_layer_groups(mistral) == {"sliding_attention": [0, 1]}
    qwen.layer_types = ["full_attention", "linear_attention"]  # a hybrid: its recurrent layer has no key slots
    assert _upstream.engine_layer_groups(qwen) == {"full_attention": [0]}
    qwen.layer_types = ["full_attention", "chunked_attention"]
    with pytest.raises(ValueError, match="Invalid layer type"):
        _upstream.engine_layer_groups(qwen)


def test_prefix_match_leaves_one_token_and_a_fork_prefills_all_but_the_last():
    """`_upstream_prefix.with_two_tokens_left` wraps `PagedAttentionCache.search_prefix_match(request_id, prompt_ids)`
    because the allocators match whole pages of all but the prompt's last token (one left) and the scheduler gives a
    request with children all but its last token (one fewer): a fork on a match would prefill nothing."""
    from transformers.generation.continuous_batching import cache, scheduler
    from transformers.generation.continuous_batching.cache_allocators import cache_allocator

    assert list(inspect.signature(cache.PagedAttentionCache.search_prefix_match).parameters) == [
        "self",
        "request_id",
        "prompt_ids",
    ]
    assert "(len(prompt_ids) - 1) // self.tokens_per_page" in inspect.getsource(
        cache_allocator.CacheAllocator.match_prefix_blocks
    )
    source = inspect.getsource(scheduler.Scheduler)
    assert "search_prefix_match(state.request_id, state.remaining_prefill_tokens)" in source
    assert "token_budget = len(request_tokens) - 1" in source


def test_attention_interface_accepts_a_registered_probe(tokenizer):
    """The compatibility probe registers its own attention function and runs one forward through it."""
    from transformers import AttentionInterface

    from trl_cb.offline.tiny import tiny_model

    calls = []

    def probe(module, query, key, value, attention_mask, **kwargs):
        calls.append((module.layer_idx, tuple(key.shape)))
        return torch.zeros(query.shape[0], query.shape[2], query.shape[1], query.shape[3]), None

    AttentionInterface.register("trl_cb_contract_probe", probe)
    model = tiny_model(tokenizer)
    model.set_attn_implementation("trl_cb_contract_probe")
    with torch.no_grad():
        model(torch.tensor([[3, 4, 5]]), use_cache=False)
    assert [c[0] for c in calls] == [0, 1] and calls[0][1] == (1, 2, 3, 16)  # (B, KV heads, T, head size)


# ---------------------------------------------------------------------------------------------------------- TRL


def test_trl_generation_hooks():
    assert params(trl.GRPOTrainer._generate_single_turn) == [
        "self", "prompt_ids", "images", "multimodal_fields", "num_generations", "has_tool_images",
    ]  # fmt: skip
    assert params(trl.RLOOTrainer._generate_single_turn) == ["self", "prompt_ids", "images", "multimodal_fields"]
    for cls in (trl.GRPOTrainer, trl.RLOOTrainer):
        p = params(cls._get_per_token_logps_and_entropies)
        assert p[:5] == ["self", "model", "input_ids", "attention_mask", "logits_to_keep"]
        assert "batch_size" in p


def test_trl_grpo_accepts_per_token_advantages_and_reads_is_ratio_for_vespo():
    src = inspect.getsource(trl.GRPOTrainer._compute_loss)
    assert "advantages.dim() == 1" in src, "GRPO loss no longer accepts (B, T) advantages"
    assert 'inputs.get("importance_sampling_ratio")' in src, "VESPO no longer reads importance_sampling_ratio"
    src = inspect.getsource(trl.RLOOTrainer._compute_loss)
    assert 'advantages = inputs["advantages"]' in src and "coef_1 * advantages" in src


def test_trl_loss_computes_policy_logprobs_before_reading_advantages():
    """A deferred IS correction (trainers/is_correction.py `_compute_loss`) rewrites `inputs["advantages"]` (and sets
    `inputs["importance_sampling_ratio"]`) when TRL's loss forward returns the policy's logprobs: that call must come
    first, before TRL reads either, and must be TRL's first `_get_per_token_logps_and_entropies` call there."""
    for cls in (trl.GRPOTrainer, trl.RLOOTrainer):
        src = inspect.getsource(cls._compute_loss)
        call = src.find("self._get_per_token_logps_and_entropies(")
        assert call != -1, f"{cls.__name__}._compute_loss no longer calls _get_per_token_logps_and_entropies"
        reads = [src.find(key) for key in ('inputs["advantages"]', 'inputs.get("importance_sampling_ratio")')]
        assert all(r == -1 or r > call for r in reads), f"{cls.__name__} reads advantages before its loss forward"
    src = inspect.getsource(trl.GRPOTrainer._generate_and_score_completions)
    assert "gradient_accumulation_steps % generate_every != 0" in src, "TRL's condition for old logps changed"


def test_rloo_old_logps_forward_and_its_readers():
    """trl_cb may answer RLOO's scoring forward for the old-policy logprobs with a placeholder and take them from the
    loss forward (`is_correction.py` `old_logps_from_loss`): that forward must be the scoring's only policy call
    without a KL term, its values read only for `old_logps` and the KL, and the loss must read `inputs["old_logps"]`
    after its own forward."""
    score = inspect.getsource(trl.RLOOTrainer._generate_and_score_completions)
    assert "old_per_token_logps, _, _ = self._get_per_token_logps_and_entropies(\n                self.model," in score
    readers = [line.strip() for line in score.splitlines() if "old_per_token_logps" in line]
    assert readers == [
        "old_per_token_logps, _, _ = self._get_per_token_logps_and_entropies(",
        "old_logps = (old_per_token_logps * completion_mask).sum(1)  # mask out padding and tokens after EOS",
        "per_token_kl = old_per_token_logps - ref_per_token_logps",
    ], readers
    assert score.count("self._get_per_token_logps_and_entropies(") == 3  # old logps; ref model; PEFT's ref adapter
    assert score.find("if self.beta != 0.0:") < score.find("ref_per_token_logps, _, _")  # both ref calls need beta
    loss = inspect.getsource(trl.RLOOTrainer._compute_loss)
    assert loss.find('old_logps = inputs["old_logps"]') > loss.find("self._get_per_token_logps_and_entropies(")
    assert "logps = (per_token_logps * completion_mask).sum(1)" in loss  # the sums trl_cb forms the same way


def test_trainers_reach_trl_internals_only_through_one_module():
    """Every TRL private attribute trl_cb's trainers touch goes through trainers/trl_internals.py (pinned by the tests
    around this one); the other trainer modules only override TRL's generation, tool-loop and loss hooks."""
    import ast
    from pathlib import Path

    import trl_cb.trainers

    overrides = {"_generate_single_turn", "_generate_and_score_completions", "_compute_loss", "_tool_call_loop"}
    paths = [p for p in sorted(Path(trl_cb.trainers.__file__).parent.glob("*.py")) if p.name != "trl_internals.py"]
    trees = [(path, ast.parse(path.read_text())) for path in paths]
    # trl_cb's own private methods (the rollout component's parts), never TRL's: every one is defined here
    own = {n.name for _, tree in trees for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)} - overrides
    offenders = []
    for path, tree in trees:
        for node in ast.walk(tree):
            name = node.attr if isinstance(node, ast.Attribute) else None
            private = name and name.startswith("_") and not name.startswith(("_cb_", "__"))
            if private and name not in overrides and name not in own:
                offenders.append(f"{path.name}:{node.lineno} .{name}")
    assert not offenders, offenders
    for cls in (trl.GRPOTrainer, trl.RLOOTrainer):
        assert "self._metrics" in inspect.getsource(cls.__init__), f"{cls.__name__} no longer keeps _metrics"
        assert callable(getattr(cls, "_tokenize_prompts", None))


def test_trl_output_keys_we_read():
    grpo = inspect.getsource(trl.GRPOTrainer._generate_and_score_completions)
    for key in ("sampling_per_token_logps", "old_per_token_logps", "completion_mask", "prompt_mask", "tool_mask"):
        assert f'"{key}"' in grpo, f"GRPO output no longer has {key!r}"
    rloo = inspect.getsource(trl.RLOOTrainer._generate_and_score_completions)
    for key in ("completion_ids", "completion_mask", "prompt_ids", "prompt_mask", "advantages"):
        assert f'"{key}"' in rloo


def test_grpo_takes_no_logprob_lists_and_reads_the_sampling_logprobs_from_the_batch():
    """trl_cb's GRPO hands TRL `None` logprobs (no per-token lists) unless tools are on, and puts the padded
    `sampling_per_token_logps` into the scored batch itself (trainers/mixin.py): TRL must build that key only from
    non-`None` lists, run its tool loop only `if self.tools`, and read the key from the batch in its loss."""
    assert "if sampling_per_token_logps_list is not None:" in inspect.getsource(
        trl.GRPOTrainer._generate_and_score_completions
    )
    assert "if self.tools:" in inspect.getsource(trl.GRPOTrainer._generate)
    assert 'inputs.get("sampling_per_token_logps"' in inspect.getsource(trl.GRPOTrainer._compute_loss)


def test_trl_unwrap_helpers():
    from trl.distributed import DistributedBackend
    from trl.models.utils import disable_gradient_checkpointing, unwrap_model_for_generation

    assert {"gather_deepspeed3_params", "gradient_checkpointing_kwargs"} <= set(params(unwrap_model_for_generation))
    assert callable(DistributedBackend.summon_full_params)
    assert callable(disable_gradient_checkpointing)


@pytest.mark.parametrize("cls", [trl.GRPOConfig, trl.RLOOConfig])
def test_trl_config_fields_we_read(cls):
    names = {f.name for f in dataclasses.fields(cls)}
    assert {"ds3_gather_for_generation", "bf16", "fp16", "gradient_checkpointing_kwargs", "temperature"} <= names


def test_torch_fsdp2_internals_we_save_and_restore():
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState

    for name in ("unshard", "reshard", "set_reshard_after_forward", "_get_fsdp_state"):
        assert callable(getattr(FSDPModule, name, None)), f"FSDPModule.{name} is gone"
    assert "_auto_reshard_after_forward" in inspect.getsource(FSDPState.__init__)
    assert "post_forward_mesh_info" in inspect.getsource(FSDPParamGroup.__init__)
    assert "_fsdp_param_groups" in inspect.getsource(FSDPState)


def test_scheduler_state_read_under_pause(model, tokenizer, prompts):
    """Async version tagging reads each in-flight request's generated-token count under `pause()`; requests keep
    going after the pause (nothing drained)."""
    manager = _manager(model, tokenizer, 40, 64, 64, 2)
    try:
        scheduler = manager.batch_processor.scheduler
        assert isinstance(scheduler.active_requests, dict) and isinstance(scheduler.waiting_requests, dict)
        ids = _upstream.add_forked_request(manager, prompts[0], "p", 2, 40)
        seen: dict[str, int] = {}
        for _ in range(200):
            with manager.pause():
                seen = _upstream.inflight_generated_lengths(manager)
            if any(v > 0 for v in seen.values()):
                break
        assert set(seen) <= set(ids) and any(v > 0 for v in seen.values())
        finished = set()
        while len(finished) < 2:
            result = manager.get_result(timeout=10)
            assert result is not None, "requests did not continue after the pause"
            if result.is_finished():
                finished.add(result.request_id)
    finally:
        manager.destroy()


def test_suspend_resume_keeps_the_engine(model, tokenizer, prompts):
    """`_upstream.suspend` stops the loop through internals (`request_stop`, `_wake_up_loop`, `_generation_thread`)
    and `start()` must resume on the same batch processor and cache."""
    manager = _manager(model, tokenizer, 4, 32, 64, 2)
    try:
        processor, cache_tensor = manager.batch_processor, manager.batch_processor.cache.cache_tensor
        _upstream.suspend(manager)
        assert not manager.is_running() and manager._generation_thread is None
        _upstream.resume(manager, model)
        assert manager.is_running() and manager.batch_processor is processor
        assert manager.batch_processor.cache.cache_tensor is cache_tensor
        _upstream.add_forked_request(manager, prompts[0], "again", 2, 4)
        done = set()
        while len(done) < 2:
            result = manager.get_result(timeout=10)
            assert result is not None
            if result.is_finished():
                done.add(result.request_id)
    finally:
        manager.destroy()


def test_trl_cli_pieces_used_by_trl_cb_cli():
    """`trl_cb/cli/command.py` builds `trl-cb grpo|rloo` from `trl grpo|rloo`'s own pieces (see its docstring)."""
    from trl.cli.accelerate_config import resolve_accelerate_config_argument
    from trl.cli.commands.training import _subtract_subsequence
    from trl.scripts import grpo, rloo

    for cls in (grpo.GRPOScriptArguments, rloo.RLOOScriptArguments):
        fields = {f.name for f in dataclasses.fields(cls)}
        assert issubclass(cls, trl.ScriptArguments), cls
        assert {"reward_funcs", "reward_model_name_or_path", "dataset_name", "dataset_config"} <= fields, fields
        assert {"dataset_train_split", "dataset_test_split", "dataset_streaming"} <= fields, fields
    assert {"return_remaining_strings", "separate_remaining_strings"} <= set(
        params(trl.TrlParser.parse_args_and_config)
    )
    assert resolve_accelerate_config_argument(["--accelerate_config", __file__, "--num_processes", "2"]) == [
        "--config_file", __file__, "--num_processes", "2"
    ]  # fmt: skip
    assert _subtract_subsequence(["a", "--x", "1", "b", "--x"], ["--x", "1"]) == ["a", "b", "--x"]
    # The reward names and the factory's values trl_cb.cli.reward_registry repeats so that TRL recipes mean the same.
    for script in (grpo, rloo):
        src = inspect.getsource(script.main)
        assert "get_soft_overlong_punishment(max_completion_len=1280, soft_punish_cache=256)" in src
        for name in ("accuracy_reward", "reasoning_accuracy_reward", "think_format_reward"):
            assert f'"{name}": {name}' in src, name


# ------------------------------------------------------------------------------ abort / lifecycle (issue 9)


def test_hard_stop_abandons_outstanding_requests_and_marks_the_loop_stopped(tokenizer, prompts, monkeypatch):
    """`_upstream.stop_now` relies on `request_stop(HARD_STOP)` ending the loop before its next batch (not after
    generating what is outstanding, as `destroy()` does) and on `local_status == STOPPED` once the thread is done.

    Outstanding by construction: a model that never samples EOS, and the engine parked in its second forward (prefill
    done, decoding) until the stop is requested (`tests/gates.py`), on any machine speed."""
    from transformers.generation.continuous_batching.continuous_api import BackgroundThreadStatus

    from tests.gates import engine_gate
    from tests.unit.rollouts.test_reliability import far_from_uniform
    from trl_cb.offline.tiny import tiny_model

    assert BackgroundThreadStatus.HARD_STOP > BackgroundThreadStatus.FLUSH_AND_STOP
    src = inspect.getsource(ContinuousBatchingManager._run_generation_loop)
    assert "finally:" in src and "mark_as_stopped()" in src.split("finally:")[-1], "loop no longer marks STOPPED"
    model = far_from_uniform(tiny_model(tokenizer), tokenizer)
    manager = _manager(model, tokenizer, 2000, 256, 64, 8)
    try:
        assert isinstance(manager._generation_thread, threading.Thread) and hasattr(manager, "_wake_up_loop")
        with engine_gate(model, monkeypatch, after=2) as gate:
            for i, prompt in enumerate(prompts):
                manager.add_request(prompt, request_id=f"long{i}", max_new_tokens=2000)
            gate.wait_entered()
            start = time.monotonic()
            assert _upstream.stop_now(manager, timeout=10)
            assert time.monotonic() - start < 2.0, "hard stop no longer stops promptly"
        assert manager._generation_thread is None
        status = manager.background_thread_status
        assert status.local_status == status.STOPPED
        results = []
        while (result := manager.get_result(timeout=0.1)) is not None:
            results.append(result)
        assert any(r.error is not None for r in results), "abandoned requests must come back failed"
        assert all(len(r.generated_tokens) < 2000 for r in results), "a hard stop must not generate the rest"
    finally:
        _upstream.restore_training_attention(manager)
        _upstream.release(manager)


def test_manager_constructor_switches_attention_before_it_can_raise(tokenizer):
    """Why `create_manager` restores attention and mode on failure: upstream switches eager -> paged|eager, then
    raises (here: page_size below its minimum of 4)."""
    from trl_cb.offline.tiny import tiny_model

    model = tiny_model(tokenizer)
    model.set_attn_implementation("eager")
    cfg = ContinuousBatchingConfig(return_logprobs=True, num_blocks=8, max_batch_tokens=64, page_size=1)
    with pytest.raises(ValueError, match="page_size"):
        model.init_continuous_batching(generation_config=sampling_config(tokenizer), continuous_batching_config=cfg)
    assert model.config._attn_implementation == "paged|eager", "upstream no longer switches before raising"
    model.set_attn_implementation("eager")
    model.train()
    with pytest.raises(ValueError, match="page_size"):
        _upstream.create_manager(model, sampling_config(tokenizer), cfg, WorkloadHints(max_prompt_length=8))
    assert model.config._attn_implementation == "eager" and model.training


def test_cpython_thread_atexit_hook():
    """`guards.register_before_thread_join` needs the hook that runs before non-daemon threads are joined."""
    assert callable(getattr(threading, "_register_atexit", None)), "threading._register_atexit is gone"


def test_trainer_checkpoint_hooks_we_use():
    """Async resume: `on_save` fires right after `_save_checkpoint` wrote `<output_dir>/checkpoint-<global_step>`;
    `train(resume_from_checkpoint=True)` resolves the path with `get_last_checkpoint(output_dir)`."""
    from transformers import Trainer
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint

    assert PREFIX_CHECKPOINT_DIR == "checkpoint" and callable(get_last_checkpoint)
    src = inspect.getsource(Trainer._maybe_log_save_evaluate)
    assert src.index("self._save_checkpoint(model, trial)") < src.index("self.callback_handler.on_save(")
    save = inspect.getsource(Trainer._save_checkpoint)
    assert 'checkpoint_folder = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"' in save
    assert params(Trainer.train)[1] == "resume_from_checkpoint"
    assert "get_last_checkpoint(args.output_dir)" in inspect.getsource(Trainer.train)


def test_trl_generation_schedule_and_prompt_tokenizer():
    """Async: prompts are tokenized with TRL's `_tokenize_prompts`; rollouts are taken once every
    `steps_per_generation * num_iterations` micro-steps (the default staleness bound is derived from it)."""
    for cls in (trl.GRPOTrainer, trl.RLOOTrainer):
        assert callable(getattr(cls, "_tokenize_prompts", None))
        src = inspect.getsource(cls._prepare_inputs)
        assert "generate_every = self.args.steps_per_generation * self.num_iterations" in src
    for cls in (trl.GRPOConfig, trl.RLOOConfig):
        assert {"steps_per_generation", "num_iterations", "gradient_accumulation_steps"} <= {
            f.name for f in dataclasses.fields(cls)
        }


def test_paged_cache_internals_the_fast_reads_use(model, tokenizer):
    """`engine/_upstream_cache.py` and `_upstream_patches` (step threads) rely on these names and signatures; their
    behaviour (same rows, same logprobs) is tested in tests/unit/engine/test_upstream_cache.py and test_attention."""
    from transformers.generation.continuous_batching.cache_allocators.full_attention import (
        FullAttentionCacheAllocator,
    )
    from transformers.generation.continuous_batching.input_outputs import ContinuousBatchingIOs
    from transformers.generation.continuous_batching.model_runner import ModelRunner

    assert params(ContinuousBatchingIOs.prepare_batch_tensors) == [
        "self", "requests_in_batch", "logits_processors", "use_decode_fast_path", "num_q_tokens", "max_kv_read",
        "use_padding",
    ]  # fmt: skip
    assert params(ModelRunner.compute_batch) == ["self", "model", "batch_data"]
    read_params = ["self", "request_id", "past_length", "query_length"]
    assert params(FullAttentionCacheAllocator.get_read_indices) == read_params
    manager = _manager(model, tokenizer, 4, 8, 64, 1)
    try:
        processor = manager.batch_processor
        ios, cache = processor.inputs_and_outputs, processor.cache
        for name in ("read_index_storage", "true_read_sizes", "requests_in_batch", "block_table"):
            assert hasattr(ios, name), name
        allocator = cache.layer_to_allocator[0]
        assert type(allocator) is FullAttentionCacheAllocator
        for name in ("index", "layer_type", "block_table", "tokens_per_page", "block_physical_stride"):
            assert hasattr(allocator, name), name
        k_view, v_view = allocator._kv_token_views[0]
        assert k_view.dim() == 3 and k_view.shape[1] == model.config.num_key_value_heads
    finally:
        manager.destroy()


def test_module_attachments_the_engine_view_strips(model, tokenizer):
    """engine/_upstream_view.py: where torch keeps hooks, where transformers caches a persistent engine and keeps
    the gradient checkpointing switch, and that the wrappers accelerate (mixed precision) and TRL (fused logprobs)
    install are instance `forward`s, which the view drops (a bound method rebound to the copy by `deepcopy` would
    still call the training module through its closure)."""
    from types import MethodType

    import trl.trainer.utils
    from accelerate import Accelerator

    from trl_cb.engine import _upstream_view
    from trl_cb.engine.model_view import EngineView

    for name in _upstream_view.HOOK_DICTS:
        assert isinstance(getattr(torch.nn.Linear(2, 2), name), dict), f"torch.nn.Module.{name} moved"
    model.activation_checkpointing_enable()
    assert all(layer.gradient_checkpointing for layer in model.model.layers), "checkpointing switch moved"
    model.generate_batch(
        [[5, 6, 7]], generation_config=sampling_config(tokenizer, max_new_tokens=2), persistent_manager=True,
        continuous_batching_config=ContinuousBatchingConfig(num_blocks=8, max_batch_tokens=64, page_size=16),
        progress_bar=False,
    )  # fmt: skip
    try:
        assert getattr(model, _upstream_view.CACHED_MANAGER_ATTRIBUTE) is not None, "cached manager attribute moved"
        source = inspect.getsource(Accelerator.prepare_model)
        assert "model._original_forward = model.forward" in source and "MethodType(new_forward, model)" in source
        assert "original_forward = model.forward" in inspect.getsource(trl.trainer.utils)  # TRL's fused forward
        original = model.forward
        model.forward = MethodType(lambda self, *a, **k: original(*a, **k), model)  # TRL's shape: closes over model
        view = EngineView(model).module
        assert "forward" not in vars(view), "an instance forward would run the training module"
        assert getattr(view, _upstream_view.CACHED_MANAGER_ATTRIBUTE, None) is None
        assert not any(layer.gradient_checkpointing for layer in view.model.layers)
    finally:
        model.destroy_cached_continuous_batching_manager()


def test_manager_internals_the_engine_stream_uses(model, tokenizer):
    """engine/_upstream_patches.py (`run_loop_in`, `adopt_compute_stream`): `start` builds the loop thread from the
    instance's `_run_generation_loop` (so a wrapper installed before `start` runs on the engine's thread, for the whole
    loop); the batch processor exists before `start` (warm-up builds it) and reads its compute stream from its IOs at
    every step; the offloading manager keeps its own reference; async batching keeps three streams."""
    from transformers.generation.continuous_batching import continuous_api, input_outputs, model_runner

    from trl_cb.engine import _upstream_patches

    # 5.23: `Thread(target=self._run_generation_loop)`; 5.24 adds `kwargs={"use_inference_mode": ...}`
    assert re.search(
        rf"threading\.Thread\(\s*target=self\.{_upstream_patches.LOOP_ATTRIBUTE}\b",
        inspect.getsource(ContinuousBatchingManager.start),
    ), "start() no longer runs the loop thread from the instance's loop attribute"
    assert "compute_stream = self.inputs_and_outputs.compute_stream" in inspect.getsource(
        model_runner.ModelRunner.compute_batch
    ), "the forward no longer reads the IOs' compute stream at each step"
    assert "compute_stream=self.inputs_and_outputs.compute_stream" in inspect.getsource(continuous_api)
    assert {"self.h2d_stream", "self.d2h_stream", "self.compute_stream"} <= set(
        re.findall(r"self\.\w+_stream", inspect.getsource(input_outputs.ContinuousBatchingAsyncIOs))
    )
    manager = _upstream.create_manager(
        model,
        sampling_config(tokenizer, max_new_tokens=4),
        ContinuousBatchingConfig(return_logprobs=True, num_blocks=8, max_batch_tokens=64, page_size=16),
        WorkloadHints(max_prompt_length=40, max_generated_length=4, num_requests=1),
    )
    entered: list[str] = []

    class Recording:
        def __enter__(self) -> None:
            entered.append(threading.current_thread().name)

        def __exit__(self, *exc: object) -> None:
            return None

    try:
        processor = manager.batch_processor
        assert processor.use_async_batching is False and processor.inputs_and_outputs.compute_stream is None  # CPU
        assert processor.offloading_manager._compute_stream is None
        assert _upstream_patches.adopt_compute_stream(manager, object()) == []
        assert processor.inputs_and_outputs.compute_stream is None, "a CPU engine has no stream to replace"
        _upstream_patches.run_loop_in(manager, Recording)
        _upstream_patches.run_loop_in(manager, Recording)  # idempotent
        _upstream.resume(manager, model)
        manager.add_request([5, 6, 7], request_id="r", max_new_tokens=4)
        assert manager.get_result(request_id="r", timeout=60) is not None
        assert len(entered) == 1 and entered[0] != threading.current_thread().name
    finally:
        manager.destroy()


def test_scheduler_and_batch_internals_the_decode_fast_path_uses(model, tokenizer):
    """`engine/_upstream_decode.py` reads and writes these names; its behaviour (the slow path's tokens and logprobs
    on long decodes, a control) is tested in tests/unit/engine/test_decode_fast_path.py."""
    from transformers.generation.continuous_batching.input_outputs import ContinuousBatchingIOs
    from transformers.generation.continuous_batching.requests import TMP_TOKEN_ID, FutureRequestState, RequestState
    from transformers.generation.continuous_batching.scheduler import FIFOScheduler, Scheduler

    from trl_cb.engine import _upstream_decode

    assert params(Scheduler.schedule_batch) == ["self", "token_budget", "cache_budget"]
    assert params(FutureRequestState) == ["state", "has_new_token", "complete_blocks", "query_length"]
    assert params(ContinuousBatchingIOs.prepare_batch_update) == ["self"]
    assert TMP_TOKEN_ID == -1
    fields = {f.name for f in dataclasses.fields(RequestState)}
    for name in ("position_offset", "tokens_to_process", "num_children", "generated_tokens", "logprobs", "streaming",
                 "record_timestamps", "_eos_token_ids", "_new_tokens_limit", "request_id"):  # fmt: skip
        assert name in fields, name
    assert isinstance(RequestState.status, property)
    manager = _manager(model, tokenizer, 4, 8, 64, 1)
    try:
        processor = manager.batch_processor
        ios, cache, scheduler = processor.inputs_and_outputs, processor.cache, processor.scheduler
        assert type(scheduler) is FIFOScheduler and type(ios) is ContinuousBatchingIOs
        for name in ("active_requests", "waiting_requests", "block_new_requests", "_requests_to_fork",
                     "starved_requests", "max_requests_per_batch"):  # fmt: skip
            assert hasattr(scheduler, name), name
        for name in ("use_prefix_sharing", "read_cache_limit", "cache_allocators", "can_store_request_tokens"):
            assert hasattr(cache, name), name
        for name in ("input_ids", "position_ids", "cumulative_seqlens_q", "cumulative_seqlens_k", "logits_indices",
                     "output_ids", "write_index_storage", "read_index_storage", "true_write_sizes", "true_read_sizes",
                     "max_length_q", "max_length_k", "total_seqlen_q", "total_seqlen_k", "num_q_tokens", "max_kv_read",
                     "num_request_in_batch", "use_block_table", "requests_in_batch", "req_id_to_new_token_position",
                     "_bulk_input_tensor", "static_inputs", "attention_mask", "block_table"):  # fmt: skip
            assert hasattr(ios, name), name
        assert processor.model_runner.pad_inputs is False
        assert _upstream_decode.decode_fast_path_stats(manager) is not None, "not installed on a CPU engine"
    finally:
        manager.destroy()


def test_fork_deepcopies_the_state_and_mask_builders_return_a_4d_mask(tokenizer):
    """`engine/_upstream_fork.py`: `RequestState.fork` copies through `copy.deepcopy(self)` (which consults an
    instance's `__deepcopy__`), on a plain dataclass. `engine/_upstream_patches.py`' mask placeholder: a 4D
    `attention_mask` is returned untouched by the mask builders (tests/unit/engine/test_upstream_forward.py checks the
    engine side)."""
    from transformers import masking_utils
    from transformers.generation.continuous_batching.requests import RequestState

    from trl_cb.engine import _upstream_patches
    from trl_cb.offline.tiny import tiny_model

    assert "__deepcopy__" not in vars(RequestState) and not hasattr(RequestState, "__slots__")
    state = RequestState(request_id="r", initial_tokens=[1, 2, 3], max_new_tokens=8)
    seen = []
    state.__dict__["__deepcopy__"] = lambda memo: seen.append(memo) or RequestState("copy", [1, 2, 3])
    child = state.fork("r__child#0")
    assert len(seen) == 1 and child.request_id == "r__child#0", "fork no longer copies through deepcopy(self)"
    model = tiny_model(tokenizer)
    placeholder = _upstream_patches.placeholder_mask(torch.device("cpu"))
    for build in (masking_utils.create_causal_mask, masking_utils.create_sliding_window_causal_mask):
        mask = build(
            config=model.config, inputs_embeds=torch.zeros(1, 3, 64), attention_mask=placeholder,
            past_key_values=None, position_ids=torch.arange(3)[None],
        )  # fmt: skip
        assert mask is placeholder, f"{build.__name__} no longer returns a 4D mask as-is"


def test_batch_internals_the_decode_graphs_use(model, tokenizer, monkeypatch):
    """`engine/decode_graphs.py` and `engine/paged_decode.py` rely on these; behaviour (exact graphed rounds, graphs
    kept across optimizer steps, re-capture on a moved weight and its control) is in tests/unit/engine/
    test_decode_graphs.py."""
    from transformers.generation.continuous_batching.cache import ATTN_TYPE_TO_ALLOCATOR, group_layers_by_attn_type
    from transformers.generation.continuous_batching.input_outputs import ContinuousBatchingIOs
    from transformers.generation.continuous_batching.model_runner import ModelRunner
    from transformers.generation.continuous_batching.utils import pad_to_pow2

    from tests.graph_fakes import use_fake_graphs
    from trl_cb.engine import decode_graphs

    assert params(ModelRunner.maybe_pad_inputs) == ["self", "num_q_tokens", "max_kv_read", "use_decode_fast_path"]
    assert params(ModelRunner._forward_process_and_sample) == [
        "self", "model", "batch_data", "carry_over_ids", "prev_output_ids", "output_ids",
    ]  # fmt: skip
    assert params(ModelRunner.compute_batch) == ["self", "model", "batch_data"]
    assert params(ContinuousBatchingIOs.get_cb_kwargs) == ["self"]
    assert pad_to_pow2(5, 64) == 8 and pad_to_pow2(100, 64) == 64
    assert ATTN_TYPE_TO_ALLOCATOR["full_attention"].supports_block_table
    assert not ATTN_TYPE_TO_ALLOCATOR["sliding_attention"].supports_block_table
    assert set(group_layers_by_attn_type(model.config)) == {"full_attention"}
    for name in ("max_blocks_per_request", "max_requests_per_batch", "page_size"):
        assert name in {f.name for f in dataclasses.fields(ContinuousBatchingConfig)}, name
    use_fake_graphs(monkeypatch)
    manager = _upstream.create_manager(
        model,
        sampling_config(tokenizer, max_new_tokens=4),
        ContinuousBatchingConfig(return_logprobs=True, num_blocks=8, max_batch_tokens=64, page_size=16),
        WorkloadHints(max_prompt_length=40, max_generated_length=4, num_requests=1),
        graphs=True,
    )
    try:
        processor = manager.batch_processor
        runner, ios, cache = processor.model_runner, processor.inputs_and_outputs, processor.cache
        assert decode_graphs.graphs_of(manager) is not None
        assert cache.max_decode_fast_path_length > 0, "the scheduler's block-table decode path must be on"
        assert ios.block_table.numel() > 0, "the IOs hold a kernel block table"
        for name in ("use_block_table", "num_q_tokens", "compute_stream", "block_table"):
            assert hasattr(ios, name), name
        assert hasattr(runner, "pad_inputs") and callable(runner.supports_logits_to_keep)
        allocator = cache.layer_to_allocator[0]
        assert isinstance(allocator.write_trash_index, int) and allocator.write_trash_index > 0
        # A block-table "update" writes nothing and hands over the layer's page views and block table.
        kwargs = {
            "cu_seq_lens_k": {"full_attention": torch.tensor([0, 1], dtype=torch.int32)},
            "max_length_k": {"full_attention": 1},
            "block_table": ios.block_table[:, :1],
        }
        key = torch.randn(1, allocator.num_key_value_heads, 1, allocator.head_dim)
        before = cache.cache_tensor.clone()
        returned, _ = cache.update(key_states=key, value_states=key, layer_idx=0, kwargs=kwargs)
        assert returned is key and torch.equal(cache.cache_tensor, before)
        pages = kwargs["k_cache"]
        assert pages.dim() == 4 and pages.shape[1] == allocator.tokens_per_page
        assert kwargs["block_table"].dim() == 2
    finally:
        manager.destroy()


def test_sliding_window_ring_the_windowed_block_tables_read():
    """`engine/_upstream_window.py` relies on these: upstream's ring (slot `position % W`, `min(past + query, W)` keys,
    block ids as a full-attention group's, page views inherited), block tables refused for it upstream, and the
    cache's decode-path length limit as one table's tokens. Behaviour: tests/unit/checks/test_compat_matrix.py
    (`test_windowed_families_decode_through_graphs_exactly`) and tests/unit/engine/test_decode_graphs.py."""
    from transformers.generation.continuous_batching.cache import PagedAttentionCache
    from transformers.generation.continuous_batching.cache_allocators.full_attention import (
        FullAttentionCacheAllocator,
    )
    from transformers.generation.continuous_batching.cache_allocators.sliding_attention import (
        SlidingAttentionCacheAllocator as Ring,
    )
    from transformers.generation.continuous_batching.input_outputs import ContinuousBatchingIOs

    from trl_cb.engine import _upstream_window

    assert issubclass(Ring, FullAttentionCacheAllocator) and not Ring.supports_block_table
    assert params(Ring.get_seqlen_k) == ["self", "past_length", "query_length"]
    assert params(Ring.fill_block_table) == ["self", "request_id", "past_length", "query_length", "block_table"]
    assert params(Ring.get_cache_for_block_table) == ["self", "layer_idx"]
    ring = Ring.__new__(Ring)
    ring.sliding_window, ring.tokens_per_page, ring.block_physical_stride = 8, 4, 40
    ring.block_table = {"r": [3, 5]}
    assert [ring.get_seqlen_k(p, 1) for p in (0, 6, 7, 30)] == [1, 7, 8, 8]
    assert ring._token_indices_to_physical_indices("r", 9 % 8, 1) == [3 * 40 + 1]  # position 9: slot 1, page 0
    table = torch.full((4,), -1, dtype=torch.int32)
    with pytest.raises(NotImplementedError):
        ring.fill_block_table("r", 9, 1, table)
    _upstream_window.ring_methods(ring, types.SimpleNamespace(use_block_table=True))[0]("r", 9, 1, table)
    assert table.tolist() == [3 * 10, 5 * 10, -1, -1]  # block id x (stride / page), as a full-attention group's
    assert params(Ring.needs_new_blocks) == ["self", "request_id", "past_length", "query_length"]
    assert [ring.needs_new_blocks("r", p, 1) for p in (7, 8, 16, 24)] == [0, 0, 0, 0]  # a full ring: no page more
    ring.block_table = {"r": [3]}
    assert [ring.needs_new_blocks("r", p, 1) for p in (3, 4, 12)] == [0, 1, 1]  # the second page, then never a third
    assert "_infer_max_decode_fast_path_length" in vars(PagedAttentionCache)
    assert "use_block_table" in inspect.getsource(ContinuousBatchingIOs.prepare_batch_tensors)


def test_trl_tool_loop_surface_async_tools_rely_on():
    """Async multi-turn rollouts (trainers/tool_turns.py) replay TRL's tool loop: `_tool_call_loop` is called from
    `_generate` with these arguments and returns these seven values; the per-sample tool dicts, the environment pool
    and the suffix ids are built as `trl_internals` rebuilds them."""
    assert params(trl.GRPOTrainer._tool_call_loop) == [
        "self", "prompts", "prompt_ids", "completion_ids", "completions", "logprobs", "images", "multimodal_fields",
    ]  # fmt: skip
    loop = inspect.getsource(trl.GRPOTrainer._tool_call_loop)
    assert (
        "return tool_mask, completions, completion_ids, logprobs, tool_call_count, tool_failure_count, tool_images"
        in loop
    )
    assert '{"error": str(e)}' in loop and "self._get_tool_suffix_ids(tool_messages)" in loop
    assert "self.max_tool_calling_iterations" in loop and "asyncio.run_coroutine_threadsafe(" in loop
    score = inspect.getsource(trl.GRPOTrainer._generate_and_score_completions)
    assert "pool = self._environment_pool[name]" in score and "environment.reset(**reset_kwargs)" in score
    assert 'member_name not in ("reset", "get_reward") and not member_name.startswith("_")' in score
    assert "for tool in self._standalone_tools + methods:" in score
    assert params(trl.GRPOTrainer._get_tool_suffix_ids) == ["self", "tool_messages"]
    tokenize = inspect.getsource(trl.GRPOTrainer._tokenize_prompts)
    assert "tools=self._env_tools[name] or None" in tokenize and "chat_template=self.chat_template" in tokenize


def test_prefix_cache_surface_the_weight_epochs_wrap():
    """`engine/_upstream_prefix.py` chains block hashes from the weight epoch: the allocators must call
    `compute_block_hash` by its module name, and the cache's per-request hooks must keep these signatures."""
    from transformers.generation.continuous_batching.cache import PagedAttentionCache
    from transformers.generation.continuous_batching.cache_allocators import cache_allocator
    from transformers.generation.continuous_batching.continuous_api import ContinuousBatchProcessor

    assert params(cache_allocator.compute_block_hash) == ["parent_hash", "tokens"]
    for method in ("match_prefix_blocks", "mark_complete_blocks"):
        assert "compute_block_hash(" in inspect.getsource(getattr(cache_allocator.CacheAllocator, method))
    assert params(PagedAttentionCache.mark_complete_blocks) == ["self", "state", "complete_blocks"]
    batch = inspect.getsource(ContinuousBatchProcessor.update_batch)
    assert batch.count("self.cache.mark_complete_blocks(state, future_state.complete_blocks)") == 2


def test_recurrent_layer_surface_hybrid_models_rely_on():
    """`engine/_upstream_recurrent*.py`: the paged cache and the config resolution look `group_layers_by_attn_type`
    up by module global at call time (`attention_only_cache` swaps it while an engine is built); the cache methods
    a slot's lifetime follows; a `Cache` of `LinearAttentionLayer`s hands a mixer the states put in its dicts and
    updates them in place (the stepper reads them back after the call); the engine kwargs a mixer never gets."""
    from transformers.cache_utils import Cache, DummyLayer, LinearAttentionLayer
    from transformers.generation.continuous_batching import PagedAttentionCache
    from transformers.generation.continuous_batching import cache as cb_cache
    from transformers.generation.continuous_batching import initialization as cb_initialization
    from transformers.generation.continuous_batching.input_outputs import PagedAttentionArgs
    from transformers.generation.continuous_batching.requests import FutureRequestState

    assert "group_layers_by_attn_type" in PagedAttentionCache.__init__.__code__.co_names
    assert "group_layers_by_attn_type" in cb_initialization.ensure_decode_fast_path_is_available.__code__.co_names
    assert callable(cb_cache.group_layers_by_attn_type) and "full_attention" in cb_cache.ATTN_TYPE_TO_ALLOCATOR
    assert params(PagedAttentionCache.free_blocks)[1:] == ["request_id", "no_cache"]
    assert params(PagedAttentionCache.free_all_requests)[1:] == ["clear_ledgers"]
    assert params(PagedAttentionCache.prepare_fork_request)[1:] == ["src_state", "dst_req_ids", "copy_src_and_dst"]
    assert "query_length" in FutureRequestState.__slots__ and "state" in FutureRequestState.__slots__
    assert {"cu_seq_lens_q", "read_index", "write_index", "cache", "block_table"} <= set(
        PagedAttentionArgs.__annotations__
    )

    layer = LinearAttentionLayer(number_of_states=4)
    for name in ("conv_states", "recurrent_states", "has_previous_state", "is_conv_states_initialized",
                 "is_recurrent_states_initialized", "conv_kernel_size"):  # fmt: skip
        assert set(getattr(layer, name)) == {0, 1, 2, 3}, name
    conv, state = torch.zeros(2, 3, 4), torch.zeros(2, 1, 2, 2)
    layer.conv_states[0], layer.recurrent_states[0] = conv, state
    layer.is_conv_states_initialized[0] = layer.is_recurrent_states_initialized[0] = True
    layer.has_previous_state[0], layer.conv_kernel_size[0] = True, 4
    cache = Cache(layers=[DummyLayer(), layer])  # the stepper's: the running layer's states, no state elsewhere
    assert cache.get_conv_state(1) is conv and cache.get_recurrent_state(1) is state and not cache.is_recording_past(1)
    with pytest.raises(ValueError, match="non linear attention layer"):  # a read of another layer fails loudly
        cache.get_recurrent_state(0)
    full = cache.update_conv_state(torch.ones(2, 3, 1), 1, conv_kernel_size=4)
    assert full.shape == (2, 3, 5) and conv[..., -1].eq(1).all(), "conv window no longer updated in place"
    cache.update_recurrent_state(torch.full((2, 1, 2, 2), 5.0), 1)
    assert layer.recurrent_states[0] is state and state.eq(5).all(), "recurrent state no longer copied in place"
    fresh = LinearAttentionLayer()
    Cache(layers=[fresh]).update_conv_state(torch.ones(1, 3, 2), 0, conv_kernel_size=4)
    assert fresh.is_conv_states_initialized[0] and fresh.conv_states[0].shape == (1, 3, 4), "no lazy init"


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "qwen3_next", "lfm2", "granitemoehybrid", "falcon_h1"])
def test_each_hybrid_family_has_one_mixer_per_recurrent_layer(model_type, tokenizer):
    """Each served hybrid family's token mixers read their state through `get_conv_state` / `get_recurrent_state`
    (how `mixer_modules` finds them) and take the cache as `cache=`, with `hidden_states` first."""
    from tests.model_zoo import HYBRID, tiny_arch_model
    from trl_cb.engine import _upstream_recurrent

    model = tiny_arch_model(next(a for a in HYBRID if a.model_type == model_type), len(tokenizer))
    config = model.config.get_text_config()
    mixers = _upstream_recurrent.mixer_modules(model, config)
    assert sorted(mixers) == _upstream_recurrent.recurrent_layers(config) != []
    for module in mixers.values():
        names = params(type(module).forward)
        assert names[1] == "hidden_states" and "cache" in names, (type(module).__name__, names)
