"""Benchmark of route sessions: one table from one run (issue 3).

* prefill / decode tok/s: route with 1, 2, 3 node processes vs single-process ``generate`` vs llama.cpp
* mean decode step at position ~100 vs ~2000 on the 3-node route (KV is local: must not grow > 1.5x)
* aggregate decode tok/s with 1, 4, 8 concurrent sessions on the 3-node route

Every process uses --threads (default 1) PyTorch / llama.cpp threads. Usage:
    .venv/bin/python bench/bench_route.py [--threads 1] [--prefill 512] [--decode 64]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from ggufswarm.artifact.default_model import default_model_path
from ggufswarm.client.local import LocalModel
from ggufswarm.client.route import RemoteRoute
from ggufswarm.node.launch import start_nodes, stop_nodes
from ggufswarm.runtime.sampling import SamplingParams
from ggufswarm.runtime.shard import even_split

GREEDY = SamplingParams(temperature=0)
TEXT = (Path(__file__).parent.parent / "tests" / "data" / "gpl-3.0-excerpt.txt").read_text(encoding="utf-8")


def prompt_ids(tokenizer, n: int) -> list[int]:
    ids = tokenizer.encode(TEXT * 4)
    return ids[:n]


def run_session(session, ids: list[int], n_decode: int) -> tuple[float, float, list[float]]:
    """(prefill tok/s, decode tok/s, decode step seconds) of one greedy generation."""
    t0 = time.perf_counter()
    token = session.step(ids)
    t1 = time.perf_counter()
    steps = []
    for _ in range(n_decode):
        s = time.perf_counter()
        token = session.step([token])
        steps.append(time.perf_counter() - s)
    return len(ids) / (t1 - t0), n_decode / sum(steps), steps


def bench_route(n_nodes: int, path: str, ids: list[int], n_decode: int, threads: int, extra: bool) -> dict:
    nodes = start_nodes(even_split(18, n_nodes), path, threads=threads)
    try:
        route = RemoteRoute([n.url for n in nodes], 60.0)
        warm = route.open(64, GREEDY)
        run_session(warm, ids[:16], 4)
        warm.close()
        session = route.open(len(ids) + n_decode + 8, GREEDY)
        prefill, decode, _ = run_session(session, ids, n_decode)
        session.close()
        out = {"prefill": prefill, "decode": decode}
        if extra:
            session = route.open(2200, GREEDY)
            ids_long = (ids * 8)[:2000]
            session.step(ids_long[:100])
            _, _, near = run_session_from(session, 20)
            session.step(ids_long[100 + 20 : 2000])  # continue the prefill up to position ~2000
            _, _, far = run_session_from(session, 20)
            session.close()
            out["step_100_ms"] = 1e3 * sum(near) / len(near)
            out["step_2000_ms"] = 1e3 * sum(far) / len(far)
            for conc in (1, 4, 8):
                out[f"agg_{conc}"] = aggregate(route, conc, ids[:32], 32)
        return out
    finally:
        stop_nodes(nodes)


def run_session_from(session, n_decode: int):
    """Decode ``n_decode`` tokens from the current position (the sampled token is fed back)."""
    token = session.step([1])
    steps = []
    for _ in range(n_decode - 1):
        s = time.perf_counter()
        token = session.step([token])
        steps.append(time.perf_counter() - s)
    return 0.0, 0.0, steps


def aggregate(route: RemoteRoute, conc: int, ids: list[int], n_decode: int) -> float:
    """Aggregate decode tok/s of ``conc`` concurrent sessions (each: short prefill, then n_decode tokens)."""

    def one(_):
        s = route.open(len(ids) + n_decode + 8, GREEDY)
        try:
            token = s.step(ids)
            t0 = time.perf_counter()
            for _ in range(n_decode):
                token = s.step([token])
            return t0, time.perf_counter()
        finally:
            s.close()

    with ThreadPoolExecutor(conc) as pool:
        spans = list(pool.map(one, range(conc)))
    wall = max(e for _, e in spans) - min(s for s, _ in spans)
    return conc * n_decode / wall


def bench_local(path: str, ids: list[int], n_decode: int) -> dict:
    model = LocalModel.load(path)
    warm = model.session(64, GREEDY)
    run_session(warm, ids[:16], 4)
    prefill, decode, _ = run_session(model.session(len(ids) + n_decode + 8, GREEDY), ids, n_decode)
    return {"prefill": prefill, "decode": decode}


def bench_llama_cpp(path: str, ids: list[int], n_decode: int, threads: int) -> dict:
    import llama_cpp

    llm = llama_cpp.Llama(
        path, n_ctx=len(ids) + n_decode + 8, n_batch=512, n_threads=threads, n_threads_batch=threads, verbose=False
    )
    import numpy as np

    n_vocab = llm.n_vocab()

    def last_argmax() -> int:
        ptr = llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1)
        return int(np.ctypeslib.as_array(ptr, shape=(n_vocab,)).argmax())

    t0 = time.perf_counter()
    llm.eval(ids)
    t1 = time.perf_counter()
    token = last_argmax()
    t2 = time.perf_counter()
    for _ in range(n_decode):
        llm.eval([token])
        token = last_argmax()
    t3 = time.perf_counter()
    return {"prefill": len(ids) / (t1 - t0), "decode": n_decode / (t3 - t2)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1, help="threads per process (default 1)")
    ap.add_argument("--prefill", type=int, default=512, help="prompt tokens (default 512)")
    ap.add_argument("--decode", type=int, default=64, help="decoded tokens (default 64)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    path = str(default_model_path())
    model = LocalModel.load(path)
    ids = prompt_ids(model.tokenizer, args.prefill)
    del model
    rows = []
    print(
        f"Gemma 3 270M Q4_K_M, {len(ids)}-token prompt, {args.decode} decoded tokens, {args.threads} thread(s) "
        f"per process, {os.cpu_count()} cores, f16 frames",
        file=sys.stderr,
    )
    rows.append(("llama.cpp (1 process)", bench_llama_cpp(path, ids, args.decode, args.threads)))
    rows.append(("ggufswarm generate (1 process)", bench_local(path, ids, args.decode)))
    results = {}
    for n in (1, 2, 3):
        results[n] = bench_route(n, path, ids, args.decode, args.threads, extra=n == 3)
        rows.append((f"route, {n} node process{'es' if n > 1 else ''}", results[n]))
    print("\n| setup | prefill tok/s | decode tok/s |\n|---|---:|---:|")
    for name, r in rows:
        print(f"| {name} | {r['prefill']:.1f} | {r['decode']:.1f} |")
    r = results[3]
    ratio = r["step_2000_ms"] / r["step_100_ms"]
    print(
        f"\n3-node route, mean decode step: {r['step_100_ms']:.1f} ms at position ~100, "
        f"{r['step_2000_ms']:.1f} ms at position ~2000 (x{ratio:.2f}; limit x1.5)"
    )
    print("\n| concurrent sessions (3-node route) | aggregate decode tok/s |\n|---:|---:|")
    for c in (1, 4, 8):
        print(f"| {c} | {r[f'agg_{c}']:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
