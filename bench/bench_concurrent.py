"""Many requests end to end (issue 40): --requests streamed completions sent to the gateway at once over the 3-node
route, against one request alone, and llama-server ``--parallel`` with the same total threads and the same
requests; one markdown table from one run.

Model: the embedded default (Gemma 3 270M Q4_K_M). Route: three ``ggufswarm node`` processes (blocks 0-5 / 6-11 /
12-17, 1 thread each, ``--max-sessions`` = --requests, exact batching: the default) behind an in-process gateway
(``GatewayConfig``, ring decode on: the default). Each request: ``POST /v1/completions`` with a prompt of --prompt
token ids (each from another offset of the GPL excerpt), ``max_tokens`` --tokens, greedy, ``ignore_eos``, streamed;
each from its own client thread. llama-server (``make llamacpp-tools``; the row is left out when it is not built):
``--parallel`` --requests, ``-t/-tb 3`` (the route's total), no prompt cache, the same requests on its own
``/v1/completions``.

Per row and round: **aggregate** = all completion tokens / the time from the first request sent to the last token
read; TTFT (request sent to first streamed token: the prefill, queued behind the other requests' prefills);
**decode aggregate** = the tokens after each request's first / (the last token read - the last first token), the
part of the run where every request decodes; ratio = the concurrent row's aggregate / one request alone of the same
engine in the same round. Engines and batch sizes run in interleaved rounds (--rounds, after an untimed warm-up
round); cells are medians over the rounds. Target (issue 40): the route's --requests aggregate >= 1.5x one alone.

Usage: .venv/bin/python bench/bench_concurrent.py [--requests 16] [--prompt 60] [--tokens 48] [--rounds 2] [--quick]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
import urllib.error
import urllib.request

from bench_batching import concurrently, prompts, start_llama_server
from bench_llamacpp import TEXT, cpu_model, say

from ggufswarm.artifact.default_model import default_model_path
from ggufswarm.artifact.gguf_file import GGUFModelFile
from ggufswarm.client.tokenizer import Tokenizer
from ggufswarm.gateway import GatewayConfig, make_app
from ggufswarm.net.http import ServerThread
from ggufswarm.node.launch import start_nodes, stop_nodes
from ggufswarm.runtime.shard import even_split

N_LAYERS, N_NODES, SERVER_THREADS = 18, 3, 3


def stream(base: str, ids: list[int], tokens: int, model: str | None) -> tuple[float, float, float, int]:
    """One streamed greedy completion: (sent, first token, last token: perf_counter s; content chunks read)."""
    body = {"prompt": ids, "max_tokens": tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    if model:
        body["model"] = model
    req = urllib.request.Request(
        base + "/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    t0 = time.perf_counter()
    first, n = None, 0
    try:
        r = urllib.request.urlopen(req, timeout=1800)
    except urllib.error.HTTPError as exc:
        raise RuntimeError(f"{base}: HTTP {exc.code}: {exc.read()[:300]!r}") from None
    with r:
        for line in r:
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[6:])
            if any(c.get("text") for c in chunk.get("choices", [])):
                first = first or time.perf_counter()
                n += 1
    return t0, first or time.perf_counter(), time.perf_counter(), n


def run_batch(base: str, batch: list[list[int]], tokens: int, model: str | None = None) -> dict:
    """``batch`` requests at once, each from its own thread: aggregate tok/s, TTFT median / max (ms), decode
    aggregate tok/s (module docstring)."""
    out, errors = [None] * len(batch), []

    def one(i: int) -> None:
        try:
            out[i] = stream(base, batch[i], tokens, model)
        except BaseException as exc:
            errors.append(exc)

    concurrently(one, list(range(len(batch))), errors)
    start, end = min(o[0] for o in out), max(o[2] for o in out)
    last_first = max(o[1] for o in out)
    ttft = [(o[1] - o[0]) * 1e3 for o in out]
    after_first = sum(max(o[3] - 1, 0) for o in out)
    return {
        "tok_s": len(batch) * tokens / (end - start),
        "ttft_median_ms": statistics.median(ttft),
        "ttft_max_ms": max(ttft),
        "decode_tok_s": after_first / (end - last_first) if end > last_first else float("nan"),
        "chunks": sum(o[3] for o in out),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=16, help="requests sent at once (default 16)")
    ap.add_argument("--prompt", type=int, default=60, help="prompt tokens per request (default 60)")
    ap.add_argument("--tokens", type=int, default=48, help="completion tokens per request (default 48)")
    ap.add_argument("--rounds", type=int, default=2, help="timed rounds after a warm-up one (default 2)")
    ap.add_argument("--quick", action="store_true", help="smoke run: 4 requests of 8 tokens, 1 round")
    args = ap.parse_args()
    if args.quick:
        args.requests, args.tokens, args.rounds = 4, 8, 1
    path = str(default_model_path())
    ids = Tokenizer(path, GGUFModelFile(path).metadata).encode(TEXT)
    batch = prompts(ids, args.requests, args.prompt)
    ctx = args.prompt + args.tokens + 64
    say(f"# Many requests end to end — {os.path.basename(path)}")
    say(
        f"CPU: {cpu_model()}, {os.cpu_count()} logical cores; {datetime.datetime.now().astimezone().isoformat()}; "
        f"load average {', '.join(f'{x:.2f}' for x in os.getloadavg())}"
    )
    say(f"{args.requests} requests of {args.prompt} prompt + {args.tokens} completion tokens, {args.rounds} round(s)")
    nodes = start_nodes(
        even_split(N_LAYERS, N_NODES),
        path,
        threads=1,
        extra=["--ctx-size", str(ctx), "--max-sessions", str(args.requests), "--gpu", "none"],
    )
    server = ServerThread(make_app(GatewayConfig([n.url for n in nodes], model=path)))
    proc, llama_base = start_llama_server(path, ctx, SERVER_THREADS, args.requests)
    if proc is None:
        say("llama-server: not built (make llamacpp-tools): its rows are left out")
    rows: dict[str, list[dict]] = {}
    try:
        base = server.start()
        engines = [("route", base, None)] + ([("llama-server", llama_base, "x")] if proc is not None else [])
        for r in range(args.rounds + 1):
            for name, url, model in engines:
                alone = run_batch(url, batch[:1], args.tokens, model)
                many = run_batch(url, batch, args.tokens, model)
                many["ratio"] = many["tok_s"] / alone["tok_s"]
                say(
                    f"  round {r}{' (warm-up)' if r == 0 else ''}: {name}: 1 alone {alone['tok_s']:.1f} tok/s, "
                    f"{args.requests} at once {many['tok_s']:.1f} tok/s ({many['ratio']:.2f}x), TTFT median "
                    f"{many['ttft_median_ms']:.0f} ms, max {many['ttft_max_ms']:.0f} ms, decode aggregate "
                    f"{many['decode_tok_s']:.1f} tok/s"
                )
                if r:
                    rows.setdefault(f"{name} 1", []).append(alone)
                    rows.setdefault(f"{name} {args.requests}", []).append(many)
    finally:
        server.stop()
        stop_nodes(nodes)
        if proc is not None:
            proc.kill()
            proc.wait()

    def med(name: str, key: str) -> float:
        return statistics.median(x[key] for x in rows[name])

    say("")
    say(
        "| engine | requests at once | aggregate tok/s | ÷ one alone | TTFT median ms | TTFT max ms "
        "| decode aggregate tok/s |"
    )
    say("|---|---:|---:|---:|---:|---:|---:|")
    for name, _, _ in engines:
        for n in (1, args.requests):
            key = f"{name} {n}"
            label = "route, 3 nodes + gateway" if name == "route" else f"llama-server --parallel {args.requests}"
            ratio = f"{med(key, 'ratio'):.2f}" if n > 1 else "–"
            say(
                f"| {label} | {n} | {med(key, 'tok_s'):.1f} | {ratio} | {med(key, 'ttft_median_ms'):.0f} | "
                f"{med(key, 'ttft_max_ms'):.0f} | {med(key, 'decode_tok_s'):.1f} |"
            )
    got = med(f"route {args.requests}", "ratio")
    say("")
    say(f"Target: route, {args.requests} at once >= 1.5x one alone: {got:.2f}x {'MET' if got >= 1.5 else 'MISSED'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
