"""`prompt_scoring`: the chunked log-softmax gives the unchunked values, ranks and alternatives exactly, the
alternatives are each position's most likely tokens, and a model whose attention only runs inside the engine is refused
before anything is queued."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from trl_cb.offline.tiny import tiny_model
from trl_cb.serving import prompt_scoring


def test_chunks_match_one_pass_and_ranks_count_better_tokens(tokenizer, monkeypatch):
    model = tiny_model(tokenizer, init_std=0.2).eval()
    prompts = [[5, 9, 11, 30, 2, 7, 12, 40], [3, 4]]
    whole = prompt_scoring.score_prompts(model, prompts, top=4)
    monkeypatch.setattr(prompt_scoring, "_POSITIONS", 3)  # chunk boundaries inside the 7 scored positions
    chunked = prompt_scoring.score_prompts(model, prompts, top=4)
    assert chunked == whole and [len(v) for v, _, _ in whole] == [7, 1]
    with torch.no_grad():
        rows = torch.log_softmax(model(torch.tensor([prompts[0]])).logits[0, :-1].float(), dim=-1)
    chosen = rows.gather(1, torch.tensor(prompts[0][1:])[:, None])
    assert whole[0][1] == ((rows > chosen).sum(dim=1) + 1).tolist()
    assert torch.allclose(torch.tensor(whole[0][0]), chosen[:, 0], atol=0, rtol=0)
    best = rows.topk(4, dim=-1)
    assert [[i for i, _ in top] for top in whole[0][2]] == best.indices.tolist()
    assert torch.equal(torch.tensor([[v for _, v in top] for top in whole[0][2]]), best.values)
    entries = prompt_scoring.prompt_logprob_entries(prompts[1], whole[1], None)
    own = {"4": {"logprob": whole[1][0][0], "rank": whole[1][1][0], "decoded_token": None}}
    assert entries[0] is None and entries[1].items() >= own.items()
    others = {int(t): e for t, e in entries[1].items() if t != "4"}
    assert sorted(e["rank"] for e in others.values()) == [k for k in range(1, 5) if whole[1][2][0][k - 1][0] != 4]
    plain = prompt_scoring.prompt_logprob_entries(
        prompts[1], prompt_scoring.score_prompts(model, [prompts[1]])[0], None
    )
    assert plain == [None, own]  # k = 0: the prompt's token only


def test_a_paged_only_attention_is_refused_naming_it():
    paged = SimpleNamespace(config=SimpleNamespace(_attn_implementation="paged|eager"))
    assert "paged|eager" in prompt_scoring.refuse_unscorable(paged)
    assert (
        prompt_scoring.refuse_unscorable(SimpleNamespace(config=SimpleNamespace(_attn_implementation="sdpa"))) is None
    )
