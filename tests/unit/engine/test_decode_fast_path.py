"""The steady-state decode fast path (`engine/_upstream_decode.py`) against transformers' per-request path.

Same seed, same prompts: the engine with the fast path gives the same tokens and logprobs (bit for bit: the forward
sees the same inputs) as transformers' own per-request path (the fast path switched off in the test), on a long decode
that crosses many pages (page size 8), with requests finishing at different lengths by EOS, requests joining while
others decode (a 48-token budget prefills the six prompts over several steps) and forked samples sharing their prompt's
blocks; and, with identical forks (top_k=1), completed pages swapped for a sibling's by prefix de-duplication (without
the fast path's re-read of a page-start row's block table, both `shared_pages` tests fail: checked by hand). The fast
path must have prepared most steps (its counter), and a control shows a wrong position or write row would be caught."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.continuous_batching.cache_allocators.cache_allocator import CacheAllocator

from tests.conftest import sampling_config
from tests.graph_fakes import use_fake_graphs
from trl_cb import ContinuousBatchingGenerator
from trl_cb.engine import _upstream_decode, _upstream_decode_plan
from trl_cb.offline.tiny import tiny_model

NEW_TOKENS = 64
fits = _upstream_decode.fast_path_fits  # the real rule (tests switch the path off by replacing it)


def _case(request, tokenizer, case: str):
    """`eos`: a peaked model ending samples at many lengths. `shared_pages`: no EOS bias, top_k=1, every sample to
    the cap, forks of one prompt identical, so their completed pages are de-duplicated. `sliding` / `mixed` (block
    tables only): a 12-token window on every layer / on half of them, so each sample wraps its ring of two 8-token
    pages several times beside (mixed) a full-attention group's pages."""
    if case == "eos":
        return request.getfixturevalue("sharp_model"), {}
    if case in WINDOWED:
        from tests.unit.engine.test_attention import _config, _far_from_uniform

        return _far_from_uniform(_config(WINDOWED[case], tokenizer)), {}
    return tiny_model(tokenizer), {"top_k": 1}


#: The windowed cases and the families they take (tests/unit/engine/test_attention.py's configs).
WINDOWED = {"sliding": "mistral", "mixed": "qwen2-swa"}


def _run(model, tokenizer, prompts, monkeypatch, enabled: bool, block_tables: bool = False, **sampling: object):
    """Completions, logprobs and the fast path's counters (None when off) of one seeded round. `block_tables`: the
    GPU layout (decode steps through block tables, padded, replayed as graphs by tests/graph_fakes.py)."""
    monkeypatch.setattr(_upstream_decode, "fast_path_fits", fits if enabled else (lambda processor: False))
    if block_tables:
        use_fake_graphs(monkeypatch)
    cfg = sampling_config(tokenizer, max_new_tokens=NEW_TOKENS, **sampling)
    engine = {"max_batch_tokens": 48, "page_size": 8, "use_cuda_graph": block_tables}
    with ContinuousBatchingGenerator(model, cfg, engine) as gen:
        torch.manual_seed(0)
        out = gen.generate([p[: 12 + 5 * i] for i, p in enumerate(prompts[:6])], num_generations=4)
        stats = _upstream_decode.decode_fast_path_stats(gen._pool.engine.manager)  # noqa: SLF001
    return out.completion_ids, out.logprobs, stats


def _positions(batch, states) -> list[int]:
    """Each row's position in the step just prepared, from its request state: a lazy plan's states written first
    (as when anything else reads them), which then stand before the step (upstream's prepare advances them)."""
    plan = getattr(batch, "plan", None)
    lazy = plan is not None and plan.pending is not None
    _upstream_decode_plan.write_pending(batch)
    return [s.position_offset - (0 if lazy else 1) for s in states]


@pytest.mark.parametrize(
    ("case", "layout"),
    [(c, layout) for c in ("eos", "shared_pages") for layout in ("read_rows", "block_tables")]
    + [(c, "block_tables") for c in WINDOWED],
)
def test_fast_path_gives_the_slow_paths_tokens_and_logprobs(request, tokenizer, prompts, monkeypatch, case, layout):
    model, sampling = _case(request, tokenizer, case)
    tables = layout == "block_tables"
    ids, logprobs, stats = _run(model, tokenizer, prompts, monkeypatch, True, tables, **sampling)
    slow_ids, slow_logprobs, slow_stats = _run(model, tokenizer, prompts, monkeypatch, False, tables, **sampling)
    lengths = sorted(len(c) for c in ids)
    assert slow_stats is None, "the reference run must take upstream's path"
    if case == "eos":
        assert len(set(lengths)) >= 4 and lengths[0] < NEW_TOKENS, f"want EOS at several lengths: {lengths}"
    assert lengths[-1] > 3 * 8, "the decode must cross several pages"
    assert ids == slow_ids
    assert logprobs == slow_logprobs
    assert stats.fast > 2 * stats.slow, f"the fast path prepared too few steps: {stats}"
    # most fast steps were scheduled from the last step's plan, reading back only the rows upstream updated
    assert stats.continued > stats.fast // 2, f"too few steps continued from the last step's plan: {stats}"


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


@pytest.mark.parametrize("case", ["eos", "shared_pages"])
def test_every_fast_step_holds_the_allocators_rows_and_positions(request, tokenizer, prompts, monkeypatch, case):
    """Each batch the fast path prepares, against transformers' per-request answers for the same requests: positions,
    write rows (`get_write_indices`), read rows (`get_read_indices`), key lengths and the rows' input tokens. Case
    `eos`: requests finish at many lengths. Case `shared_pages`: with top_k=1 the forked samples repeat each other, so
    completed pages are de-duplicated (a request's block table swaps a page for its sibling's, `mark_complete_blocks`),
    which the fast path must read back."""
    model, sampling = _case(request, tokenizer, case)
    advance, checked, swapped = _upstream_decode._advance, [], []
    mark = CacheAllocator.mark_complete_blocks

    def mark_and_watch(allocator, request_id, token_ids, new_blocks):
        before = list(allocator.block_table[request_id])
        mark(allocator, request_id, token_ids, new_blocks)
        swapped.append(before != allocator.block_table[request_id])

    monkeypatch.setattr(CacheAllocator, "mark_complete_blocks", mark_and_watch)

    def compare(ios, allocator, last, batch, *args, **kwargs):
        result = advance(ios, allocator, last, batch, *args, **kwargs)
        if result is None:
            return None
        states, n = result.states, len(result.states)
        past = _positions(batch, states)
        writes = [i for s, p in zip(states, past) for i in allocator.get_write_indices(s.request_id, p, 1)]
        reads = [i for s, p in zip(states, past) for i in allocator.get_read_indices(s.request_id, p, 1)]
        assert ios.position_ids[:n].tolist() == past
        assert ios.write_index_storage[0, :n].tolist() == writes
        assert ios.true_read_sizes == [len(reads)]
        assert ios.read_index_storage[0, : len(reads)].tolist() == reads
        cu_k = ios.cumulative_seqlens_k["full_attention"][: n + 1].tolist()
        assert [b - a for a, b in zip(cu_k, cu_k[1:])] == [p + 1 for p in past]
        # the token each row samples from: its last sampled one, or the prompt token of a one-token prefill step
        expected = [
            t.generated_tokens[-1] if t.generated_tokens else t.initial_tokens[p] for t, p in zip(states, past)
        ]
        assert ios.input_ids[:n].tolist() == expected
        checked.append(n)
        return result

    monkeypatch.setattr(_upstream_decode, "_advance", compare)
    _run(model, tokenizer, prompts, monkeypatch, enabled=True, **sampling)
    assert len(checked) > 30, checked
    if case == "eos":
        assert len(set(checked)) > 5, checked  # batches shrinking as requests finish
    else:
        assert sum(swapped) > 20, "completed pages were not de-duplicated: the case is not exercised"


@pytest.mark.parametrize("case", ["eos", "shared_pages"])
def test_every_block_table_step_holds_the_allocators_pages(request, tokenizer, prompts, monkeypatch, case):
    """The block-table layout (GPU): each fast step's table rows are the requests' block ids (as kernel page entries),
    padding rows -1 and key-less; positions, key counts and input tokens as transformers would set them."""
    model, sampling = _case(request, tokenizer, case)
    advance, checked = _upstream_decode._advance_table, []

    def compare(ios, allocators, host, last, batch, processors, rows):
        result = advance(ios, allocators, host, last, batch, processors, rows)
        (allocator,) = allocators
        if result is None:
            return None
        states, n = result.states, len(result.states)
        past = _positions(batch, states)
        stride = allocator.block_physical_stride // allocator.tokens_per_page
        for i, state in enumerate(states):
            blocks = allocator.block_table[state.request_id]
            row = ios.block_table[0, i].tolist()
            assert row[: len(blocks)] == [b * stride for b in blocks] and set(row[len(blocks) :]) <= {-1}
        assert (ios.block_table[0, n:rows] == -1).all()
        assert ios.position_ids[:n].tolist() == past
        cu_k = ios.cumulative_seqlens_k["full_attention"][: rows + 1].tolist()
        assert [b - a for a, b in zip(cu_k, cu_k[1:])] == [p + 1 for p in past] + [0] * (rows - n)
        # the token each row samples from: its last sampled one, or the prompt token of a one-token prefill step (a
        # step of single tokens can also hold a prompt's last chunk: prepared from the states alone)
        expected = [
            t.generated_tokens[-1] if t.generated_tokens else t.initial_tokens[p] for t, p in zip(states, past)
        ]
        assert ios.input_ids[:n].tolist() == expected
        assert rows == min(1 << (n - 1).bit_length(), 6 * 4), "padded to a power of two rows, at most the requests"
        checked.append(n)
        return result

    monkeypatch.setattr(_upstream_decode, "_advance_table", compare)
    _run(model, tokenizer, prompts, monkeypatch, True, True, **sampling)
    assert len(checked) > 30, checked


def test_control_a_wrong_table_row_changes_the_samples(sharp_model, tokenizer, prompts, monkeypatch):
    """Control for the block-table layout: one page entry off in every fast step is caught by the comparison."""
    advance = _upstream_decode._advance_table

    def wrong(ios, allocators, host, *args):
        result = advance(ios, allocators, host, *args)
        if result is not None:  # another page of the cache (one lower, or one higher from page 0)
            ios.block_table[0, 0, 0] += -1 if ios.block_table[0, 0, 0] > 0 else 1
        return result

    ids, logprobs, _ = _run(sharp_model, tokenizer, prompts, monkeypatch, False, True)
    monkeypatch.setattr(_upstream_decode, "_advance_table", wrong)
    bad_ids, bad_logprobs, stats = _run(sharp_model, tokenizer, prompts, monkeypatch, True, True)
    assert stats.fast > 0
    assert (ids, logprobs) != (bad_ids, bad_logprobs)
