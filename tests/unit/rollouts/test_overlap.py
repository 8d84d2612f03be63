"""True overlap on one weight copy (trl_cb/rollouts/overlap.py, engine/model_view.py): the engine generates during
the trainer's forward and backward on a view of the training module, pausing only for optimizer steps.

Tiny fp32 models with std-0.2 weights (logprobs far from uniform: a wrong forward misses by 0.1-1 nats) and no EOS
bias (completions run to `max_new_tokens`, so updates land mid-request). Concurrency is proven, not assumed: the
engine starts a forward only with a permit (`tests/gates.py`, `EngineThrottle`); the trainer's forward and backward
each grant one and wait until it has started, and weight updates come a fixed number of engine steps apart, so the
verdicts do not depend on the machine's speed.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator

import pytest
import torch
from transformers import DynamicCache, Phi3Config, Phi3ForCausalLM, PreTrainedModel

from tests.conftest import sampling_config
from tests.gates import EngineThrottle, engine_gate, engine_throttle, interrupted_in_round
from tests.unit.serving.conftest import FP32_LOGPROB_TOL
from trl_cb import ContinuousBatchingGenerator, GRPOConfig
from trl_cb.engine import _upstream
from trl_cb.engine.model_view import EngineView
from trl_cb.offline.data import synthetic_gsm8k
from trl_cb.offline.tiny import tiny_model
from trl_cb.rollouts.async_controller import AsyncRolloutController

#: |engine logprob - teacher-forced reference| allowed in fp32: the server tests' bound (fp32 noise only; the engine
#: batches tokens of many requests, the reference one sequence). Measured here 7.8e-6 to 1.1e-5 over runs; every
#: control misses by 0.5 nats or more.
FP32_TOL = FP32_LOGPROB_TOL
#: The tiny Phi-3 of the dropout test: the engine alone (no trainer running) already differs from teacher forcing by
#: up to 3.3e-5 in fp32 (measured, 3 runs: 6.7e-6 to 3.3e-5); the train-mode control misses by 6.6-64 nats.
PHI3_FP32_TOL = 1e-4
#: Every control (old weights, train-mode forward) misses by more than this.
CONTROL_GAP = 0.05


# ------------------------------------------------------------------------------------------------------ helpers


def sharp_model(tokenizer, **kwargs) -> PreTrainedModel:
    """Std-0.2 weights, EOS logit 0 (`never_eos`): requests outlive a test's few dozen engine steps."""
    return never_eos(tiny_model(tokenizer, init_std=0.2, **kwargs), tokenizer)


def never_eos(model: PreTrainedModel, tokenizer) -> PreTrainedModel:
    """Zero the EOS output row: its logit is 0 in every context (p ~ 1e-3 per token), so a request ends early only
    rarely and the 12 requests in flight never all end within ~20 steps (P < 1e-6). Not `bias_eos(-30)`: it scales
    the EOS row along the mean hidden direction, so a context anti-aligned with it gets a large *positive* EOS logit
    (p(EOS) = 1.0 was sampled, and the engine ran dry in 3 of 6 runs)."""
    with torch.no_grad():
        model.lm_head.weight[tokenizer.eos_token_id] = 0.0
    return model.eval()


def phi3_with_dropout(tokenizer, p: float = 0.5) -> PreTrainedModel:
    """A tiny std-0.2 Phi-3 with residual, embedding and attention dropout `p` (Qwen2/Llama have only attention
    dropout, which the engine's attention ignores: a train-mode forward would not show in their logprobs)."""
    config = Phi3Config(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=2048, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, resid_pdrop=p, embd_pdrop=p,
        attention_dropout=p, initializer_range=0.2, tie_word_embeddings=False,
    )  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Phi3ForCausalLM(config)
    model.set_attn_implementation("sdpa")
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return never_eos(model, tokenizer)


def overlap_controller(
    model: PreTrainedModel, tokenizer, max_new_tokens: int = 64, **kwargs
) -> AsyncRolloutController:
    rows = synthetic_gsm8k(40, seed=4)
    stream = ((r, tokenizer(r["prompt"])["input_ids"]) for r in itertools.cycle(rows))
    gen = ContinuousBatchingGenerator(model, sampling_config(tokenizer, max_new_tokens=max_new_tokens))
    options = dict(num_generations=2, groups_per_step=2, prefetch_depth=2, max_staleness=1, keep_stale=True)
    options.update(kwargs)
    ctl = AsyncRolloutController(gen, model, stream, max_prompt_len=64, overlap=True, **options)
    ctl.start()
    return ctl


@contextlib.contextmanager
def engine_runs_during_forward_and_backward(model: PreTrainedModel, throttle: EngineThrottle) -> Iterator[list[int]]:
    """Make the trainer's forward (at its second layer) grant the engine one forward and wait until it started;
    `wait_in_backward` does the same in the backward. Yields the list each such wait appends to."""
    waited: list[int] = []

    def in_forward(*_: object) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # the control's engine runs this very module
        throttle.step()
        waited.append(throttle.started)

    handle = model.model.layers[1].register_forward_pre_hook(in_forward)
    try:
        yield waited
    finally:
        handle.remove()


def wait_in_backward(logits: torch.Tensor, throttle: EngineThrottle, waited: list[int]) -> None:
    def in_backward(grad: torch.Tensor) -> None:
        throttle.step()
        waited.append(throttle.started)

    logits.register_hook(in_backward)


@torch.no_grad()
def versioned_reference(
    models: dict[int, PreTrainedModel],
    prompt: list[int],
    tokens: list[int],
    versions: list[int],
    prefix_version: int | None = None,
) -> torch.Tensor:
    """Logprobs of `tokens` when token j was sampled by `models[versions[j]]` over the KV prefix the engine actually
    had: the step sampling token 0 prefills the prompt (with token 0's version), the step sampling token j >= 1 feeds
    token j-1 (with token j's version) and attends to keys earlier steps wrote with their own versions. With one
    switch this is the server tests' `straddling_reference` (tests/unit/serving/test_inflight.py). In the models'
    fp32, like the engine: an fp64 reference is further from the engine (up to 4e-5), whose rounding it lacks.
    `prefix_version`: the prompt but its last token was processed by that version (a forked prompt is prefilled up
    to its last token, forked, and the next step samples token 0: an update can land between; `switch_gap`)."""
    first = models[versions[0]]
    cache = DynamicCache(config=first.config)
    if prefix_version is not None and len(prompt) > 1:
        models[prefix_version](torch.tensor([prompt[:-1]]), past_key_values=cache, use_cache=True)
        rows = [first(torch.tensor([prompt[-1:]]), past_key_values=cache, use_cache=True).logits[0, -1:]]
    else:
        rows = [first(torch.tensor([prompt]), past_key_values=cache, use_cache=True).logits[0, -1:]]
    j = 1
    while j < len(tokens):
        k = j
        while k < len(tokens) and versions[k] == versions[j]:
            k += 1
        chunk = torch.tensor([tokens[j - 1 : k - 1]])
        rows.append(models[versions[j]](chunk, past_key_values=cache, use_cache=True).logits[0])
        j = k
    logits = torch.cat(rows).float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens)[:, None])[:, 0]


def version_gaps(models: dict[int, PreTrainedModel], groups: list) -> tuple[list[float], list[float], set[int]]:
    """Per completion of `groups`: the max |recorded - `versioned_reference`| logprob gap, the same against the old
    weights only (the control, for completions whose versions changed), and the versions that started mid-request.
    Checks each completion has one version per token, never decreasing."""
    gaps, controls, straddled = [], [], set()
    for g in groups:
        for tokens, recorded, versions in zip(g.completion_ids, g.logprobs, g.versions, strict=True):
            assert len(tokens) == len(versions) and versions == sorted(versions)
            straddled |= {b for a, b in itertools.pairwise(versions) if a != b}
            got = torch.tensor(recorded)
            gap = (versioned_reference(models, g.prompt_ids, tokens, versions) - got).abs().max().item()
            earlier_versions = [v for v in models if v < versions[0]] if gap > 1e-5 else []  # only where it misses
            for earlier in earlier_versions:  # the prompt but its last token processed by `earlier`
                forked = versioned_reference(models, g.prompt_ids, tokens, versions, prefix_version=earlier)
                gap = min(gap, (forked - got).abs().max().item())
            gaps.append(gap)
            if versions[0] != versions[-1]:
                old_only = versioned_reference(models, g.prompt_ids, tokens, [versions[0]] * len(tokens))
                controls.append((old_only - got).abs().max().item())
    return gaps, controls, straddled


def perturb(model: PreTrainedModel, generator: torch.Generator, scale: float = 0.05) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=generator))


def engine_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if "_run_generation_loop" in repr(t) and t.is_alive()]


# ------------------------------------------------------------------------------------------------- the view


def test_view_aliases_parameters_and_owns_config_mode_and_hooks(tokenizer):
    model = sharp_model(tokenizer)
    model.train()
    model.activation_checkpointing_enable()
    calls: list[int] = []
    model.model.layers[0].register_forward_hook(lambda *_: calls.append(1))
    view = EngineView(model).module
    assert not view.training and model.training
    assert view.config is not model.config and view.model.layers[0].self_attn.config is view.config
    assert not any(getattr(m, "gradient_checkpointing", False) for m in view.modules())
    assert model.model.layers[0].gradient_checkpointing, "the trainer's checkpointing must stay on"
    for (name, p), (view_name, q) in zip(model.named_parameters(), view.named_parameters(), strict=True):
        assert name == view_name and p.data_ptr() == q.data_ptr() and p is not q and not q.requires_grad
    x = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        out = view(x).logits
        assert not calls, "the trainer's hooks must not run on the view"
        model.model.embed_tokens.weight.add_(0.5)  # an in-place update (as the optimizer's) is seen at once
        assert (view(x).logits - out).abs().max() > 0.1
    view.set_attn_implementation("eager")
    assert _upstream.attention_implementation(model) == "sdpa"


def test_view_refuses_sharded_parameters_naming_the_rollout_server(tokenizer):
    model = sharp_model(tokenizer)
    model.lm_head.weight.ds_id = 0  # what a ZeRO-3 partitioned parameter carries
    with pytest.raises(ValueError, match="cb_server_urls"):
        EngineView(model)


def test_replaced_training_tensor_is_refused_at_the_next_update(tokenizer):
    model = sharp_model(tokenizer)
    ctl = overlap_controller(model, tokenizer, max_new_tokens=8)
    try:
        model.lm_head.weight.data = model.lm_head.weight.data.clone()  # not in place: the view cannot see it
        with pytest.raises(RuntimeError, match="replaced instead of updated in place"):
            with ctl.weight_update():
                pass
    finally:
        ctl.stop()


def test_bf16_generation_copies_live_on_the_view_and_are_refreshed_in_the_pause(tokenizer):
    """With a generation dtype the view reads bf16 copies (made once, refreshed in place inside each optimizer-step
    pause); the training module keeps its fp32 tensors throughout."""
    model = sharp_model(tokenizer)
    rows = synthetic_gsm8k(8, seed=4)
    stream = ((r, tokenizer(r["prompt"])["input_ids"]) for r in itertools.cycle(rows))
    gen = ContinuousBatchingGenerator(model, sampling_config(tokenizer, max_new_tokens=8), cast_dtype=torch.bfloat16)
    ctl = AsyncRolloutController(
        gen, model, stream, max_prompt_len=64, overlap=True, num_generations=2, groups_per_step=2, max_staleness=2
    )
    ctl.start()
    try:
        view = ctl.backend.view.module
        copy_address = view.lm_head.weight.data_ptr()
        with ctl.weight_update():
            perturb(model, torch.Generator().manual_seed(0))
        assert view.lm_head.weight.dtype == torch.bfloat16 and view.lm_head.weight.data_ptr() == copy_address
        assert torch.equal(view.lm_head.weight, model.lm_head.weight.to(torch.bfloat16))
        assert all(p.dtype == torch.float32 for p in model.parameters())
        groups, _ = ctl.take(2)
        assert all(
            c and torch.isfinite(torch.tensor(lp)).all() for g in groups for c, lp in zip(g.completion_ids, g.logprobs)
        )
    finally:
        ctl.stop()
    assert all(p.dtype == torch.float32 for p in ctl.backend.view.module.parameters()), "copies released at stop"


def test_engine_gets_its_own_intra_op_threads(tokenizer):
    """`engine_threads=1`: every engine forward runs on one intra-op thread while the trainer's thread keeps its
    count (torch's count is per thread; only the default for new threads is shared)."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    seen: list[int] = []
    try:
        model = sharp_model(tokenizer)
        ctl = overlap_controller(model, tokenizer, max_new_tokens=16, engine_threads=1)
        hook = ctl.backend.view.module.get_input_embeddings().register_forward_pre_hook(
            lambda *_: seen.append(torch.get_num_threads())
        )
        try:
            ctl.take(2)
            assert torch.get_num_threads() == 2
        finally:
            hook.remove()
            ctl.stop()
    finally:
        torch.set_num_threads(before)
    assert seen and set(seen) == {1}


# ------------------------------------------------------------------------------------------------ exactness


def test_every_token_matches_its_version_over_its_kv_prefix_across_5_updates(tokenizer, monkeypatch):
    """Six optimizer steps while requests generate: every token's logprob equals teacher forcing under the weights
    of its recorded version over the KV prefix it had (`FP32_TOL`). Control: the old weights alone miss."""
    model = sharp_model(tokenizer)
    models = {0: copy.deepcopy(model)}
    noise = torch.Generator().manual_seed(3)
    ctl = overlap_controller(model, tokenizer, max_new_tokens=64)
    try:
        with engine_throttle(ctl.backend.view.module, monkeypatch) as throttle:
            for version in range(1, 7):
                throttle.step(3)  # three engine steps between two updates
                with ctl.weight_update():
                    perturb(model, noise)
                models[version] = copy.deepcopy(model)
            throttle.open()
            groups = [g for _ in range(3) for g in ctl.take(2)[0]]
    finally:
        ctl.stop()
    gaps, controls, straddled = version_gaps(models, groups)
    print(f"\nupdates landing mid-request: {sorted(straddled)}; max|d|={max(gaps):.2e}; old-weights control "
          f"{min(controls):.3f}")  # fmt: skip
    assert len(straddled) >= 5, f"only updates {sorted(straddled)} landed while a request was generating"
    assert max(gaps) <= FP32_TOL
    assert controls and min(controls) > CONTROL_GAP


# ------------------------------------------------------------------------------------------- training is unchanged


def train_three_steps(
    model: PreTrainedModel, ctl: AsyncRolloutController, throttle: EngineThrottle | None, batch: torch.Tensor
):
    """Three optimizer steps of a next-token loss on `batch`; with a `throttle` the engine runs during forward and
    backward (each waits for an engine forward to start), without one it is paused for them. Returns each step's
    gradients, the final weights and the number of waits per step."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    grads, waits = [], []
    for _ in range(3):
        model.train()
        concurrent = throttle is not None
        gates = engine_runs_during_forward_and_backward(model, throttle) if concurrent else contextlib.nullcontext([])
        paused = contextlib.nullcontext() if concurrent else ctl.backend.manager.pause()
        with gates as waited, paused:
            logits = model(batch).logits
            if concurrent:
                wait_in_backward(logits, throttle, waited)
            loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), batch[:, 1:].flatten())
            loss.backward()
        waits.append(len(waited))
        grads.append([p.grad.clone() for p in model.parameters()])
        with ctl.weight_update():
            optimizer.step()
        optimizer.zero_grad()
    return grads, [p.detach().clone() for p in model.parameters()], waits


@pytest.mark.parametrize(
    ("attention", "use_view"),
    [("sdpa", True), ("eager", True), ("eager", False)],
    ids=["sdpa", "eager", "control-shared-module"],
)
def test_training_is_bitwise_equal_with_the_engine_running_during_forward_and_backward(
    tokenizer, monkeypatch, attention, use_view
):
    """Same samples fed: the gradients of every step and the updated weights are bitwise those of a run where the
    engine is paused during forward and backward. With `eager`, the engine's own config switches to `paged|eager`
    while the trainer's stays `eager`. Control: the engine on the training module itself (one shared config) routes
    the training forward through the paged path, and training changes or fails."""
    if not use_view:
        monkeypatch.setattr(EngineView, "__init__", lambda self, m: setattr(self, "module", m))
        monkeypatch.setattr(EngineView, "check_aliased", lambda self: None)
        with pytest.raises(Exception):  # noqa: B017,PT011 - any failure, or unequal gradients below, is the control
            _training_runs_match(tokenizer, monkeypatch, attention)
        return
    _training_runs_match(tokenizer, monkeypatch, attention)


def _training_runs_match(tokenizer, monkeypatch, attention: str) -> None:
    base = sharp_model(tokenizer)
    base.set_attn_implementation(attention)
    batch = torch.randint(5, len(tokenizer), (4, 24), generator=torch.Generator().manual_seed(0))
    runs = []
    for concurrent in (False, True):
        model = copy.deepcopy(base)
        ctl = overlap_controller(model, tokenizer, max_new_tokens=64)
        try:
            with contextlib.ExitStack() as stack:
                throttle = (
                    stack.enter_context(engine_throttle(ctl.backend.view.module, monkeypatch)) if concurrent else None
                )
                runs.append(train_three_steps(model, ctl, throttle, batch))
            assert _upstream.attention_implementation(model) == attention
        finally:
            ctl.stop()
    (grads_a, weights_a, _), (grads_b, weights_b, waits) = runs
    assert waits == [2, 2, 2], "the engine must have stepped during every forward and backward"
    for step_a, step_b in zip(grads_a, grads_b, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(step_a, step_b, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(weights_a, weights_b, strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(weights_a, base.parameters())), "the steps changed nothing"


@pytest.mark.parametrize("use_view", [True, False], ids=["view", "control-shared-module"])
def test_dropout_and_gradient_checkpointing_in_the_trainer_leave_engine_logprobs_unchanged(
    tokenizer, monkeypatch, use_view
):
    """The trainer runs train-mode forwards and backwards (Phi-3, residual / embedding / attention dropout 0.5,
    gradient checkpointing) while the engine generates: the engine's logprobs equal eval-mode teacher forcing
    (to the engine's own fp32 noise on this model, `PHI3_FP32_TOL`). Control: an engine running the training module
    itself (no view) samples with the trainer's dropout and misses."""
    model = phi3_with_dropout(tokenizer)
    model.activation_checkpointing_enable()
    reference = copy.deepcopy(model).eval()
    if not use_view:  # the control: the "view" is the training module itself
        monkeypatch.setattr(EngineView, "__init__", lambda self, m: setattr(self, "module", m))
        monkeypatch.setattr(EngineView, "check_aliased", lambda self: None)
    ctl = overlap_controller(model, tokenizer, max_new_tokens=64)
    batch = torch.randint(5, len(tokenizer), (2, 16), generator=torch.Generator().manual_seed(0))
    waits, groups = 0, []
    try:
        with engine_throttle(ctl.backend.view.module, monkeypatch) as throttle:
            for _ in range(4):
                throttle.open()
                groups += ctl.take(2)[0]  # as the trainer does: the engine is topped up with new groups
                throttle.close()
                model.train()
                with engine_runs_during_forward_and_backward(model, throttle) as waited:
                    logits = model(batch).logits
                    wait_in_backward(logits, throttle, waited)
                    logits.float().logsumexp(-1).mean().backward()
                waits += len(waited)
                model.zero_grad()
    finally:
        ctl.stop()
    assert waits == 8 and model.model.layers[0].gradient_checkpointing  # forward and backward, four times
    gaps = [
        (versioned_reference({0: reference}, g.prompt_ids, t, v) - torch.tensor(lp)).abs().max().item()
        for g in groups
        for t, lp, v in zip(g.completion_ids, g.logprobs, g.versions, strict=True)
    ]
    print(f"\n{'view' if use_view else 'shared module'}: max|d|={max(gaps):.2e}")
    if use_view:
        assert max(gaps) <= PHI3_FP32_TOL
    else:
        assert max(gaps) > CONTROL_GAP


# ------------------------------------------------------------------------------------------------- reliability


def heavy_overlap(tokenizer, **kwargs) -> AsyncRolloutController:
    """In-flight groups that take many seconds to generate (a compute-heavier tiny model, 160 tokens, no EOS)."""
    from tests.unit.rollouts.test_reliability import far_from_uniform

    model = far_from_uniform(tiny_model(tokenizer, hidden_size=128, num_layers=4), tokenizer)
    options = dict(num_generations=4, groups_per_step=2, prefetch_depth=1, max_staleness=1)
    options.update(kwargs)
    return overlap_controller(model, tokenizer, max_new_tokens=160, **options)


def test_stop_with_rollouts_in_flight_returns_within_2s_and_leaves_no_thread(tokenizer, monkeypatch):
    ctl = heavy_overlap(tokenizer, groups_per_step=4)
    model = ctl.module
    ctl.timeout = 0.5
    with engine_gate(ctl.backend.view.module, monkeypatch, after=3) as gate:  # parked mid-generation
        with pytest.raises(TimeoutError, match="No rollouts within 0.5 s"):
            ctl.take(4)
        assert gate.parked
        start = time.monotonic()
        ctl.stop()
        took = time.monotonic() - start
    assert took < 2.0, f"stop() took {took:.2f}s with rollouts in flight"
    assert not engine_threads() and not model.training
    ctl.stop()


def test_paused_holds_the_engine_without_marking_a_weight_update(tokenizer, monkeypatch):
    """`paused()` (an evaluation of the policy while overlap runs): no token is generated inside the block, no version
    is marked, and the engine steps again after it."""
    ctl = heavy_overlap(tokenizer)
    manager = ctl.backend.manager
    with engine_throttle(ctl.backend.view.module, monkeypatch) as throttle:
        throttle.step(3)  # requests are in flight
        version = ctl.policy_version
        with ctl.backend.paused():
            before = _upstream.inflight_generated_lengths(manager)
            time.sleep(0.3)  # a negative check: a broken pause could only make it fail, never make it pass wrongly
            assert _upstream.inflight_generated_lengths(manager) == before and before
            assert all(not p.boundaries for p in ctl.backend._groups.pending), "a weight update was marked"
        throttle.step(2)  # runs again
    assert ctl.policy_version == version
    ctl.stop()


def test_stop_inside_an_optimizer_step_releases_the_pause(tokenizer):
    """An error in the optimizer step (between `begin` and `end`): `stop` releases the held pause and still stops."""
    ctl = heavy_overlap(tokenizer)
    ctl.begin_weight_update()
    start = time.monotonic()
    ctl.stop()
    assert time.monotonic() - start < 2.0 and not engine_threads()


def test_ctrl_c_in_take_and_during_training_reach_the_caller_within_2s(tokenizer, monkeypatch):
    ctl = heavy_overlap(tokenizer)
    try:
        with engine_gate(ctl.backend.view.module, monkeypatch, after=3) as gate:  # no group can finish first
            latency = interrupted_in_round(lambda: ctl.take(2), gate)
        assert gate.parked and latency is not None and latency < 2.0, latency

        def training_forwards() -> None:
            with torch.no_grad():
                while True:
                    ctl.module(torch.tensor([[5, 6, 7]]))

        with engine_gate(ctl.backend.view.module, monkeypatch, after=2) as gate:  # the engine is mid-step
            latency = interrupted_in_round(training_forwards, gate)
        assert latency is not None and latency < 2.0, latency
    finally:
        start = time.monotonic()
        ctl.stop()
        assert time.monotonic() - start < 2.0
    assert not engine_threads()


def test_interpreter_exit_with_a_running_overlap_engine_prints_nothing_and_does_not_hang(tmp_path):
    """The engine is generating (never paused) when the script ends without `stop`: exit hard-stops it."""
    script = tmp_path / "exit_check.py"
    script.write_text(
        textwrap.dedent(
            """
            import itertools
            from transformers import GenerationConfig
            from trl_cb import ContinuousBatchingGenerator
            from trl_cb.rollouts.async_controller import AsyncRolloutController
            from trl_cb.offline.tiny import bias_eos, tiny_model, tiny_tokenizer

            tok = tiny_tokenizer()
            cfg = GenerationConfig(do_sample=True, top_k=0, max_new_tokens=400, eos_token_id=tok.eos_token_id,
                                   pad_token_id=tok.pad_token_id)
            model = tiny_model(tok, init_std=0.2)
            bias_eos(model, tok.eos_token_id, -30.0)
            stream = (({"i": i}, [5, 6, 7 + i % 50]) for i in itertools.count())
            ctl = AsyncRolloutController(ContinuousBatchingGenerator(model, cfg), model, stream, max_prompt_len=8,
                                         overlap=True, num_generations=2, groups_per_step=2)
            ctl.start()
            print("exiting while generating", flush=True)
            """
        )
    )
    start = time.monotonic()
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "exiting while generating" in proc.stdout
    assert "Traceback" not in proc.stderr and "Exception ignored" not in proc.stderr, proc.stderr[-2000:]
    assert time.monotonic() - start < 60


# ------------------------------------------------------------------------------------------------- the trainer


def test_overlap_config_validation():
    def make(**kw):
        return GRPOConfig(output_dir="/tmp/trl_cb_test", report_to=[], use_cpu=True, **kw)

    with pytest.raises(ValueError, match="cb_async_overlap needs cb_async_generation"):
        make(use_transformers_continuous_batching=True, cb_async_overlap=True)
    with pytest.raises(ValueError, match="rollout servers already"):
        make(
            use_transformers_continuous_batching=True,
            cb_async_generation=True,
            cb_async_overlap=True,
            cb_server_urls=["http://127.0.0.1:1"],
        )
    with pytest.raises(ValueError, match="overlapping engine's threads: set cb_async_overlap"):
        make(use_transformers_continuous_batching=True, cb_async_generation=True, cb_async_overlap_engine_threads=1)
    threads = dict(cb_async_generation=True, cb_async_overlap_engine_threads=1)
    assert make(use_transformers_continuous_batching=True, cb_async_overlap=True, **threads).cb_async_overlap
    assert not make().cb_async_overlap


def test_engine_threads_without_overlap_is_refused_not_dropped(tokenizer):
    model = sharp_model(tokenizer)
    gen = ContinuousBatchingGenerator(model, sampling_config(tokenizer, max_new_tokens=4))
    options = dict(max_prompt_len=8, engine_threads=1, num_generations=2, groups_per_step=1)
    with pytest.raises(ValueError, match="engine_threads .* needs overlap=True"):
        AsyncRolloutController(gen, model, iter([]), **options)
    ctl = AsyncRolloutController(gen, model, iter([]), overlap=True, **options)
    assert ctl.backend.engine_threads == 1
    ctl.stop()


def test_trainer_refuses_sharded_parameters_at_construction_naming_rollout_servers(tokenizer, tmp_path, monkeypatch):
    from tests.unit.trainers.test_trainers import make_trainer
    from trl_cb.engine import sharding

    monkeypatch.setattr(sharding, "is_sharded", lambda *_: True)  # as under ZeRO-3 / FSDP
    with pytest.raises(ValueError, match="cb_server_urls"):
        make_trainer("grpo", tokenizer, tmp_path, cb_async_generation=True, cb_async_overlap=True)


@pytest.mark.parametrize("kind", ["grpo", "rloo"])
def test_trainer_overlap_is_exact_without_updates(kind, tokenizer, tmp_path):
    """lr=0: the weights never change, so the behaviour logprobs (sampled while the trainer trained) equal TRL's
    training logprobs; no forward of the trainer's module ran off the main thread (the engine ran its view, not
    TRL's patched `forward`, which calls the training module)."""
    from tests.unit.trainers.test_trainers import make_trainer

    trainer = make_trainer(
        kind, tokenizer, tmp_path, cb_async_generation=True, cb_async_overlap=True, max_steps=3, learning_rate=0.0,
        max_completion_length=16,
    )  # fmt: skip
    off_main: list[str] = []
    trainer.model.model.register_forward_pre_hook(
        lambda *_: None if threading.current_thread() is threading.main_thread() else off_main.append("x")
    )
    trainer.train()
    assert not off_main, f"{len(off_main)} forwards of the training module ran on the engine's thread"
    logs = [e for e in trainer.state.log_history if "loss" in e]
    assert len(logs) == 3
    for entry in logs:
        assert entry["sampling/sampling_logp_difference/max"] <= 1e-4
    assert logs[-1]["async/policy_version"] == 2
    assert (
        trainer.rollouts.async_rollouts.source is None and trainer.rollouts.generator is None and not engine_threads()
    )


def test_trainer_overlap_learns_with_updates(tokenizer, tmp_path):
    from tests.unit.trainers.test_trainers import make_trainer

    trainer = make_trainer(
        "grpo",
        tokenizer,
        tmp_path,
        cb_async_generation=True,
        cb_async_overlap=True,
        max_steps=3,
        max_completion_length=16,
    )
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.train()
    logs = [e for e in trainer.state.log_history if "loss" in e]
    assert len(logs) == 3 and all(torch.isfinite(torch.tensor(e["loss"])) for e in logs)
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))
