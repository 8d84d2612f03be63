"""A graph backend for CPU tests of `trl_cb.engine.decode_graphs`: it replays what a CUDA graph would read.

A CUDA graph replays the kernels of its capture on the *addresses* they read then: a weight updated in place is seen,
a weight whose storage moved is not (the graph reads the old, freed memory). `FakeGraph` emulates exactly that on the
CPU: it keeps the parameter tensors its capture saw and, at replay, runs the step with the module's parameters pointed
back at them. An in-place update reaches those tensors; a moved parameter leaves them stale. So a test that replays
without the engine's re-capture check produces wrong logprobs, as a real stale graph would.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class FakeGraph:
    def __init__(self, run: Callable[[], None], module: torch.nn.Module) -> None:
        self.run = run
        self.module = module
        self.captured = {name: p.data for name, p in module.named_parameters(remove_duplicate=False)}

    def replay(self) -> None:
        params = dict(self.module.named_parameters(remove_duplicate=False))
        live = {name: p.data for name, p in params.items()}
        for name, p in params.items():
            p.data = self.captured[name]
        try:
            self.run()
        finally:
            for name, p in params.items():
                p.data = live[name]


class FakeGraphBackend:
    """Capture = one eager run (the step's result, as the CUDA backend's warm run) and a `FakeGraph` of it."""

    def __init__(self) -> None:
        self.graphs: list[FakeGraph] = []

    def capture(self, run: Callable[[], None], stream: object, module: torch.nn.Module) -> FakeGraph:
        run()
        graph = FakeGraph(run, module)
        self.graphs.append(graph)
        return graph


def use_fake_graphs(monkeypatch) -> FakeGraphBackend:
    """Give CPU engines decode graphs (through the fake backend) by default, as CUDA engines have them."""
    from trl_cb.engine import decode_graphs

    backend = FakeGraphBackend()
    monkeypatch.setattr(decode_graphs, "backend_for", lambda device: backend)
    monkeypatch.setattr(decode_graphs, "backend_available", lambda device: True)
    return backend
