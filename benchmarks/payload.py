"""Rollout-server payload cost at GPU-scale answers: JSON lists vs packed arrays vs binary frames, and the event loop
meanwhile.

    python benchmarks/payload.py                      # 256 completions x 8,192 tokens per step
    python benchmarks/payload.py --quick              # 64 x 1,024 tokens: a smoke run

    python benchmarks/payload.py --parts scale        # 1,024 groups of 4 x 8,192 tokens in flight (minutes, ~5 GB)

Parts, all with a **fake engine** (the answer's tokens exist at once, as Python lists like the engine's; only payload
work is measured):
1. `in-process`: the server's encoder (`server.encode_choices` for JSON, `server.pack_choices` then
   `PackedColumns.json_pieces` for packed, `frames.frame_pieces` for binary: the code `/v1/completions` runs) and the
   client's decoder (`RolloutClient`'s parse: the response model, then `PackedChoices.unpack`; binary: `read_frames`
   and `decode_frame`, into tensors) on one step's answer, per encoding, `--rounds` rounds with the encodings
   interleaved; "before" is what the code before issue 27 did (pydantic `CompletionResponse` JSON both ways);
   `x before` is the median of each round's ratio. Every path but binary ends in Python lists; binary ends in
   tensors, and the lists TRL's input format needs are timed on their own: completion ids (`trl lists s`, both
   trainers: TRL decodes and pads lists). GRPO also needs its (B, T) sampling logprobs (`+grpo sampling s`): from
   lists TRL builds them with a per-token loop and pads them (before binary answers GRPO handed TRL lists); from a
   binary answer the trainer pads the tensors. `x before rloo` / `x before grpo` compare totals with that work
   included on both sides (each path against "before" doing the same trainer's work).
   `pack`: the server's ways to turn the engine's lists into bytes (`struct.pack`, `array.array`, numpy, torch), timed
   on the same lists, interleaved.
2. `http`: a real `uvicorn` server process whose engine answers instantly (`--serve-fake`): one client thread asks for
   the whole step's answer `--requests` times per encoding while another process polls `/health` every 20 ms; the
   table gives the request's wall time (raw `requests`, body read), `RolloutClient.generate`'s wall time (body read
   and decoded into what the client returns) and `/health` latency percentiles (the event loop's lag while the answer
   is produced).
3. `controller`: the trainer's side of async rollouts (`RemoteRolloutController`) against that server: trainer CPU
   seconds per step, threads, `/health` latency meanwhile; `scale`: the same with `--scale-groups` (1,024) in flight.
Prints a table, then one JSON document as the last line.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import itertools
import json
import os
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

from common import DEFAULT_OUT, OUT_HELP, environment, format_table, percentile, write_json  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
#: The in-process part's encodings, in the order each round runs them.
ENCODINGS = ("before", "json", "packed", "binary")


def fake_group(prompt: list[int], n: int, tokens: int, seed: int) -> Any:
    """A finished group of `n` completions of `tokens` tokens with fp32 logprobs, as the engine hands them over."""
    import torch

    from trl_cb.rollouts.rollout_groups import RolloutGroup

    generator = torch.Generator().manual_seed(seed)
    group = RolloutGroup(row=None, prompt_ids=prompt, submitted_version=0)
    group.completion_ids = [torch.randint(5, 500, (tokens,), generator=generator).tolist() for _ in range(n)]
    group.logprobs = [(-torch.rand(tokens, generator=generator) * 5).tolist() for _ in range(n)]
    group.policy_logprobs = list(group.logprobs)  # the same lists, as `ServingEngine._collect` hands them over
    group.versions = [[0] * (tokens // 2) + [1] * (tokens - tokens // 2) for _ in range(n)]
    return group


def in_process(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Encode and decode one step's answer per encoding, with the server's and the client's code, `--rounds` times
    (medians; `x_before` is the median of each round's ratio to that round's "before")."""
    groups = [fake_group([5] * 8, args.n, args.tokens, seed) for seed in range(args.prompts)]
    rounds: list[dict[str, dict[str, Any]]] = []
    for _ in range(args.rounds):  # the encodings interleaved, so that load from other jobs hits all of them alike
        rounds.append({row["encoding"]: row for row in _in_process_round(args, groups)})
    rows = []
    for encoding in ENCODINGS:
        runs = [r[encoding] for r in rounds]
        keys = ("mib", "server_encode_s", "client_decode_s", "trl_lists_s", "grpo_sampling_s", "total_s")
        keys += ("total_rloo_s", "total_grpo_s")
        row = {key: statistics.median(run[key] for run in runs) for key in keys}
        ratios = [r[encoding]["total_s"] / r["before"]["total_s"] for r in rounds]
        row.update(part="in-process", encoding=encoding, rounds=len(runs), x_before=statistics.median(ratios))
        row.update(x_before_min=min(ratios), x_before_max=max(ratios), total_s_all=[run["total_s"] for run in runs])
        for trainer in ("rloo", "grpo"):  # each against "before" doing the same trainer's work
            ratios = [r[encoding][f"total_{trainer}_s"] / r["before"][f"total_{trainer}_s"] for r in rounds]
            row[f"x_before_{trainer}"] = statistics.median(ratios)
            row[f"x_before_{trainer}_min"], row[f"x_before_{trainer}_max"] = min(ratios), max(ratios)
        rows.append(row)
    return rows


def pack_paths(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The server's ways to turn the engine's per-token lists (one step's answer) into little-endian bytes, each
    exact, timed on the same lists with the ways interleaved, `--rounds` rounds (medians)."""
    import array
    import struct

    import numpy as np
    import torch

    groups = [fake_group([5] * 8, args.n, args.tokens, seed) for seed in range(args.prompts)]
    ids = [row for g in groups for row in g.completion_ids]
    logprobs = [row for g in groups for row in g.logprobs]
    ways = {
        "struct.pack": lambda rows, code: [struct.pack(f"<{len(r)}{code}", *r) for r in rows],
        "array.array": lambda rows, code: [array.array(code, r).tobytes() for r in rows],
        "numpy.array": lambda rows, code: [np.array(r, dtype=f"<{code}4").tobytes() for r in rows],
        "torch.tensor": lambda rows, code: [
            torch.tensor(r, dtype=torch.int32 if code == "i" else torch.float32).numpy().tobytes() for r in rows
        ],
    }
    reference = {code: ways["struct.pack"](rows, code) for code, rows in (("i", ids), ("f", logprobs))}
    times: dict[str, list[float]] = {way: [] for way in ways}
    for _ in range(args.rounds):
        for way, pack in ways.items():
            start = time.perf_counter()
            packed = {"i": pack(ids, "i"), "f": pack(logprobs, "f")}
            times[way].append(time.perf_counter() - start)
            assert packed == reference, way  # exact: the same bytes every way
            del packed
    return [{"part": "pack", "encoding": way, "server_encode_s": statistics.median(t)} for way, t in times.items()]


def _in_process_round(args: argparse.Namespace, groups: list[Any]) -> list[dict[str, Any]]:
    """One encode and decode of the step's answer per encoding."""
    import torch

    from trl_cb.rollouts.rollout_groups import as_lists
    from trl_cb.serving.frames import decode_frame, frame_pieces, read_frames
    from trl_cb.serving.protocol import (
        Choice,
        CompletionRequest,
        CompletionResponse,
        PackedColumns,
        PackedCompletionResponse,
    )
    from trl_cb.serving.server import encode_choices, pack_choices
    from trl_cb.trainers.trl_internals import pad

    rows = []
    for encoding in ENCODINGS:
        body = CompletionRequest(
            prompt=[[5] * 8] * args.prompts,
            n=args.n,
            max_tokens=args.tokens,
            encoding="json" if encoding == "before" else encoding,
        )
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
                )
                for i, g in enumerate(groups)
                for k in range(args.n)
            ]
            payload = CompletionResponse(id="x", model="m", choices=choices, usage={}).model_dump_json().encode()
        elif encoding == "json":  # what `/v1/completions` runs per group, joined
            parts = [part for i, g in enumerate(groups) for part in encode_choices(g, i, body, {0})]
            payload = b'{"id": "x", "model": "m", "usage": {}, "choices": [' + b",".join(parts) + b"]}"
        elif encoding == "packed":  # each group's arrays packed, then the answer's buffers encoded once
            columns = PackedColumns()
            for i, g in enumerate(groups):
                columns.extend(pack_choices(g, i, body, {0}))
            payload = b'{"id": "x", "model": "m", "usage": {}, "choices": ' + b"".join(columns.json_pieces()) + b"}"
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
            answer_type = PackedCompletionResponse if encoding == "packed" else CompletionResponse
            choices = answer_type.model_validate_json(payload).choices
            if encoding == "packed":
                choices = choices.unpack()
        decoded = time.perf_counter()
        # What TRL's input format needs as lists (a no-op where the answer already holds lists): the completion ids
        # (both trainers). Then GRPO's (B, T) sampling logprobs: from lists, TRL's own per-token loop and padding (what
        # GRPO did with every answer before binary ones); from a binary answer, the rows padded (`_cb_score`)
        id_lists = as_lists([c.token_ids for c in choices])
        listed = time.perf_counter()
        logps = [c.policy_logprobs for c in choices]
        if encoding != "binary":
            logps = [torch.tensor([float("nan") if x is None else x for x in row]) for row in logps]
        sampling = pad([torch.as_tensor(row, dtype=torch.float32) for row in logps], padding_value=0.0)
        grpo_listed = time.perf_counter()
        assert len(choices) == args.prompts * args.n and len(id_lists[-1]) == args.tokens
        assert sampling.shape == (len(choices), args.tokens) and sampling.dtype == torch.float32
        trl_lists, grpo_lists = listed - decoded, grpo_listed - listed
        rows.append(
            {
                "part": "in-process",
                "encoding": encoding,
                "mib": (len(payload) if isinstance(payload, bytes) else sum(map(len, payload))) / 2**20,
                "server_encode_s": encoded - start,
                "client_decode_s": decoded - encoded,
                "trl_lists_s": trl_lists,
                "grpo_sampling_s": grpo_lists,
                "total_s": decoded - start,
                "total_rloo_s": decoded - start + trl_lists,
                "total_grpo_s": decoded - start + trl_lists + grpo_lists,
            }
        )
        del choices, payload, id_lists, logps, sampling  # freed here, not inside the next encoding's timing
    return rows


def serve_fake(port: int) -> None:
    """`--serve-fake`: a real server app on uvicorn whose engine finishes every group at once (`fake_group`)."""
    import torch
    import uvicorn

    from trl_cb.offline.tiny import tiny_model, tiny_tokenizer
    from trl_cb.serving.engine import Ticket
    from trl_cb.serving.server import create_app

    torch.set_num_threads(1)
    model = tiny_model(tiny_tokenizer())
    model.config.max_position_embeddings = 16384  # 8,192-token completions pass the prompt checks
    app = create_app(model, api_key=None)
    engine = app.state.engine

    made: dict[tuple[int, int, int], Any] = {}  # built once: the fake engine itself costs nothing per request

    def submit(prompts, n, config, on_done=None, watchers=None):  # no watcher: nothing streams here
        tickets = [Ticket(list(p), n, config, on_done=on_done) for p in prompts]
        for seed, ticket in enumerate(tickets):
            key = (n, int(config.max_new_tokens), seed % 64)  # at most 64 distinct groups held: bounded memory
            if key not in made:
                made[key] = fake_group(ticket.prompt_ids, *key)
            ticket.finish(made[key])
        return tickets

    engine.submit = submit
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


@contextlib.contextmanager
def fake_server() -> Iterator[str]:
    """A `--serve-fake` server process on a free loopback port; yields its URL once `/health` answers from it (waited
    for while it progresses, `launch.wait_until_serving`; its exit or a stall fails at once with its log's tail)."""
    import tempfile

    from trl_cb.errors import RolloutServerError
    from trl_cb.serving.launch import shut_down, wait_until_serving
    from trl_cb.serving.weight_sync import free_port

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env_path = {"PYTHONPATH": str(ROOT)}
    with tempfile.NamedTemporaryFile(prefix="trl-cb-fake-serve-", suffix=".log") as log:
        proc = subprocess.Popen(
            [sys.executable, __file__, "--serve-fake", str(port)],
            env={**os.environ, **env_path, "OMP_NUM_THREADS": "1"},
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
    """One request that makes the fake engine build every group it will hand out (64 distinct ones, on the server's
    event loop: done before anything is timed)."""
    body = {"prompt": [[5] * 8] * 64, "n": args.n, "max_tokens": args.tokens}
    requests.post(url + "/v1/completions", json=body, timeout=600).raise_for_status()


@contextlib.contextmanager
def health_poller(url: str) -> Iterator[list[float]]:
    """Polls `url`'s `/health` every 20 ms from a separate process while the block runs (so that the latencies are the
    server's, not this process's threads' GIL waits); yields the list the latencies (seconds) land in at the end."""
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
        "health_p50_ms": 1000 * percentile(latencies, 50),
        "health_p99_ms": 1000 * percentile(latencies, 99),
        "health_max_ms": 1000 * max(latencies),
        "health_polls": len(latencies),
    }


def over_http(args: argparse.Namespace) -> list[dict[str, Any]]:
    from trl_cb.serving.client import RolloutClient

    with fake_server() as url:
        rows = []
        warm(url, args)
        for encoding in args.encodings:
            body = {"prompt": [[5] * 8] * args.prompts, "n": args.n, "max_tokens": args.tokens, "encoding": encoding}
            walls, sizes = [], []
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
                client_walls = []
                for _ in range(args.requests):
                    start = time.perf_counter()
                    result = client.generate([[5] * 8] * args.prompts, args.n, max_tokens=args.tokens)
                    client_walls.append(time.perf_counter() - start)
                    del result
            rows.append(
                {
                    "part": "http",
                    "encoding": encoding,
                    "mib": sizes[-1] / 2**20,
                    "request_wall_s": min(walls),
                    "client_wall_s": min(client_walls),
                    **health_stats(latencies),
                }
            )
        return rows


def controller(args: argparse.Namespace, groups_in_flight: int | None = None) -> list[dict[str, Any]]:
    """The trainer's side of async rollouts from a server (`RemoteRolloutController`, what the trainers use) at
    `--prompts` groups of `--n` x `--tokens` per step, `--prefetch-depth` steps ahead (or as many as hold
    `groups_in_flight`): CPU seconds of the whole trainer process (its rollout threads included) and wall seconds per
    step's worth of groups received (`--steps` + 1 taken, then the window's received: from `start` until every group
    requested has arrived), threads, and the server's `/health` latency meanwhile."""
    from trl_cb.serving.client import RolloutClient
    from trl_cb.serving.remote_rollouts import RemoteRolloutController

    depth = args.prefetch_depth if groups_in_flight is None else max(1, groups_in_flight // args.prompts - 1)
    with fake_server() as url:
        warm(url, args)
        client = RolloutClient([url], timeout=600, encoding=args.client_encoding)
        client.known_versions.add(1)  # the fake groups switch to version 1 halfway
        stream = ((i, [5] * 8) for i in itertools.count())
        sampling = {"max_tokens": args.tokens}
        ctl = RemoteRolloutController(
            client, stream, args.n, args.prompts, sampling, prefetch_depth=depth, max_staleness=10
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
    return [
        {
            "part": "controller" if groups_in_flight is None else "scale",
            "encoding": getattr(client, "encoding", "json"),
            "groups_in_flight": (depth + 1) * args.prompts,
            "trainer_cpu_s_per_step": cpu * args.prompts / received,
            "step_wall_s": wall * args.prompts / received,
            "rollout_threads": peak_threads,
            **health_stats(latencies),
        }
    ]


def scale(args: argparse.Namespace) -> list[dict[str, Any]]:
    """`controller` with `--scale-groups` groups in flight (issue 27's scale test: 1,024)."""
    return controller(args, groups_in_flight=args.scale_groups)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--n", type=int, default=4, help="completions per prompt (prompts x n = the step's answer)")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--requests", type=int, default=2, help="HTTP requests per encoding (the fastest is kept)")
    parser.add_argument("--rounds", type=int, default=3, help="in-process part: rounds of every encoding, interleaved")
    parser.add_argument("--scale-groups", type=int, default=1024, help="scale part: groups in flight")
    parser.add_argument("--quick", action="store_true", help="64 completions x 1,024 tokens, one request")
    parser.add_argument(
        "--parts",
        nargs="+",
        default=["in-process", "http", "controller"],
        choices=["in-process", "pack", "http", "controller", "scale"],
        help="scale: the controller part with --scale-groups groups in flight (not run by default: minutes, GBs)",
    )
    parser.add_argument("--prefetch-depth", type=int, default=1, help="controller part: steps requested ahead")
    parser.add_argument("--steps", type=int, default=3, help="controller part: steps timed (after the first)")
    parser.add_argument(
        "--encodings",
        nargs="+",
        default=["json", "packed", "binary"],
        choices=["json", "packed", "binary"],
        help="HTTP part: answer encodings asked for (a server from before issue 27 answers JSON only)",
    )
    parser.add_argument(
        "--client-encoding",
        default="binary",
        choices=["json", "packed", "binary"],
        help="controller and scale parts: the answers the trainer's client asks for",
    )
    parser.add_argument("--serve-fake", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--poll-health", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=OUT_HELP)
    args = parser.parse_args()
    if args.serve_fake is not None:
        serve_fake(args.serve_fake)
        return
    if args.poll_health is not None:
        poll_health(args.poll_health)
        return
    if args.quick:
        args.prompts, args.n, args.tokens, args.requests, args.steps, args.rounds = 16, 4, 1024, 1, 1, 1
    parts = {"in-process": in_process, "pack": pack_paths, "http": over_http, "controller": controller, "scale": scale}
    rows = [row for name in args.parts for row in parts[name](args)]
    columns = [
        ("part", "part"),
        ("encoding", "encoding"),
        ("mib", "MiB"),
        ("server_encode_s", "encode s"),
        ("client_decode_s", "decode s"),
        ("total_s", "total s"),
        ("x_before", "x before"),
        ("trl_lists_s", "trl lists s"),
        ("x_before_rloo", "x before rloo"),
        ("grpo_sampling_s", "+grpo sampling s"),
        ("x_before_grpo", "x before grpo"),
        ("request_wall_s", "request s"),
        ("client_wall_s", "client s"),
        ("health_p50_ms", "/health p50 ms"),
        ("health_p99_ms", "/health p99 ms"),
        ("health_max_ms", "/health max ms"),
        ("groups_in_flight", "groups in flight"),
        ("trainer_cpu_s_per_step", "trainer CPU s/step"),
        ("step_wall_s", "step s"),
        ("rollout_threads", "threads"),
    ]
    print(format_table(rows, columns))
    hidden = ("serve_fake", "poll_health")
    config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k not in hidden}
    payload = {"benchmark": "payload", "config": config, "env": environment("cpu"), "points": rows}
    path = write_json(payload, args.out, "payload")
    print(f"wrote {path}", file=sys.stderr)
    print(json.dumps(payload))


if __name__ == "__main__":
    main()
