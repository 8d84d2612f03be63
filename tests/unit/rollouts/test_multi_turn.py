"""Multi-turn async rollouts (`rollouts/multi_turn.py`) on the in-process engine, with a scripted conversation that
answers each turn with fixed "tool" ids: every model token's recorded logprob equals teacher forcing over the full
trajectory (the tool ids in context) under its recorded version (a turn in flight at an update: the new weights over
the KV prefix the old ones wrote), std-0.2 weights, with later turns reusing their earlier turns' KV blocks under the
same weights (`engine/_upstream_prefix.py`). Controls: the same tokens without the tool ids in context, and under the
other version's weights, miss by far; blocks kept across updates (no epoch) are caught. Tool tokens: mask 0, logprob
0, their neighbour's version.

Precision (the 1e-5 target, in the form that can be asserted honestly): with float64 weights the engine's forward is
exact and only its logprob is fp32 (the engine samples and records in fp32), so the gap is a few fp32 ulps of the
logprob; in fp32, the model's own fp32 forward is already ~1e-5 from the float64 logprobs on these tokens, so the
engine is held to that noise floor (as `trl-cb check-model --noise-floor` does), not to a fixed 1e-5 it cannot beat."""

from __future__ import annotations

import copy
import itertools
from dataclasses import dataclass

import pytest
import torch
from transformers.generation.continuous_batching.cache import PagedAttentionCache

from tests.conftest import sampling_config
from tests.unit.rollouts.test_async import logprobs_of, perturb
from tests.unit.serving.conftest import FP32_LOGPROB_TOL
from trl_cb import ContinuousBatchingGenerator
from trl_cb.offline.data import synthetic_gsm8k
from trl_cb.offline.tiny import tiny_model
from trl_cb.rollouts.async_controller import AsyncRolloutController
from trl_cb.rollouts.multi_turn import Conversation, with_turns

TURN_TOKENS, COMPLETION_TOKENS, ROUNDS = 8, 40, 2
#: float64 weights: the engine against float64 teacher forcing, max over ~360 tokens, measured 4.8e-7 to 9.5e-7 (1-2
#: ulps of the fp32 logprob the engine records); the issue's 1e-5 target with room for one more binade of logprob.
FP64_TOL = 5e-6
#: float32 weights: measured 4.6e-6 to 1.7e-5 (~35 runs), while the fp32 teacher-forced forward itself is 4.9e-6 to
#: 1.3e-5 from the float64 logprobs on the same tokens (engine / forward up to 1.8x). Bound: the suite's fp32 bound or
#: twice that floor, whichever is larger (`trl-cb check-model --noise-floor`'s rule).
FLOOR_FACTOR = 2.0


class ScriptedTools(Conversation):
    """Answers every turn with the same tool ids, `ROUNDS` times."""

    def __init__(self, prompt_ids: list[int], suffix: list[int]) -> None:
        self.prompt_ids, self.suffix, self.rounds = prompt_ids, suffix, 0

    def after_turn(self, context: list[int], turn_ids: list[int]) -> list[int] | None:
        assert context[: len(self.prompt_ids)] == self.prompt_ids
        if self.rounds == ROUNDS:
            return None
        self.rounds += 1
        return self.suffix


def turns_of(mask: list[int]) -> list[tuple[int, int]]:
    """(start, end) of each run of model tokens (mask 1)."""
    runs, start = [], None
    for i, m in enumerate([*mask, 0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            runs.append((start, i))
            start = None
    return runs


def engine_logprobs(weights, context: list[int], tokens: list[int], versions: list[int], prefill: int) -> torch.Tensor:
    """Teacher forcing as the engine computed a turn: the context's KV but its last position by version `prefill`,
    then each position fed by the version that sampled the token after it (over the KV before it)."""
    feeds = [context[-1], *tokens[:-1]]
    with torch.no_grad():
        cache = weights[prefill](torch.tensor([context[:-1]]), use_cache=True).past_key_values
        logits, a = [], 0
        while a < len(feeds):
            b = a + 1
            while b < len(feeds) and versions[b] == versions[a]:
                b += 1
            out = weights[versions[a]](torch.tensor([feeds[a:b]]), past_key_values=cache, use_cache=True)
            cache, a = out.past_key_values, b
            logits.append(out.logits[0].double())
    return torch.log_softmax(torch.cat(logits), -1).gather(-1, torch.tensor(tokens)[:, None])[:, 0]


@dataclass
class TurnGaps:
    """One turn of a multi-turn sample against float64 teacher forcing (`turn_gaps`)."""

    #: The versions that may have prefilled the turn's context, and the engine-path recomputation under each.
    prefills: list[int]
    candidates: list[torch.Tensor]
    #: The closest candidate's max |logprob - served|.
    gap: float
    #: Controls: the next version's weights (None when there is none), and, after a tool, the context without the
    #: tool's ids (None for a first turn): each must miss by far more than `gap`.
    other_version: float | None
    no_tools: float | None


def turn_gaps(weights, prompt: list[int], ids: list[int], mask: list[int], versions: list[int], served: torch.Tensor,
              turn: int, start: int, end: int) -> TurnGaps:  # fmt: skip
    """Turn `turn` (`ids[start:end]`, logprobs `served`) of a sample: a forked first turn may be prefilled (all but its
    last prompt token) before an update; later turns (one sample each) prefill and sample in one step."""
    context, tokens, sampled_by = prompt + ids[:start], ids[start:end], versions[start:end]
    first = sampled_by[0]
    prefills = sorted({first, max(first - 1, 0)}) if turn == 0 else [first]
    candidates = [engine_logprobs(weights, context, tokens, sampled_by, v) for v in prefills]
    gap = min((c - served).abs().max().item() for c in candidates)
    other = None
    if first + 1 in weights:
        other = (logprobs_of(weights[first + 1], context, tokens) - served).abs().max().item()
    no_tools = None
    if turn > 0:  # the tool ids were in context: without them the same tokens are far off
        kept = [t for t, m in zip(ids[:start], mask[:start], strict=True) if m]
        no_tools = (logprobs_of(weights[first], prompt + kept, tokens) - served).abs().max().item()
    return TurnGaps(prefills, candidates, gap, other, no_tools)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
def test_every_model_token_matches_teacher_forcing_under_its_version(tokenizer, monkeypatch, dtype):
    """A turn's context is prefilled, then its tokens sampled; an update between two engine steps lands anywhere:
    inside the turn (later tokens: new weights over the KV the old ones wrote), or between the prefill of the
    context and its last position (forked samples: the engine prefills all but the prompt's last token before
    forking), so for first turns the reference tries the context's KV from the first token's version and from the one
    before. Later turns reuse their earlier turns' KV blocks (block sharing) under the same weights (counted); that
    they never reuse blocks across an update is tests/unit/engine/test_prefix_epochs.py's (with its control)."""
    matched = []
    search = PagedAttentionCache.search_prefix_match
    monkeypatch.setattr(
        PagedAttentionCache, "search_prefix_match", lambda *a: matched.append(search(*a)) or matched[-1]
    )
    model = tiny_model(tokenizer, init_std=0.2).to(dtype)  # no EOS bias: turns run to their limit, updates mid-turn
    suffix = tokenizer.encode(" tool says 42.")
    rows = synthetic_gsm8k(20, seed=5)
    stream = ((r, tokenizer(r["prompt"])["input_ids"]) for r in itertools.cycle(rows))
    generator = ContinuousBatchingGenerator(
        model, sampling_config(tokenizer, max_new_tokens=TURN_TOKENS), {"max_requests_per_batch": 3}
    )
    ctl = AsyncRolloutController(
        generator, model, stream, max_prompt_len=96 + COMPLETION_TOKENS, num_generations=2, groups_per_step=2,
        prefetch_depth=1, max_staleness=4,
    )  # fmt: skip
    with_turns(ctl, lambda row, k, ids: ScriptedTools(ids, suffix), COMPLETION_TOKENS, 2, max_turn_tokens=TURN_TOKENS)
    weights = {0: copy.deepcopy(model).double()}  # the references in fp64
    forward = {0: copy.deepcopy(model)}  # fp32: the model's own forward, for the noise floor
    ctl.start()
    groups = []
    try:
        for step in range(3):
            groups += ctl.take(2)[0]
            with ctl.weight_update():
                perturb(model)
            weights[step + 1], forward[step + 1] = copy.deepcopy(model).double(), copy.deepcopy(model)
    finally:
        ctl.stop()

    gaps, floor, no_tools, other_version, updated, later_turns = [], [], [], [], 0, 0
    for group in groups:
        for k, ids in enumerate(group.completion_ids):
            mask, versions, logprobs = group.tool_masks[k], group.versions[k], torch.tensor(group.logprobs[k])
            assert len(ids) == len(mask) == len(versions) == len(logprobs) <= COMPLETION_TOKENS
            tool = [i for i, m in enumerate(mask) if not m]
            assert tool and all(logprobs[i] == 0 and versions[i] == versions[i - 1] for i in tool)
            for n, (start, end) in enumerate(turns_of(mask)):
                served = logprobs[start:end]
                turn = turn_gaps(weights, group.prompt_ids, ids, mask, versions, served, n, start, end)
                gaps.append(turn.gap)
                if dtype == torch.float32:  # the same computation by the fp32 model's own forward
                    context, tokens, sampled_by = group.prompt_ids + ids[:start], ids[start:end], versions[start:end]
                    own = [engine_logprobs(forward, context, tokens, sampled_by, v) for v in turn.prefills]
                    floor.append(min((o - c).abs().max().item() for o, c in zip(own, turn.candidates, strict=True)))
                updated += len(set(versions[start:end])) > 1 or (turn.candidates[0] - served).abs().max().item() > 1e-3
                assert turn.other_version is not None, "every take is followed by an update"
                other_version.append(turn.other_version)
                if n > 0:
                    later_turns += 1
                    no_tools.append(turn.no_tools)
    bound = FP64_TOL if dtype == torch.float64 else max(FP32_LOGPROB_TOL, FLOOR_FACTOR * max(floor))
    print(f"\n{dtype}: multi-turn vs float64 teacher forcing max|d| = {max(gaps):.2e} over {len(gaps)} turns "
          f"({updated} with an update inside, {later_turns} after a tool), bound {bound:.1e}"
          + (f" (fp32 forward's own gap {max(floor):.2e})" if floor else "")
          + f"; controls: no tool ids {min(no_tools):.3f}, other version {min(other_version):.3f}")  # fmt: skip
    assert sum(1 for m in matched if m) >= len(groups), "later turns reused their earlier turns' blocks"
    assert later_turns >= len(groups) * 2 and max(gaps) <= bound
    assert min(no_tools) > 1e-2 and min(other_version) > 1e-2
