"""Every engine method trl_cb changes is set in one module, `engine/_upstream_patches.py`, once per engine.

Read from the source (ast): an assignment to one of transformers' engine methods anywhere else in trl_cb fails, except
the two temporary swaps a wrapper makes and undoes within one call (listed with their reason). Then, on a built engine,
each method trl_cb changes is a trl_cb function (so `install` reached it), and the graph is the innermost
`compute_batch` layer: the mask placeholder is in the batch before a graph captures or replays it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import torch

import trl_cb
from tests.conftest import sampling_config
from tests.graph_fakes import use_fake_graphs
from trl_cb import ContinuousBatchingGenerator
from trl_cb.engine import decode_graphs

PACKAGE = Path(trl_cb.__file__).parent
#: The engine methods trl_cb changes (model runner, IOs, scheduler, batch processor, cache, manager).
ENGINE_METHODS = {
    "compute_batch", "_sample", "maybe_pad_inputs", "prepare_batch_update", "schedule_batch",
    "prepare_batch_tensors", "update_batch", "update", "_run_generation_loop", "mark_complete_blocks",
    "compute_block_hash",
    "forward",  # a hybrid's token-mixer classes (class-level: every model of the family in the process)
}  # fmt: skip
#: (module, method): swapped for the duration of one call and restored in a `finally`, not a patch.
TEMPORARY_SWAPS = {
    ("trl_cb/engine/_upstream_decode.py", "prepare_batch_update"),  # upstream's update_batch run on some rows only
    ("trl_cb/engine/_upstream_cache.py", "get_read_indices"),  # allocators report no reads while tensors build them
}


def _assignments(path: Path) -> list[tuple[str, int]]:
    """(method, line) of every `x.method = ...` / `setattr(x, "method", ...)` in `path` for an engine method."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        targets = node.targets if isinstance(node, ast.Assign) else []
        if isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        for target in targets:
            for leaf in ast.walk(target):
                if isinstance(leaf, ast.Attribute) and leaf.attr in ENGINE_METHODS:
                    found.append((leaf.attr, node.lineno))
    return found


def test_engine_methods_are_assigned_only_in_the_patches_module():
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = str(path.relative_to(PACKAGE.parent))
        if relative == "trl_cb/engine/_upstream_patches.py":
            continue
        for method, line in _assignments(path):
            if (relative, method) not in TEMPORARY_SWAPS:
                offenders.append(f"{relative}:{line} sets {method}")
    assert not offenders, offenders
    # Control: the scan does see the patches module's assignments.
    assert {m for m, _ in _assignments(PACKAGE / "engine" / "_upstream_patches.py")} >= {
        "compute_batch", "_sample", "prepare_batch_tensors", "update_batch", "schedule_batch", "update", "forward",
    }  # fmt: skip


#: Engine modules that may `setattr`: the patch module, the gateway that builds the engine (its build-time marks), two
#: that set attributes on their own objects (a copied module's parameters, a key tensor's read index), and the cache
#: geometry, which swaps names of transformers' cache module only while an engine is built (restored after; no engine
#: object is touched: tests/unit/engine/test_cache_geometry.py).
SETATTR_ALLOWED = {
    "_upstream_patches.py",
    "_upstream.py",
    "precision.py",
    "_upstream_cache.py",
    "_upstream_geometry.py",
}


def _setattr_calls(source: str) -> list[int]:
    return [
        node.lineno
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr"
    ]


def test_feature_modules_keep_nothing_on_engine_objects():
    """A feature's state on the engine (the fast path's counters and last batch, the decode graphs) is attached by
    `install`: the feature modules build it and hand it back."""
    offenders = [
        f"{path.name}:{line}"
        for path in sorted((PACKAGE / "engine").glob("*.py"))
        if path.name not in SETATTR_ALLOWED
        for line in _setattr_calls(path.read_text())
    ]
    assert not offenders, offenders
    assert _setattr_calls("setattr(processor, NAME, stats)") == [1]  # control: the scan sees a setattr


def test_a_built_engine_runs_the_composed_methods_with_the_graph_innermost(model, tokenizer, prompts, monkeypatch):
    use_fake_graphs(monkeypatch)
    placeholder_seen = []
    with ContinuousBatchingGenerator(model, sampling_config(tokenizer, max_new_tokens=8)) as gen:
        gen.generate(prompts[:2], num_generations=2)
        manager = gen._pool.engine.manager
        processor = manager.batch_processor
        runner, ios = processor.model_runner, processor.inputs_and_outputs
        for method in (runner.compute_batch, runner._sample, ios.prepare_batch_tensors, processor.update_batch,
                       processor.scheduler.schedule_batch, runner.maybe_pad_inputs):  # fmt: skip
            assert method.__module__.startswith("trl_cb."), f"{method} is upstream's: install missed it"
        forward = runner._forward_process_and_sample

        def record(module, batch_data, *args):  # what a captured or replayed step is given
            placeholder_seen.append(isinstance(batch_data.get("attention_mask"), torch.Tensor))
            return forward(module, batch_data, *args)

        runner._forward_process_and_sample = record
        gen.generate(prompts[:2], num_generations=2)
        graphs = decode_graphs.graphs_of(manager)
    assert graphs.replays > 0
    assert placeholder_seen and all(placeholder_seen), "a graph step ran without the mask placeholder"
