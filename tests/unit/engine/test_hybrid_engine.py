"""Hybrid models on the engine (trl_cb/engine/_upstream_recurrent.py, recurrent_state.py): Gated DeltaNet (Qwen3.5,
Qwen3-Next), short convolutions (LFM2) and Mamba-2 (Granite-4.0-H, Falcon-H1) layers beside paged attention.

Exactness is checked in float64 (weights of std 0.2, far from uniform) against `tests/hybrid_reference.py`:
transformers' own cached computation of the same tokens in the same segments (<= 1e-5; measured ~5e-7, the
sampler's fp32 logits). Controls: the same completions after another prompt, and one row's state corrupted
mid-generation (only that row moves, by > 0.1). The fp32 gap to the trainer's teacher-forced forward is printed and
bounded next to transformers' own cached path's gap (the two Gated DeltaNet kernels differ in fp32 by 1e-5 to 1e-4).
`-s` prints the figures (docs/models.md).
"""

from __future__ import annotations

import copy

import pytest
import torch

from tests.conftest import sampling_config
from tests.hybrid_reference import StepTrace, replay_logprobs, request_ids
from tests.model_zoo import HYBRID, Arch, tiny_arch_model
from tests.unit.rollouts.test_generator import teacher_forced_logprobs
from trl_cb import ContinuousBatchingGenerator, GenerationError
from trl_cb.checks import model as compat
from trl_cb.engine import _upstream_decode, _upstream_recurrent
from trl_cb.offline.data import synthetic_gsm8k

TOLERANCE = 1e-5
CONTROL_GAP = 0.1
G = 2
BY_TYPE = {a.model_type: a for a in HYBRID}


@pytest.fixture(scope="module")
def special_ids(tokenizer) -> dict[str, int]:
    return dict(pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                eos_token_id=tokenizer.eos_token_id)  # fmt: skip


@pytest.fixture(scope="module")
def text_ids(tokenizer) -> list[int]:
    return tokenizer(" ".join(r["prompt"] for r in synthetic_gsm8k(400, seed=11)))["input_ids"]


def prompts_of(text_ids: list[int], lengths: list[int]) -> list[list[int]]:
    return [text_ids[97 * i : 97 * i + n] for i, n in enumerate(lengths)]


def hybrid_model(arch: Arch, tokenizer, special_ids, dtype=torch.float64):
    return tiny_arch_model(arch, len(tokenizer), special_ids, dtype=dtype)


def round_gaps(model, trace: StepTrace, prompts, result, round_index: int, temperature: float) -> list[float]:
    """Per completion: max |engine logprob - same-segment replay| (float64)."""
    gaps = []
    ids = request_ids(round_index, len(prompts), G)
    for i, (completion, logprobs) in enumerate(zip(result.completion_ids, result.logprobs, strict=True)):
        prompt = prompts[i // G]
        reference = replay_logprobs(model, trace.of(ids[i]), prompt + completion, len(prompt), temperature)
        gaps.append((reference - torch.tensor(logprobs, dtype=torch.float64)).abs().max().item())
    return gaps


def wrong_prompt_gap(model, prompts, result, temperature: float) -> float:
    """Control: the same completions scored after another prompt (teacher forcing) must miss by far."""
    return min(
        (teacher_forced_logprobs(model, prompts[(i // G + 1) % len(prompts)], c, temperature, 0, 1.0)
         - torch.tensor(lp, dtype=torch.float64)).abs().max().item()
        for i, (c, lp) in enumerate(zip(result.completion_ids, result.logprobs))
    )  # fmt: skip


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "qwen3_next"])
def test_qwen_hybrids_are_exact_on_long_prompts_with_forks_and_chunked_prefill(
    model_type, tokenizer, special_ids, text_ids, monkeypatch
):
    """Qwen3.5 / Qwen3-Next, two 1,500-token prompts x 2 samples, T=1.0 and 0.7: every token's logprob is the
    cached computation's; prompts are prefilled in several chunks (the engine's 256-token budget) and forked."""
    model = hybrid_model(BY_TYPE[model_type], tokenizer, special_ids)
    prompts = prompts_of(text_ids, [1500, 1500])
    trace = StepTrace().install(monkeypatch)
    figures = {}
    with ContinuousBatchingGenerator(model, sampling_config(tokenizer, max_new_tokens=16)) as gen:
        for round_index, temperature in enumerate((1.0, 0.7), start=1):
            trace.clear()
            cfg = sampling_config(tokenizer, temperature=temperature, max_new_tokens=16)
            result = gen.generate(prompts, num_generations=G, generation_config=cfg)
            gap = max(round_gaps(model, trace, prompts, result, round_index, temperature))
            figures[f"T={temperature}"] = gap
            assert gap <= TOLERANCE, f"{model_type} T={temperature}: max |CB - cached| = {gap:.2e}"
            figures[f"wrong prompt T={temperature}"] = wrong = wrong_prompt_gap(model, prompts, result, temperature)
            assert wrong >= CONTROL_GAP
            assert max(s.length for segs in trace.segments.values() for s in segs) < 1500, "prefill was not chunked"
            assert any("__child#" in rid for rid in trace.segments), "nothing was forked"
        stats = _upstream_decode.decode_fast_path_stats(gen._pool.engine.manager)  # noqa: SLF001
    assert stats is not None and stats.fast > 0, "the decode fast path must serve hybrid models too"
    print(f"\n[hybrid] {model_type} (1500-token prompts): " + ", ".join(f"{k}: {v:.1e}" for k, v in figures.items()))


def test_a_corrupted_state_moves_only_its_own_row(tokenizer, special_ids, text_ids, monkeypatch):
    """Control for the exactness check: one row's slot is perturbed mid-generation (between two engine steps);
    that row's logprobs move by > 0.1 from the reference while every other row stays exact, so a row reading
    another's state, or a state lost at a step, could not pass."""
    model = hybrid_model(BY_TYPE["qwen3_5_text"], tokenizer, special_ids)
    prompts = prompts_of(text_ids, [40, 50, 60])
    victim = "r1_p1__child#0"
    trace = StepTrace().install(monkeypatch)
    with ContinuousBatchingGenerator(model, sampling_config(tokenizer, max_new_tokens=12)) as gen:

        def corrupt(step: int) -> None:
            stepper = _upstream_recurrent.stepper(gen._pool.engine.manager.batch_processor.cache)  # noqa: SLF001
            decoded = [s for s in trace.segments.get(victim, []) if s.length == 1]
            if len(decoded) == 3 and not corrupt.done:  # after its third token, before the next step
                slot = torch.tensor([stepper.slots.slot(victim)])
                states = stepper.slots.read(0, slot)
                stepper.slots.write(0, slot, {k: v + 0.5 * torch.randn_like(v) for k, v in states.items()})
                corrupt.done = True

        corrupt.done = False
        trace.on_step = corrupt
        result = gen.generate(prompts, num_generations=G)
    assert corrupt.done
    gaps = dict(zip(request_ids(1, len(prompts), G), round_gaps(model, trace, prompts, result, 1, 1.0)))
    moved = gaps.pop(victim)
    print(f"\n[hybrid] one row's state corrupted: that row {moved:.2f}, the others {max(gaps.values()):.1e}")
    assert moved >= CONTROL_GAP
    assert max(gaps.values()) <= TOLERANCE, gaps


def test_requests_join_and_leave_across_steps(tokenizer, special_ids, text_ids, monkeypatch):
    """At most 3 requests per step and 64 tokens per forward: prompts of different lengths are prefilled in chunks
    while earlier requests decode, rows finish and leave while others join. Every token is exact."""
    model = hybrid_model(BY_TYPE["qwen3_5_text"], tokenizer, special_ids)
    prompts = prompts_of(text_ids, [30, 150, 70, 110])
    trace = StepTrace().install(monkeypatch)
    cb = {"max_requests_per_batch": 3, "max_batch_tokens": 64}
    with ContinuousBatchingGenerator(model, sampling_config(tokenizer, max_new_tokens=10), cb) as gen:
        result = gen.generate(prompts, num_generations=G)
    gaps = round_gaps(model, trace, prompts, result, 1, 1.0)
    assert max(gaps) <= TOLERANCE, gaps
    mixed = [rows for rows in trace.steps if any(n > 1 for _, _, n in rows) and any(n == 1 for _, _, n in rows)]
    assert mixed, "no step ran prefill chunks beside decode rows"
    alive = [{rid for rid, _, _ in rows} for rows in trace.steps]
    assert any(a - b and b - a for a, b in zip(alive, alive[1:])), "no step where rows left while others joined"
    assert set(trace.decode_on_views) == {True, False}, "decode rows ran both on slot views and gathered"


OTHER_FAMILIES = ["lfm2", "lfm3", "granitemoehybrid", "falcon_h1", "qwen3_5_moe_text", "jamba", "olmo_hybrid"]


def test_every_served_hybrid_family_is_in_this_matrix():
    assert {a.model_type for a in HYBRID} == set(compat.VERIFIED_HYBRIDS)
    assert set(OTHER_FAMILIES) | {"qwen3_5_text", "qwen3_next"} == set(compat.VERIFIED_HYBRIDS)


@pytest.mark.parametrize("model_type", OTHER_FAMILIES)
def test_other_hybrid_families_are_exact(model_type, tokenizer, special_ids, text_ids, monkeypatch):
    """Short convolutions (LFM2, LFM3), Mamba-2 beside attention (Granite-4.0-H, MoE) and in parallel with it in
    every layer (Falcon-H1), Mamba-1 (Jamba), Gated DeltaNet (Qwen3.6's MoE layout, OLMo-hybrid): 80-token prompts
    scan several 32-token chunks where the family chunks; every token is exact (T=0.7)."""
    model = hybrid_model(BY_TYPE[model_type], tokenizer, special_ids)
    assert compat.check_model(model) is True
    prompts = prompts_of(text_ids, [80, 80])
    trace = StepTrace().install(monkeypatch)
    cfg = sampling_config(tokenizer, temperature=0.7, max_new_tokens=12)
    with ContinuousBatchingGenerator(model, cfg) as gen:
        result = gen.generate(prompts, num_generations=G)
    gap = max(round_gaps(model, trace, prompts, result, 1, 0.7))
    wrong = wrong_prompt_gap(model, prompts, result, 0.7)
    print(f"\n[hybrid] {model_type}: T=0.7: {gap:.1e}, wrong prompt: {wrong:.1f}")
    assert gap <= TOLERANCE and wrong >= CONTROL_GAP


def test_fp32_gap_to_teacher_forcing_is_the_models_own(tokenizer, special_ids, text_ids, monkeypatch):
    """What the trainer sees: fp32 Qwen3.5, engine vs the teacher-forced forward, next to transformers' own cached
    computation of the same tokens vs that forward (its chunked and recurrent Gated DeltaNet kernels differ in
    fp32). Both stay far below the structural errors the controls show (> 0.1)."""
    model = hybrid_model(BY_TYPE["qwen3_5_text"], tokenizer, special_ids, dtype=torch.float32)
    prompts = prompts_of(text_ids, [200, 200])
    trace = StepTrace().install(monkeypatch)
    with ContinuousBatchingGenerator(model, sampling_config(tokenizer, max_new_tokens=16)) as gen:
        result = gen.generate(prompts, num_generations=G)
    ids = request_ids(1, len(prompts), G)
    engine, cached = [], []
    for i, (c, lp) in enumerate(zip(result.completion_ids, result.logprobs)):
        forward = teacher_forced_logprobs(model, prompts[i // G], c, 1.0, 0, 1.0)
        engine.append((forward - torch.tensor(lp, dtype=torch.float64)).abs().max().item())
        replay = replay_logprobs(model, trace.of(ids[i]), prompts[i // G] + c, len(prompts[i // G]), 1.0)
        cached.append((forward - replay).abs().max().item())
    print(f"\n[hybrid] qwen3_5_text fp32 vs teacher forcing: engine {max(engine):.1e}, transformers cached "
          f"{max(cached):.1e}")  # fmt: skip
    assert max(engine) <= 1e-3 and max(cached) <= 1e-3


def test_engine_settings_that_cannot_keep_states_are_refused(tokenizer, special_ids):
    """Accelerator graphs (the step plan is built on the host): off by default, refused when asked for; CPU
    offloading (it restores keys, not states)."""
    from trl_cb.rollouts.pool import EnginePool

    model = hybrid_model(BY_TYPE["qwen3_5_text"], tokenizer, special_ids, dtype=torch.float32)
    with pytest.raises(ValueError, match="state slot"):  # trl_cb's decode graphs, asked for explicitly
        EnginePool({"use_cuda_graph": True}).wants_graphs(model)
    assert EnginePool({}).wants_graphs(model) is False  # and off by default
    gen = ContinuousBatchingGenerator(model, sampling_config(tokenizer, max_new_tokens=4), {"cpu_offload_space": 1.0})
    with gen, pytest.raises(ValueError, match="cpu_offload_space"):
        gen.generate([[5, 6, 7]], num_generations=1)


def test_the_step_plan_maps_rows_to_slots_and_never_resumes_from_a_zero_state():
    """Decode rows on consecutive slots run on views of the storage (no copies), others are gathered; a sequence with
    a past but no slot is an error, never a zero state."""
    from types import SimpleNamespace

    def row(rid: str, position: int, length: int) -> SimpleNamespace:
        return SimpleNamespace(state=SimpleNamespace(request_id=rid, position_offset=position), query_length=length)

    stepper = _upstream_recurrent.RecurrentStepper(num_layers=4, device=torch.device("cpu"))
    stepper.plan_step([row(rid, 5, 5) for rid in "abc"])  # three prefills: slots 0, 1, 2
    assert [stepper.slots.slot(rid) for rid in "abc"] == [0, 1, 2]
    stepper.plan_step([row("a", 6, 1), row("b", 6, 1), row("c", 6, 1)])
    assert stepper._plan.decode_span == (0, 3) and stepper._plan.decode_tokens is None
    stepper.plan_step([row("a", 7, 1), row("c", 7, 1), row("d", 4, 4)])  # b left, d joins behind them
    assert stepper._plan.decode_span is None and stepper._plan.decode_slots.tolist() == [0, 2]
    plan = stepper._plan  # its indices: views of one tensor, copied to the device once for the step
    assert [r.slots.tolist() for r in plan.runs] == [[3]] and plan.decode_tokens is None
    assert plan.runs[0].slots.untyped_storage().data_ptr() == plan.decode_slots.untyped_storage().data_ptr()
    with pytest.raises(RuntimeError, match="holds no recurrent state"):
        stepper.plan_step([row("a", 8, 1), row("lost", 9, 1)])


def test_each_step_copies_its_slot_indices_to_the_device_once(tokenizer, special_ids, text_ids, monkeypatch):
    """The step plan's slot and token indices are one tensor on the model's device, built once per step: every
    recurrent layer's `read` / `write` (each decode batch and prefill run, every layer) gets views of it, never a
    tensor of its own (on CUDA each host-to-device copy would stall the host, several times per layer). Control: the
    steps seen include decode rows beside prefill chunks and decode rows gathered out of packed order."""
    from trl_cb.engine.recurrent_state import RecurrentStateSlots

    model = hybrid_model(BY_TYPE["qwen3_5_text"], tokenizer, special_ids, dtype=torch.float32)
    plans, indices = [], []  # the plan of each step; (step, slot indices) of each read / write
    plan_step = _upstream_recurrent.RecurrentStepper.plan_step
    read, write = RecurrentStateSlots.read, RecurrentStateSlots.write

    def spy_plan_step(stepper, requests):
        plan_step(stepper, requests)
        plans.append(stepper._plan)

    def spy_read(slots, layer, index):
        indices.append((len(plans) - 1, index))  # kept alive: a per-layer tensor cannot reuse a freed one's memory
        return read(slots, layer, index)

    def spy_write(slots, layer, index, states):
        indices.append((len(plans) - 1, index))
        return write(slots, layer, index, states)

    monkeypatch.setattr(_upstream_recurrent.RecurrentStepper, "plan_step", spy_plan_step)
    monkeypatch.setattr(RecurrentStateSlots, "read", spy_read)
    monkeypatch.setattr(RecurrentStateSlots, "write", spy_write)
    cb = {"max_requests_per_batch": 3, "max_batch_tokens": 64}
    with ContinuousBatchingGenerator(model, sampling_config(tokenizer, max_new_tokens=10), cb) as gen:
        gen.generate(prompts_of(text_ids, [30, 150, 70, 110]), num_generations=G)
    assert any(p.runs and p.decode_slots is not None for p in plans), "no step had decode rows beside a prefill"
    assert any(p.decode_tokens is not None for p in plans), "no step gathered decode rows out of packed order"
    by_step: dict[int, set[int]] = {}
    for step, index in indices:
        assert index.device == model.device and index.dtype == torch.int64
        by_step.setdefault(step, set()).add(index.untyped_storage().data_ptr())
    assert by_step and all(len(storages) == 1 for storages in by_step.values()), "indices built per layer or run"
    for step, storages in by_step.items():
        plan = plans[step]
        planned = (plan.decode_slots, plan.decode_tokens, *(run.slots for run in plan.runs))
        assert {t.untyped_storage().data_ptr() for t in planned if t is not None} == storages, f"step {step}"


def test_the_training_forward_is_untouched(tokenizer, special_ids):
    """A mixer class wrapped for the engine runs its original forward outside engine forwards: same logits, same
    gradients, cache or no cache."""
    arch = BY_TYPE["qwen3_5_text"]
    model = hybrid_model(arch, tokenizer, special_ids, dtype=torch.float32)
    reference = copy.deepcopy(model)
    with ContinuousBatchingGenerator(model, sampling_config(tokenizer, max_new_tokens=4)) as gen:
        gen.generate([[5, 6, 7, 8]], num_generations=2)  # the engine is built: the mixer class is wrapped
    mixer = type(model.model.layers[0].linear_attn)
    assert hasattr(mixer, "_trl_cb_original_forward")
    ids = torch.tensor([[5, 9, 11, 30, 2, 7]])
    model.train(), reference.train()
    loss = model(ids, labels=ids).loss
    loss_ref = reference(ids, labels=ids).loss
    loss.backward(), loss_ref.backward()
    assert torch.equal(loss, loss_ref)
    grads = [(p.grad, q.grad) for p, q in zip(model.parameters(), reference.parameters()) if p.grad is not None]
    assert grads and all(torch.equal(a, b) for a, b in grads)


def test_prefix_matching_is_off_for_hybrids(tokenizer, special_ids, text_ids, monkeypatch):
    """Two prompts sharing a 96-token prefix (three 32-token pages), scheduled one after the other: with block sharing
    allowed the second would match the first's pages, which hold keys but no recurrent state at their end. The engine
    keeps matching off and both are exact; control: with matching forced on, the second request fails loudly (its
    plan finds no state), never runs from a zero state."""
    model = hybrid_model(BY_TYPE["qwen3_5_text"], tokenizer, special_ids)
    shared = text_ids[:96]
    prompts = [shared + text_ids[200:210], shared + text_ids[300:310]]
    cb = {"max_requests_per_batch": 1, "allow_block_sharing": True}
    trace = StepTrace().install(monkeypatch)
    with ContinuousBatchingGenerator(model, sampling_config(tokenizer, max_new_tokens=4), cb) as gen:
        result = gen.generate(prompts, num_generations=G)
        cache = gen._pool.engine.manager.batch_processor.cache  # noqa: SLF001
        assert cache.allow_block_sharing and not cache.use_prefix_sharing
        assert max(round_gaps(model, trace, prompts, result, 1, 1.0)) <= TOLERANCE
        cache.use_prefix_sharing = True  # the control: what upstream would do
        with pytest.raises(GenerationError, match="holds no recurrent state"):
            gen.generate(prompts, num_generations=G)
