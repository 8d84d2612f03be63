"""Forked request states copied field by field (`engine/_upstream_fork.py`) against transformers' `deepcopy`.

`copy_state` must return what `copy.deepcopy` returns for a request state with every kind of field set (token and
logprob lists, a nested processor-kwargs dict, an alias between two fields, enums, tuples): equal fields, no mutable
object shared with the original, the same aliases; a shallow copy fails the same check (control). In an engine, every
fork goes through it (counted), with the same tokens and logprobs as transformers' own `deepcopy` fork (the fast
fork patched out), which never calls it.
"""

from __future__ import annotations

import copy

import torch
from transformers.generation.continuous_batching.requests import RequestState, RequestStatus

from tests.conftest import sampling_config
from trl_cb import ContinuousBatchingGenerator
from trl_cb.engine import _upstream_fork


def _state() -> RequestState:
    state = RequestState(request_id="r", initial_tokens=list(range(3, 40)), max_new_tokens=32, eos_token_id=[2, 7])
    state.generated_tokens, state.logprobs, state.tokens_to_process = [5, 9], [-0.5, -1.25], [9]
    state.logit_processor_kwargs = {"temperature": 0.7, "nested": {"ids": [1, 2]}}
    state.status, state.record_timestamps, state._timestamps = RequestStatus.DECODING, True, [0.5, 1.5]
    state.remaining_prefill_tokens = state.tokens_to_process  # an alias: the copy must keep it
    return state


def _mutables(obj: object) -> list[object]:
    out = []
    for value in vars(obj).values():
        if isinstance(value, (list, dict, set)):
            out.append(value)
            if isinstance(value, dict):
                out += [v for v in value.values() if isinstance(v, (list, dict, set))]
    return out


def _assert_like_deepcopy(copied: RequestState, original: RequestState) -> None:
    expected = copy.deepcopy(original)
    assert vars(copied) == vars(expected) and type(copied) is RequestState
    for name, value in vars(expected).items():
        assert type(vars(copied)[name]) is type(value), name
    shared = {id(v) for v in _mutables(original)} & {id(v) for v in _mutables(copied)}
    assert not shared, "the copy shares a mutable field with the original"
    assert copied.remaining_prefill_tokens is copied.tokens_to_process, "the alias between two fields was lost"


def test_copy_state_returns_what_deepcopy_returns():
    state = _state()
    _assert_like_deepcopy(_upstream_fork.copy_state(state), state)
    forked = _upstream_fork.copy_state(state)
    forked.generated_tokens.append(11)
    forked.logit_processor_kwargs["nested"]["ids"].append(3)
    assert state.generated_tokens == [5, 9] and state.logit_processor_kwargs["nested"]["ids"] == [1, 2]


def test_control_a_shallow_copy_fails_the_check():
    state = _state()
    try:
        _assert_like_deepcopy(copy.copy(state), state)
    except AssertionError:
        return
    raise AssertionError("the check passes a shallow copy: it proves nothing")


def _round(model, tokenizer, prompts, monkeypatch, fast: bool) -> tuple[list, list, int]:
    if not fast:  # the reference: transformers' own `deepcopy` of each forked state
        monkeypatch.setattr(_upstream_fork, "with_fast_fork", lambda scheduler, update: update)
    calls = []
    copy_state = _upstream_fork.copy_state

    def counted(state, memo=None):
        calls.append(state.request_id)
        return copy_state(state, memo)

    monkeypatch.setattr(_upstream_fork, "copy_state", counted)
    with ContinuousBatchingGenerator(model, sampling_config(tokenizer, max_new_tokens=12)) as gen:
        torch.manual_seed(0)
        out = gen.generate([p[:24] for p in prompts[:3]], num_generations=4)
    return out.completion_ids, out.logprobs, len(calls)


def test_engine_forks_through_copy_state_with_the_same_samples(model, tokenizer, prompts, monkeypatch):
    ids, logprobs, copies = _round(model, tokenizer, prompts, monkeypatch, fast=True)
    slow_ids, slow_logprobs, slow_copies = _round(model, tokenizer, prompts, monkeypatch, fast=False)
    assert copies == 3 * 3, f"every fork (3 prompts x 3 extra samples) must use copy_state: {copies}"
    assert slow_copies == 0
    assert ids == slow_ids and logprobs == slow_logprobs
