"""ContinuousBatchingGenerator: order, logprobs, persistence, fresh weights, training unaffected."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from tests.conftest import sampling_config
from trl_cb import ContinuousBatchingGenerator
from trl_cb.engine.sizing import CPU_PAGE_SIZE


def teacher_forced_logprobs(
    model: torch.nn.Module, prompt: list[int], completion: list[int], temperature: float, top_k: int, top_p: float
) -> torch.Tensor:
    """Logprobs of `completion` under the same processing the sampler applies (transformers' standard warpers)."""
    processors = LogitsProcessorList()
    if temperature != 1.0:
        processors.append(TemperatureLogitsWarper(temperature))
    if top_k:
        processors.append(TopKLogitsWarper(top_k))
    if top_p < 1.0:
        processors.append(TopPLogitsWarper(top_p))
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()  # (T, V)
    scores = processors(ids, logits)
    return torch.log_softmax(scores, dim=-1).gather(-1, torch.tensor(completion)[:, None])[:, 0]


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"),
    [(1.0, 0, 1.0), (0.7, 0, 1.0), (0.7, 20, 0.9)],
    ids=["T1", "T0.7", "T0.7-k20-p0.9"],
)
def test_logprobs_match_teacher_forcing(sharp_model, tokenizer, prompts, temperature, top_k, top_p):
    model = sharp_model  # std 0.2 weights: far from uniform, so the comparison can fail
    cfg = sampling_config(tokenizer, temperature=temperature, top_k=top_k, top_p=top_p)
    with ContinuousBatchingGenerator(model, cfg) as gen:
        result = gen.generate(prompts, num_generations=3)
    worst = control = 0.0
    for i, (completion, logprobs) in enumerate(zip(result.completion_ids, result.logprobs)):
        assert len(completion) == len(logprobs) > 0
        ref = teacher_forced_logprobs(model, prompts[i // 3], completion, temperature, top_k, top_p)
        worst = max(worst, (ref - torch.tensor(logprobs)).abs().max().item())
        # Control: the same completion after another prompt — what a misordered result would look like.
        wrong = teacher_forced_logprobs(model, prompts[(i // 3 + 1) % len(prompts)], completion, temperature, 0, 1.0)
        control = max(control, (wrong - torch.tensor(logprobs)).abs().max().item())
    assert worst <= 1e-4, f"max |CB logprob - teacher-forced| = {worst}"
    assert control >= 0.1, f"a misordered result would move the logprobs by only {control}"


@pytest.mark.parametrize("batch", [[[5]], [[5], [6, 7], [9]]], ids=["alone", "beside-longer"])
def test_one_token_prompts_with_several_samples(sharp_model, tokenizer, batch):
    """A one-token prompt with G > 1 (transformers' fork would run an empty prefill and fail): G independent samples,
    in order, each exact against teacher forcing after its own prompt; a longer prompt beside it is unaffected."""
    G = 3
    with ContinuousBatchingGenerator(sharp_model, sampling_config(tokenizer, max_new_tokens=8)) as gen:
        result = gen.generate(batch, num_generations=G)
    assert len(result.completion_ids) == len(batch) * G
    for i, (completion, logprobs) in enumerate(zip(result.completion_ids, result.logprobs, strict=True)):
        ref = teacher_forced_logprobs(sharp_model, batch[i // G], completion, 1.0, 0, 1.0)
        assert torch.allclose(ref, torch.tensor(logprobs), atol=1e-4)
    assert len({tuple(c) for c in result.completion_ids[:G]}) > 1, "the G samples must not be identical"


def test_order_contiguous_groups_and_independent_samples(sharp_model, tokenizer, prompts):
    model = sharp_model
    G = 4
    with ContinuousBatchingGenerator(model, sampling_config(tokenizer, max_new_tokens=32)) as gen:
        result = gen.generate(prompts, num_generations=G)
    assert len(result.completion_ids) == len(result.logprobs) == len(prompts) * G
    for i, prompt in enumerate(prompts):
        group = result.completion_ids[i * G : (i + 1) * G]
        assert len({tuple(c) for c in group}) > 1, "the G samples of a prompt must not be identical"
        control = 0.0
        for j, completion in enumerate(group):  # each completion continues *its* prompt: logprobs prove the pairing
            recorded = torch.tensor(result.logprobs[i * G + j])
            ref = teacher_forced_logprobs(model, prompt, completion, 1.0, 0, 1.0)
            assert torch.allclose(ref, recorded, atol=1e-4)
            other = prompts[(i + 1) % len(prompts)]  # control: the completions paired with the wrong prompt
            control = max(
                control, (teacher_forced_logprobs(model, other, completion, 1.0, 0, 1.0) - recorded).abs().max()
            )
        assert control >= 0.1, "a misordered result would go unnoticed"


def test_repeated_prompts_are_deduplicated_and_order_kept(sharp_model, tokenizer, prompts):
    """TRL passes each prompt G times; a run may be split (a group across ranks). Output order is input order."""
    model = sharp_model
    repeated = [prompts[0]] * 3 + [prompts[1]] * 2 + [prompts[0]] * 1
    with ContinuousBatchingGenerator(model, sampling_config(tokenizer)) as gen:
        result = gen.generate(repeated)
    assert len(result.completion_ids) == 6
    control = 0.0
    for prompt, completion, logprobs in zip(repeated, result.completion_ids, result.logprobs):
        ref = teacher_forced_logprobs(model, prompt, completion, 1.0, 0, 1.0)
        assert torch.allclose(ref, torch.tensor(logprobs), atol=1e-4)
        other = prompts[1] if prompt == prompts[0] else prompts[0]  # control: the other prompt's position
        wrong = teacher_forced_logprobs(model, other, completion, 1.0, 0, 1.0)
        control = max(control, (wrong - torch.tensor(logprobs)).abs().max().item())
    assert control >= 0.1, "a shifted result would go unnoticed"


def test_eos_ends_completion_and_is_kept(model, tokenizer, prompts):
    with ContinuousBatchingGenerator(model, sampling_config(tokenizer, max_new_tokens=64)) as gen:
        result = gen.generate(prompts, num_generations=4)
    eos = tokenizer.eos_token_id
    ended = [c for c in result.completion_ids if eos in c]
    assert ended, "the biased tiny model should stop on EOS sometimes"
    for c in ended:
        assert c.index(eos) == len(c) - 1, "nothing may follow EOS"
    assert all(len(c) <= 64 for c in result.completion_ids)


def test_greedy_matches_generate(model, tokenizer, prompts):
    cfg = sampling_config(tokenizer, do_sample=False, max_new_tokens=20)
    with ContinuousBatchingGenerator(model, cfg) as gen:
        result = gen.generate(prompts, num_generations=2)
    for i, prompt in enumerate(prompts):
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False,
            max_new_tokens=20,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )[0, len(prompt) :].tolist()
        if tokenizer.eos_token_id in out:
            out = out[: out.index(tokenizer.eos_token_id) + 1]
        assert result.completion_ids[2 * i] == out
        assert result.completion_ids[2 * i + 1] == out


def test_rounds_differ_and_engine_persists(model, tokenizer, prompts):
    with ContinuousBatchingGenerator(model, sampling_config(tokenizer)) as gen:
        torch.manual_seed(123)
        first = gen.generate(prompts, num_generations=2).completion_ids
        second = gen.generate(prompts, num_generations=2).completion_ids
        assert first != second, "two rounds on the same prompts must sample differently"
        assert gen.num_engine_builds == 1


def test_engine_build_does_not_reseed_global_rng(model, tokenizer, prompts):
    gen = ContinuousBatchingGenerator(model, sampling_config(tokenizer, max_new_tokens=1))
    try:
        torch.manual_seed(7)
        gen._pool.ensure(
            model, _workload(prompts), gen.generation_config
        )  # engine creation only: no sampling consumes the RNG
        after_build = torch.rand(4)
        torch.manual_seed(7)
        assert torch.equal(torch.rand(4), after_build)
    finally:
        gen.close()


def _workload(prompts: list[list[int]]):
    from trl_cb.engine.sizing import Workload

    return Workload(len(prompts), max(map(len, prompts)), 1, sum(map(len, prompts)))


def test_changed_generation_config_applies(sharp_model, tokenizer, prompts):
    model = sharp_model
    with ContinuousBatchingGenerator(model, sampling_config(tokenizer)) as gen:
        gen.generate(prompts, num_generations=4)
        # G changes (train -> eval) need no rebuild: forking is per request.
        assert len(gen.generate(prompts, num_generations=2).completion_ids) == 2 * len(prompts)
        assert gen.num_engine_builds == 1
        cold = sampling_config(tokenizer, temperature=0.3)
        result = gen.generate(prompts, num_generations=2, generation_config=cold)
        assert gen.num_engine_builds == 2
        for i, (completion, logprobs) in enumerate(zip(result.completion_ids, result.logprobs)):
            ref = teacher_forced_logprobs(model, prompts[i // 2], completion, 0.3, 0, 1.0)
            assert torch.allclose(ref, torch.tensor(logprobs), atol=1e-4), "new temperature was not applied"
            stale = teacher_forced_logprobs(model, prompts[i // 2], completion, 1.0, 0, 1.0)  # control: old T
            assert (stale - torch.tensor(logprobs)).abs().max() >= 0.1


def test_workload_sized_cache_and_growth(model, tokenizer, prompts):
    with ContinuousBatchingGenerator(model, sampling_config(tokenizer, max_new_tokens=24)) as gen:
        gen.generate(prompts[:2], num_generations=2)
        size = gen.cache_size
        longest = max(len(p) for p in prompts[:2]) + 24
        assert size.page_size == CPU_PAGE_SIZE
        assert size.num_blocks == 4 * -(-longest // CPU_PAGE_SIZE)  # every request at its longest, whole pages
        gen.generate(prompts[:2], num_generations=2)
        assert gen.num_engine_builds == 1
        gen.generate(prompts, num_generations=4)  # larger workload: grows once
        assert gen.num_engine_builds == 2 and gen.cache_size.num_blocks > size.num_blocks
        gen.generate(prompts[:2], num_generations=2)  # smaller again: no shrink, no rebuild
        assert gen.num_engine_builds == 2


def test_fresh_weights_after_update_long_prompt(sharp_model, tokenizer):
    """After an in-place update, logprobs follow the new weights, also for prompts longer than one page that
    the prefix cache could otherwise serve from blocks computed with the old weights."""
    model = sharp_model
    old = copy.deepcopy(model)
    long_prompt = torch.randint(3, len(tokenizer), (3 * CPU_PAGE_SIZE + 5,)).tolist()
    cfg = sampling_config(tokenizer)
    with ContinuousBatchingGenerator(model, cfg, {"allow_block_sharing": True}) as gen:
        gen.generate([long_prompt], num_generations=2)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.05 * torch.randn_like(p))
        result = gen.generate([long_prompt], num_generations=2)
    for completion, logprobs in zip(result.completion_ids, result.logprobs):
        ref = teacher_forced_logprobs(model, long_prompt, completion, 1.0, 0, 1.0)
        assert (ref - torch.tensor(logprobs)).abs().max().item() <= 1e-4
        stale = teacher_forced_logprobs(old, long_prompt, completion, 1.0, 0, 1.0)  # control: the old weights
        assert (stale - torch.tensor(logprobs)).abs().max().item() >= 0.1


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_training_forward_unchanged_after_generation(tokenizer, prompts, attn):
    from trl_cb.offline.tiny import tiny_model

    model = tiny_model(tokenizer, eos_logit_bias=4.0)
    model.set_attn_implementation(attn)
    model.train()
    batch = torch.tensor([prompts[0][:20], prompts[1][:20]])
    loss_before = model(batch, labels=batch).loss.item()
    with ContinuousBatchingGenerator(model, sampling_config(tokenizer)) as gen:
        gen.generate(prompts, num_generations=2)
        assert model.training, "train mode must be restored"
        assert model.config._attn_implementation == attn, "attention implementation must be restored"
        loss_after = model(batch, labels=batch).loss
        loss_after.backward()  # the training path (with grad) works on the restored implementation
    assert loss_after.item() == pytest.approx(loss_before, abs=1e-6)


def test_close_is_idempotent_and_context_manager_frees(model, tokenizer, prompts):
    gen = ContinuousBatchingGenerator(model, sampling_config(tokenizer))
    gen.generate(prompts[:1])
    manager = gen._pool.engine.manager
    assert not manager.is_running(), "no engine thread between rounds"
    assert getattr(model, "_cached_continuous_batching_manager", None) is None, "nothing cached on the model"
    gen.generate(prompts[:1])
    assert gen.num_engine_builds == 1 and not manager.is_running()
    gen.close()
    gen.close()
    assert not manager.is_running() and gen.cache_size is None


def test_empty_prompt_list_returns_empty(model, tokenizer):
    with ContinuousBatchingGenerator(model, sampling_config(tokenizer)) as gen:
        result = gen.generate([], num_generations=4)
        assert result.completion_ids == [] and result.logprobs == []
        assert gen.num_engine_builds == 0


def test_peft_generation_uses_adapter_weights(tokenizer, prompts):
    peft = pytest.importorskip("peft")
    from trl_cb.offline.tiny import tiny_model

    base = tiny_model(tokenizer, eos_logit_bias=4.0, init_std=0.2)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    model = peft.get_peft_model(base, config)
    with ContinuousBatchingGenerator(model, sampling_config(tokenizer)) as gen:
        result = gen.generate(prompts[:2], num_generations=2)
    for i, (completion, logprobs) in enumerate(zip(result.completion_ids, result.logprobs)):
        with_adapter = teacher_forced_logprobs(model, prompts[i // 2], completion, 1.0, 0, 1.0)
        assert torch.allclose(with_adapter, torch.tensor(logprobs), atol=1e-4)
    with model.disable_adapter():
        without = teacher_forced_logprobs(model, prompts[0], result.completion_ids[0], 1.0, 0, 1.0)
    assert (without - torch.tensor(result.logprobs[0])).abs().max() >= 0.1, "adapter had no effect"


def test_the_model_is_unwrapped_once_not_every_round(model, tokenizer, prompts, monkeypatch):
    """accelerate's `extract_model_from_parallel` costs ~0.6 ms a call (package metadata reads): a round must not pay
    it again (issue 28). Counted over three rounds: once for the round lock's key, once for the module."""
    import accelerate.utils

    calls = []
    extract = accelerate.utils.extract_model_from_parallel

    def counted(*args, **kwargs):
        calls.append(1)
        return extract(*args, **kwargs)

    monkeypatch.setattr(accelerate.utils, "extract_model_from_parallel", counted)
    with ContinuousBatchingGenerator(model, sampling_config(tokenizer, max_new_tokens=4)) as gen:
        calls.clear()  # the constructor's model checks unwrap too
        for _ in range(3):
            assert len(gen.generate(prompts[:2], num_generations=2).completion_ids) == 4
    assert len(calls) == 2, f"unwrapped {len(calls)} times in 3 rounds"
