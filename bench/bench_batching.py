"""Cross-session batching benchmark (issue 13 items 1 and 2): aggregate decode tok/s of 1, 4, 16 and 32 concurrent
greedy sessions on the 3-node route, next to llama-server ``--parallel 16`` with the same total threads; and the
decode step of a running session while another session's 4K-token prompt is prefilled on the same route.

Model: the embedded default (Gemma 3 270M Q4_K_M). Route: three ``ggufswarm node`` processes (blocks 0-5 / 6-11 /
12-17, 1 thread each, ``--max-sessions`` = the most sessions measured), once per ``--modes`` entry: ``exact`` (the
default: every session's result bitwise its result alone; with llama.cpp patch 0005 any number of sessions per
ubatch), ``exact3`` (exact with ``--batch-group 3``: what the exact mode was before patch 0005), ``throughput``
(``--batching throughput``: one unified KV stream per node so that any sessions share a graph evaluation, not
bitwise). Each session has its own prompt (``--prompt`` tokens of the GPL excerpt, each from another offset),
prefilled before the clock starts; then all decode ``--decode`` tokens at once, each in its own client thread;
aggregate = all decoded tokens / wall time from the common start to the last token.

llama-server (``make llamacpp-tools`` builds it into .cache/llamacpp-tools/0.3.36/bin; skipped when missing):
``--parallel 16`` (non-unified KV, as the nodes), ``-t/-tb`` = 3 (the route's total), the same prompts as token ids
over ``/completion`` (temperature 0, ``ignore_eos``); aggregate decode = all predicted tokens / (last end -
first decode start), each request's decode start being its end minus its ``timings.predicted_ms``.

Prefill interference: a fresh route with ``--ctx-size`` >= the long prompt and ``--max-sessions 2``: session A
decodes alone (its median step), then while session B prefills ``--long`` tokens (in the client's 2048-token
steps; each node runs them in 512-token pieces with A's decode steps in between): A's median and largest step
and its tokens during the prefill, and the prefill's wall time.

Numbers depend on an idle machine: run it alone. ``--quick`` only checks that it works (1 and 4 sessions,
a few tokens, a 1K prompt).

Usage: .venv/bin/python bench/bench_batching.py [--sessions 1,4,16,32] [--decode 64] [--prompt 64]
       [--modes exact,exact3,throughput] [--long 4096 (0: none)] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import threading
import time
import urllib.request

import numpy as np
from bench_llamacpp import GREEDY, TEXT, TOOLS_BIN, free_port
from prometheus_client.parser import text_string_to_metric_families

from ggufswarm.artifact.default_model import default_model_path
from ggufswarm.artifact.gguf_file import GGUFModelFile
from ggufswarm.client.route import RemoteRoute
from ggufswarm.client.tokenizer import Tokenizer
from ggufswarm.node.launch import start_nodes, stop_nodes
from ggufswarm.runtime.shard import even_split

THREADS_PER_NODE = 3 * [1]


def prompts(ids: list[int], n: int, length: int) -> list[list[int]]:
    """``n`` prompts of ``length`` tokens, each from another offset of ``ids``."""
    step = max(1, (len(ids) - length) // max(n, 1))
    return [(ids * 2)[i * step % len(ids) :][:length] for i in range(n)]


def route_aggregate(urls: list[str], prompt_ids: list[list[int]], n_decode: int) -> dict:
    """All sessions prefilled, then decoding together: {'tok_s' (aggregate), 'per_session' (mean tok/s)}."""
    n = len(prompt_ids)
    ready, go = threading.Barrier(n + 1), threading.Event()
    spans: list[tuple[float, float]] = []
    errors: list[BaseException] = []

    def one(ids: list[int]) -> None:
        session = RemoteRoute(urls, 120.0).open(len(ids) + n_decode + 1, GREEDY)
        try:
            tok = session.step(ids)
            ready.wait(600)
            go.wait(600)
            t0 = time.perf_counter()
            for _ in range(n_decode):
                tok = session.step([tok])
            spans.append((t0, time.perf_counter()))
        except BaseException as exc:
            errors.append(exc)
            try:
                ready.abort()
            except threading.BrokenBarrierError:
                pass
        finally:
            session.close()

    threads = [threading.Thread(target=one, args=(ids,)) for ids in prompt_ids]
    for t in threads:
        t.start()
    ready.wait(600)
    go.set()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    wall = max(e for _, e in spans) - min(s for s, _ in spans)
    return {"tok_s": n * n_decode / wall, "per_session": float(np.mean([n_decode / (e - s) for s, e in spans]))}


def batching_counters(urls: list[str]) -> list[dict]:
    """Each node's /health ``batching`` block, with its decode ``busy_s`` and ``decode_steps`` from /metrics."""
    out = []
    for u in urls:
        block = json.load(urllib.request.urlopen(u + "/health", timeout=30)).get("batching") or {}
        text = urllib.request.urlopen(u + "/metrics", timeout=30).read().decode()
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.labels.get("kind") == "decode" and s.name == "ggufswarm_node_busy_seconds_total":
                    block["busy_s"] = s.value
                elif s.labels.get("kind") == "decode" and s.name == "ggufswarm_node_steps_total":
                    block["decode_steps"] = s.value
        out.append(block)
    return out


def pipeline_bound(after: list[dict], before: list[dict]) -> tuple[float, list[float]]:
    """The route's pipeline bound (tok/s: 1 / the slowest stage's compute time per token, a shared decode counted
    once) between two ``batching_counters`` readings, and each stage's ms per token."""
    ms = [
        1e3 * (a.get("busy_s", 0) - b.get("busy_s", 0)) / max(a.get("decode_steps", 0) - b.get("decode_steps", 0), 1)
        for a, b in zip(after, before)
    ]
    return (1e3 / max(ms) if max(ms) > 0 else float("inf")), ms


def server_aggregate(base: str, prompt_ids: list[list[int]], n_decode: int) -> dict:
    """Concurrent /completion requests to llama-server: aggregate decode tok/s (see the module docstring)."""
    spans, errors = [], []

    def one(ids: list[int]) -> None:
        body = json.dumps(
            {"prompt": ids, "n_predict": n_decode, "temperature": 0, "ignore_eos": True, "cache_prompt": False}
        ).encode()
        req = urllib.request.Request(base + "/completion", data=body, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=1800) as r:
                out = json.load(r)
            end = time.perf_counter()
            t = out["timings"]
            spans.append((end - t["predicted_ms"] / 1e3, end, int(t["predicted_n"])))
        except BaseException as exc:
            errors.append(exc)

    concurrently(one, prompt_ids, errors)
    wall = max(e for _, e, _ in spans) - min(s for s, _, _ in spans)
    return {
        "tok_s": sum(n for _, _, n in spans) / wall,
        "per_session": float(np.mean([n / (e - s) for s, e, n in spans])),
    }


def concurrently(fn, items: list, errors: list) -> None:
    """``fn(item)`` for every item at once, each in its own thread; the first exception ``fn`` put in ``errors``
    raised once all are done."""
    threads = [threading.Thread(target=fn, args=(item,)) for item in items]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def start_llama_server(path: str, n_ctx_seq: int, threads: int, parallel: int = 16):
    exe = TOOLS_BIN / "llama-server"
    if not exe.exists():
        return None, None
    port = free_port()
    proc = subprocess.Popen(
        [
            str(exe),
            "-m",
            path,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "-np",
            str(parallel),
            "-c",
            str(n_ctx_seq * parallel),
            "-t",
            str(threads),
            "-tb",
            str(threads),
            "-b",
            "2048",
            "-ub",
            "512",
            "--no-webui",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={k: v for k, v in os.environ.items() if k != "LLAMA_BATCH_INVARIANT"},  # llama-server as shipped
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"llama-server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(base + "/health", timeout=5) as r:
                if r.status == 200:
                    return proc, base
        except OSError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError("llama-server not ready within 300 s")


MODES = {  # --modes entry -> node flags
    "exact": ["--batching", "exact"],
    "exact3": ["--batching", "exact", "--batch-group", "3"],
    "throughput": ["--batching", "throughput"],
}


def prefill_interference(path: str, ids: list[int], long_n: int, n_base: int, mode: str) -> dict:
    """Session A's decode steps alone and while B prefills ``long_n`` tokens on the same route (seconds, counts)."""
    ctx = max(4096, -(-(long_n + 600) // 256) * 256)
    nodes = start_nodes(
        even_split(18, 3),
        path,
        threads=1,
        extra=["--ctx-size", str(ctx), "--max-sessions", "2", *MODES[mode], "--hop-timeout", "600"],
    )
    try:
        urls = [n.url for n in nodes]
        a = RemoteRoute(urls, 600.0).open(ctx, GREEDY)
        stamps, stop = [], threading.Event()

        def decode() -> None:
            tok = a.step(ids[:16])
            stamps.append(time.perf_counter())
            while not stop.is_set() and a.position < ctx - 2:
                tok = a.step([tok])
                stamps.append(time.perf_counter())

        worker = threading.Thread(target=decode)
        worker.start()
        while len(stamps) < n_base + 1:
            time.sleep(0.01)
        base = np.diff(stamps[1 : n_base + 1])
        b = RemoteRoute(urls, 600.0).open(long_n + 8, GREEDY)
        t0 = time.perf_counter()
        b.step((ids * (long_n // len(ids) + 1))[:long_n])
        t1 = time.perf_counter()
        time.sleep(0.3)
        stop.set()
        worker.join()
        b.close()
        a.close()
    finally:
        stop_nodes(nodes)
    during = [t for t in stamps if t0 <= t <= t1]
    gaps = np.diff([t0] + during + [next((t for t in stamps if t > t1), t1)])
    return {
        "alone_ms": 1e3 * float(np.median(base)),
        "during_median_ms": 1e3 * float(np.median(gaps)),
        "during_max_ms": 1e3 * float(gaps.max()),
        "tokens_during": len(during),
        "prefill_s": t1 - t0,
    }


def _mean(after: dict, before: dict, what: str) -> float:
    """Sessions per shared decode (``what`` = "batches") or per ubatch ("ubatches") between two /health batching
    readings of one node; 1.0 when it ran none."""
    n = (after.get(what) or 0) - (before.get(what) or 0)
    return (after.get("batched_steps", 0) - before.get("batched_steps", 0)) / n if n > 0 else 1.0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sessions", default="1,4,16,32", help="concurrent session counts (default 1,4,16,32)")
    ap.add_argument("--decode", type=int, default=64, help="tokens each session decodes (default 64)")
    ap.add_argument("--prompt", type=int, default=64, help="prompt tokens per session (default 64)")
    ap.add_argument("--modes", default="exact,exact3,throughput", help="node batching modes (default: all three)")
    ap.add_argument("--long", type=int, default=4096, help="prompt tokens of the prefill run (4096; 0 skips it)")
    ap.add_argument("--quick", action="store_true", help="check that it works: 1,4 sessions, 8 tokens, 1K prefill")
    args = ap.parse_args()
    if args.quick:
        args.sessions, args.decode, args.prompt, args.modes, args.long = "1,4", 8, 32, "exact", 1024
    counts = [int(x) for x in args.sessions.split(",")]
    modes = args.modes.split(",")
    if unknown := [m for m in modes if m not in MODES]:
        ap.error(f"--modes: unknown {unknown}; choose from {sorted(MODES)}")
    path = str(default_model_path())
    f = GGUFModelFile(path)
    ids = Tokenizer(path, f.metadata).encode(TEXT)
    ctx = -(-(args.prompt + args.decode + 8) // 256) * 256
    print(
        f"# Batching: {os.path.basename(path)}, 3-node route (1 thread per node), prompt {args.prompt}, decode "
        f"{args.decode} tokens per session; load {os.getloadavg()[0]:.2f}",
        flush=True,
    )

    rows: dict[str, dict[int, dict]] = {}
    for mode in modes:
        nodes = start_nodes(
            even_split(18, 3),
            path,
            threads=1,
            extra=[
                "--max-sessions",
                str(max(counts)),
                "--ctx-size",
                str(ctx),
                *MODES[mode],
                "--hop-timeout",
                "600",
            ],
        )
        try:
            urls = [n.url for n in nodes]
            route_aggregate(urls, prompts(ids, 1, args.prompt), 4)  # warm up
            for n in counts:
                before = batching_counters(urls)
                r = route_aggregate(urls, prompts(ids, n, args.prompt), args.decode)
                after = batching_counters(urls)
                r["mean_batch"] = max(_mean(a, b, "batches") for a, b in zip(after, before))
                r["mean_ubatch"] = max(_mean(a, b, "ubatches") for a, b in zip(after, before))
                r["bound_tok_s"], r["stage_ms"] = pipeline_bound(after, before)
                rows.setdefault(f"route, {mode}", {})[n] = r
                print(
                    f"  route {mode}, {n} sessions: {r['tok_s']:.1f} tok/s aggregate (sessions per batch "
                    f"{r['mean_batch']:.1f}, per ubatch {r['mean_ubatch']:.1f}); stages "
                    + " / ".join(f"{x:.1f}" for x in r["stage_ms"])
                    + f" ms per token, pipeline bound {r['bound_tok_s']:.1f} tok/s "
                    f"({r['tok_s'] / r['bound_tok_s']:.2f} of it)",
                    flush=True,
                )
        finally:
            stop_nodes(nodes)
    proc, base = start_llama_server(path, ctx, sum(THREADS_PER_NODE))
    if proc is None:
        print(f"  llama-server: not built ({TOOLS_BIN / 'llama-server'} missing; make llamacpp-tools)", flush=True)
    else:
        try:
            server_aggregate(base, prompts(ids, 1, args.prompt), 4)
            for n in counts:
                r = server_aggregate(base, prompts(ids, n, args.prompt), args.decode)
                rows.setdefault("llama-server --parallel 16, 3 threads", {})[n] = r
                print(f"  llama-server, {n} sessions: {r['tok_s']:.1f} tok/s aggregate", flush=True)
        finally:
            proc.terminate()
            proc.wait(30)

    print(
        "\naggregate decode tok/s (in brackets: mean sessions per shared llama_decode / per ubatch on the node "
        "batching most; aggregate / the pipeline's bound: 1 / the slowest stage's compute ms per token)"
    )
    print("\n| | " + " | ".join(f"{n} sessions" for n in counts) + " | aggregate x single |")
    print("|---|" + "---|" * (len(counts) + 1))
    for name, by_n in rows.items():
        cells = [
            f"{by_n[n]['tok_s']:.1f}"
            + (
                f" ({by_n[n]['mean_batch']:.1f} / {by_n[n]['mean_ubatch']:.1f}; "
                f"{by_n[n]['tok_s'] / by_n[n]['bound_tok_s']:.2f} of bound)"
                if "mean_batch" in by_n[n]
                else ""
            )
            for n in counts
        ]
        scale = by_n[max(counts)]["tok_s"] / by_n[min(counts)]["tok_s"]
        print(f"| {name} | " + " | ".join(cells) + f" | {scale:.2f} |")
    print()
    server = rows.get("llama-server --parallel 16, 3 threads")
    for name, by_n in rows.items():
        if name.startswith("route") and 16 in by_n:
            line = (
                f"{name}: 16 sessions {by_n[16]['tok_s'] / by_n[min(counts)]['tok_s']:.2f}x its single (target 2.5), "
                f"{by_n[16]['tok_s'] / by_n[16]['bound_tok_s']:.2f} of the pipeline bound (target 0.9)"
            )
            if server and 16 in server:
                line += f", {by_n[16]['tok_s'] / server[16]['tok_s']:.2f}x llama-server's 16 (target 0.8)"
            print(line)

    if args.long <= 0:
        return 0
    p = prefill_interference(path, ids, args.long, 16, modes[0])
    print(
        f"\n| decode of a running session | median step ms | largest step ms | its tokens |\n|---|---|---|---|\n"
        f"| alone | {p['alone_ms']:.1f} | | |\n"
        f"| while a {args.long}-token prompt is prefilled ({p['prefill_s']:.1f} s) | {p['during_median_ms']:.1f} "
        f"| {p['during_max_ms']:.1f} | {p['tokens_during']} |"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
