"""Bad input gets a clear error before generation; engine failures raise instead of returning short or shifted
results (the engine alone returns garbage or fails every request for several of these: docs/index.md)."""

from __future__ import annotations

import time

import pytest

from tests.conftest import sampling_config
from trl_cb import ContinuousBatchingGenerator, EngineDiedError, GenerationError
from trl_cb.rollouts.generator import _upstream


def test_empty_prompt(model, tokenizer, prompts):
    with ContinuousBatchingGenerator(model, sampling_config(tokenizer)) as gen:
        with pytest.raises(ValueError, match="Prompt 1 is empty"):
            gen.generate([prompts[0], [], prompts[1]])
        assert gen.num_engine_builds == 0, "validation must happen before the engine sees anything"


@pytest.mark.parametrize("bad", [-1, 10_000])
def test_token_id_outside_vocab(model, tokenizer, prompts, bad):
    with ContinuousBatchingGenerator(model, sampling_config(tokenizer)) as gen:
        with pytest.raises(ValueError, match=rf"Prompt 1 holds token id {bad}, outside the model's vocabulary"):
            gen.generate([prompts[0], prompts[1] + [bad]])


def test_numpy_integer_token_ids_accepted(model, prompts):
    """Token ids are checked with a fast path for plain ints; other integer types (numpy's) still pass, and a bool
    or float among plain ints is still refused (the generator-level refusals: test_generation_settings.py)."""
    import numpy as np

    from trl_cb.checks.inputs import validate_prompts

    validate_prompts([[np.int64(t) for t in prompts[0]], prompts[1]], model, 8, {})
    for bad in (True, 2.0):
        with pytest.raises(ValueError, match="Prompt 1 holds .* token ids must be integers"):
            validate_prompts([prompts[0], [*prompts[1], bad]], model, 8, {})


def test_prompt_beyond_model_positions(model, tokenizer):
    too_long = [5] * (model.config.max_position_embeddings - 10)
    with ContinuousBatchingGenerator(model, sampling_config(tokenizer, max_new_tokens=24)) as gen:
        with pytest.raises(ValueError, match="beyond the model's max_position_embeddings"):
            gen.generate([too_long])


def test_prompt_beyond_user_fixed_cache(model, tokenizer, prompts):
    cb = {"num_blocks": 1, "page_size": 16}
    with ContinuousBatchingGenerator(model, sampling_config(tokenizer), cb) as gen:
        with pytest.raises(ValueError, match="needs .* cache blocks of 16 tokens, but num_blocks=1"):
            gen.generate(prompts[:1])


@pytest.mark.parametrize("max_new_tokens", [None, 0, -3])
def test_max_new_tokens_missing_or_not_positive(model, tokenizer, max_new_tokens):
    cfg = sampling_config(tokenizer)
    cfg.max_new_tokens = max_new_tokens
    with pytest.raises(ValueError, match="max_new_tokens must be a positive integer"):
        ContinuousBatchingGenerator(model, cfg)


def test_num_generations_must_be_positive(model, tokenizer, prompts):
    with ContinuousBatchingGenerator(model, sampling_config(tokenizer)) as gen:
        with pytest.raises(ValueError, match="num_generations must be >= 1"):
            gen.generate(prompts, num_generations=0)


def test_request_failing_inside_engine_raises_with_id(model, tokenizer, prompts, monkeypatch):
    """A request the engine cannot schedule (here: larger than a deliberately tiny cache, with our pre-check
    disabled) fails inside the engine; the round raises with that request's id instead of returning fewer rows."""
    monkeypatch.setattr("trl_cb.checks.inputs.validate_prompts", lambda *a, **k: None)
    long_prompt = [7] * 200
    cb = {"num_blocks": 6, "page_size": 16, "max_batch_tokens": 64}
    gen = ContinuousBatchingGenerator(model, sampling_config(tokenizer), cb, timeout=60)
    try:
        with pytest.raises(GenerationError) as info:
            gen.generate([prompts[0], long_prompt])
        assert info.value.request_id.endswith("_p1"), info.value.request_id
        assert gen.cache_size is None, "a failed round must not leave a half-used engine behind"
    finally:
        gen.close()


def test_engine_thread_dying_raises_within_seconds(model, tokenizer, prompts, monkeypatch):
    gen = ContinuousBatchingGenerator(model, sampling_config(tokenizer, max_new_tokens=200))
    real_add = _upstream.add_forked_request

    def add_then_kill(manager, *args, **kwargs):
        ids = real_add(manager, *args, **kwargs)
        manager.stop(block=False, hard_stop=True)  # the loop exits with requests outstanding
        return ids

    monkeypatch.setattr(_upstream, "add_forked_request", add_then_kill)
    try:
        start = time.monotonic()
        with pytest.raises((EngineDiedError, GenerationError)):
            gen.generate(prompts, num_generations=4)
        assert time.monotonic() - start < 10
    finally:
        gen.close()


def test_engine_crash_in_forward_surfaces(model, tokenizer, prompts):
    gen = ContinuousBatchingGenerator(model, sampling_config(tokenizer))
    gen.generate(prompts[:1])  # engine built and healthy

    def boom(*args, **kwargs):
        raise RuntimeError("simulated kernel failure")

    handle = model.model.layers[0].register_forward_pre_hook(boom)
    try:
        start = time.monotonic()
        with pytest.raises((GenerationError, EngineDiedError), match="simulated kernel failure|stopped"):
            gen.generate(prompts, num_generations=2)
        assert time.monotonic() - start < 10
    finally:
        handle.remove()
        gen.close()
    with ContinuousBatchingGenerator(model, sampling_config(tokenizer)) as fresh:  # and recovery works
        assert len(fresh.generate(prompts[:2]).completion_ids) == 2


def test_zero3_without_gather_is_rejected(model, tokenizer):
    from types import SimpleNamespace

    accelerator = SimpleNamespace(state=SimpleNamespace(deepspeed_plugin=SimpleNamespace(zero_stage=3)))
    with pytest.raises(ValueError, match="ds3_gather_for_generation=False is not supported"):
        ContinuousBatchingGenerator(
            model, sampling_config(tokenizer), accelerator=accelerator, gather_deepspeed3_params=False
        )
    # ZeRO-2 has nothing to gather: accepted.
    accelerator.state.deepspeed_plugin.zero_stage = 2
    ContinuousBatchingGenerator(
        model, sampling_config(tokenizer), accelerator=accelerator, gather_deepspeed3_params=False
    )
