"""Every GenerationConfig field reaches the CB sampler exactly or is refused before anything is built.

Exactness is checked against transformers' own processors: `model._get_logits_processor` builds what `generate()`
applies for a config, and the reference re-applies it position by position on a teacher-forced forward. The model
has weights far from uniform (std 0.2, sharpened head: entropy ~3 nats of 6.2), so a dropped or misapplied setting
moves logprobs well past the tolerance; each family has a control showing the test would see it.
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import GenerationConfig

from tests.conftest import sampling_config
from trl_cb import ContinuousBatchingGenerator
from trl_cb.checks.generation_settings import check_generation_config
from trl_cb.offline.tiny import bias_eos, tiny_model

TOL = 1e-4


@pytest.fixture(scope="module")
def sharp_model(tokenizer):
    """Weights far from uniform, EOS likely enough (~10%/step) that completions end at varied lengths."""
    model = tiny_model(tokenizer)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(1)
        for param in model.parameters():
            if param.dim() >= 2:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.2)
        model.lm_head.weight.mul_(2.0)
        bias_eos(model, tokenizer.eos_token_id, 5.0)
    return model


def reference_logprobs(
    model, prompt: list[int], completion: list[int], cfg: GenerationConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logprob of each completion token, whether it was allowed) under generate()'s processors for `cfg`."""
    cfg = copy.deepcopy(cfg)
    eos = cfg.eos_token_id
    cfg._eos_token_tensor = None if eos is None else torch.tensor(eos if isinstance(eos, list) else [eos])
    processors = model._get_logits_processor(cfg, input_ids_seq_length=len(prompt))
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()  # (T, V)
    rows = [processors(ids[:, : len(prompt) + t], logits[t : t + 1].clone())[0] for t in range(len(completion))]
    scores = torch.stack(rows)  # (T, V)
    picked = scores.gather(-1, torch.tensor(completion)[:, None])[:, 0]
    return torch.log_softmax(scores, -1).gather(-1, torch.tensor(completion)[:, None])[:, 0], picked.isfinite()


def max_gap(model, prompts, result, cfg, G) -> tuple[float, bool]:
    """Largest |CB logprob - reference| over all tokens, and whether every sampled token was allowed."""
    worst, obeyed = 0.0, True
    for i, (completion, logprobs) in enumerate(zip(result.completion_ids, result.logprobs)):
        ref, allowed = reference_logprobs(model, prompts[i // G], completion, cfg)
        worst = max(worst, (ref - torch.tensor(logprobs)).abs().max().item())
        obeyed = obeyed and bool(allowed.all())
    return worst, obeyed


# ------------------------------------------------------------------------------------------------------ refused


REFUSED = {
    "beam-sampling": dict(num_beams=2),
    "beam-greedy": dict(num_beams=2, do_sample=False),
    "bad_words_ids": dict(bad_words_ids=[[5]]),
    "no_repeat_ngram_size": dict(no_repeat_ngram_size=2),
    "sequence_bias": dict(sequence_bias={(5,): -1.0}),
    "begin_suppress_tokens": dict(begin_suppress_tokens=[5]),
    "stop_strings": dict(stop_strings=["\n"]),
    "max_time": dict(max_time=1.0),
    "forced_eos_token_id": dict(forced_eos_token_id=2),
    "guidance_scale": dict(guidance_scale=1.5),
    "assistant": dict(prompt_lookup_num_tokens=3),
    "unknown-attribute": dict(my_custom_knob=3),
    "max_new_tokens-float": dict(max_new_tokens=2.5),
    "max_new_tokens-bool": dict(max_new_tokens=True),
    "min_new_tokens-float": dict(min_new_tokens=1.5),
    "top_k-float": dict(top_k=2.5),
    "eos-float": dict(eos_token_id=2.0),
    "temperature-zero": dict(temperature=0.0),
    "top_p-above-one": dict(top_p=1.5),
    "min_p-negative": dict(min_p=-0.1),
    "repetition_penalty-zero": dict(repetition_penalty=0.0),
}


@pytest.mark.parametrize("overrides", REFUSED.values(), ids=REFUSED.keys())
def test_refused_settings_raise_at_construction(model, tokenizer, overrides):
    with pytest.raises(ValueError, match=next(iter(overrides))):
        ContinuousBatchingGenerator(model, sampling_config(tokenizer, **overrides))


def test_refused_setting_in_generate_builds_nothing_and_keeps_old_settings(model, tokenizer, prompts):
    with ContinuousBatchingGenerator(model, sampling_config(tokenizer, max_new_tokens=4)) as gen:
        with pytest.raises(ValueError, match="num_beams=2"):
            gen.generate(prompts[:1], generation_config=sampling_config(tokenizer, num_beams=2))
        assert gen.num_engine_builds == 0
        assert gen.generation_config.num_beams is None
        gen.generate(prompts[:1])
        assert gen.num_engine_builds == 1


def test_neutral_and_irrelevant_values_accepted(model, tokenizer):
    cfg = sampling_config(
        tokenizer,
        num_beams=1,
        repetition_penalty=1.0,
        no_repeat_ngram_size=0,
        guidance_scale=1.0,
        length_penalty=-0.1,  # beam search only
        early_stopping=True,
        cache_implementation="static",
        disable_compile=True,
        output_scores=True,
        return_dict_in_generate=True,
        max_length=5,  # max_new_tokens takes precedence, as in generate()
    )
    ContinuousBatchingGenerator(model, cfg).close()


def test_every_refusal_names_field_and_reason():
    cfg = GenerationConfig(max_new_tokens=4, do_sample=True, num_beams=3, no_repeat_ngram_size=2, foo="bar")
    with pytest.raises(ValueError) as info:
        check_generation_config(cfg)
    message = str(info.value)
    for expected in ("num_beams=3", "beam search", "no_repeat_ngram_size=2", "foo='bar'", "not a GenerationConfig"):
        assert expected in message


def test_sync_only_engine_settings_refused_with_history_processors(model, tokenizer):
    cb = {"use_async_batching": True}
    with pytest.raises(ValueError, match="use_async_batching"):
        ContinuousBatchingGenerator(model, sampling_config(tokenizer, repetition_penalty=1.2), cb)
    ContinuousBatchingGenerator(model, sampling_config(tokenizer), cb).close()  # fine without them


@pytest.mark.parametrize("bad", [5.0, True], ids=["float", "bool"])
def test_non_integer_token_ids_refused_in_validation(model, tokenizer, prompts, bad):
    with ContinuousBatchingGenerator(model, sampling_config(tokenizer)) as gen:
        with pytest.raises(ValueError, match="Prompt 1 holds .* token ids must be integers"):
            gen.generate([prompts[0], prompts[1] + [bad]])
        assert gen.num_engine_builds == 0


# ------------------------------------------------------------------------------------------- exact (engine's own)


EXACT = {
    "min_p": (dict(temperature=0.8, min_p=0.2), "min_p"),
    "top_h": (dict(top_h=0.6), "top_h"),
    "typical_p": (dict(typical_p=0.6), "typical_p"),
    "epsilon_cutoff": (dict(epsilon_cutoff=0.03), "epsilon_cutoff"),
    "eta_cutoff": (dict(eta_cutoff=0.05), "eta_cutoff"),
    "suppress_tokens": (dict(suppress_tokens=[2]), "suppress_tokens"),  # 2 is EOS: ~10% of the mass here
    "renormalize+remove_invalid": (dict(renormalize_logits=True, remove_invalid_values=True), None),
}


@pytest.mark.parametrize(("overrides", "field"), EXACT.values(), ids=EXACT.keys())
def test_engine_warpers_exact(sharp_model, tokenizer, prompts, overrides, field):
    cfg = sampling_config(tokenizer, max_new_tokens=16, **overrides)
    G = 3
    with ContinuousBatchingGenerator(sharp_model, cfg) as gen:
        result = gen.generate(prompts[:3], num_generations=G)
    gap, obeyed = max_gap(sharp_model, prompts, result, cfg, G)
    assert obeyed, "a sampled token lies outside what the setting allows"
    assert gap <= TOL, f"max |CB logprob - generate()'s processed logprob| = {gap}"
    if field is not None:  # control: without the setting the reference moves, so dropping it would be caught
        control = copy.deepcopy(cfg)
        setattr(control, field, None)
        control_gap, _ = max_gap(sharp_model, prompts, result, control, G)
        assert control_gap > 100 * TOL, f"{field} does not change these logprobs: the test would not catch a drop"


# ---------------------------------------------------------------------------------------- honoured by trl_cb


def test_repetition_penalty_and_min_new_tokens_exact(sharp_model, tokenizer, prompts):
    cfg = sampling_config(tokenizer, max_new_tokens=16, temperature=0.9, repetition_penalty=1.6, min_new_tokens=8)
    G = 4
    with ContinuousBatchingGenerator(sharp_model, cfg) as gen:
        result = gen.generate(prompts[:4], num_generations=G)
    eos = tokenizer.eos_token_id
    for completion in result.completion_ids:
        assert eos not in completion[:8], f"EOS before min_new_tokens: {completion}"
        assert len(completion) >= 8
    gap, obeyed = max_gap(sharp_model, prompts, result, cfg, G)
    assert obeyed and gap <= TOL, f"max |CB logprob - generate()'s processed logprob| = {gap}"

    # Controls: each setting changes the reference, so dropping either would be caught.
    for field, neutral in (("repetition_penalty", None), ("min_new_tokens", None)):
        control = copy.deepcopy(cfg)
        setattr(control, field, neutral)
        control_gap, _ = max_gap(sharp_model, prompts, result, control, G)
        assert control_gap > 100 * TOL, field
    # ... and without min_new_tokens this model does stop early (what the engine alone silently did).
    with ContinuousBatchingGenerator(sharp_model, sampling_config(tokenizer, max_new_tokens=16)) as gen:
        plain = gen.generate(prompts[:4], num_generations=G)
    assert min(len(c) for c in plain.completion_ids) < 8


def test_min_length_counts_each_requests_own_prompt(sharp_model, tokenizer, prompts):
    lengths = [len(p) for p in prompts[:4]]
    min_length = max(lengths) + 3
    cfg = sampling_config(tokenizer, max_new_tokens=40, min_length=min_length)
    G = 3
    with ContinuousBatchingGenerator(sharp_model, cfg) as gen:
        result = gen.generate(prompts[:4], num_generations=G)
    for i, completion in enumerate(result.completion_ids):
        assert len(prompts[i // G]) + len(completion) >= min_length
    gap, obeyed = max_gap(sharp_model, prompts, result, cfg, G)
    assert obeyed and gap <= TOL, gap
    control = copy.deepcopy(cfg)
    control.min_length = None
    assert max_gap(sharp_model, prompts, result, control, G)[0] > 100 * TOL


def test_greedy_with_penalty_and_min_new_tokens_matches_generate(sharp_model, tokenizer, prompts):
    def greedy(**overrides):
        return sampling_config(tokenizer, do_sample=False, max_new_tokens=20, **overrides)

    cfg = greedy(repetition_penalty=1.5, min_new_tokens=6)
    with ContinuousBatchingGenerator(sharp_model, cfg) as gen:
        ours = gen.generate(prompts[:4]).completion_ids
    with ContinuousBatchingGenerator(sharp_model, greedy()) as gen:
        plain = gen.generate(prompts[:4]).completion_ids
    for prompt, completion in zip(prompts, ours):
        ids = torch.tensor([prompt])
        ref = sharp_model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=cfg)
        assert completion == ref[0, len(prompt) :].tolist()
    assert ours != plain, "control: the settings change greedy completions here"


def test_eos_unset_falls_back_to_model_eos(sharp_model, tokenizer, prompts):
    eos = tokenizer.eos_token_id
    assert sharp_model.generation_config.eos_token_id == eos
    cfg = sampling_config(tokenizer, do_sample=False, max_new_tokens=20, eos_token_id=None)
    with ContinuousBatchingGenerator(sharp_model, cfg) as gen:
        result = gen.generate(prompts[:4])
    ended = [c for c in result.completion_ids if c[-1] == eos]
    assert ended, "control: this model reaches EOS within 20 tokens"
    for prompt, completion in zip(prompts, result.completion_ids):
        assert eos not in completion[:-1], "generation ran past EOS"
        ids = torch.tensor([prompt])
        ref = sharp_model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=cfg)
        assert completion == ref[0, len(prompt) :].tolist()  # generate() falls back the same way


def test_changed_min_p_rebuilds_engine(model, tokenizer, prompts):
    with ContinuousBatchingGenerator(model, sampling_config(tokenizer, max_new_tokens=4)) as gen:
        gen.generate(prompts[:1])
        gen.generate(prompts[:1], generation_config=sampling_config(tokenizer, max_new_tokens=4, min_p=0.1))
        assert gen.num_engine_builds == 2, "a live engine ignores a new config: min_p must trigger a rebuild"


# ------------------------------------------------------------------------------- trainer-comparable logprobs


def trainer_logprobs(model, prompt: list[int], completion: list[int], temperature: float) -> torch.Tensor:
    """What TRL's trainer computes for `completion`: `log_softmax(logits / T)` over the whole vocabulary."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()  # (T, V)
    return torch.log_softmax(logits / temperature, -1).gather(-1, torch.tensor(completion)[:, None])[:, 0]


RESHAPING = {
    "top_p": dict(top_p=0.9),
    "top_k": dict(top_k=10),
    "min_p": dict(min_p=0.05),
    "typical_p": dict(typical_p=0.6),
    "epsilon_cutoff": dict(epsilon_cutoff=0.03),
    "eta_cutoff": dict(eta_cutoff=0.05),
    "top_h": dict(top_h=0.6),
    "repetition_penalty": dict(repetition_penalty=1.6),
    "min_new_tokens": dict(min_new_tokens=8),
    "trl-additional-kwargs": dict(top_p=0.9, top_k=10, min_p=0.01, repetition_penalty=1.1),
}


@pytest.mark.parametrize("overrides", RESHAPING.values(), ids=RESHAPING.keys())
def test_policy_logprobs_are_the_trainers_quantity_under_reshaping_settings(
    sharp_model, tokenizer, prompts, overrides
):
    """`policy_logprobs` (what IS compares with the trainer) equal the trainer's temperature-only, whole-vocabulary
    logprobs under every truncating or penalising setting; `logprobs` stay those of the processed distribution.
    Control: the processed logprobs are far from the trainer's here, so an IS weight built from them (what trl_cb did)
    would be < 1 on every token and vanish over a sequence."""
    temperature = 0.8
    cfg = sampling_config(tokenizer, max_new_tokens=16, temperature=temperature, **overrides)
    G = 3
    with ContinuousBatchingGenerator(sharp_model, cfg) as gen:
        result = gen.generate(prompts[:3], num_generations=G)
    worst = processed_gap = 0.0
    for i, (completion, policy, processed) in enumerate(
        zip(result.completion_ids, result.policy_logprobs, result.logprobs, strict=True)
    ):
        assert len(completion) == len(policy) == len(processed) > 0
        ref = trainer_logprobs(sharp_model, prompts[i // G], completion, temperature)
        worst = max(worst, (ref - torch.tensor(policy)).abs().max().item())
        processed_gap = max(processed_gap, (ref - torch.tensor(processed)).abs().max().item())
    assert worst <= TOL, f"max |policy logprob - trainer logprob| = {worst}"
    assert processed_gap > 0.05, f"control: the setting moves the processed logprob by only {processed_gap}"
    gap, obeyed = max_gap(sharp_model, prompts, result, cfg, G)
    assert obeyed and gap <= TOL, f"processed logprobs no longer generate()'s: {gap}"


def test_policy_logprobs_equal_processed_ones_with_temperature_only(sharp_model, tokenizer, prompts):
    """Nothing but temperature: no recorder runs, and both logprobs are the trainer's quantity."""
    cfg = sampling_config(tokenizer, max_new_tokens=16, temperature=0.7)
    with ContinuousBatchingGenerator(sharp_model, cfg) as gen:
        result = gen.generate(prompts[:2], num_generations=2)
    assert result.policy_logprobs == result.logprobs
    for i, (completion, policy) in enumerate(zip(result.completion_ids, result.policy_logprobs, strict=True)):
        ref = trainer_logprobs(sharp_model, prompts[i // 2], completion, 0.7)
        assert (ref - torch.tensor(policy)).abs().max().item() <= TOL


def test_reshaping_settings_refuse_async_engine_keys(model, tokenizer, prompts):
    """Recording the trainer-comparable logprob reads each step on the host: a user-set async engine is refused when
    the engine is built, not silently turned off."""
    cb = {"use_async_batching": True}
    with ContinuousBatchingGenerator(model, sampling_config(tokenizer, top_p=0.9, max_new_tokens=4), cb) as gen:
        with pytest.raises(ValueError, match="use_async_batching"):
            gen.generate(prompts[:1])


# ------------------------------------------------------------------------------------------------------ trainers


@pytest.mark.parametrize("kind", ["grpo", "rloo"])
def test_trainer_sampling_fields_and_generation_kwargs_reach_the_sampler(
    kind, tokenizer, prompts, tmp_path, monkeypatch
):
    """TRL's `min_p` / `repetition_penalty` fields and `generation_kwargs` flow into the generator and are obeyed."""
    from tests.unit.trainers.test_trainers import IS_METRICS, make_trainer

    trainer = make_trainer(
        kind,
        tokenizer,
        tmp_path,
        eos_logit_bias=8.0,  # EOS likely: without min_new_tokens many completions would be shorter than 6
        max_steps=1,
        temperature=0.9,
        min_p=0.05,
        repetition_penalty=1.3,
        generation_kwargs={"min_new_tokens": 6, "top_k": 50},
    )
    seen = []
    real_generate = ContinuousBatchingGenerator.generate

    def spy(self, *args, **kwargs):
        result = real_generate(self, *args, **kwargs)
        seen.append((self.generation_config, result))
        return result

    monkeypatch.setattr(ContinuousBatchingGenerator, "generate", spy)
    trainer.train()
    cfg, result = seen[0]
    assert (cfg.min_p, cfg.repetition_penalty, cfg.min_new_tokens, cfg.top_k) == (0.05, 1.3, 6, 50)
    assert min(len(c) for c in result.completion_ids) >= 6
    entry = next(e for e in trainer.state.log_history if "loss" in e)
    assert entry["completions/min_length"] >= 6
    for name in IS_METRICS:
        assert name in entry and torch.isfinite(torch.tensor(entry[name])), name
    # Control: the same model without min_new_tokens stops earlier than 6 tokens.
    with ContinuousBatchingGenerator(tiny_model(tokenizer, eos_logit_bias=8.0), sampling_config(tokenizer)) as gen:
        assert min(len(c) for c in gen.generate(prompts, num_generations=4).completion_ids) < 6


@pytest.mark.parametrize("kind", ["grpo", "rloo"])
def test_trainer_refuses_beam_generation_kwargs_at_construction(kind, tokenizer, tmp_path):
    """TRL's own `test_train_with_generation_kwargs` asks for beam sampling (`num_beams=2`), which has no per-token
    sampling policy: refused with the reason when the trainer is built (it crashed with an AttributeError before)."""
    from tests.unit.trainers.test_trainers import make_trainer

    kwargs = {"do_sample": True, "top_k": 50, "num_beams": 2, "length_penalty": -0.1}
    with pytest.raises(ValueError, match="num_beams=2: beam search"):
        make_trainer(kind, tokenizer, tmp_path, generation_kwargs=kwargs)


def test_docs_field_table_matches_the_code():
    """docs/index.md lists every field with the handling the code applies (no drift between the two)."""
    from pathlib import Path

    from trl_cb.checks.generation_settings import FIELD_RULES, Handling

    docs = (Path(__file__).parents[3] / "docs" / "index.md").read_text()
    section = docs.split("## Sampling settings", 1)[1].split("\n## ", 1)[0]
    for name, rule in FIELD_RULES.items():
        if rule.handling is Handling.IRRELEVANT:
            assert f"`{name}`" in section.split("**irrelevant to sampling**", 1)[1].split("\n- **", 1)[0], name
        else:
            assert f"| `{name}` | {rule.handling.value} |" in section, name
