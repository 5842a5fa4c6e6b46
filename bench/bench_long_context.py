"""Long-context benchmark (issue 13 item 3): one session filled to the model's trained context through the 3-node
route, the decode step at positions ~100, 8K and the end, next to llama.cpp in-process at the same positions;
and each node's KV memory against what it advertises. One table from one run.

Model: the embedded default (Gemma 3 270M Q4_K_M, 32,768-token trained context). Three ``ggufswarm node``
processes (blocks 0-5 / 6-11 / 12-17, 1 thread each, ``--ctx-size`` = the context, ``--max-sessions 1``) and
llama.cpp through llama-cpp-python (n_ctx = the context, n_batch 2048, n_ubatch 512, flash attention, 1
thread) read the same text (the GPL excerpt repeated) in 2048-token prefill steps; at each checkpoint both
decode --decode greedy tokens, timed one by one (the mean step is reported; the decoded tokens are then
dropped again on the route by truncation, and by llama.cpp's own seq_rm, so the text stays the same).

The KV table: llama.cpp allocates (and clears, so it is resident) a node's whole KV cache when its context is
created, ``--ctx-size`` x ``--max-sessions`` cells; each node's advertised ``kv_bytes_per_token`` (its /health,
from the GGUF header; tests/test_accounting.py checks it against llama.cpp's own per-token state growth) times
those cells is set next to the node's RSS after the fill (which also holds Python, llama.cpp and the
mapped weights).

Usage: .venv/bin/python bench/bench_long_context.py [--context 32768] [--decode 8]
"""

from __future__ import annotations

import argparse
import json
import os
import time
import urllib.request

import llama_cpp
import numpy as np
import psutil
from bench_llamacpp import GREEDY, TEXT

from ggufswarm.artifact.default_model import default_model_path
from ggufswarm.artifact.gguf_file import GGUFModelFile
from ggufswarm.client.route import RemoteRoute
from ggufswarm.client.tokenizer import Tokenizer
from ggufswarm.node.launch import start_nodes, stop_nodes
from ggufswarm.runtime.shard import even_split

CHUNK = 2048
MIB = 1 << 20


def checkpoints(context: int) -> list[int]:
    """Positions (tokens held) at which decode is timed: ~100, 8K (when below the end) and the end."""
    end = context - 64
    return sorted({100, *(p for p in (8192,) if p < end), end})


def text_ids(tokenizer, n: int) -> list[int]:
    ids: list[int] = []
    while len(ids) < n:
        ids += tokenizer.encode(TEXT)
    return ids[:n]


def route_run(route: RemoteRoute, ids: list[int], points: list[int], n_decode: int) -> dict[int, float]:
    """Mean decode step (ms) at each point of ``points`` on one session over ``route``."""
    session = route.open(route.max_length, GREEDY)
    steps: dict[int, float] = {}
    try:
        held = 0
        for point in points:
            while held < point:
                n = min(CHUNK, point - held)
                token = session.step(ids[held : held + n])
                held += n
            times = []
            for _ in range(n_decode):
                t = time.perf_counter()
                token = session.step([token])
                times.append(time.perf_counter() - t)
            steps[point] = 1e3 * sum(times) / len(times)
            session.truncate(held)
            print(f"  route: {held} tokens, decode step {steps[point]:.2f} ms", flush=True)
    finally:
        session.close()
    return steps


def llama_run(path: str, context: int, ids: list[int], points: list[int], n_decode: int) -> dict[int, float]:
    """The same on llama.cpp in-process (llama-cpp-python, greedy)."""
    llm = llama_cpp.Llama(
        path, n_ctx=context, n_batch=CHUNK, n_ubatch=512, n_threads=1, n_threads_batch=1, flash_attn=True, verbose=False
    )
    steps: dict[int, float] = {}
    try:
        held = 0
        for point in points:
            while held < point:
                n = min(CHUNK, point - held)
                llm.eval(ids[held : held + n])
                held += n
            times = []
            for _ in range(n_decode):
                t = time.perf_counter()
                last = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(llm.n_vocab(),))
                llm.eval([int(np.argmax(last))])
                times.append(time.perf_counter() - t)
            steps[point] = 1e3 * sum(times) / len(times)
            llama_cpp.llama_memory_seq_rm(llama_cpp.llama_get_memory(llm.ctx), 0, held, -1)
            llm.n_tokens = held
            print(f"  llama.cpp: {held} tokens, decode step {steps[point]:.2f} ms", flush=True)
    finally:
        llm.close()
    return steps


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context", type=int, default=0, help="tokens (default: the model's trained context)")
    ap.add_argument("--decode", type=int, default=8, help="decode steps timed at each point (default 8)")
    args = ap.parse_args()
    path = str(default_model_path())
    f = GGUFModelFile(path)
    context = args.context or int(f.metadata[f"{f.architecture}.context_length"])
    ids = text_ids(Tokenizer(path, f.metadata), context)
    points = checkpoints(context)
    print(
        f"# Long context: {os.path.basename(path)}, {context} tokens, 1 thread per process; load "
        f"{os.getloadavg()[0]:.2f}",
        flush=True,
    )

    nodes = start_nodes(
        even_split(18, 3),
        path,
        threads=1,
        extra=["--ctx-size", str(context), "--max-sessions", "1", "--hop-timeout", "600"],
    )
    try:
        route = RemoteRoute([n.url for n in nodes], 600.0)
        health = [json.load(urllib.request.urlopen(n.url + "/health", timeout=30)) for n in nodes]
        t0 = time.perf_counter()
        route_steps = route_run(route, ids, points, args.decode)
        fill_s = time.perf_counter() - t0
        rss = [psutil.Process(n.proc.pid).memory_info().rss for n in nodes]
        kv_per_token = [h.get("kv_bytes_per_token", 0) for h in health]
        cells = [h.get("kv_budget_tokens", 0) for h in health]
    finally:
        stop_nodes(nodes)
    llama_steps = llama_run(path, context, ids, points, args.decode)

    print(f"\nroute fill: {fill_s:.0f} s\n")
    print(
        "| tokens held | route decode step ms | ratio to ~100 | llama.cpp decode step ms | ratio to ~100 "
        "| route / llama.cpp step |"
    )
    print("|---|---|---|---|---|---|")
    first = points[0]
    for p in points:
        print(
            f"| {p} | {route_steps[p]:.2f} | {route_steps[p] / route_steps[first]:.2f} | {llama_steps[p]:.2f} | "
            f"{llama_steps[p] / llama_steps[first]:.2f} | {route_steps[p] / llama_steps[p]:.2f} |"
        )
    print("\n| node | kv_bytes_per_token (advertised) | KV cells | advertised KV MiB | RSS MiB after the fill |")
    print("|---|---|---|---|---|")
    for n, b, c, r in zip(nodes, kv_per_token, cells, rss):
        print(f"| {n.spec.start}:{n.spec.end} | {b} | {c} | {b * c / MIB:.1f} | {r / MIB:.0f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
