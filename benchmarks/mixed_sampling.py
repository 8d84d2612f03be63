"""Rollout-server throughput when its traffic mixes sampling settings: one temperature vs two, same load.

    python benchmarks/mixed_sampling.py                       # tiny model, 16 clients, 8 s per load, both engines
    python benchmarks/mixed_sampling.py --clients 32 --seconds 20 --engines per_request
    python benchmarks/mixed_sampling.py --quick               # a few seconds, for the test that keeps it from rotting

`--clients` threads each send one-prompt requests (`n` samples, `--max-tokens` tokens) back to back to one local
`trl-cb serve` replica for `--seconds`; in the `two` load half the clients ask for temperature 1.0 and half for 0.7,
in the `one` load all ask for 1.0. Engines: `per_request` (the server's default: transformers' per-request warpers,
one engine for every setting) and `rebuild` (`per_request_processors=false`: a group with other settings waits for
the engine to empty, which is rebuilt, the behaviour before issue 27). Each (engine, load) gets a fresh server.
Prints a table, then one JSON document as the last line.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import threading
import time
from pathlib import Path
from typing import Any

import requests

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import DEFAULT_OUT, OUT_HELP, environment, format_table, percentile, write_json  # noqa: E402

ENGINES = {"per_request": {}, "rebuild": {"per_request_processors": False}}
LOADS = {"one": (1.0,), "two": (1.0, 0.7)}


def run_load(url: str, temperatures: tuple[float, ...], args: argparse.Namespace) -> dict[str, Any]:
    """Drive `args.clients` closed-loop clients for `args.seconds`; requests/s, latency, engine rebuilds."""
    rng = random.Random(0)
    prompts = [[rng.randrange(5, 200) for _ in range(args.prompt_len)] for _ in range(64)]
    for temperature in temperatures:  # warm: the engine is built (and sized) before the clock starts
        body = {"prompt": [prompts[0]], "n": args.n, "max_tokens": args.max_tokens, "temperature": temperature}
        requests.post(url + "/v1/completions", json=body, timeout=120).raise_for_status()
    builds_before = requests.get(url + "/metrics", timeout=10).json()["engine_builds"]
    stop = time.monotonic() + args.seconds
    latencies: list[float] = []
    errors = [0]
    lock = threading.Lock()

    def client(index: int) -> None:
        temperature = temperatures[index % len(temperatures)]
        session = requests.Session()
        k = index
        while time.monotonic() < stop:
            body = {"prompt": [prompts[k % len(prompts)]], "n": args.n, "max_tokens": args.max_tokens}
            body["temperature"] = temperature
            k += args.clients
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
    threads = [threading.Thread(target=client, args=(i,)) for i in range(args.clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed = time.monotonic() - started  # includes the last requests' tails
    builds = requests.get(url + "/metrics", timeout=10).json()["engine_builds"] - builds_before
    return {
        "requests": len(latencies),
        "errors": errors[0],
        "requests_per_s": len(latencies) / elapsed,
        "latency_p50_s": percentile(latencies, 50) if latencies else None,
        "latency_p99_s": percentile(latencies, 99) if latencies else None,
        "engine_rebuilds": builds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="trl-cb/tiny", help="what `trl-cb serve --model` takes")
    parser.add_argument("--engines", nargs="+", default=list(ENGINES), choices=list(ENGINES))
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--n", type=int, default=4, help="samples per prompt")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=24)
    parser.add_argument("--server-threads", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="4 clients, 2 s per load: a smoke run")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=OUT_HELP)
    args = parser.parse_args()
    if args.quick:
        args.clients, args.seconds, args.max_tokens = 4, 2.0, 8

    from trl_cb.serving.launch import local_rollout_server

    points = []
    for engine in args.engines:
        for load, temperatures in LOADS.items():
            extra = ["--continuous_batching_config", json.dumps(ENGINES[engine])] if ENGINES[engine] else []
            with local_rollout_server(args.model, threads=args.server_threads, extra_args=extra) as server:
                point = {"engine": engine, "load": load, "temperatures": list(temperatures)}
                point.update(run_load(server.url, temperatures, args))
            points.append(point)
            print(f"{engine} {load}: {point['requests_per_s']:.1f} req/s", file=sys.stderr, flush=True)
    for point in points:
        one = next(p for p in points if p["engine"] == point["engine"] and p["load"] == "one")
        point["x_one_temperature"] = point["requests_per_s"] / max(one["requests_per_s"], 1e-9)
    columns = [
        ("engine", "engine"),
        ("load", "temperatures"),
        ("requests_per_s", "req/s"),
        ("x_one_temperature", "x one temp"),
        ("latency_p50_s", "p50 s"),
        ("latency_p99_s", "p99 s"),
        ("engine_rebuilds", "rebuilds"),
        ("errors", "errors"),
    ]
    print(format_table(points, columns))
    config = {k: v for k, v in vars(args).items() if k != "out"}
    config["out"] = str(args.out)
    payload = {"benchmark": "mixed_sampling", "config": config, "env": environment("cpu"), "points": points}
    path = write_json(payload, args.out, "mixed_sampling")
    print(f"wrote {path}", file=sys.stderr)
    print(json.dumps(payload))


if __name__ == "__main__":
    main()
