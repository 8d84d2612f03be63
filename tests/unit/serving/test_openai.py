"""The OpenAI-compatible endpoint through the official `openai` client (docs/server.md, "OpenAI-compatible endpoint"):
models, completions with text and token ids, chat with and without tools, `stream=True` for both, stop strings, token-
in chat. Exactness: every returned or streamed token's logprob equals teacher forcing under the served weights (fp32,
std-0.2 weights far from uniform; control: the same tokens at the wrong temperature miss by far), and the returned ids
decode to the returned text. The servers run in this process (uvicorn in a thread) on their own copy of the model;
the hostile-client rules on these routes are tested on a real process in test_hardening.py.
"""

from __future__ import annotations

import copy
import json

import openai
import pytest
import requests
import torch

from tests.parity.scripted import chat_tokenizer, scripted_model
from tests.unit.rollouts.test_generator import teacher_forced_logprobs
from tests.unit.serving.conftest import AUTH, FP32_LOGPROB_TOL, KEY, in_process_server
from trl_cb.offline import agent
from trl_cb.offline.tiny import tiny_model
from trl_cb.serving.server import create_app

MODEL = "tiny-sharp"
TEMPERATURE = 0.7
#: fp32, the engine's batches against one teacher-forced pass in this process: measured 4.9e-6 to 8.1e-6; bounded as
#: every fp32 server comparison is (conftest.FP32_LOGPROB_TOL: the engine's own fp32 noise reaches 1.2e-5).
TOL = FP32_LOGPROB_TOL
PROMPT = "Natalia sold clips to 48 of her friends in April"
MULTIPLY = {
    "type": "function",
    "function": {
        "name": "multiply",
        "description": "Multiplies two integers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}


@pytest.fixture(scope="module")
def served(tokenizer):
    """A std-0.2 tiny model served with the tiny tokenizer (plain chat template); a copy for teacher forcing."""
    model = tiny_model(tokenizer, eos_logit_bias=2.0, init_std=0.2)
    reference = copy.deepcopy(model)
    with in_process_server(create_app(model, model_name=MODEL, tokenizer=tokenizer, api_key=KEY)) as url:
        warm(url, MODEL)
        yield openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=120), url, reference


def warm(url: str, model: str) -> None:
    """Build the engine with every per-request warper and the longest length the module asks for, so that no test
    rebuilds it (its thread is then the fixture's, not a test's)."""
    body = {"model": model, "prompt": [[5, 6]], "max_tokens": 64, "temperature": 0.7, "top_p": 0.9, "top_k": 5}
    assert requests.post(url + "/v1/completions", json=body, headers=AUTH, timeout=120).status_code == 200


@pytest.fixture(scope="module")
def scripted():
    """The scripted tool-calling policy (tests/parity/scripted.py): it calls multiply(3, 4), then answers Done!."""
    tokenizer = chat_tokenizer()
    app = create_app(scripted_model(tokenizer), model_name="scripted", tokenizer=tokenizer, api_key=KEY)
    with in_process_server(app) as url:
        warm(url, "scripted")
        yield openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=120), url, tokenizer


#: What the multi-byte policy answers: characters of 2, 3 and 4 UTF-8 bytes, each split into byte tokens, no token
#: twice (each token's successor is a function of it).
MULTIBYTE = "Café €😀"


@pytest.fixture(scope="module")
def multibyte():
    """A scripted policy (tests/parity/scripted.py's construction) that answers `MULTIBYTE`, token by token, with
    probability 1 - 1e-15 each: several of its tokens end inside a character."""
    tokenizer = agent.chat_tokenizer([])
    tokens = tokenizer.convert_ids_to_tokens(tokenizer.encode(MULTIBYTE))
    chain = ["<|assistant|>", *tokens, "<|end|>"]
    assert len(set(chain)) == len(chain)
    model = agent.scripted_model(tokenizer, [(a, b, 40.0) for a, b in zip(chain, chain[1:])], max_positions=1024)
    with in_process_server(create_app(model, model_name="bytes", tokenizer=tokenizer, api_key=KEY)) as url:
        warm(url, "bytes")
        yield openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=120), tokenizer


def gaps(reference, prompt: list[int], ids: list[int], logprobs: list[float]) -> tuple[float, float]:
    """(|served - teacher forcing| at the request's temperature, the same at T=1: the control), max over tokens."""
    served = torch.tensor(logprobs)
    exact = teacher_forced_logprobs(reference, prompt, ids, TEMPERATURE, 0, 1.0)
    wrong = teacher_forced_logprobs(reference, prompt, ids, 1.0, 0, 1.0)
    return (exact - served).abs().max().item(), (wrong - served).abs().max().item()


def decoded(tokenizer, ids: list[int]) -> str:
    """The text of `ids` as the server returns it: the EOS that ended the sample adds none."""
    ended = ids and ids[-1] == tokenizer.eos_token_id
    return tokenizer.decode(ids[:-1] if ended else ids, skip_special_tokens=True)


def check_exact(reference, tokenizer, prompt: list[int], ids: list[int], logprobs: list[float], text: str) -> None:
    assert ids and len(logprobs) == len(ids)
    assert decoded(tokenizer, ids) == text  # the ids are exactly the text
    gap, control = gaps(reference, prompt, ids, logprobs)
    print(f"\nserved vs teacher forcing max|d| = {gap:.2e} (control at T=1: {control:.3f})")
    assert gap <= TOL and control > 1e-2


def test_models_and_text_completion(served, tokenizer):
    client, _, reference = served
    assert [m.id for m in client.models.list().data] == [MODEL]
    extra = {"return_token_ids": True}
    answer = client.completions.create(
        model=MODEL, prompt=PROMPT, n=3, max_tokens=24, temperature=TEMPERATURE, logprobs=0, extra_body=extra
    )
    prompt = tokenizer.encode(PROMPT)
    assert answer.object == "text_completion" and [c.index for c in answer.choices] == [0, 1, 2]
    for choice in answer.choices:
        rl = choice.model_extra
        assert rl["prompt_token_ids"] == prompt and rl["weight_version"] == 0
        assert rl["token_weight_versions"] == [0] * len(rl["token_ids"])
        assert rl["policy_logprobs"] == choice.logprobs.token_logprobs  # only temperature shapes the distribution
        assert "".join(choice.logprobs.tokens) == choice.text
        assert choice.logprobs.text_offset == [
            sum(map(len, choice.logprobs.tokens[:i])) for i in range(len(rl["token_ids"]))
        ]
        check_exact(reference, tokenizer, prompt, rl["token_ids"], choice.logprobs.token_logprobs, choice.text)
        ended = rl["token_ids"][-1] == tokenizer.eos_token_id
        assert choice.finish_reason == ("stop" if ended else "length")
    generated = sum(len(c.model_extra["token_ids"]) for c in answer.choices)
    assert (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (len(prompt), generated)


def test_detokenize_false_answers_ids_and_exact_logprobs_without_text(served, tokenizer, prompts, monkeypatch):
    """`detokenize: false` (what trl_cb's client sends with JSON): no text and no token strings, nothing decoded on the
    server (it was decoded anyway, ~0.8 s of CPU per 32k tokens), the ids and logprobs as with text, exact. Control:
    the same request with text decodes."""
    from trl_cb.serving import detokenize

    _, url, reference = served
    body = {"model": MODEL, "prompt": prompts[:2], "n": 2, "max_tokens": 12, "temperature": TEMPERATURE,
            "logprobs": 0, "return_token_ids": True}  # fmt: skip
    decoded_ids = []
    real_decode = detokenize.TokenText._decode

    def counting_decode(self, ids):
        decoded_ids.append(len(ids))
        return real_decode(self, ids)

    monkeypatch.setattr(detokenize.TokenText, "_decode", counting_decode)
    plain = requests.post(url + "/v1/completions", json={**body, "detokenize": False}, headers=AUTH, timeout=120)
    assert plain.status_code == 200 and not decoded_ids, "ids-only answers decode nothing"
    for choice in plain.json()["choices"]:
        assert choice["text"] == "" and set(choice["logprobs"]["tokens"]) <= {""}
        prompt = prompts[choice["index"] // 2]
        assert choice["prompt_token_ids"] == prompt and len(choice["token_ids"]) > 0
        gap, control = gaps(reference, prompt, choice["token_ids"], choice["logprobs"]["token_logprobs"])
        assert gap <= TOL and control > 1e-2
    texts = requests.post(url + "/v1/completions", json=body, headers=AUTH, timeout=120).json()["choices"]
    assert decoded_ids and any(choice["text"] for choice in texts)  # control: decoded when asked


def test_prompt_logprobs_are_the_policys_own_teacher_forced_logprobs(served, tokenizer, prompts, monkeypatch):
    """`prompt_logprobs: k` (vLLM's): every choice carries its prompt's token logprobs and ranks, and the k most likely
    tokens at each position, equal to one teacher-forced pass of the served weights at temperature 1 whatever the
    request samples with; position 0 is None. Control: the same values at the request's temperature are far off. More
    than `MAX_PROMPT_LOGPROBS` alternatives and streaming are refused, naming the field."""
    _, url, reference = served
    from trl_cb.serving import engine_loop

    scored, real_score = [], engine_loop.score_prompts
    monkeypatch.setattr(
        engine_loop, "score_prompts", lambda model, ps, k: scored.extend(ps) or real_score(model, ps, k)
    )
    sent = [prompts[0], prompts[1], prompts[0]]  # a prompt twice: scored once, its entries in both places
    body = {"model": MODEL, "prompt": sent, "n": 2, "max_tokens": 4, "temperature": TEMPERATURE,
            "prompt_logprobs": 3, "return_token_ids": True}  # fmt: skip
    answer = requests.post(url + "/v1/completions", json=body, headers=AUTH, timeout=120)
    assert answer.status_code == 200, answer.text
    assert len(answer.json()["choices"]) == 6 and scored == [prompts[0], prompts[1]]
    for choice in answer.json()["choices"]:
        prompt = sent[choice["index"] // 2]
        entries = choice["prompt_logprobs"]
        assert entries[0] is None and len(entries) == len(prompt) and choice["prompt_logprobs_weight_version"] == 0
        assert [int(next(iter(e))) for e in entries[1:]] == prompt[1:]  # the prompt's token first
        served_values = torch.tensor([e[str(t)]["logprob"] for e, t in zip(entries[1:], prompt[1:])])
        with torch.no_grad():
            rows = torch.log_softmax(reference(torch.tensor([prompt])).logits[0, :-1].float(), dim=-1)
            hot = torch.log_softmax(reference(torch.tensor([prompt])).logits[0, :-1].float() / TEMPERATURE, dim=-1)
        target = torch.tensor(prompt[1:])[:, None]
        exact, control = rows.gather(1, target)[:, 0], hot.gather(1, target)[:, 0]
        assert (served_values - exact).abs().max().item() <= TOL
        assert (served_values - control).abs().max().item() > 1e-2
        ranks = ((rows > exact[:, None]).sum(dim=1) + 1).tolist()
        assert [e[str(t)]["rank"] for e, t in zip(entries[1:], prompt[1:])] == ranks and min(ranks) >= 1
        assert [e[str(t)]["decoded_token"] for e, t in zip(entries[1:], prompt[1:])] == [
            tokenizer.decode([t]) for t in prompt[1:]
        ]
        best = rows.topk(3, dim=-1)
        for entry, ids, values in zip(entries[1:], best.indices.tolist(), best.values, strict=True):
            assert set(map(str, ids)) <= entry.keys() and len(entry) <= 4
            served_top = torch.tensor([entry[str(i)]["logprob"] for i in ids])
            assert (served_top - values).abs().max().item() <= TOL
            assert [entry[str(i)]["rank"] for i in ids] == [1, 2, 3]
    for extra, field in (({"prompt_logprobs": 21}, "prompt_logprobs"), ({"stream": True}, "prompt_logprobs")):
        refused = requests.post(url + "/v1/completions", json={**body, **extra}, headers=AUTH, timeout=120)
        assert refused.status_code == 422 and field in refused.text, refused.text


def test_token_id_prompts_and_a_plain_client(served, tokenizer, prompts):
    """Several token-id prompts: choice `index` is prompt * n + sample; without `return_token_ids` the answer is
    OpenAI's object alone (no RL fields but the version)."""
    client, _, reference = served
    answer = client.completions.create(model=MODEL, prompt=prompts[:2], n=2, max_tokens=12, temperature=TEMPERATURE)
    assert [c.index for c in answer.choices] == [0, 1, 2, 3]
    assert set(answer.choices[0].model_extra) == {"weight_version"} and answer.choices[0].logprobs is None
    extra = {"return_token_ids": True}
    answer = client.completions.create(
        model=MODEL, prompt=prompts[:2], n=2, max_tokens=12, temperature=TEMPERATURE, logprobs=0, extra_body=extra
    )
    for choice in answer.choices:
        prompt = prompts[choice.index // 2]
        assert choice.model_extra["prompt_token_ids"] == prompt
        check_exact(reference, tokenizer, prompt, choice.model_extra["token_ids"], choice.logprobs.token_logprobs,
                    choice.text)  # fmt: skip


def test_streamed_completion(served, tokenizer):
    """Chunks per sample concatenate to its text, ids and logprobs (each exact); the prompt's ids come once per
    sample; the usage chunk counts every streamed token."""
    client, _, reference = served
    stream = client.completions.create(
        model=MODEL, prompt=PROMPT, n=2, max_tokens=20, temperature=TEMPERATURE, logprobs=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"return_token_ids": True},
    )  # fmt: skip
    texts, ids, logprobs, finish, firsts, usage = {}, {}, {}, {}, {}, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            k, rl = choice.index, choice.model_extra
            texts[k] = texts.get(k, "") + choice.text
            ids.setdefault(k, []).extend(rl.get("token_ids") or [])
            logprobs.setdefault(k, []).extend(choice.logprobs.token_logprobs if choice.logprobs else [])
            firsts[k] = firsts.get(k, 0) + ("prompt_token_ids" in rl)
            finish[k] = choice.finish_reason or finish.get(k)
    prompt = tokenizer.encode(PROMPT)
    assert sorted(texts) == [0, 1] and firsts == {0: 1, 1: 1} and set(finish.values()) <= {"stop", "length"}
    for k in texts:
        check_exact(reference, tokenizer, prompt, ids[k], logprobs[k], texts[k])
    assert usage.completion_tokens == sum(map(len, ids.values()))


def test_chat_completion_and_its_stream(served, tokenizer):
    client, _, reference = served
    messages = [{"role": "user", "content": "How many clips did Natalia sell?"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    extra = {"return_token_ids": True}
    answer = client.chat.completions.create(
        model=MODEL, messages=messages, n=2, max_tokens=16, temperature=TEMPERATURE, logprobs=True, extra_body=extra
    )
    assert answer.object == "chat.completion" and answer.model_extra["prompt_token_ids"] == list(prompt)
    for choice in answer.choices:
        assert choice.message.role == "assistant" and not choice.message.tool_calls
        values = [t.logprob for t in choice.logprobs.content]
        assert "".join(t.token for t in choice.logprobs.content) == choice.message.content
        check_exact(
            reference, tokenizer, list(prompt), choice.model_extra["token_ids"], values, choice.message.content
        )
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=16, temperature=TEMPERATURE, logprobs=True, stream=True,
        extra_body=extra,
    )  # fmt: skip
    content, ids, values, roles = "", [], [], []
    for chunk in stream:
        delta = chunk.choices[0].delta
        roles.append(delta.role)
        content += delta.content or ""
        ids += chunk.choices[0].model_extra.get("token_ids") or []
        values += [t.logprob for t in chunk.choices[0].logprobs.content] if chunk.choices[0].logprobs else []
    assert roles[0] == "assistant" and set(roles[1:]) <= {None}
    check_exact(reference, tokenizer, list(prompt), ids, values, content)


def test_stop_strings_end_the_sample_there(served, tokenizer):
    """The text ends before the stop string; the ids run through the token that completed it and no further (the
    engine request ended there), so they decode to the text, the stop string, and the rest of that token."""
    client, _, _ = served
    extra = {"return_token_ids": True}
    for stream in (False, True):
        answer = client.completions.create(
            model=MODEL, prompt=PROMPT, n=4, max_tokens=64, temperature=1.5, stop=[" "], extra_body=extra,
            stream=stream,
        )  # fmt: skip
        samples: dict[int, dict] = {}
        for chunk in answer if stream else [answer]:
            for choice in chunk.choices:
                sample = samples.setdefault(choice.index, {"text": "", "ids": [], "stop_reason": None})
                sample["text"] += choice.text
                sample["ids"] += choice.model_extra.get("token_ids") or []
                sample["stop_reason"] = choice.model_extra.get("stop_reason") or sample["stop_reason"]
        stopped = [s for s in samples.values() if s["stop_reason"] == " "]
        assert stopped, samples  # temperature 1.5 over 64 tokens: a space comes (the run shows it, not assumed)
        for sample in stopped:
            text, ids = sample["text"], sample["ids"]
            assert " " not in text and len(ids) < 64
            assert decoded(tokenizer, ids).startswith(text + " ") and " " not in decoded(tokenizer, ids[:-1])


def test_chat_tool_call_two_turns_and_token_in(scripted):
    """The scripted policy calls a tool: the call comes back parsed (OpenAI's shape, `finish_reason` tool_calls, also
    streamed); the second turn with the tool's answer says Done!. The same second turn sent as `tokens` (the first
    turn's prompt and completion ids, then the tool turn's suffix) gives the same answer without re-rendering."""
    client, url, tokenizer = scripted
    messages = [{"role": "user", "content": "What is 3 times 4?"}]
    extra = {"return_token_ids": True}
    first = client.chat.completions.create(
        model="scripted", messages=messages, tools=[MULTIPLY], max_tokens=16, extra_body=extra
    )
    call = first.choices[0].message.tool_calls[0]
    assert first.choices[0].finish_reason == "tool_calls" and call.function.name == "multiply"
    assert json.loads(call.function.arguments) == {"a": 3, "b": 4}
    streamed = client.chat.completions.create(
        model="scripted", messages=messages, tools=[MULTIPLY], max_tokens=16, stream=True
    )
    last = [chunk.choices[0] for chunk in streamed][-1]
    assert last.finish_reason == "tool_calls" and last.delta.tool_calls[0].function.name == "multiply"

    history = messages + [
        {"role": "assistant", "content": "", "tool_calls": [call.model_dump()]},
        {"role": "tool", "name": "multiply", "tool_call_id": call.id, "content": "12"},
    ]
    second = client.chat.completions.create(
        model="scripted", messages=history, tools=[MULTIPLY], max_tokens=16, extra_body=extra
    )
    assert second.choices[0].message.content == "Done!" and second.choices[0].finish_reason == "stop"

    turn1 = first.model_extra["prompt_token_ids"] + first.choices[0].model_extra["token_ids"]
    rendered = second.model_extra["prompt_token_ids"]
    body = {"model": "scripted", "messages": history, "tools": [MULTIPLY]}
    tokenized = requests.post(url + "/tokenize", json=body, headers=AUTH, timeout=60).json()
    assert tokenized["tokens"] == rendered and tokenized["count"] == len(rendered)  # vLLM's /tokenize, the same ids
    assert rendered[: len(turn1)] == turn1  # the template preserves the prefix: suffix = the tool turn
    tokens = turn1 + rendered[len(turn1) :]
    body = {"model": "scripted", "messages": history, "tokens": tokens, "max_tokens": 16, "return_token_ids": True}
    again = requests.post(url + "/v1/chat/completions/tokens", json=body, headers=AUTH, timeout=60).json()
    assert again["prompt_token_ids"] == tokens and again["choices"][0]["message"]["content"] == "Done!"


def test_chat_logprob_bytes_are_each_tokens_own(multibyte):
    """Chat logprobs' `bytes` are each token's own bytes, also for tokens that end inside a character (whose `token`,
    its share of the text, is ""): they concatenate to the content's UTF-8, whole and streamed. Control: a mid-
    character token's bytes do not decode on their own (they are not some completed character's)."""
    client, tokenizer = multibyte
    messages = [{"role": "user", "content": "Say it"}]
    answer = client.chat.completions.create(model="bytes", messages=messages, max_tokens=32, logprobs=True)
    content = answer.choices[0].logprobs.content
    streamed = client.chat.completions.create(
        model="bytes", messages=messages, max_tokens=32, logprobs=True, stream=True
    )
    chunks = [t for chunk in streamed if chunk.choices and chunk.choices[0].logprobs
              for t in chunk.choices[0].logprobs.content]  # fmt: skip
    assert answer.choices[0].message.content == MULTIBYTE
    for tokens in (content, chunks):
        assert len(tokens) == len(tokenizer.encode(MULTIBYTE)) + 1
        assert tokens[-1].bytes == [] and tokens[-1].token == ""  # the EOS that ended the answer: no text
        assert "".join(t.token for t in tokens) == MULTIBYTE
        assert bytes(b for t in tokens for b in t.bytes) == MULTIBYTE.encode("utf-8")
        mid = [t for t in tokens[:-1] if t.token == ""]
        assert len(mid) >= 4  # é: 1, €: 2, 😀: 3 tokens end inside the character
        for t in mid:
            with pytest.raises(UnicodeDecodeError):
                bytes(t.bytes).decode("utf-8")
    # Per token: its slice of the UTF-8 (a byte-level vocabulary string has one character per byte).
    encoded, at, expected = MULTIBYTE.encode("utf-8"), 0, []
    for vocabulary_string in tokenizer.convert_ids_to_tokens(tokenizer.encode(MULTIBYTE)):
        expected.append(list(encoded[at : at + len(vocabulary_string)]))
        at += len(vocabulary_string)
    assert [t.bytes for t in content[:-1]] == expected == [t.bytes for t in chunks[:-1]]


def test_temperature_0_is_greedy_with_the_trainers_logprobs(served, tokenizer):
    """`temperature: 0` (evaluations and agent loops send it) samples the argmax at every step, the same for every
    sample; `logprobs` are 0 (the sampled distribution is one token) and `policy_logprobs` the trainer's
    `log_softmax(logits)`, exact against teacher forcing. Control: sampling at T=1 leaves the argmax somewhere."""
    client, url, reference = served
    prompt = tokenizer.encode(PROMPT)
    extra = {"return_token_ids": True}
    answer = client.completions.create(
        model=MODEL, prompt=PROMPT, n=2, max_tokens=16, temperature=0, logprobs=0, extra_body=extra
    )
    ids = [c.model_extra["token_ids"] for c in answer.choices]
    assert ids[0] == ids[1] and len(ids[0]) > 3, ids
    with torch.no_grad():
        logits = reference(torch.tensor([prompt + ids[0]])).logits[0, len(prompt) - 1 : -1].float()
    assert logits.argmax(-1).tolist() == ids[0], "a greedy sample left the argmax"
    choice = answer.choices[0]
    assert choice.logprobs.token_logprobs == [0.0] * len(ids[0])
    exact = teacher_forced_logprobs(reference, prompt, ids[0], 1.0, 0, 1.0)
    assert (exact - torch.tensor(choice.model_extra["policy_logprobs"])).abs().max().item() <= TOL
    token_in = {"token_ids": prompt, "sampling_params": {"temperature": 0, "max_tokens": 16, "logprobs": 1}}
    routed = requests.post(url + "/inference/v1/generate", json=token_in, headers=AUTH, timeout=120)
    assert routed.status_code == 200 and routed.json()["choices"][0]["token_ids"] == ids[0]
    sampled = client.completions.create(model=MODEL, prompt=PROMPT, n=4, max_tokens=16, temperature=1.0,
                                        extra_body=extra)  # fmt: skip
    assert any(c.model_extra["token_ids"] != ids[0] for c in sampled.choices), "control: T=1 sampled the argmax"
    refused = requests.post(url + "/v1/completions", json={"prompt": PROMPT, "temperature": 0.001}, headers=AUTH)
    assert refused.status_code == 422 and "greedy" in refused.text and "0.001" not in refused.text


def test_echo_puts_the_prompt_before_the_sample(served, tokenizer, prompts):
    """OpenAI's `echo`: the text starts with the prompt's; with `logprobs`, the prompt's tokens come first, `None`
    then each one's logprob under the served policy (teacher forcing, temperature 1), offsets into the echoed text;
    the sample's tokens follow, exact as without echo. Streaming it is refused (422)."""
    client, url, reference = served
    answer = client.completions.create(
        model=MODEL, prompt=[prompts[0]], n=2, max_tokens=5, temperature=TEMPERATURE, logprobs=0, echo=True,
        extra_body={"return_token_ids": True},
    )  # fmt: skip
    prompt_text = tokenizer.decode(prompts[0], skip_special_tokens=True)
    with torch.no_grad():
        rows = torch.log_softmax(reference(torch.tensor([prompts[0]])).logits[0, :-1].float(), dim=-1)
        hot = torch.log_softmax(reference(torch.tensor([prompts[0]])).logits[0, :-1].float() / TEMPERATURE, dim=-1)
    exact = rows.gather(1, torch.tensor(prompts[0][1:])[:, None])[:, 0]
    control = hot.gather(1, torch.tensor(prompts[0][1:])[:, None])[:, 0]  # the sampling temperature: far off
    for choice in answer.choices:
        ids = choice.model_extra["token_ids"]
        values = choice.logprobs.token_logprobs
        assert choice.text == prompt_text + decoded(tokenizer, ids)
        assert len(values) == len(prompts[0]) + len(ids) and values[0] is None
        assert (torch.tensor(values[1 : len(prompts[0])]) - exact).abs().max().item() <= TOL
        assert (torch.tensor(values[1 : len(prompts[0])]) - control).abs().max().item() > 1e-2
        check_exact(reference, tokenizer, prompts[0], ids, values[len(prompts[0]) :], decoded(tokenizer, ids))
        assert "".join(choice.logprobs.tokens) == choice.text
        assert [choice.text[o:] for o in choice.logprobs.text_offset[:1]] == [choice.text]
    plain = client.completions.create(model=MODEL, prompt="Natalia", max_tokens=3, echo=True)
    assert plain.choices[0].text.startswith("Natalia") and plain.choices[0].logprobs is None
    body = {"model": MODEL, "prompt": "x", "echo": True, "stream": True}
    refused = requests.post(url + "/v1/completions", json=body, headers=AUTH, timeout=60)
    assert refused.status_code == 422 and "echo" in refused.text
