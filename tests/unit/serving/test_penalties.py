"""vLLM's and OpenAI's penalty fields on the server, per request: `repetition_penalty`, `presence_penalty`,
`frequency_penalty`, `logit_bias`, `min_p`, `min_tokens` and `ignore_eos`, sharing one running engine with requests
that set none of them. Exactness: each request's `logprobs` against a teacher-forced pass with that request's own
processing (below, written out from the definitions: the bias and penalties on the raw logits, EOS held back for
`min_tokens`, then transformers' temperature, top-k, top-p and min-p warpers), its `policy_logprobs` against
`log_softmax(logits / T)`; control: the same tokens without the request's penalties miss by far. Behaviour: a bias of
+100 samples only its token, `min_tokens` holds back EOS on a model that wants to stop, `ignore_eos` runs past it,
greedy takes the penalised argmax, a `seed` replays beside other traffic; the official `openai` client sends them all.
The server runs in this process (uvicorn in a thread), fp32 std-0.2 weights (far from uniform).
"""

from __future__ import annotations

import copy
import threading
import time
from collections import Counter

import pytest
import requests
import torch
from transformers import LogitsProcessorList
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from tests.unit.serving.conftest import AUTH, FP32_LOGPROB_TOL, KEY, cut_gaps, in_process_server
from trl_cb.offline.tiny import tiny_model
from trl_cb.serving.server import create_app

MODEL = "tiny-penalties"
#: The tiny model's EOS logit bias: most samples would end within a few tokens, so `min_tokens` has work to do.
EOS_BIAS = 4.0
#: One request per row: the fields it sets (none for the first: it shares the batch with the others).
REQUESTS = [
    {},
    {"temperature": 0.8, "repetition_penalty": 1.8},
    {"temperature": 0.9, "presence_penalty": 1.5, "frequency_penalty": 1.0, "top_k": 40},
    {"logit_bias": {"7": 5.0, "11": -3.0, "12": 2.5}, "top_p": 0.9},
    {"temperature": 0.7, "min_p": 0.05, "repetition_penalty": 0.7},
    {"min_tokens": 6, "frequency_penalty": -0.5},
]
MAX_TOKENS = 12
#: A request that needs every per-request processor: the engine adds each the first time one is needed (grow-only).
WARM = {"temperature": 0.9, "top_k": 30, "top_p": 0.95, "min_p": 0.01, "repetition_penalty": 1.1, "seed": 1,
        "presence_penalty": 0.1, "frequency_penalty": 0.1, "logit_bias": {"3": 0.5}, "min_tokens": 1,
        "logprobs": 2}  # fmt: skip


@pytest.fixture(scope="module")
def served(tokenizer):
    model = tiny_model(tokenizer, eos_logit_bias=EOS_BIAS, init_std=0.2)
    reference = copy.deepcopy(model)
    with in_process_server(create_app(model, model_name=MODEL, tokenizer=tokenizer, api_key=KEY)) as url:
        complete(url, [[5, 6]], WARM, max_tokens=16)  # the engine with every processor, built by the fixture
        yield url, reference, tokenizer.eos_token_id


def complete(url: str, prompts: list[list[int]], fields: dict, n: int = 2, max_tokens: int = MAX_TOKENS) -> dict:
    body = {"model": MODEL, "prompt": prompts, "n": n, "max_tokens": max_tokens, "logprobs": 0,
            "return_token_ids": True, **fields}  # fmt: skip
    answer = requests.post(url + "/v1/completions", json=body, headers=AUTH, timeout=300)
    assert answer.status_code == 200, answer.text
    return answer.json()


def metrics(url: str) -> dict:
    return requests.get(url + "/metrics", headers={**AUTH, "Accept": "application/json"}, timeout=10).json()


def run_together(url: str, jobs: dict, n: int = 2, max_tokens: int = MAX_TOKENS) -> dict:
    """`jobs` (name: (prompts, fields)) in one engine batch without racing the machine: the server is paused, every
    request queued (polled on `/metrics` while the senders live), then resumed, so one scheduling pass admits them."""
    assert requests.post(url + "/pause", headers=AUTH, timeout=30).status_code == 200
    answers: dict = {}
    threads = [
        threading.Thread(target=lambda k=k, p=p, f=f: answers.__setitem__(k, complete(url, p, f, n, max_tokens)))
        for k, (p, f) in jobs.items()
    ]
    for thread in threads:
        thread.start()
    while metrics(url)["queue_groups"] < sum(len(p) for p, _ in jobs.values()):
        assert all(t.is_alive() for t in threads), "a request was refused"
        time.sleep(0.02)
    assert requests.post(url + "/resume", headers=AUTH, timeout=30).status_code == 200
    for thread in threads:
        thread.join()
    assert answers.keys() == jobs.keys()
    return answers


def processed_logprobs(model, prompt: list[int], ids: list[int], fields: dict, eos: int) -> tuple[torch.Tensor, ...]:
    """(the request's processed logprob of each token, `log_softmax(logits / T)`'s), by teacher forcing: position j
    sees the prompt and `ids[:j]`, processed as the fields say."""
    rows, policy = processed_rows(model, prompt, ids, fields, eos)
    target = torch.tensor(ids)[:, None]
    return rows.gather(1, target)[:, 0], policy.gather(1, target)[:, 0]


def cut_reference(model, prompt: list[int], ids: list[int], fields: dict, eos: int):
    """`processed_logprobs` as a function of the request's top-p and min-p: what `cut_gaps` nudges."""
    return lambda top_p, min_p: processed_logprobs(
        model, prompt, ids, {**fields, "top_p": top_p, "min_p": min_p}, eos
    )[0]


def processed_rows(model, prompt: list[int], ids: list[int], fields: dict, eos: int) -> tuple[torch.Tensor, ...]:
    """`processed_logprobs`' whole distributions: (processed, policy) log-probabilities, (len(ids), vocab) each."""
    with torch.no_grad():
        raw = model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1 : -1].float()  # (len(ids), V)
    temperature = fields.get("temperature", 1.0)
    warpers = LogitsProcessorList([TemperatureLogitsWarper(temperature)] if temperature != 1.0 else [])
    if fields.get("top_k"):
        warpers.append(TopKLogitsWarper(fields["top_k"]))
    if fields.get("top_p", 1.0) < 1.0:
        warpers.append(TopPLogitsWarper(fields["top_p"]))
    if fields.get("min_p"):
        warpers.append(MinPLogitsWarper(fields["min_p"]))
    rows = []
    for j, logits in enumerate(raw):
        scores = logits.clone()
        for token, bias in fields.get("logit_bias", {}).items():
            scores[int(token)] += bias
        penalty = fields.get("repetition_penalty", 1.0)
        for token in set(prompt + ids[:j]):
            scores[token] = scores[token] * penalty if scores[token] < 0 else scores[token] / penalty
        for token, count in Counter(ids[:j]).items():
            scores[token] -= fields.get("presence_penalty", 0.0) + fields.get("frequency_penalty", 0.0) * count
        if j < fields.get("min_tokens", 0):
            scores[eos] = -torch.inf
        rows.append(warpers(None, scores[None])[0])
    return torch.log_softmax(torch.stack(rows), dim=-1), torch.log_softmax(raw / temperature, dim=-1)


def test_each_requests_penalties_are_exact_in_one_shared_engine(served, prompts):
    url, reference, eos = served
    builds = metrics(url)["engine_builds"]
    sent = [[prompts[i % len(prompts)], prompts[(i + 1) % len(prompts)]] for i in range(len(REQUESTS))]
    answers = run_together(url, {i: (sent[i], fields) for i, fields in enumerate(REQUESTS)})
    assert metrics(url)["engine_builds"] == builds, "a request's penalties rebuilt the engine"

    gaps, policy_gaps, controls, flips = [], [], [], 0
    for i, fields in enumerate(REQUESTS):
        plain = {k: v for k, v in fields.items() if k in ("temperature", "top_k", "top_p")}
        request_controls = []
        for choice in answers[i]["choices"]:
            prompt, ids = sent[i][choice["index"] // 2], choice["token_ids"]
            _, policy = processed_logprobs(reference, prompt, ids, fields, eos)
            served_values = torch.tensor(choice["logprobs"]["token_logprobs"])
            at_cut = cut_reference(reference, prompt, ids, fields, eos)
            gap, flipped = cut_gaps(served_values, at_cut, fields.get("top_p", 1.0), fields.get("min_p", 0.0))
            gaps.append(gap.max().item())
            flips += flipped
            policy_gaps.append((policy - torch.tensor(choice["policy_logprobs"])).abs().max().item())
            if fields.keys() - plain.keys():
                unpenalised, _ = processed_logprobs(reference, prompt, ids, plain, eos)
                request_controls.append((unpenalised - served_values).abs().max().item())
            if "min_tokens" in fields:
                assert eos not in ids[: fields["min_tokens"]]
        if request_controls:
            controls.append(max(request_controls))
    print(
        f"\nprocessed max|d|={max(gaps):.2e} ({flips} cut flips), policy max|d|={max(policy_gaps):.2e}; "
        f"controls min {min(controls):.3f}"
    )
    assert max(gaps) <= FP32_LOGPROB_TOL and max(policy_gaps) <= FP32_LOGPROB_TOL and flips <= 1
    # The control needs only to stand far above the tolerance: how far depends on the sampled tokens (a request whose
    # samples end at EOS after two tokens moves little under a repetition penalty: 0.03 nats seen), not on the engine.
    assert min(controls) > 100 * FP32_LOGPROB_TOL


def test_a_bias_of_100_samples_only_its_token(served, prompts):
    url, _, _ = served
    answer = complete(url, [prompts[0]], {"logit_bias": {"9": 100}}, n=3, max_tokens=6)
    for choice in answer["choices"]:
        assert choice["token_ids"] == [9] * 6
        assert max(abs(v) for v in choice["logprobs"]["token_logprobs"]) < 1e-4  # the biased distribution's


def test_min_tokens_holds_back_eos_and_ignore_eos_runs_past_it(served, prompts):
    """On a model that wants to stop (EOS logit +4), unset: samples end early; `min_tokens=8`: none ends before 8
    tokens; `ignore_eos`: every sample runs to `max_tokens`, EOS sampled inside (it no longer ends the sample)."""
    url, _, eos = served
    free = complete(url, prompts[:3], {}, n=4, max_tokens=16)["choices"]
    held = complete(url, prompts[:3], {"min_tokens": 8}, n=4, max_tokens=16)["choices"]
    ignored = complete(url, prompts[:3], {"ignore_eos": True}, n=4, max_tokens=16)["choices"]
    assert min(len(c["token_ids"]) for c in free) < 8  # control: without it, some sample ends early
    assert all(len(c["token_ids"]) >= 8 for c in held)
    assert all(len(c["token_ids"]) == 16 and c["finish_reason"] == "length" for c in ignored)
    assert any(eos in c["token_ids"] for c in ignored)


def greedy_under_penalty(model, prompt: list[int], ids: list[int], penalty: float) -> tuple[list[int], list[int]]:
    """(the argmax of the repetition-penalised logits at each step of `ids`, the plain argmax there)."""
    with torch.no_grad():
        plain = model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1 : -1]
    expected = []
    for j in range(len(ids)):
        scores = plain[j].clone()
        for token in set(prompt + ids[:j]):
            scores[token] = scores[token] * penalty if scores[token] < 0 else scores[token] / penalty
        expected.append(int(scores.argmax()))
    return expected, plain.argmax(-1).tolist()


def test_greedy_applies_the_penalty_first(served, prompts):
    url, _, _ = served
    fields = {"temperature": 0, "repetition_penalty": 3.0, "ignore_eos": True}  # EOS would end it at once
    ids = complete(url, [prompts[1]], fields, n=1)["choices"][0]["token_ids"]
    expected, unpenalised = greedy_under_penalty(served[1], prompts[1], ids, 3.0)
    assert ids == expected and ids != unpenalised  # control: the penalty changed the greedy path


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"logit_bias": {"999999": 1.0}}, "outside the model's vocabulary"),
        ({"min_tokens": 2, "stop_token_ids": [5]}, "min_tokens with stop_token_ids"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
    ],
)
def test_out_of_range_penalties_are_refused_naming_them(served, prompts, fields, words):
    url, _, _ = served
    body = {"model": MODEL, "prompt": [prompts[0]], "max_tokens": 2, **fields}
    answer = requests.post(url + "/v1/completions", json=body, headers=AUTH, timeout=60)
    assert answer.status_code in (400, 422) and words in answer.text


def test_the_same_fields_in_process_from_the_generation_config(sharp_model, tokenizer, prompts):
    """In process (TRL's `generation_kwargs` land in the generation config): OpenAI's presence / frequency penalties
    and logit bias, engine-wide, exact against the same reference; control: without them the logprobs move."""
    from tests.conftest import sampling_config
    from trl_cb.rollouts.generator import ContinuousBatchingGenerator

    fields = {"temperature": 0.8, "presence_penalty": 1.2, "frequency_penalty": 0.6, "logit_bias": {5: 3.0, 9: -2.0}}
    cfg = sampling_config(tokenizer, max_new_tokens=10, **fields)
    with ContinuousBatchingGenerator(sharp_model, cfg) as generator:
        result = generator.generate(prompts[:3], num_generations=2)
    eos = tokenizer.eos_token_id
    gaps, controls = [], []
    for i, (ids, served) in enumerate(zip(result.completion_ids, result.logprobs, strict=True)):
        prompt = prompts[i // 2]
        processed, _ = processed_logprobs(sharp_model, prompt, ids, fields, eos)
        plain, _ = processed_logprobs(sharp_model, prompt, ids, {"temperature": 0.8}, eos)
        gaps.append((processed - torch.tensor(served)).abs().max().item())
        controls.append((plain - torch.tensor(served)).abs().max().item())
    print(f"\nin process: max|d|={max(gaps):.2e}, control {max(controls):.3f}")
    assert max(gaps) <= 1e-4 and max(controls) > 0.05


def test_a_seeded_request_replays_whatever_shares_the_batch(served, prompts):
    """`seed`: the same prompt and seed give the same samples, alone or beside unseeded traffic; its n samples differ
    from each other; another seed, or no seed, gives other samples (control); logprobs stay exact."""
    url, reference, eos = served
    fields = {"seed": 1234, "temperature": 1.0, "ignore_eos": True}
    alone = [c["token_ids"] for c in complete(url, [prompts[2]], fields, n=2, max_tokens=16)["choices"]]
    assert alone[0] != alone[1]  # sample 1 draws other noise than sample 0

    jobs = {"seeded": ([prompts[2]], fields), "other": (prompts[:3], {"ignore_eos": True})}
    answers = run_together(url, jobs, max_tokens=16)
    shared = answers["seeded"]["choices"]
    assert [c["token_ids"] for c in shared] == alone
    for choice in shared:
        processed, _ = processed_logprobs(reference, prompts[2], choice["token_ids"], fields, eos)
        assert (processed - torch.tensor(choice["logprobs"]["token_logprobs"])).abs().max().item() <= FP32_LOGPROB_TOL

    other_seed = complete(url, [prompts[2]], {**fields, "seed": 4321}, n=2, max_tokens=16)["choices"]
    unseeded = [complete(url, [prompts[2]], {"ignore_eos": True}, n=2, max_tokens=16)["choices"] for _ in range(2)]
    assert [c["token_ids"] for c in other_seed] != alone
    assert [c["token_ids"] for c in unseeded[0]] != [c["token_ids"] for c in unseeded[1]]  # unseeded: fresh noise


def test_the_fields_through_the_official_openai_client(served, tokenizer, prompts):
    """The checklist with `openai`'s own client: its native fields (`presence_penalty`, `frequency_penalty`,
    `logit_bias`, `seed`, `temperature`, `logprobs`) and vLLM's through `extra_body` (`min_p`, `repetition_penalty`,
    `min_tokens`, `top_k`, `ignore_eos`, `return_token_ids`) on completions and chat: answered, exact, seeded."""
    import openai

    url, reference, eos = served
    client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=300)
    native = {"presence_penalty": 0.8, "frequency_penalty": 0.4, "logit_bias": {"9": 3.0}, "seed": 11,
              "temperature": 0.8}  # fmt: skip
    extra = {"min_p": 0.02, "repetition_penalty": 1.3, "min_tokens": 3, "top_k": 40, "return_token_ids": True}
    fields = {**native, **{k: v for k, v in extra.items() if k != "return_token_ids"}}

    def ask():
        return client.completions.create(model=MODEL, prompt=prompts[0], max_tokens=8, n=2, logprobs=0,
                                         extra_body=extra, **native)  # fmt: skip

    first, again = ask(), ask()
    ids = [c.model_extra["token_ids"] for c in first.choices]
    assert ids == [c.model_extra["token_ids"] for c in again.choices]  # seeded: the same samples
    for choice, completion in zip(first.choices, ids, strict=True):
        processed, _ = processed_logprobs(reference, prompts[0], completion, fields, eos)
        plain, _ = processed_logprobs(reference, prompts[0], completion, {"temperature": 0.8}, eos)
        served_values = torch.tensor(choice.logprobs.token_logprobs)
        assert (processed - served_values).abs().max().item() <= FP32_LOGPROB_TOL
        assert (plain - served_values).abs().max().item() > 0.05  # control: the fields changed the distribution
        assert eos not in completion[:3]

    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Natalia sold clips"}], max_tokens=10, logprobs=True,
        extra_body={"ignore_eos": True, "min_p": 0.05, "return_token_ids": True}, **native,
    )  # fmt: skip
    (choice,) = chat.choices
    assert len(choice.model_extra["token_ids"]) == 10 and choice.finish_reason == "length"
    assert len(choice.logprobs.content) == 10
    greedy = client.completions.create(
        model=MODEL, prompt=prompts[1], max_tokens=6, temperature=0,
        extra_body={"repetition_penalty": 3.0, "ignore_eos": True, "return_token_ids": True},
    )  # fmt: skip
    ids = greedy.choices[0].model_extra["token_ids"]
    assert ids == greedy_under_penalty(reference, prompts[1], ids, 3.0)[0]


def test_top_logprobs_are_the_sampled_distributions_likeliest(served, tokenizer, prompts):
    """`top_logprobs: k` (chat) and `logprobs: k` (completions): per token, the k likeliest tokens of the distribution
    it was sampled from (after the request's penalties and warpers) with their logprobs, best first, exact against
    teacher forcing; control: the raw distribution's top k miss. Streaming them is refused (422)."""
    url, reference, eos = served
    fields = {"temperature": 0.8, "top_k": 30, "repetition_penalty": 1.3}
    body = {"model": MODEL, "tokens": prompts[0], "max_tokens": 8, "n": 2, "logprobs": True, "top_logprobs": 4,
            "return_token_ids": True, **fields}  # fmt: skip
    chat = requests.post(url + "/v1/chat/completions/tokens", json=body, headers=AUTH, timeout=300)
    assert chat.status_code == 200, chat.text
    gaps, controls = [], []
    for choice in chat.json()["choices"]:
        ids, content = choice["token_ids"], choice["logprobs"]["content"]
        rows, policy = processed_rows(reference, prompts[0], ids, fields, eos)
        best, raw_best = rows.topk(4, dim=-1), policy.topk(4, dim=-1)
        for entry, values, top_ids, raw_values in zip(content, best.values, best.indices, raw_best.values):
            assert [a["token"] for a in entry["top_logprobs"]] == [tokenizer.decode([t]) for t in top_ids.tolist()]
            served_values = torch.tensor([a["logprob"] for a in entry["top_logprobs"]])
            gaps.append((served_values - values).abs().max().item())
            controls.append((served_values - raw_values).abs().max().item())
    assert max(gaps) <= FP32_LOGPROB_TOL and max(controls) > 0.05

    completion = complete(url, [prompts[1]], {**fields, "logprobs": 3}, n=1, max_tokens=6)["choices"][0]
    rows, _ = processed_rows(reference, prompts[1], completion["token_ids"], fields, eos)
    for top, values in zip(completion["logprobs"]["top_logprobs"], rows.topk(3, dim=-1).values, strict=True):
        assert len(top) >= 3
        assert all(any(abs(v - float(x)) <= FP32_LOGPROB_TOL for v in top.values()) for x in values)
    refused = requests.post(url + "/v1/chat/completions/tokens", json={**body, "stream": True}, headers=AUTH)
    assert refused.status_code == 422 and "top_logprobs" in refused.text


def test_top_logprobs_in_process_are_refused_not_dropped(sharp_model, tokenizer, prompts):
    """In process nothing returns the alternatives (`GenerationResult` has no place for them): refused, naming it."""
    from tests.conftest import sampling_config
    from trl_cb.rollouts.generator import ContinuousBatchingGenerator

    cfg = sampling_config(tokenizer, max_new_tokens=4, top_logprobs=3)
    with ContinuousBatchingGenerator(sharp_model, cfg) as generator, pytest.raises(ValueError, match="top_logprobs"):
        generator.generate(prompts[:1])


def test_cut_gaps_explain_a_flipped_cut_and_nothing_else():
    """The control for `cut_gaps`: a token 2e-5 inside a top-p or min-p cut that the other side's noise put on the
    other side (0.06 nats) is explained as a flip at each position; an error at every position, or another top-p, is
    not."""

    def warped(probs: list[float]):
        def reference(top_p: float, min_p: float) -> torch.Tensor:
            warpers = LogitsProcessorList([TopPLogitsWarper(top_p)] if top_p < 1.0 else [])
            if min_p:
                warpers.append(MinPLogitsWarper(min_p))
            scores = torch.tensor(probs).log()[None].repeat(3, 1)  # 3 positions
            return torch.log_softmax(warpers(None, scores), dim=-1)[:, 0]

        return reference

    at_top_p = warped([0.5, 0.3, 0.10002, 0.05998, 0.04])  # ascending cumulative mass 0.04, 0.09998: cut at 0.1
    flipped = at_top_p(0.9 + 5e-5, 0.0)  # the 0.05998 token kept
    assert (flipped - at_top_p(0.9, 0.0)).abs().max() > 0.05
    gaps, flips = cut_gaps(flipped, at_top_p, 0.9)
    assert gaps.max() <= FP32_LOGPROB_TOL and flips == 3
    gaps, flips = cut_gaps(at_top_p(0.9, 0.0) + 1e-3, at_top_p, 0.9)  # a processing error
    assert gaps.min() > FP32_LOGPROB_TOL and flips == 0
    gaps, flips = cut_gaps(at_top_p(0.7, 0.0), at_top_p, 0.9)  # another request's top-p
    assert gaps.min() > FP32_LOGPROB_TOL and flips == 0

    at_min_p = warped([0.5, 0.3, 0.1000025, 0.0599975, 0.04])  # 0.1000025 / 0.5: 2.5e-5 (relative) above 0.2
    flipped = at_min_p(1.0, 0.2 * (1 + 5e-5))  # the 0.1000025 token dropped
    assert (flipped - at_min_p(1.0, 0.2)).abs().max() > 0.05
    gaps, flips = cut_gaps(flipped, at_min_p, 1.0, 0.2)
    assert gaps.max() <= FP32_LOGPROB_TOL and flips == 3
    gaps, flips = cut_gaps(at_min_p(1.0, 0.1), at_min_p, 1.0, 0.2)  # another min-p
    assert gaps.min() > FP32_LOGPROB_TOL and flips == 0
