"""Benchmark: time to first token (TTFT) of a short prompt through a 3-node tracker route, as a client sees it
(request sent → first streamed token), next to llama.cpp in-process on the same prompt. One run, loopback.

The route's TTFT is route setup (plan at the tracker, describe the nodes, open the session on each, restore a
cached prefix) plus the prompt's step through the 3 nodes; llama.cpp's is its prefill alone. Each number is the
median of --requests requests (after two untimed warm-ups).

Not a test. Usage: .venv/bin/python bench/bench_ttft.py [--requests 10] [--threads 1] [--cache]
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import tempfile
import time
from pathlib import Path
from urllib.parse import urlsplit

PROMPT = "The capital of France is"


def stream_deltas(base: str, prompt: str, max_tokens: int, timeout_s: float = 120.0) -> tuple[float, list[float], dict]:
    """One streamed greedy ``/v1/completions`` request to the gateway at ``base``: (perf_counter s it was sent,
    perf_counter s of each text delta, the final telemetry object). RuntimeError for an error event."""
    parts = urlsplit(base)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout_s)
    t0 = time.perf_counter()
    conn.request(
        "POST",
        "/v1/completions",
        json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}),
        {"Content-Type": "application/json"},
    )
    times, telemetry = [], {}
    for raw in conn.getresponse():
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        event = json.loads(line[6:])
        if "error" in event:
            raise RuntimeError(event["error"])
        if event.get("choices") and event["choices"][0].get("text"):
            times.append(time.perf_counter())
        telemetry = event.get("telemetry") or telemetry
    conn.close()
    return t0, times, telemetry


def client_ttft(base: str, prompt: str) -> tuple[float, dict]:
    """(ms from sending a streamed completion request to its first text delta, the final telemetry)."""
    t0, times, telemetry = stream_deltas(base, prompt, 2)
    return (times[0] - t0) * 1e3 if times else None, telemetry


def llama_cpp_ttft(path: Path, prompt: str, threads: int, n: int) -> float:
    """Median ms to the first streamed token of ``prompt`` in llama.cpp (a fresh KV each time)."""
    import llama_cpp

    llm = llama_cpp.Llama(str(path), n_ctx=2048, n_threads=threads, verbose=False)
    out = []
    for _ in range(n + 2):
        llm.reset()
        t0 = time.perf_counter()
        next(iter(llm.create_completion(prompt, max_tokens=1, temperature=0, stream=True)))
        out.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(out[2:])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=10, help="timed requests (default 10)")
    ap.add_argument("--threads", type=int, default=1, help="threads per process (default 1)")
    ap.add_argument("--cache", action="store_true", help="give the nodes a snapshot cache (prefix restore on)")
    args = ap.parse_args()

    from ggufswarm.artifact.default_model import default_model_path
    from ggufswarm.cache.app import CacheConfig
    from ggufswarm.cache.app import make_app as make_cache_app
    from ggufswarm.directory.trackers import TrackerClient
    from ggufswarm.gateway import GatewayConfig, make_app
    from ggufswarm.net.http import ServerThread
    from ggufswarm.node.launch import start_nodes, stop_nodes
    from ggufswarm.runtime.shard import even_split
    from ggufswarm.swarm.publish import publish
    from ggufswarm.swarm.torrent import Swarm, save_path_for
    from ggufswarm.tracker.app import TrackerConfig
    from ggufswarm.tracker.app import make_app as make_tracker_app

    path = default_model_path()
    ref = llama_cpp_ttft(path, PROMPT, args.threads, args.requests)  # before the cluster starts: an idle machine
    work = Path(tempfile.mkdtemp(prefix="ggufswarm-bench-ttft-"))
    nodes, gateway, seeder = [], None, None
    tracker = ServerThread(make_tracker_app(TrackerConfig(db=":memory:", ttl_s=6.0)))
    cache = ServerThread(make_cache_app(CacheConfig(dir=str(work / "cache"))))
    try:
        tracker_url = tracker.start()
        extra = ["--tracker", tracker_url] + (["--cache", cache.start()] if args.cache else [])
        published = publish(path, tracker_url, "gemma", work / "publisher")
        seeder = Swarm()
        seeder.seed(published.torrent, save_path_for([path]))
        nodes = start_nodes(
            even_split(18, 3),
            "gemma",
            threads=args.threads,
            timeout=600,
            extra=extra,
            per_node=lambda i: ["--data-dir", str(work / f"node{i}")],
        )
        deadline = time.monotonic() + 30
        while len(TrackerClient(tracker_url).nodes("gemma")) < len(nodes):
            assert time.monotonic() < deadline, "nodes did not advertise"
            time.sleep(0.2)
        gateway = ServerThread(
            make_app(GatewayConfig([], model="gemma", tracker=tracker_url, data_dir=str(work / "gateway")))
        )
        base = gateway.start()
        for _ in range(2):
            client_ttft(base, PROMPT)
        runs = [client_ttft(base, PROMPT) for _ in range(args.requests)]
        ours = statistics.median(r[0] for r in runs)
        step = statistics.median(r[1]["ttft_ms"] for r in runs)
        print(
            f"\nTTFT of a short prompt ({runs[0][1]['prompt_tokens']} tokens), 3-node tracker route "
            f"({'with' if args.cache else 'without'} a snapshot cache), threads {args.threads}, "
            f"median of {args.requests}"
        )
        print("| engine | TTFT ms | of which: the prompt's step (gateway telemetry ttft_ms) |")
        print("|---|---:|---:|")
        print(f"| ggufswarm gateway → 3 nodes | {ours:.1f} | {step:.1f} |")
        print(f"| llama.cpp in-process | {ref:.1f} | |")
        print(f"route setup + HTTP ≈ {ours - step:.1f} ms; ggufswarm / llama.cpp = {ours / ref:.2f}x")
    finally:
        if gateway is not None:
            gateway.stop()
        stop_nodes(nodes)
        if seeder is not None:
            seeder.close()
        if cache.url is not None:
            cache.stop()
        tracker.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
