"""bf16/fp16 generation never casts the training module (issue 14): dtypes and exact values survive every round.

Each test snapshots every parameter and buffer (dtype and a clone) and checks them bit for bit after CB rounds, and
checks the other side too: the round really ran in the low-precision dtype (a forward hook records the weight dtype
the engine's forwards saw), so a fix that simply stopped casting would fail here as well.
"""

from __future__ import annotations

import contextlib
import threading

import pytest
import torch
from datasets import Dataset
from transformers import Gemma2Config, Gemma2ForCausalLM

from tests.conftest import sampling_config
from tests.unit.trainers.test_trainers import PAIRS, length_reward
from trl_cb import ContinuousBatchingGenerator
from trl_cb.engine.precision import GenerationPrecision
from trl_cb.offline.data import synthetic_gsm8k
from trl_cb.offline.tiny import tiny_model

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def snapshot(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer by name, cloned."""
    tensors = dict(module.named_parameters(remove_duplicate=False))
    tensors.update(module.named_buffers(remove_duplicate=False))
    return {name: t.detach().clone() for name, t in tensors.items()}


def assert_unchanged(module: torch.nn.Module, before: dict[str, torch.Tensor]) -> None:
    after = snapshot(module)
    assert after.keys() == before.keys()
    dtypes = {n: (before[n].dtype, t.dtype) for n, t in after.items() if t.dtype != before[n].dtype}
    assert not dtypes, f"dtype changed by generation: {dtypes}"
    changed = [n for n, t in after.items() if not torch.equal(t, before[n])]
    assert not changed, f"values changed by generation: {changed}"


class WeightDtypeSpy:
    """Records the dtype (and address) of a linear layer's weight in every forward the engine runs."""

    def __init__(self, layer: torch.nn.Module) -> None:
        self.seen: list[tuple[torch.dtype, int, threading.Thread]] = []
        self._layer = layer
        self._handle = layer.register_forward_pre_hook(self._record)

    def _record(self, module: torch.nn.Module, args: object) -> None:
        self.seen.append((module.weight.dtype, module.weight.data_ptr(), threading.current_thread()))

    def remove(self) -> None:
        self._handle.remove()


def q_proj(module: torch.nn.Module) -> torch.nn.Module:
    base = module.get_base_model() if hasattr(module, "get_base_model") else module
    layer = base.model.layers[0].self_attn.q_proj
    return getattr(layer, "base_layer", layer)  # PEFT LoRA wraps the linear


# ------------------------------------------------------------------------------------------------ generator level


@pytest.mark.parametrize("name", list(DTYPES))
def test_generator_rounds_run_low_precision_on_copies(name, model, tokenizer, prompts):
    dtype = DTYPES[name]
    before = snapshot(model)
    with ContinuousBatchingGenerator(model, sampling_config(tokenizer, max_new_tokens=8), cast_dtype=dtype) as gen:
        spy = WeightDtypeSpy(q_proj(model))  # after construction: its compat probe runs one fp32 forward (no engine)
        for _ in range(2):
            out = gen.generate(prompts[:3], num_generations=2)
            assert len(out.completion_ids) == 6
            assert_unchanged(model, before)
        assert gen._model.precision.copy_bytes > 0, "copies are kept between rounds"
    spy.remove()
    assert {d for d, *_ in spy.seen} == {dtype}, "the engine's forwards must run in the generation dtype"
    assert len({ptr for _, ptr, _ in spy.seen}) == 1, "a kept copy has a stable address across rounds (CUDA graphs)"
    assert model.dtype == torch.float32


def test_generator_copies_follow_weight_updates(model, tokenizer, prompts):
    """Copies are refreshed every round: an in-place weight update between rounds reaches generation."""
    cfg = sampling_config(tokenizer, max_new_tokens=4)
    with ContinuousBatchingGenerator(model, cfg, cast_dtype=torch.bfloat16) as gen:
        gen.generate(prompts[:1], num_generations=2)
        spy_values = []
        handle = q_proj(model).register_forward_pre_hook(lambda m, a: spy_values.append(m.weight.float().clone()))
        with torch.no_grad():
            q_proj(model).weight.add_(1.0)
        expected = q_proj(model).weight.to(torch.bfloat16).float()
        gen.generate(prompts[:1], num_generations=2)
        handle.remove()
    assert spy_values and all(torch.equal(v, expected) for v in spy_values)


def test_precision_restores_on_error(model):
    before = snapshot(model)
    with pytest.raises(RuntimeError, match="boom"), GenerationPrecision(torch.bfloat16).applied(model):
        assert q_proj(model).weight.dtype == torch.bfloat16
        raise RuntimeError("boom")
    assert_unchanged(model, before)


def test_precision_keeps_gradients(model):
    """A parameter carrying a gradient (accumulation between rounds) keeps it, untouched."""
    model.train()
    model(torch.tensor([[5, 6, 7]])).logits.sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    with GenerationPrecision(torch.bfloat16).applied(model):
        pass
    assert all(torch.equal(p.grad, grads[n]) and p.grad.dtype == torch.float32 for n, p in model.named_parameters())


# ------------------------------------------------------------------------------------------------- trainer level


def _trainer(kind: str, tokenizer, tmp_path, model=None, **overrides):
    config_cls, trainer_cls = PAIRS[kind]
    kwargs = dict(
        output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4, max_completion_length=8,
        max_steps=1, logging_steps=1, learning_rate=0.0, beta=0.0, report_to=[], save_strategy="no", use_cpu=True,
        use_transformers_continuous_batching=True, disable_tqdm=True,
    )  # fmt: skip
    peft_config = overrides.pop("peft_config", None)
    kwargs.update(overrides)
    return trainer_cls(
        model=model if model is not None else tiny_model(tokenizer, eos_logit_bias=4.0),
        reward_funcs=length_reward,
        args=config_cls(**kwargs),
        train_dataset=Dataset.from_list(synthetic_gsm8k(8, seed=5)),
        processing_class=tokenizer,
        peft_config=peft_config,
    )


def _lora():
    peft = pytest.importorskip("peft")
    return peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)


def _check_training_module_untouched(trainer, monkeypatch, dtype: torch.dtype) -> None:
    """Every CB round leaves the training module as it was; a step at lr=0 too; the rounds ran in `dtype`."""
    rounds = []
    real_generate = ContinuousBatchingGenerator.generate

    def checked_generate(self, *args, **kwargs):
        before = snapshot(trainer.model)
        spy = WeightDtypeSpy(q_proj(trainer.model))
        try:
            return real_generate(self, *args, **kwargs)
        finally:
            spy.remove()
            assert_unchanged(trainer.model, before)
            rounds.append({d for d, *_ in spy.seen})

    monkeypatch.setattr(ContinuousBatchingGenerator, "generate", checked_generate)
    start = snapshot(trainer.model)
    trainer.train()
    assert rounds and all(seen == {dtype} for seen in rounds), rounds
    assert_unchanged(trainer.model, start)  # lr=0: the step itself changes nothing either


@pytest.mark.parametrize("name", list(DTYPES))
@pytest.mark.parametrize("kind", ["grpo", "rloo"])
def test_trainer_keeps_fp32_weights_under_mixed_precision(kind, name, tokenizer, tmp_path, monkeypatch):
    flags = {"bf16": name == "bf16", "fp16": name == "fp16"}
    trainer = _trainer(kind, tokenizer, tmp_path, gradient_checkpointing=True, **flags)
    _check_training_module_untouched(trainer, monkeypatch, DTYPES[name])


@pytest.mark.parametrize("name", list(DTYPES))
@pytest.mark.parametrize("how", ["peft_config", "peft_model"])
def test_trainer_keeps_peft_weights_under_mixed_precision(how, name, tokenizer, tmp_path, monkeypatch):
    flags = {"bf16": name == "bf16", "fp16": name == "fp16"}
    if how == "peft_config":
        trainer = _trainer("grpo", tokenizer, tmp_path, peft_config=_lora(), gradient_checkpointing=True, **flags)
    else:
        peft = pytest.importorskip("peft")
        model = peft.get_peft_model(tiny_model(tokenizer, eos_logit_bias=4.0), _lora())
        trainer = _trainer("grpo", tokenizer, tmp_path, model=model, gradient_checkpointing=True, **flags)
    assert any("lora_" in n for n, _ in trainer.model.named_parameters())
    _check_training_module_untouched(trainer, monkeypatch, DTYPES[name])


def test_async_generation_samples_low_precision_copies(tokenizer, tmp_path, monkeypatch):
    """Async keeps one engine across optimizer steps: it samples from bf16 copies applied only while it runs (its KV
    cache is bf16: on the training weights, accelerate's autocast made bf16 keys that an fp32 cache refused), and
    the trainer's forwards and optimizer see the fp32 weights. lr=0: nothing changes across steps."""
    trainer = _trainer("grpo", tokenizer, tmp_path, bf16=True, cb_async_generation=True, max_steps=2)
    spy = WeightDtypeSpy(q_proj(trainer.model))
    start = snapshot(trainer.model)
    trainer.train()
    spy.remove()
    assert_unchanged(trainer.model, start)
    engine = {d for d, _, thread in spy.seen if thread is not threading.main_thread()}
    training = {d for d, _, thread in spy.seen if thread is threading.main_thread()}
    assert engine == {torch.bfloat16} and training == {torch.float32}, (engine, training)
    logs = [e for e in trainer.state.log_history if "loss" in e]
    assert len(logs) == 2 and all(e["sampling/sampling_logp_difference/max"] < 0.05 for e in logs)


# ------------------------------------------------------------------------------------- tied LM head in fp32 (Gemma-2)


def tiny_gemma2(tokenizer, dtype: torch.dtype) -> Gemma2ForCausalLM:
    config = Gemma2Config(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=512, tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Gemma2ForCausalLM(config).to(dtype)
    model.set_attn_implementation("eager")  # Gemma-2 has no sdpa path
    assert model.lm_head.weight is model.model.embed_tokens.weight
    return model.eval()


@pytest.mark.parametrize(
    ("model_dtype", "bf16"), [(torch.float32, True), (torch.bfloat16, True), (torch.bfloat16, False)], ids=str
)
def test_cast_lm_head_to_fp32_with_tied_embeddings(model_dtype, bf16, tokenizer, tmp_path):
    """Failed with `index_copy_(): ... Float and BFloat16` (the fp32 tied embedding made the engine build an fp32
    KV cache). Now generation runs, the training module is untouched, and sampling matches training closely."""
    model = tiny_gemma2(tokenizer, model_dtype)
    trainer = _trainer("grpo", tokenizer, tmp_path, model=model, bf16=bf16, cast_lm_head_to_fp32=True)
    start = snapshot(trainer.model)
    assert trainer.model.lm_head.weight is trainer.model.model.embed_tokens.weight
    trainer.train()
    assert_unchanged(trainer.model, start)
    assert trainer.model.lm_head.weight is trainer.model.model.embed_tokens.weight, "tie restored"
    entry = next(e for e in trainer.state.log_history if "loss" in e)
    assert entry["sampling/sampling_logp_difference/max"] < 0.05


def _autocast_gap(model, tokenizer, prompt_len: int) -> tuple[float, float]:
    """(max, mean) |policy logprob of a bf16 round - the fp32 model's logprob under `torch.autocast(bfloat16)`|, the
    regime TRL trains in with `bf16=True`, over 4 completions of 16 tokens after random prompts of `prompt_len`."""
    gen = torch.Generator().manual_seed(prompt_len)
    prompts = [torch.randint(10, len(tokenizer), (prompt_len,), generator=gen).tolist() for _ in range(2)]
    with ContinuousBatchingGenerator(
        model, sampling_config(tokenizer, max_new_tokens=16), cast_dtype=torch.bfloat16
    ) as generator:
        result = generator.generate(prompts, num_generations=2)
    gaps = []
    for i, (completion, policy) in enumerate(zip(result.completion_ids, result.policy_logprobs, strict=True)):
        ids = torch.tensor([prompts[i // 2] + completion])
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(ids).logits[0, prompt_len - 1 : -1].float()  # (T, V)
        ref = torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion)[:, None])[:, 0]
        gaps.append((ref - torch.tensor(policy)).abs())
    gaps = torch.cat(gaps)
    return gaps.max().item(), gaps.mean().item()


def test_bf16_round_keeps_rope_in_fp32_at_long_prompts(tokenizer, monkeypatch):
    """bf16 rounds sample with the rotary frequencies in the dtype the trainer keeps them in (fp32), so logprobs stay
    within bf16 noise of the autocast trainer at 16 and at 1500 prompt tokens alike (std-0.2 weights; measured
    max/mean 0.15/0.030 and 0.16/0.033). Control: rounding the generation's buffers to bf16 as well (what casting
    every buffer did) moves the 1500-token logprobs by far more."""
    model = tiny_model(tokenizer, init_std=0.2)
    short_max, short_mean = _autocast_gap(model, tokenizer, 16)
    long_max, long_mean = _autocast_gap(model, tokenizer, 1500)
    assert long_max <= 0.3 and long_mean <= 0.05, (long_max, long_mean)
    assert short_max <= 0.3 and short_mean <= 0.05, (short_max, short_mean)

    real_applied = GenerationPrecision.applied

    @contextlib.contextmanager
    def applied_rounding_buffers(self, module):
        saved = [(b, b.data) for b in module.buffers() if b.is_floating_point()]
        for buffer, data in saved:
            buffer.data = data.to(self.dtype)
        try:
            with real_applied(self, module):
                yield
        finally:
            for buffer, data in saved:
                buffer.data = data

    monkeypatch.setattr(GenerationPrecision, "applied", applied_rounding_buffers)
    rounded_max, rounded_mean = _autocast_gap(model, tokenizer, 1500)
    assert rounded_max >= 0.8 and rounded_mean >= 3 * long_mean, (rounded_max, rounded_mean, long_mean)


def test_weights_that_move_between_rounds_turn_accelerator_graphs_off(model, tokenizer, prompts):
    """Per-round generation copies (or gathered shards) live at new addresses every round, which graphs captured at
    the first round would replay stale: graphs are off for such an engine, and asking for them is refused."""
    cfg = sampling_config(tokenizer, max_new_tokens=4)
    per_round = dict(cast_dtype=torch.bfloat16, keep_generation_weights=False)
    with ContinuousBatchingGenerator(model, cfg, {"use_cuda_graph": True}, **per_round) as generator:
        with pytest.raises(ValueError, match="same addresses every round"):
            generator.generate(prompts[:1])
    with ContinuousBatchingGenerator(model, cfg, **per_round) as generator:
        generator.generate(prompts[:1])
        assert not any(generator._pool.engine.manager.continuous_batching_config.cuda_graph_booleans)
    kept = dict(cast_dtype=torch.bfloat16, keep_generation_weights=True)
    with ContinuousBatchingGenerator(model, cfg, {"use_cuda_graph": True}, **kept) as generator:
        assert generator._pool.stable_weights, "control: kept copies are refreshed in place and may be captured"
