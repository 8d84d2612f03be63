"""Rollout-server benchmark (`trl-cb serve`): what an answer costs to move, and what the server sustains under load.

    python benchmarks/server.py                       # every default part: a few minutes on 2 CPU cores
    python benchmarks/server.py --quick               # ~1 min: a smoke run
    python benchmarks/server.py --parts scale         # 1,024 groups of 4 x 8,192 tokens in flight (minutes, ~5 GB)
    python benchmarks/server.py --parts openai        # 4 OpenAI JSON clients, 16 x 8 x 256 tokens: /health meanwhile

Parts (`--parts`); the first four use a **fake engine** (an answer's tokens exist at once, as Python lists like the
engine's, `--prompts` x `--n` completions of `--tokens` tokens): only payload work is measured.
- `encode`: the server's encoder and the client's decoder on one step's answer, in process, per encoding (`json`:
  `generation_routes.encode_choices`, read back by the response model; `binary`: `frames.frame_pieces`, read by
  `read_frames` / `decode_frame` into tensors), `--rounds` rounds interleaved, with `before` (pydantic
  `CompletionResponse` JSON both ways) as the reference. The lists TRL's input needs are timed too: completion ids
  (both trainers) and GRPO's (B, T) sampling logprobs (from lists TRL's per-token loop; from a binary answer the rows
  padded).
- `http`: a real uvicorn server process (`--serve-fake`) answering the whole step `--requests` times per encoding,
  while another process polls `/health` every 20 ms: request wall time, `RolloutClient.generate` wall time (decoded),
  and `/health` latency percentiles (the event loop's lag while the answer is produced).
- `controller`: the trainer's side of async rollouts (`RemoteRolloutController`) against that server: trainer CPU
  seconds per step, threads, `/health` latency meanwhile; `scale` (not by default): the same with `--scale-groups`
  groups in flight.
- `openai` (not by default): `--openai-clients` clients each send `--openai-requests` OpenAI JSON completions of
  `--openai-shape` prompts x samples x tokens (logprobs, the RL fields, text decoded with the tiny tokenizer) at once,
  while `/health` is polled: the event loop's lag while OpenAI answers are decoded and encoded.
The last two run a real server on the offline tiny model (`--model`):
- `load`: `--clients-sweep` closed-loop clients send one-prompt requests (`--n` samples, `--max-tokens`) for
  `--seconds`: requests/s and latency per client count.
- `mixed`: the same at `--clients` with traffic of one temperature or two (half 1.0, half 0.7), per engine setting:
  `per_request` (the server's default: per-request sampling settings in one engine) and `rebuild`
  (`per_request_processors=false`: a group with other settings waits for the engine to empty, which is rebuilt).
Every row is written to the JSON (and PNG) as soon as it is measured; a table at the end, the JSON as the last line.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import itertools
import json
import os
import random
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import requests

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
import plots  # noqa: E402

PARTS = ("encode", "http", "controller", "scale", "openai", "load", "mixed")
DEFAULT_PARTS = ("encode", "http", "controller", "load", "mixed")
#: The in-process part's encodings, in the order each round runs them ("before": the reference).
ENCODINGS = ("before", "json", "binary")
#: Engine settings of the `mixed` part, and its loads (the temperatures the clients alternate over).
ENGINES = {"per_request": {}, "rebuild": {"per_request_processors": False}}
LOADS = {"one": (1.0,), "two": (1.0, 0.7)}


# ------------------------------------------------------------------------------------------- the fake engine


def fake_group(prompt: list[int], n: int, tokens: int, seed: int) -> Any:
    """A finished group of `n` completions of `tokens` tokens with fp32 logprobs, as the engine hands them over."""
    import torch

    from trl_cb.rollouts.rollout_groups import RolloutGroup

    generator = torch.Generator().manual_seed(seed)
    group = RolloutGroup(row=None, prompt_ids=prompt, submitted_version=0)
    group.completion_ids = [torch.randint(5, 500, (tokens,), generator=generator).tolist() for _ in range(n)]
    group.logprobs = [(-torch.rand(tokens, generator=generator) * 5).tolist() for _ in range(n)]
    group.policy_logprobs = list(group.logprobs)  # the same lists, as `EngineLoop._collect` hands them over
    group.versions = [[0] * (tokens // 2) + [1] * (tokens - tokens // 2) for _ in range(n)]
    return group


def serve_fake(port: int, text: bool = False, gil_switch_interval_ms: float | None = None) -> None:
    """`--serve-fake PORT`: a real server app on uvicorn whose engine finishes every group at once (`fake_group`);
    with `text` (`--fake-text`) it has the tiny tokenizer, so OpenAI answers carry decoded text. A watched group (a
    stream) is fed to its watchers one token per sample per step on a thread of its own, as the engine's loop does,
    then finished."""
    import torch

    from trl_cb.offline.tiny import tiny_model, tiny_tokenizer
    from trl_cb.rollouts.rollout_groups import PartialSample
    from trl_cb.serving.engine_loop import Ticket
    from trl_cb.serving.server import create_app, serve

    torch.set_num_threads(1)
    tokenizer = tiny_tokenizer()
    model = tiny_model(tokenizer)
    model.config.max_position_embeddings = 16384  # 8,192-token completions pass the prompt checks
    app = create_app(model, api_key=None, tokenizer=tokenizer if text else None)
    made: dict[tuple[int, int, int], Any] = {}  # built once: the fake engine itself costs nothing per request

    def stepped(ticket: Ticket, group: Any) -> None:
        """The engine's side of a stream: every sample's tokens so far, step after step, then the finished group."""
        for step in range(1, len(group.completion_ids[0]) + 1):
            for k, ids in enumerate(group.completion_ids):
                lps = group.logprobs[k][:step]
                ticket.watcher(PartialSample(k, ids[:step], lps, lps, group.versions[k][:step]))
        ticket.finish(group)

    def submit(prompts, n, config, on_done=None, watchers=None, ignore_eos=False):
        watchers = watchers or [None] * len(prompts)
        tickets = [Ticket(list(p), n, config, on_done=on_done, watcher=w) for p, w in zip(prompts, watchers)]
        for seed, ticket in enumerate(tickets):
            key = (n, int(config.max_new_tokens), seed % 64)  # at most 64 distinct groups held: bounded memory
            if key not in made:
                made[key] = fake_group(ticket.prompt_ids, *key)
            if ticket.watcher is None:
                ticket.finish(made[key])
            else:
                threading.Thread(target=stepped, args=(ticket, made[key]), daemon=True).start()
        return tickets

    app.state.engine_loop.submit = submit
    serve(app, "127.0.0.1", port, gil_switch_interval_ms=gil_switch_interval_ms)  # as `trl-cb serve` runs it


@contextlib.contextmanager
def fake_server(text: bool = False, gil_switch_interval_ms: float | None = None) -> Iterator[str]:
    """A `--serve-fake` server process (`text`: with the tokenizer) on a free loopback port; yields its URL once
    `/health` answers from it (waited for while it progresses, `launch.wait_until_serving`; its exit or a stall fails
    at once with its log's tail)."""
    import tempfile

    from trl_cb.errors import RolloutServerError
    from trl_cb.serving.launch import shut_down, wait_until_serving
    from trl_cb.serving.weight_sync import free_port

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.NamedTemporaryFile(prefix="trl-cb-fake-serve-", suffix=".log") as log:
        proc = subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--serve-fake",
                str(port),
                *(["--fake-text"] if text else []),
                *([f"--gil-switch-interval-ms={gil_switch_interval_ms}"] if gil_switch_interval_ms else []),
            ],  # fmt: skip
            env={**os.environ, "PYTHONPATH": str(common.ROOT), "OMP_NUM_THREADS": "1"},
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            if not wait_until_serving(proc, url, log.name):
                raise RolloutServerError(f"the fake server exited with code {proc.returncode} during startup")
            yield url
        finally:
            shut_down(proc)


def warm(url: str, args: argparse.Namespace) -> None:
    """One request that makes the fake engine build every group it will hand out (before anything is timed)."""
    body = {"prompt": [[5] * 8] * 64, "n": args.n, "max_tokens": args.tokens}
    requests.post(url + "/v1/completions", json=body, timeout=600).raise_for_status()


@contextlib.contextmanager
def health_poller(url: str) -> Iterator[list[float]]:
    """Polls `url`'s `/health` every 20 ms from a separate process while the block runs (the latencies are the
    server's, not this process's GIL waits); the list receives the latencies (seconds) at the end."""
    latencies: list[float] = []
    child = subprocess.Popen(
        [sys.executable, __file__, "--poll-health", url], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    try:
        assert child.stdout.readline().strip() == b"ready"  # the first poll answered
        yield latencies
    finally:
        out, _ = child.communicate(timeout=120)  # closing stdin ends the polling
        latencies += json.loads(out)


def poll_health(url: str) -> None:
    """`--poll-health URL`: GET `/health` every 20 ms until stdin closes; print the latencies as one JSON list."""
    session = requests.Session()
    session.get(url + "/health", timeout=60)
    done = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
    print("ready", flush=True)
    latencies = []
    while not done.is_set():
        start = time.perf_counter()
        session.get(url + "/health", timeout=60)
        latencies.append(time.perf_counter() - start)
        time.sleep(0.02)
    print(json.dumps(latencies))


def health_stats(latencies: list[float]) -> dict[str, float]:
    return {
        "health_p50_ms": 1000 * common.percentile(latencies, 50),
        "health_p99_ms": 1000 * common.percentile(latencies, 99),
        "health_max_ms": 1000 * max(latencies),
        "health_polls": len(latencies),
    }


# ---------------------------------------------------------------------------------------------------- parts


def encode(args: argparse.Namespace) -> Iterator[tuple[tuple[str, str], dict[str, Any]]]:
    """Each encoding's encode + decode of one step's answer, `--rounds` rounds interleaved (medians; `x_before`: the
    median of each round's ratio to that round's `before`)."""
    groups = [fake_group([5] * 8, args.n, args.tokens, seed) for seed in range(args.prompts)]
    rounds = [{row["encoding"]: row for row in _encode_round(args, groups)} for _ in range(args.rounds)]
    keys = ("mib", "server_encode_s", "client_decode_s", "trl_lists_s", "grpo_sampling_s", "total_s")
    for encoding in ENCODINGS:
        runs = [r[encoding] for r in rounds]
        row = {key: statistics.median(run[key] for run in runs) for key in (*keys, "total_rloo_s", "total_grpo_s")}
        for total in ("total_s", "total_rloo_s", "total_grpo_s"):
            ratios = [r[encoding][total] / r["before"][total] for r in rounds]
            name = "x_before" + total[len("total") : -2]
            row.update({name: statistics.median(ratios), f"{name}_min": min(ratios), f"{name}_max": max(ratios)})
        yield ("encode", encoding), {**row, "rounds": len(runs), "headline": row["total_s"], "headline_unit": "s"}


def _encode_round(args: argparse.Namespace, groups: list[Any]) -> list[dict[str, Any]]:
    import torch

    from trl_cb.rollouts.rollout_groups import as_lists
    from trl_cb.serving.frames import decode_frame, frame_pieces, read_frames
    from trl_cb.serving.generation_routes import encode_choices, pack_choices
    from trl_cb.serving.protocol import Choice, CompletionRequest, CompletionResponse, PackedColumns
    from trl_cb.trainers.trl_internals import pad

    rows = []
    for encoding in ENCODINGS:
        body = CompletionRequest(
            prompt=[[5] * 8] * args.prompts, n=args.n, max_tokens=args.tokens,
            encoding="json" if encoding == "before" else encoding,
        )  # fmt: skip
        gc.collect()
        start = time.perf_counter()
        if encoding == "before":  # build every Choice, validate and dump the whole response in one call
            choices = [
                Choice(
                    index=i * args.n + k,
                    prompt_index=i,
                    token_ids=g.completion_ids[k],
                    logprobs=g.logprobs[k],
                    policy_logprobs=g.policy_logprobs[k],
                    weight_version=0,
                    token_weight_versions=g.versions[k],
                )  # fmt: skip
                for i, g in enumerate(groups)
                for k in range(args.n)
            ]
            payload = CompletionResponse(id="x", model="m", choices=choices, usage={}).model_dump_json().encode()
        elif encoding == "json":  # what `/v1/completions` runs per group, joined
            parts = [part for i, g in enumerate(groups) for part in encode_choices(g, i, body, {0})]
            payload = b'{"id": "x", "model": "m", "usage": {}, "choices": [' + b",".join(parts) + b"]}"
        else:  # binary: each group's arrays packed, then one frame's pieces (sent as they are, never joined)
            columns = PackedColumns()
            for i, g in enumerate(groups):
                columns.extend(pack_choices(g, i, body, {0}))
            payload = frame_pieces({"id": "x", "model": "m", "usage": {}}, columns)
        encoded = time.perf_counter()
        if encoding == "binary":  # the client's read: the frame into one buffer, then tensors viewing it
            (frame,) = read_frames(payload)
            _, choices = decode_frame(frame)
        else:
            choices = CompletionResponse.model_validate_json(payload).choices
        decoded = time.perf_counter()
        id_lists = as_lists([c.token_ids for c in choices])  # what TRL's input needs as lists (both trainers)
        listed = time.perf_counter()
        logps = [c.policy_logprobs for c in choices]  # GRPO's (B, T) sampling logprobs
        if encoding != "binary":
            logps = [torch.tensor([float("nan") if x is None else x for x in row]) for row in logps]
        sampling = pad([torch.as_tensor(row, dtype=torch.float32) for row in logps], padding_value=0.0)
        grpo_listed = time.perf_counter()
        assert len(choices) == args.prompts * args.n and len(id_lists[-1]) == args.tokens
        assert sampling.shape == (len(choices), args.tokens) and sampling.dtype == torch.float32
        trl_lists, grpo_lists = listed - decoded, grpo_listed - listed
        rows.append(
            {
                "encoding": encoding,
                "mib": (len(payload) if isinstance(payload, bytes) else sum(map(len, payload))) / 2**20,
                "server_encode_s": encoded - start, "client_decode_s": decoded - encoded, "trl_lists_s": trl_lists,
                "grpo_sampling_s": grpo_lists, "total_s": decoded - start,
                "total_rloo_s": decoded - start + trl_lists, "total_grpo_s": decoded - start + trl_lists + grpo_lists,
            }
        )  # fmt: skip
        del choices, payload, id_lists, logps, sampling  # freed here, not inside the next encoding's timing
    return rows


def over_http(args: argparse.Namespace) -> Iterator[tuple[tuple[str, str], dict[str, Any]]]:
    from trl_cb.serving.client import RolloutClient

    with fake_server() as url:
        warm(url, args)
        for encoding in args.encodings:
            body = {"prompt": [[5] * 8] * args.prompts, "n": args.n, "max_tokens": args.tokens, "encoding": encoding}
            if encoding == "json":  # OpenAI's answer, with what the trainer's client asks for (`RolloutClient`)
                body.update(logprobs=0, return_token_ids=True, detokenize=False)
            walls, sizes, client_walls = [], [], []
            with health_poller(url) as latencies:
                for _ in range(args.requests):
                    start = time.perf_counter()
                    response = requests.post(url + "/v1/completions", json=body, timeout=600)
                    response.raise_for_status()
                    walls.append(time.perf_counter() - start)
                    sizes.append(len(response.content))
                    del response
                client = RolloutClient([url], timeout=600, encoding=encoding)
                client.known_versions.add(1)  # the fake groups switch to version 1 halfway
                for _ in range(args.requests):
                    start = time.perf_counter()
                    result = client.generate([[5] * 8] * args.prompts, args.n, max_tokens=args.tokens)
                    client_walls.append(time.perf_counter() - start)
                    del result
            yield ("http", encoding), {
                "mib": sizes[-1] / 2**20, "request_wall_s": min(walls), "client_wall_s": min(client_walls),
                **health_stats(latencies), "headline": min(client_walls), "headline_unit": "s",
            }  # fmt: skip


def controller(
    args: argparse.Namespace, groups_in_flight: int | None = None
) -> Iterator[tuple[tuple[str, str], dict[str, Any]]]:
    """`RemoteRolloutController` (what the trainers use) at `--prompts` groups per step, `--prefetch-depth` steps
    ahead (or as many as hold `groups_in_flight`): CPU and wall seconds of the trainer process per step's worth of
    groups received, its rollout threads, and the server's `/health` latency meanwhile."""
    from trl_cb.serving.client import RolloutClient
    from trl_cb.serving.remote_rollouts import RemoteRolloutController

    depth = args.prefetch_depth if groups_in_flight is None else max(1, groups_in_flight // args.prompts - 1)
    with fake_server() as url:
        warm(url, args)
        client = RolloutClient([url], timeout=600, encoding=args.client_encoding)
        client.known_versions.add(1)
        stream = ((i, [5] * 8) for i in itertools.count())
        ctl = RemoteRolloutController(
            client, stream, args.n, args.prompts, {"max_tokens": args.tokens}, prefetch_depth=depth, max_staleness=10
        )
        threads_before = threading.active_count()
        peak_threads = 0
        with health_poller(url) as latencies:
            cpu0, wall0 = time.process_time(), time.perf_counter()
            ctl.start(0)
            for _ in range(args.steps + 1):
                groups, _ = ctl.take(args.prompts)
                peak_threads = max(peak_threads, threading.active_count() - threads_before)
                assert len(groups) == args.prompts and len(groups[0].completion_ids[0]) == args.tokens
                del groups
            while not all(group.completion_ids for group in ctl.pending_groups):  # the window's groups received too
                time.sleep(0.05)
            cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
            received = ctl.consumed_groups + ctl.outstanding_groups
            ctl.stop()
    part = "controller" if groups_in_flight is None else "scale"
    yield (part, args.client_encoding), {
        "groups_in_flight": (depth + 1) * args.prompts, "trainer_cpu_s_per_step": cpu * args.prompts / received,
        "step_wall_s": wall * args.prompts / received, "rollout_threads": peak_threads, **health_stats(latencies),
        "headline": cpu * args.prompts / received, "headline_unit": "trainer CPU s per step",
    }  # fmt: skip


def scale(args: argparse.Namespace) -> Iterator[tuple[tuple[str, str], dict[str, Any]]]:
    return controller(args, groups_in_flight=args.scale_groups)


@contextlib.contextmanager
def openai_server(args: argparse.Namespace) -> Iterator[str]:
    """The `openai` part's server: the fake (`--openai-engine fake`) or `trl-cb serve --model MODEL` (`real`)."""
    if args.openai_engine == "fake":
        with fake_server(text=True, gil_switch_interval_ms=args.gil_switch_interval_ms) as url:
            yield url
        return
    from trl_cb.serving.launch import local_rollout_server

    switch = ["--gil-switch-interval-ms", str(args.gil_switch_interval_ms)] if args.gil_switch_interval_ms else []
    with local_rollout_server(args.model, threads=args.server_threads, extra_args=switch) as server:
        yield server.url


def openai_json(args: argparse.Namespace) -> Iterator[tuple[tuple[str, str], dict[str, Any]]]:
    """`--openai-clients` threads, each sending `--openai-requests` OpenAI JSON completions back to back (all at once:
    the answers are built concurrently), on the fake engine with the tokenizer (`--openai-engine real`: `trl-cb serve
    --model MODEL`, whose engine thread samples every token); `/health` latency meanwhile."""
    prompts, n, tokens = args.openai_shape
    route, body = "/v1/completions", {"prompt": [[5] * 8] * prompts, "n": n, "max_tokens": tokens, "logprobs": 0}
    if args.openai_stream:  # streamed chat (one prompt per request): every sample's text comes in its last chunk here
        route, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": n, "stream": True,
                                               "max_tokens": tokens, "logprobs": True}  # fmt: skip
    body["return_token_ids"] = True
    with openai_server(args) as url:
        requests.post(url + route, json=body, timeout=600).raise_for_status()  # the fake groups (the engine) built
        walls: list[float] = []
        sizes: list[int] = []
        lock = threading.Lock()

        def client() -> None:
            session = requests.Session()
            for _ in range(args.openai_requests):
                start = time.perf_counter()
                response = session.post(url + route, json=body, timeout=600, stream=bool(args.openai_stream))
                response.raise_for_status()
                content = b"".join(response.iter_content(chunk_size=None))
                assert not args.openai_stream or content.endswith(b"data: [DONE]\n\n"), content[-200:]
                with lock:
                    walls.append(time.perf_counter() - start)
                    sizes.append(len(content))

        threads = [threading.Thread(target=client) for _ in range(args.openai_clients)]
        with health_poller(url) as latencies:
            started = time.perf_counter()
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            elapsed = time.perf_counter() - started
    assert len(walls) == args.openai_clients * args.openai_requests, "a client failed (its traceback is above)"
    shape = f"chat stream 1x{n}x{tokens}" if args.openai_stream else f"{prompts}x{n}x{tokens}"
    yield ("openai", f"{args.openai_clients} clients {shape} {args.openai_engine}"), {
        "clients": args.openai_clients, "requests": len(walls), "mib": statistics.median(sizes) / 2**20,
        "request_wall_s": statistics.median(walls), "requests_per_s": len(walls) / elapsed, **health_stats(latencies),
        "headline": health_stats(latencies)["health_p99_ms"], "headline_unit": "ms /health p99",
    }  # fmt: skip


def engine_builds(url: str) -> int:
    """The server's engine (re)builds so far (`/metrics` as JSON)."""
    return requests.get(url + "/metrics", headers={"Accept": "application/json"}, timeout=10).json()["engine_builds"]


def drive(url: str, temperatures: tuple[float, ...], clients: int, args: argparse.Namespace) -> dict[str, Any]:
    """`clients` closed-loop clients for `--seconds`: requests/s, latency percentiles, engine rebuilds."""
    rng = random.Random(0)
    prompts = [[rng.randrange(5, 200) for _ in range(args.prompt_len)] for _ in range(64)]
    for temperature in temperatures:  # warm: the engine is built (and sized) before the clock starts
        body = {"prompt": [prompts[0]], "n": args.n, "max_tokens": args.max_tokens, "temperature": temperature}
        requests.post(url + "/v1/completions", json=body, timeout=120).raise_for_status()
    builds_before = engine_builds(url)
    stop = time.monotonic() + args.seconds
    latencies: list[float] = []
    errors = [0]
    lock = threading.Lock()

    def client(index: int) -> None:
        session, k = requests.Session(), index
        while time.monotonic() < stop:
            body = {"prompt": [prompts[k % len(prompts)]], "n": args.n, "max_tokens": args.max_tokens}
            body["temperature"] = temperatures[index % len(temperatures)]
            k += clients
            start = time.monotonic()
            try:
                ok = session.post(url + "/v1/completions", json=body, timeout=300).status_code == 200
            except requests.RequestException:
                ok = False
            with lock:
                if ok:
                    latencies.append(time.monotonic() - start)
                else:
                    errors[0] += 1

    started = time.monotonic()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed = time.monotonic() - started  # includes the last requests' tails
    builds = engine_builds(url) - builds_before
    return {
        "clients": clients, "requests": len(latencies), "errors": errors[0],
        "requests_per_s": len(latencies) / elapsed, "samples_per_s": len(latencies) * args.n / elapsed,
        "latency_p50_s": common.percentile(latencies, 50) if latencies else None,
        "latency_p99_s": common.percentile(latencies, 99) if latencies else None,
        "engine_rebuilds": builds, "headline": len(latencies) / elapsed, "headline_unit": "requests/s",
    }  # fmt: skip


def load(args: argparse.Namespace) -> Iterator[tuple[tuple[str, str], dict[str, Any]]]:
    from trl_cb.serving.launch import local_rollout_server

    with local_rollout_server(args.model, threads=args.server_threads) as server:
        for clients in args.clients_sweep:
            yield ("load", f"{clients} clients"), drive(server.url, LOADS["one"], clients, args)


def mixed(args: argparse.Namespace) -> Iterator[tuple[tuple[str, str], dict[str, Any]]]:
    from trl_cb.serving.launch import local_rollout_server

    for engine in args.engines:
        for name, temperatures in LOADS.items():
            extra = ["--continuous_batching_config", json.dumps(ENGINES[engine])] if ENGINES[engine] else []
            with local_rollout_server(args.model, threads=args.server_threads, extra_args=extra) as server:
                row = drive(server.url, temperatures, args.clients, args)
            yield ("mixed", f"{engine} {name}"), {**row, "temperatures": list(temperatures)}


# -------------------------------------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", nargs="+", default=list(DEFAULT_PARTS), choices=PARTS)
    g = p.add_argument_group("fake engine (encode, http, controller, scale)")
    g.add_argument("--prompts", type=int, default=64)
    g.add_argument("--n", type=int, default=4, help="completions per prompt (prompts x n = the step's answer)")
    g.add_argument("--tokens", type=int, default=8192)
    g.add_argument("--requests", type=int, default=2, help="http: requests per encoding (the fastest is kept)")
    g.add_argument("--rounds", type=int, default=3, help="encode: rounds of every encoding, interleaved")
    g.add_argument("--encodings", nargs="+", default=["json", "binary"], choices=["json", "binary"])
    g.add_argument("--client-encoding", default="binary", choices=["json", "binary"], help="controller, scale")
    g.add_argument("--prefetch-depth", type=int, default=1, help="controller: steps requested ahead")
    g.add_argument("--steps", type=int, default=3, help="controller: steps timed (after the first)")
    g.add_argument("--scale-groups", type=int, default=1024, help="scale: groups in flight")
    g.add_argument("--openai-clients", type=int, default=4, help="openai: concurrent clients")
    g.add_argument("--openai-requests", type=int, default=3, help="openai: requests per client")
    g.add_argument(
        "--openai-stream", action="store_true", help="openai: streamed chat completions (n x tokens each) instead"
    )
    g.add_argument(
        "--openai-engine", choices=["fake", "real"], default="fake",
        help="openai: the fake engine, or `trl-cb serve --model MODEL` (`--server-threads`)",
    )  # fmt: skip
    g.add_argument(
        "--openai-shape", type=int, nargs=3, default=[16, 8, 256], metavar=("PROMPTS", "N", "TOKENS"), help="openai"
    )
    g = p.add_argument_group("real server (load, mixed)")
    g.add_argument("--model", default="trl-cb/tiny", help="what `trl-cb serve --model` takes")
    g.add_argument("--clients-sweep", type=int, nargs="+", default=[1, 4, 16], help="load: client counts")
    g.add_argument("--clients", type=int, default=16, help="mixed: clients")
    g.add_argument("--engines", nargs="+", default=list(ENGINES), choices=list(ENGINES), help="mixed")
    g.add_argument("--seconds", type=float, default=8.0, help="seconds per load")
    g.add_argument("--max-tokens", type=int, default=32)
    g.add_argument("--prompt-len", type=int, default=24)
    g.add_argument("--server-threads", type=int, default=1)
    p.add_argument(
        "--gil-switch-interval-ms", type=float, default=None,
        help="openai: the fake server's GIL hand-over interval (`trl-cb serve --gil-switch-interval-ms`)",
    )  # fmt: skip
    p.add_argument("--serve-fake", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--fake-text", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--poll-health", default=None, help=argparse.SUPPRESS)
    common.add_options(p, "server")
    args = p.parse_args(argv)
    if args.serve_fake is not None or args.poll_health is not None or args.replot:
        return args
    common.finish_options(p, args)
    if args.quick:
        args.prompts, args.n, args.tokens, args.requests, args.steps, args.rounds = 16, 4, 1024, 1, 1, 1
        args.clients_sweep, args.clients, args.seconds, args.max_tokens = [1, 4], 4, 2.0, 8
        args.openai_requests = 1
    return args


def print_table(points: list[dict[str, Any]]) -> None:
    columns = [("part", "part"), ("label", "row"), ("mib", "MiB"), ("server_encode_s", "encode s"),
               ("client_decode_s", "decode s"), ("total_s", "total s"), ("x_before", "x before"),
               ("x_before_rloo", "x before rloo"), ("x_before_grpo", "x before grpo"),
               ("request_wall_s", "request s"), ("client_wall_s", "client s"), ("health_p50_ms", "/health p50 ms"),
               ("health_p99_ms", "/health p99 ms"), ("groups_in_flight", "groups in flight"),
               ("trainer_cpu_s_per_step", "trainer CPU s/step"), ("step_wall_s", "step s"),
               ("rollout_threads", "threads"), ("requests_per_s", "req/s"), ("samples_per_s", "samples/s"),
               ("latency_p50_s", "p50 s"), ("latency_p99_s", "p99 s"), ("engine_rebuilds", "rebuilds"),
               ("errors", "errors")]  # fmt: skip
    rows = [{"part": p["key"][0], "label": p["key"][1], **p} for p in points]
    print(common.format_table(rows, columns))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.serve_fake is not None:
        serve_fake(args.serve_fake, text=args.fake_text, gil_switch_interval_ms=args.gil_switch_interval_ms)
        return {}
    if args.poll_health is not None:
        poll_health(args.poll_health)
        return {}
    if common.other_mode(args, None, plots.render_server):
        return {}
    parts = {"encode": encode, "http": over_http, "controller": controller, "scale": scale, "load": load}
    parts.update(mixed=mixed, openai=openai_json)
    results = common.ResultFile("server", args, render=plots.render_server)
    print(f"rows are written to {results.path} as they are measured", flush=True)
    for name in args.parts:
        if any(p["key"][0] == name for p in results.points):  # `--resume`: a part whose rows are in is done
            continue
        try:
            for key, row in parts[name](args):
                results.add(key, row)
                print(f"  {' '.join(key)}: {row['headline']:.4g} {row['headline_unit']}", flush=True)
        except Exception as exc:  # noqa: BLE001 - one part's failure must not cost the others' rows
            results.fail((name,), f"{type(exc).__name__}: {exc}")
    return results.finish(lambda payload: print_table(payload["points"]))


if __name__ == "__main__":
    main()
