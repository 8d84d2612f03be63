"""Compatibility matrix: every architecture family the engine serves samples exactly; the rest are refused up front.

Per served family (tests/model_zoo.py: tiny, features on, init std 0.2, fp32): the CB sampling logprobs equal one
teacher-forced forward of the same model to <= 1e-4 at T=1.0 and T=0.7, and controls show the comparison would catch
an error — the same completions scored after another prompt, with the sliding window removed, without the attention
soft-cap or without the attention sinks, each differ by >= 0.1. Slow: a 2-step GRPO run per family logs
`sampling/sampling_logp_difference/max` <= 1e-4. Per refused family: `ValueError` at construction, with the reason.

`python -m pytest tests/unit/checks/test_compat_matrix.py -k logprobs -s` prints the measured figures (docs/models.md).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch
from datasets import Dataset

from tests.conftest import sampling_config
from tests.model_zoo import REFUSED, SUPPORTED, WINDOW, Arch, tiny_arch_model, tiny_config
from trl_cb import ContinuousBatchingGenerator, GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer
from trl_cb.checks import model as compat
from trl_cb.checks.model import UnsupportedModelError
from trl_cb.engine._upstream_geometry import LATENT_FAMILIES
from trl_cb.offline.data import synthetic_gsm8k

TOLERANCE = 1e-4
CONTROL_GAP = 0.1
G = 2
MAX_NEW_TOKENS = 16


@pytest.fixture(scope="module")
def special_ids(tokenizer) -> dict[str, int]:
    return dict(pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                eos_token_id=tokenizer.eos_token_id)  # fmt: skip


@pytest.fixture(scope="module")
def short_prompts(tokenizer) -> list[list[int]]:
    """Three prompts of 12 tokens: with 16 new tokens every sequence crosses the 8-token windows twice over."""
    prompts = [tokenizer(r["prompt"])["input_ids"][:12] for r in synthetic_gsm8k(3, seed=11)]
    assert all(len(p) == 12 for p in prompts)
    return prompts


def _max_gap(model, prompts, result, temperature: float, shift: int = 0) -> float:
    """Largest |CB logprob - teacher-forced logprob| over every completion token, from one batched forward.

    `shift` scores each completion after another prompt (a control). All prompts have the same length and rows are
    right-padded, so causal attention keeps every scored position independent of the padding.
    """
    plen = len(prompts[0])
    rows = [prompts[(i // G + shift) % len(prompts)] + c for i, c in enumerate(result.completion_ids)]
    width = max(map(len, rows))
    ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])  # (B, L)
    with torch.no_grad():
        logits = model(ids).logits[:, plen - 1 : -1].float() / temperature  # (B, L - plen, V)
    logp = torch.log_softmax(logits, dim=-1)
    worst = 0.0
    for b, (completion, sampled) in enumerate(zip(result.completion_ids, result.logprobs, strict=True)):
        ref = logp[b, : len(completion)].gather(-1, torch.tensor(completion)[:, None])[:, 0]
        worst = max(worst, (ref - torch.tensor(sampled)).abs().max().item())
    return worst


@contextlib.contextmanager
def _window_removed(model) -> Iterator[None]:
    """The teacher-forced model attends over everything: masks are built from `config.sliding_window`."""
    config = model.config.get_text_config()
    saved = config.sliding_window
    config.sliding_window = 10_000
    try:
        yield
    finally:
        config.sliding_window = saved


@contextlib.contextmanager
def _module_attr(model, name: str, value) -> Iterator[None]:
    """Set `name` on every module that has it (e.g. the soft-cap or the sinks), restore afterwards."""
    saved = [(m, getattr(m, name)) for m in model.modules() if getattr(m, name, None) is not None]
    assert saved, f"no module has {name!r}: the control would test nothing"
    try:
        for m, old in saved:
            setattr(m, name, value if not torch.is_tensor(old) else torch.nn.Parameter(torch.full_like(old, value)))
        yield
    finally:
        for m, old in saved:
            setattr(m, name, old)


def _controls(arch: Arch, model) -> dict[str, contextlib.AbstractContextManager[None]]:
    controls: dict[str, contextlib.AbstractContextManager[None]] = {}
    if arch.windowed:
        controls["window removed"] = _window_removed(model)
    if arch.model_type == "gemma2":
        controls["soft-cap removed"] = _module_attr(model, "attn_logit_softcapping", None)
    if arch.model_type == "gpt_oss":
        controls["sinks removed"] = _module_attr(model, "sinks", -1e4)
    return controls


@pytest.mark.parametrize("arch", SUPPORTED, ids=[a.id for a in SUPPORTED])
def test_logprobs_match_teacher_forcing(arch, tokenizer, special_ids, short_prompts):
    model = tiny_arch_model(arch, len(tokenizer), special_ids)
    figures = {}
    with ContinuousBatchingGenerator(model, sampling_config(tokenizer, max_new_tokens=MAX_NEW_TOKENS)) as gen:
        for temperature in (1.0, 0.7):
            cfg = sampling_config(tokenizer, temperature=temperature, max_new_tokens=MAX_NEW_TOKENS)
            result = gen.generate(short_prompts, num_generations=G, generation_config=cfg)
            gap = _max_gap(model, short_prompts, result, temperature)
            figures[f"T={temperature}"] = gap
            assert gap <= TOLERANCE, f"{arch.id} T={temperature}: max |CB - teacher-forced| = {gap:.2e}"
            # Controls: an error of each kind would show far above the tolerance.
            wrong_prompt = _max_gap(model, short_prompts, result, temperature, shift=1)
            assert wrong_prompt >= CONTROL_GAP, f"{arch.id}: scoring after another prompt moved only {wrong_prompt}"
            figures[f"wrong prompt T={temperature}"] = wrong_prompt
            for name, control in _controls(arch, model).items():
                with control:
                    moved = _max_gap(model, short_prompts, result, temperature)
                assert moved >= CONTROL_GAP, f"{arch.id}: {name} moved the logprobs by only {moved:.2e}"
                figures[f"{name} T={temperature}"] = moved
    longest = max(len(c) for c in result.completion_ids) + len(short_prompts[0])
    assert longest > 2 * WINDOW, "sequences must cross the window"
    print(f"\n[matrix] {arch.id}: " + ", ".join(f"{k}: {v:.1e}" for k, v in figures.items()))


#: The families whose decode steps read the cache in a layout of their own: sliding-window rings, cached latents.
GRAPHED_LAYOUTS = [a for a in SUPPORTED if a.windowed or a.model_type in LATENT_FAMILIES]


@pytest.mark.parametrize("arch", GRAPHED_LAYOUTS, ids=[a.id for a in GRAPHED_LAYOUTS])
def test_decode_graphs_are_exact_on_every_cache_layout(arch, tokenizer, special_ids, short_prompts, monkeypatch):
    """With decode graphs on (CPU fake backend, as on CUDA), each windowed family's sliding layers read their ring of
    pages through block tables (4-token pages: the 8-token ring spans two pages, every sequence wraps it more than
    twice), their steady steps prepared by the decode fast path, and each latent family's pages are gathered before its
    layer expands them. Exact as above; controls: the window removed (windowed families), another prompt."""
    from tests.graph_fakes import use_fake_graphs
    from trl_cb.engine import _upstream_decode, decode_graphs, paged_decode

    use_fake_graphs(monkeypatch)
    windows: set[int | None] = set()
    attend = paged_decode.attend

    def seen(query, layer, *args, **kwargs):
        windows.add(layer.window)
        return attend(query, layer, *args, **kwargs)

    monkeypatch.setattr(paged_decode, "attend", seen)
    model = tiny_arch_model(arch, len(tokenizer), special_ids)
    cfg = sampling_config(tokenizer, max_new_tokens=MAX_NEW_TOKENS)
    with ContinuousBatchingGenerator(model, cfg, {"page_size": 4}) as gen:
        result = gen.generate(short_prompts, num_generations=G)
        manager = gen._pool.engine.manager  # noqa: SLF001 - the engine's graphs and fast path
        graphs = decode_graphs.graphs_of(manager)
        assert graphs is not None and graphs.replays > 0, "decode steps must replay graphs"
        fast = _upstream_decode.decode_fast_path_stats(manager)  # every group read through block tables
        assert (fast is None) == (arch.model_type in LATENT_FAMILIES) and (fast is None or fast.fast > fast.slow)
    gap = _max_gap(model, short_prompts, result, 1.0)
    wrong_prompt = _max_gap(model, short_prompts, result, 1.0, shift=1)
    print(f"\n[graphs] {arch.id}: {gap:.1e}, wrong prompt {wrong_prompt:.1e}")
    assert gap <= TOLERANCE and wrong_prompt >= CONTROL_GAP
    if arch.windowed:
        assert WINDOW in windows, "no sliding layer read its ring through a block table"
        with _window_removed(model):
            moved = _max_gap(model, short_prompts, result, 1.0)
        assert moved >= CONTROL_GAP, f"{arch.id}: removing the window moved the logprobs by only {moved:.2e}"


@pytest.mark.parametrize(("arch", "reason"), REFUSED, ids=[a.id for a, _ in REFUSED])
def test_refused_at_generator_construction(arch, reason, tokenizer, special_ids):
    model = tiny_arch_model(arch, len(tokenizer), special_ids)
    with pytest.raises(UnsupportedModelError) as info:
        ContinuousBatchingGenerator(model, sampling_config(tokenizer))
    message = str(info.value)
    assert isinstance(info.value, ValueError)
    assert reason in message, message
    assert f"model_type={arch.model_type!r}" in message and "use_transformers_continuous_batching=False" in message


def test_probe_refuses_a_window_the_engine_would_not_apply(tokenizer, special_ids):
    """The layers attend through an 8-token window, but `layer_types` (what the engine groups its cache by) says
    full attention: caught by comparing what each layer hands to attention with the engine's view."""
    model = tiny_arch_model(next(a for a in SUPPORTED if a.model_type == "mistral"), len(tokenizer), special_ids)
    model.config.layer_types = ["full_attention"] * model.config.num_hidden_layers
    with pytest.raises(UnsupportedModelError, match="sliding_window=8 but the engine would use None"):
        compat.check_model(model)


def test_engine_attention_replaces_dense_mask_implementations(tokenizer, special_ids):
    """The engine always puts trl_cb's attention where transformers would run a dense mask (Gemma-2's soft-cap
    included: transformers' `paged|eager` drops it), and keeps a flash implementation."""
    from types import SimpleNamespace

    from trl_cb.engine import _upstream
    from trl_cb.engine import varlen_attention as attention

    gemma2 = tiny_arch_model(next(a for a in SUPPORTED if a.model_type == "gemma2"), len(tokenizer), special_ids)
    assert compat.check_model(gemma2) is True
    gemma2.set_attn_implementation("paged|eager")  # as the manager's constructor leaves an eager model
    switch = lambda model, flash: None  # noqa: E731 - upstream already switched (eager -> paged|eager)
    config = SimpleNamespace(auto_switch_to_flash=False)
    manager = SimpleNamespace(
        continuous_batching_config=config, _original_attn_impl=None, switch_to_cb_friendly_attn=switch
    )
    _upstream._choose_attention(manager, gemma2)
    assert getattr(manager, _upstream._VARLEN_FLAG) is True
    assert gemma2.config._attn_implementation == attention.ATTENTION_NAME
    assert manager._original_attn_impl == "paged|eager"
    assert not attention.replaces("flash_attention_2")


def test_probe_leaves_the_model_as_it_was(tokenizer, special_ids):
    model = tiny_arch_model(next(a for a in SUPPORTED if a.model_type == "gpt_oss"), len(tokenizer), special_ids)
    model.train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    torch.manual_seed(3)
    assert compat.check_model(model) is True
    after_rng = torch.rand(3)
    torch.manual_seed(3)
    assert torch.equal(torch.rand(3), after_rng), "the probe must not consume the caller's RNG"
    assert model.training and model.config._attn_implementation == "eager"
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


# ------------------------------------------------------------------------------------------------- trainers

PAIRS = {"grpo": (GRPOConfig, GRPOTrainer), "rloo": (RLOOConfig, RLOOTrainer)}


def _reward(completions: list[str], **kwargs: object) -> list[float]:
    return [len(c) / 50.0 for c in completions]


def _dataset() -> Dataset:
    return Dataset.from_list(synthetic_gsm8k(8, seed=5))


def _trainer_args(kind: str, tmp_path, **overrides):
    config_cls, _ = PAIRS[kind]
    kwargs = dict(
        output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=2, max_completion_length=12,
        max_steps=2, logging_steps=1, learning_rate=1e-3, beta=0.0, bf16=False, report_to=[], save_strategy="no",
        use_cpu=True, use_transformers_continuous_batching=True, disable_tqdm=True, temperature=0.7, top_k=0,
        top_p=1.0,
    )  # fmt: skip
    kwargs.update(overrides)
    return config_cls(**kwargs)


GRAPHED_TRAINING = [a for a in GRAPHED_LAYOUTS if a.model_type in ("gemma3_text", "gemma4_text", "deepseek_v3")]


@pytest.mark.parametrize("arch", GRAPHED_TRAINING, ids=[a.id for a in GRAPHED_TRAINING])
def test_grpo_trains_through_decode_graphs_on_every_cache_layout(arch, tokenizer, special_ids, tmp_path, monkeypatch):
    """GRPO (lr > 0, two steps) with decode graphs on (CPU fake backend, as on CUDA): the engine kept across the
    optimizer step replays its graphs over sliding-window rings, Gemma 4's KV-shared layers and DeepSeek's gathered
    latents, and the sampler's logprobs match the trainer's forward at each step."""
    from tests.graph_fakes import use_fake_graphs
    from trl_cb.engine import decode_graphs

    use_fake_graphs(monkeypatch)
    model = tiny_arch_model(arch, len(tokenizer), special_ids)
    trainer = GRPOTrainer(model=model, reward_funcs=_reward, args=_trainer_args("grpo", tmp_path),
                          train_dataset=_dataset(), processing_class=tokenizer)  # fmt: skip
    replays = []
    step = decode_graphs.DecodeGraphs.step
    monkeypatch.setattr(decode_graphs.DecodeGraphs, "step", lambda self, *a: replays.append(1) or step(self, *a))
    trainer.train()
    logs = [e for e in trainer.state.log_history if "sampling/sampling_logp_difference/max" in e]
    assert len(logs) == 2 and replays, "both steps sampled, decode steps through graphs"
    worst = max(e["sampling/sampling_logp_difference/max"] for e in logs)
    print(f"\n[graphs-grpo] {arch.id}: sampling_logp_difference/max {worst:.1e}")
    assert worst <= TOLERANCE, f"{arch.id}: logged sampling_logp_difference/max = {worst:.2e}"


@pytest.mark.parametrize("kind", ["grpo", "rloo"])
def test_trainer_refuses_at_construction(kind, tokenizer, special_ids, tmp_path):
    arch, reason = next((a, r) for a, r in REFUSED if a.model_type == "minicpm3")
    _, trainer_cls = PAIRS[kind]
    model = tiny_arch_model(arch, len(tokenizer), special_ids)
    with pytest.raises(UnsupportedModelError, match=reason):
        trainer_cls(model=model, reward_funcs=_reward, args=_trainer_args(kind, tmp_path), train_dataset=_dataset(),
                    processing_class=tokenizer)  # fmt: skip


def test_trainer_refuses_a_named_model_before_loading_weights(tokenizer, tmp_path):
    """Only config.json exists: had the trainer tried to load weights, it would fail with a different error."""
    arch = next(a for a, _ in REFUSED if a.model_type == "minicpm3")
    tiny_config(arch, len(tokenizer)).save_pretrained(tmp_path / "model")
    with pytest.raises(UnsupportedModelError, match="multi-head latent attention"):
        GRPOTrainer(model=str(tmp_path / "model"), reward_funcs=_reward, args=_trainer_args("grpo", tmp_path),
                    train_dataset=_dataset(), processing_class=tokenizer)  # fmt: skip


def test_trainer_without_cb_accepts_a_refused_model(tokenizer, special_ids, tmp_path):
    """The refusal is specific to the CB path: the way out it names works."""
    arch = next(a for a, _ in REFUSED if a.model_type == "minicpm3")
    model = tiny_arch_model(arch, len(tokenizer), special_ids)
    args = _trainer_args("grpo", tmp_path, use_transformers_continuous_batching=False)
    GRPOTrainer(model=model, reward_funcs=_reward, args=args, train_dataset=_dataset(), processing_class=tokenizer)


@pytest.mark.slow
@pytest.mark.parametrize("arch", SUPPORTED, ids=[a.id for a in SUPPORTED])
def test_grpo_two_steps_sampling_matches_training(arch, tokenizer, special_ids, tmp_path):
    model = tiny_arch_model(arch, len(tokenizer), special_ids)
    trainer = GRPOTrainer(model=model, reward_funcs=_reward, args=_trainer_args("grpo", tmp_path),
                          train_dataset=_dataset(), processing_class=tokenizer)  # fmt: skip
    trainer.train()
    logs = [e for e in trainer.state.log_history if "sampling/sampling_logp_difference/max" in e]
    assert len(logs) == 2
    worst = max(e["sampling/sampling_logp_difference/max"] for e in logs)
    assert worst <= TOLERANCE, f"{arch.id}: logged sampling_logp_difference/max = {worst:.2e}"
    print(f"\n[matrix-grpo] {arch.id}: sampling_logp_difference/max {worst:.1e}")
