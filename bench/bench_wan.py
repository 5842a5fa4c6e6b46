"""WAN benchmark (issue 13 item 4): decode tok/s of the 3-node route and of llama.cpp RPC when every hop adds a
one-way network latency, one table from one run.

Each of the three ``ggufswarm node`` processes (Gemma 3 270M, blocks 0-5 / 6-11 / 12-17, 1 thread each) and each
of the three ``rpc-server`` processes sits behind a ``ggufswarm.netdelay.DelayProxy`` adding --delays ms to
every byte in each direction (what ``tc netem delay`` would add; netem is not available on this kernel). The
route's client and llama-bench are the callers. Per decode token the route crosses client -> node 1 -> node 2 ->
node 3 and the head answers the client directly (its reply link): 4 one-way latencies, so its decode cannot
exceed ``1000 / (4 * delay)`` tok/s. llama.cpp RPC makes several round trips to every server per token.

Usage: .venv/bin/python bench/bench_wan.py [--delays 0,5,25] [--decode 16] [--prefill 64]
(the RPC rows need ``make llamacpp-tools``; without the binaries they are left out.)
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time

from bench_llamacpp import GREEDY, TOOLS_BIN, llama_bench, prompt_ids, rpc_bench_args, rpc_servers, run_session

from ggufswarm.artifact.default_model import default_model_path
from ggufswarm.artifact.gguf_file import GGUFModelFile
from ggufswarm.client.route import RemoteRoute
from ggufswarm.client.tokenizer import Tokenizer
from ggufswarm.netdelay import DelayProxy
from ggufswarm.node.launch import start_nodes, stop_nodes
from ggufswarm.runtime.shard import even_split


@contextlib.contextmanager
def delayed(addresses: list[tuple[str, int]], delay_ms: float):
    """A DelayProxy in front of each ``(host, port)``; yields their ``host:port`` strings."""
    proxies = [DelayProxy(a, delay_ms) for a in addresses]
    try:
        yield [":".join(map(str, p.start())) for p in proxies]
    finally:
        for p in proxies:
            p.stop()


def route_decode(nodes, ids: list[int], n_decode: int, delay_ms: float) -> tuple[float, float]:
    """(prefill, decode) tok/s of one greedy session over ``nodes`` behind proxies, after a warm-up session."""
    addrs = [(n.url.split("//")[1].rsplit(":", 1)[0], int(n.url.rsplit(":", 1)[1])) for n in nodes]
    with delayed(addrs, delay_ms) as hosts:
        route = RemoteRoute([f"http://{h}" for h in hosts], 60.0 + 20 * delay_ms / 1e3)
        warm = route.open(64, GREEDY)
        run_session(warm, ids[:8], 4)
        warm.close()
        session = route.open(len(ids) + n_decode + 8, GREEDY)
        try:
            return run_session(session, ids, n_decode)
        finally:
            session.close()


def rpc_decode(path: str, n_prefill: int, n_decode: int, delay_ms: float, env: dict) -> tuple[float, float]:
    """llama-bench (prefill, decode) tok/s over 3 rpc-servers behind proxies (one repetition)."""
    with rpc_servers(1, env) as (_, addrs):
        targets = [(a.rsplit(":", 1)[0], int(a.rsplit(":", 1)[1])) for a in addrs]
        with delayed(targets, delay_ms) as hosts:
            out, _ = llama_bench(path, ["-p", str(n_prefill), "-n", str(n_decode), *rpc_bench_args(1, hosts)], env, 1)
    return out["prefill"], out["decode"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--delays", default="0,5,25", help="one-way delays per hop, ms (default 0,5,25)")
    ap.add_argument("--prefill", type=int, default=64, help="prompt tokens (default 64)")
    ap.add_argument("--decode", type=int, default=16, help="greedy tokens decoded (default 16)")
    args = ap.parse_args()
    delays = [float(d) for d in args.delays.split(",")]
    path = str(default_model_path())
    f = GGUFModelFile(path)
    ids = prompt_ids(Tokenizer(path, f.metadata), args.prefill)
    have_rpc = all((TOOLS_BIN / b).is_file() for b in ("llama-bench", "rpc-server"))
    print(
        f"# 3-node route vs llama.cpp RPC with a one-way delay per hop — {os.path.basename(path)}, 1 thread per "
        f"process, {len(ids)}-token prompt, {args.decode} decode tokens; load {os.getloadavg()[0]:.2f}"
    )
    rows = []
    nodes = start_nodes(even_split(18, 3), path, threads=1)
    try:
        for d in delays:
            t0 = time.perf_counter()
            route = route_decode(nodes, ids, args.decode, d)
            rpc = rpc_decode(path, len(ids), args.decode, d, dict(os.environ)) if have_rpc else None
            rows.append((d, route, rpc))
            print(
                f"  delay {d:g} ms: route {route[1]:.2f} tok/s"
                + (f", RPC {rpc[1]:.2f} tok/s" if rpc else "")
                + f" ({time.perf_counter() - t0:.0f} s)",
                flush=True,
            )
    finally:
        stop_nodes(nodes)
    print()
    print(
        "| one-way delay per hop | route decode tok/s | bound 1000/(4·delay) | llama.cpp RPC decode tok/s "
        "| route / RPC | route prefill tok/s | RPC prefill tok/s |"
    )
    print("|---|---|---|---|---|---|---|")
    for d, route, rpc in rows:
        bound = f"{1000 / (4 * d):.1f}" if d else "-"
        print(
            f"| {d:g} ms | {route[1]:.2f} | {bound} | {rpc[1]:.2f} | {route[1] / rpc[1]:.1f}× | {route[0]:.1f} "
            f"| {rpc[0]:.1f} |"
            if rpc
            else f"| {d:g} ms | {route[1]:.2f} | {bound} | - | - | {route[0]:.1f} | - |"
        )
    if not have_rpc:
        print(f"\n(llama.cpp RPC rows left out: no llama-bench / rpc-server under {TOOLS_BIN}; make llamacpp-tools)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
