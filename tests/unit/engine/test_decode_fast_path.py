"""The steady-state decode fast path (`engine/_upstream_decode.py`) against transformers' per-request path.

Same seed, same prompts: the engine with the fast path gives the same tokens and logprobs (bit for bit: the forward
sees the same inputs) as with `TRL_CB_DECODE_FAST_PATH=0`, on a long decode that crosses many pages (page size 8),
with requests finishing at different lengths by EOS, requests joining while others decode (a 48-token budget
prefills the six prompts over several steps) and forked samples sharing their prompt's blocks. The fast path must
have prepared most steps (its counter), and a control shows a wrong position or write row would be caught.
"""

from __future__ import annotations

import pytest
import torch

from tests.conftest import sampling_config
from trl_cb import ContinuousBatchingGenerator
from trl_cb.engine import _upstream_decode, debug

NEW_TOKENS = 64


def _run(model, tokenizer, prompts, monkeypatch, enabled: bool):
    """Completions, logprobs and the fast path's counters (None when off) of one seeded round."""
    monkeypatch.setenv(debug.DECODE_FAST_PATH_ENV, "1" if enabled else "0")
    cfg = sampling_config(tokenizer, max_new_tokens=NEW_TOKENS)
    with ContinuousBatchingGenerator(model, cfg, {"max_batch_tokens": 48, "page_size": 8}) as gen:
        torch.manual_seed(0)
        out = gen.generate([p[: 12 + 5 * i] for i, p in enumerate(prompts[:6])], num_generations=4)
        stats = _upstream_decode.decode_fast_path_stats(gen._pool.engine.manager)  # noqa: SLF001
    return out.completion_ids, out.logprobs, stats


def test_fast_path_gives_the_slow_paths_tokens_and_logprobs(sharp_model, tokenizer, prompts, monkeypatch):
    ids, logprobs, stats = _run(sharp_model, tokenizer, prompts, monkeypatch, enabled=True)
    slow_ids, slow_logprobs, slow_stats = _run(sharp_model, tokenizer, prompts, monkeypatch, enabled=False)
    lengths = sorted(len(c) for c in ids)
    assert slow_stats is None, "TRL_CB_DECODE_FAST_PATH=0 must keep upstream's path"
    assert len(set(lengths)) >= 4 and lengths[0] < NEW_TOKENS, f"want EOS at several lengths: {lengths}"
    assert lengths[-1] > 3 * 8, "the decode must cross several pages"
    assert ids == slow_ids
    assert logprobs == slow_logprobs
    assert stats.fast > 2 * stats.slow, f"the fast path prepared too few steps: {stats}"


@pytest.mark.parametrize("corrupt", ["position", "write_row"])
def test_control_a_wrong_position_or_write_row_changes_the_samples(
    sharp_model, tokenizer, prompts, monkeypatch, corrupt
):
    """Control: the comparison above fails when a fast step's positions or write rows are off by one."""
    advance = _upstream_decode._advance

    def wrong(ios, *args, **kwargs):
        result = advance(ios, *args, **kwargs)
        if result is not None:
            n = len(result.states)
            target = ios.position_ids if corrupt == "position" else ios.write_index_storage[0]
            target[:n] += 1
        return result

    ids, logprobs, _ = _run(sharp_model, tokenizer, prompts, monkeypatch, enabled=False)
    monkeypatch.setattr(_upstream_decode, "_advance", wrong)
    bad_ids, bad_logprobs, stats = _run(sharp_model, tokenizer, prompts, monkeypatch, enabled=True)
    assert stats.fast > 0
    assert (ids, logprobs) != (bad_ids, bad_logprobs)


def test_every_fast_step_holds_the_allocators_rows_and_positions(sharp_model, tokenizer, prompts, monkeypatch):
    """Each batch the fast path prepares, against transformers' per-request answers for the same requests: positions,
    write rows (`get_write_indices`), read rows (`get_read_indices`), key lengths and the rows' input tokens."""
    advance, checked = _upstream_decode._advance, []

    def compare(ios, allocator, *args, **kwargs):
        result = advance(ios, allocator, *args, **kwargs)
        if result is None:
            return None
        states, n = result.states, len(result.states)
        past = [s.position_offset - 1 for s in states]
        writes = [i for s, p in zip(states, past) for i in allocator.get_write_indices(s.request_id, p, 1)]
        reads = [i for s, p in zip(states, past) for i in allocator.get_read_indices(s.request_id, p, 1)]
        assert ios.position_ids[:n].tolist() == past
        assert ios.write_index_storage[0, :n].tolist() == writes
        assert ios.true_read_sizes == [len(reads)]
        assert ios.read_index_storage[0, : len(reads)].tolist() == reads
        cu_k = ios.cumulative_seqlens_k["full_attention"][: n + 1].tolist()
        assert [b - a for a, b in zip(cu_k, cu_k[1:])] == [p + 1 for p in past]
        assert ios.input_ids[:n].tolist() == [s.generated_tokens[-1] for s in states]
        checked.append(n)
        return result

    monkeypatch.setattr(_upstream_decode, "_advance", compare)
    _run(sharp_model, tokenizer, prompts, monkeypatch, enabled=True)
    assert len(checked) > 30 and len(set(checked)) > 5, checked  # many steps, shrinking as requests finish
