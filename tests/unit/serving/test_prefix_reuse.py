"""Prefix reuse on the rollout server: each later turn of a 4-turn conversation prefills only what it adds (whole pages
of the earlier turns reused), with exact logprobs;
after a weight update nothing cached before it is reused (the next turn is prefilled whole, exact under the new
weights). Prefill is counted as the tokens the model's forwards take, decode steps subtracted."""

from __future__ import annotations

import copy

import requests
import torch

from tests.unit.rollouts.test_generator import teacher_forced_logprobs
from tests.unit.serving.conftest import AUTH, FP32_LOGPROB_TOL, KEY, in_process_server
from trl_cb.engine.sizing import CPU_PAGE_SIZE
from trl_cb.offline.tiny import tiny_model
from trl_cb.serving.server import create_app


def _turn(url: str, prompt: list[int], fed: list[int]) -> tuple[list[int], torch.Tensor, int]:
    """One 8-token request on the server: (ids, logprobs, prompt tokens the model computed for it)."""
    fed.clear()
    body = {"prompt": [prompt], "max_tokens": 8, "logprobs": 0, "return_token_ids": True}
    answer = requests.post(url + "/v1/completions", json=body, headers=AUTH, timeout=120)
    assert answer.status_code == 200, answer.text
    choice = answer.json()["choices"][0]
    ids = choice["token_ids"]
    return ids, torch.tensor(choice["logprobs"]["token_logprobs"]), sum(fed) - (len(ids) - 1)  # 1 token per step


def _counter(fed: list[int]):
    """A forward pre-hook adding each engine forward's token count to `fed` (the engine passes `input_ids` by
    keyword; the test's teacher forcing passes it positionally and is not counted)."""

    def count(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        if "input_ids" in kwargs:
            fed.append(kwargs["input_ids"].numel())

    return count


def _gap(model: torch.nn.Module, prompt: list[int], ids: list[int], logprobs: torch.Tensor) -> float:
    return (teacher_forced_logprobs(model, prompt, ids, 1.0, 0, 1.0) - logprobs).abs().max().item()


def test_a_next_turn_prefills_only_what_is_new_and_nothing_across_an_update(tokenizer, prompts):
    model = tiny_model(tokenizer, init_std=0.2)
    fed: list[int] = []
    model.register_forward_pre_hook(_counter(fed), with_kwargs=True)
    suffix = tokenizer.encode(" The calculator says 24.")
    conversation = (prompts[0] * 16)[:300]
    app = create_app(model, model_name="m", tokenizer=tokenizer, api_key=KEY)
    with in_process_server(app) as url:
        for turn in range(4):  # each turn: the conversation so far, then the tool's answer
            ids, logprobs, computed = _turn(url, conversation, fed)
            print(f"\nturn {turn + 1}: {computed} of {len(conversation)} prompt tokens computed")
            if turn == 0:
                assert computed == len(conversation), "the first turn is prefilled whole"
            else:
                assert computed <= 0.2 * len(conversation), (turn, computed, len(conversation))
            assert _gap(model, conversation, ids, logprobs) <= FP32_LOGPROB_TOL
            second, conversation = conversation, conversation + ids + suffix

        before = copy.deepcopy(model)
        noise = torch.Generator().manual_seed(1)

        def update() -> None:  # run by the engine loop between two steps, as a weight push's copy is
            with torch.no_grad():
                for param in model.parameters():
                    param.add_(0.05 * param.abs().mean() * torch.randn(param.shape, generator=noise))

        app.state.engine_loop.apply_weights(update, version=1)
        ids, logprobs, computed = _turn(url, second, fed)
        assert computed == len(second), "a prefix cached under the old weights was reused after the update"
        assert _gap(model, second, ids, logprobs) <= FP32_LOGPROB_TOL
        assert _gap(before, second, ids, logprobs) > 1e-3, "control: the update moved the logprobs"


def test_without_prefix_caching_every_turn_is_prefilled_whole(tokenizer, prompts):
    """Control: the same conversation with `prefix_caching=False` computes the whole second prompt."""
    model = tiny_model(tokenizer, init_std=0.2)
    fed: list[int] = []
    model.register_forward_pre_hook(_counter(fed), with_kwargs=True)
    first = (prompts[0] * 16)[:300]
    app = create_app(model, model_name="m", tokenizer=tokenizer, api_key=KEY, prefix_caching=False)
    with in_process_server(app) as url:
        completion, _, _ = _turn(url, first, fed)
        second = first + completion + tokenizer.encode(" The calculator says 24.")
        _, _, computed = _turn(url, second, fed)
    assert computed == len(second)


def test_a_prompt_one_token_past_a_cached_page_forks_its_samples(tokenizer, prompts):
    """A prompt whose every page but its last token is cached, asked again with n > 1: transformers' match would leave
    the forked prefill one token, which a fork turns into an empty forward ("cannot reshape tensor of 0 elements");
    the match leaves two (`_upstream_prefix.with_two_tokens_left`), and the samples are exact."""
    model = tiny_model(tokenizer, init_std=0.2)
    prompt = (prompts[0] * 16)[: 2 * CPU_PAGE_SIZE + 1]
    app = create_app(model, model_name="m", tokenizer=tokenizer, api_key=KEY)
    with in_process_server(app) as url:
        for _ in range(2):  # the second time, the prompt's whole pages are cached
            body = {"prompt": [prompt], "n": 2, "max_tokens": 8, "logprobs": 0, "return_token_ids": True}
            answer = requests.post(url + "/v1/completions", json=body, headers=AUTH, timeout=120)
            assert answer.status_code == 200, answer.text
            for choice in answer.json()["choices"]:
                logprobs = torch.tensor(choice["logprobs"]["token_logprobs"])
                assert _gap(model, prompt, choice["token_ids"], logprobs) <= FP32_LOGPROB_TOL
