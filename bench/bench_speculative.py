"""Speculative decoding benchmark (issue 13 item 5): decode tok/s of the 3-node route, plain vs ``--speculative
ngram``, on code and on repetitive text, with and without a one-way delay per hop; one table from one run.

Three ``ggufswarm node`` processes (Gemma 3 270M, blocks 0-5 / 6-11 / 12-17, 1 thread each), each behind a
``ggufswarm.netdelay.DelayProxy`` adding --delays ms per direction. A plain decode token costs 4 one-way
latencies (client -> 1 -> 2 -> head, and the head's reply link back); a verify step costs the same 4 and yields
1 to k + 1 tokens. Every speculative run's tokens are checked against the plain run's (``same`` column).

Columns: plain and speculative decode tok/s (the generation's own ``decode_tok_s``), speed-up, acceptance
(accepted / drafted), tokens per route trip (decoded tokens / decode steps), and the physical bound of plain
decoding ``1000 / (compute ms per token + 4 x delay)`` with the plain run's compute measured at 0 ms.

Usage: .venv/bin/python bench/bench_speculative.py [--delays 0,25] [--decode 64] [--draft-max 2] [--threads 1]
Not a test: run it on an idle machine.
"""

from __future__ import annotations

import argparse
import os
import sys

from bench_wan import delayed

from ggufswarm.artifact.default_model import default_model_path
from ggufswarm.artifact.gguf_file import GGUFModelFile
from ggufswarm.client.generate import GenerationStats, generate
from ggufswarm.client.route import RemoteRoute
from ggufswarm.client.speculative import NgramDrafter
from ggufswarm.client.tokenizer import Tokenizer
from ggufswarm.node.launch import start_nodes, stop_nodes
from ggufswarm.runtime.sampling import SamplingParams
from ggufswarm.runtime.shard import even_split

PROMPTS = {
    "code": (
        "import json\n\n\nclass Config:\n    def __init__(self, path):\n        self.path = path\n"
        "        self.data = {}\n\n    def load(self):\n        with open(self.path) as f:\n"
        "            self.data = json.load(f)\n\n    def save(self):\n"
    ),
    "repetitive": (
        "Monday, Tuesday, Wednesday, Thursday, Friday, Saturday, Sunday. Monday, Tuesday, Wednesday, "
        "Thursday, Friday, Saturday, Sunday. Monday,"
    ),
}


def run(route: RemoteRoute, tok: Tokenizer, ids: list[int], n: int, draft_max: int | None) -> GenerationStats:
    """One greedy generation of ``n`` tokens (speculative with ``draft_max``); its stats."""
    session = route.open(len(ids) + n + 1, SamplingParams(temperature=0), reuse_prefix=False)
    stats = GenerationStats()
    try:
        drafter = NgramDrafter(draft_max) if draft_max else None
        for _ in generate(session, tok, ids, n, None, stats, drafter):
            pass
        stats.compute_ms = sum(sum(s.compute_ms) for s in session.telemetry.steps[1:]) / max(len(stats.tokens) - 1, 1)
    finally:
        session.close()
    return stats


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--delays", default="0,25", help="one-way delays per hop, ms (default 0,25)")
    ap.add_argument("--decode", type=int, default=64, help="greedy tokens per generation (default 64)")
    ap.add_argument("--draft-max", type=int, default=2, help="drafted tokens per verify step (default 2)")
    ap.add_argument("--threads", type=int, default=1, help="llama.cpp threads per node (default 1)")
    args = ap.parse_args()
    delays = [float(d) for d in args.delays.split(",")]
    path = str(default_model_path())
    tok = Tokenizer(path, GGUFModelFile(path).metadata)
    print(
        f"# 3-node route, plain vs speculative ngram (draft-max {args.draft_max}) — {os.path.basename(path)}, "
        f"{args.threads} thread(s) per node, {args.decode} greedy tokens, cpus {os.cpu_count()}"
    )
    print(
        "| text | one-way ms/hop | plain tok/s | bound tok/s | spec tok/s | speed-up | acceptance | tok/trip | same |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---|")
    nodes = start_nodes(even_split(18, 3), path, threads=args.threads)
    compute: dict[str, float] = {}
    try:
        for delay in delays:
            addrs = [(n.url.split("//")[1].rsplit(":", 1)[0], int(n.url.rsplit(":", 1)[1])) for n in nodes]
            with delayed(addrs, delay) as hosts:
                route = RemoteRoute([f"http://{h}" for h in hosts], 60.0 + 20 * delay / 1e3)
                run(route, tok, tok.encode("Hello"), 4, None)  # warm-up: links, first steps
                for name, text in PROMPTS.items():
                    ids = tok.encode(text)
                    plain = run(route, tok, ids, args.decode, None)
                    spec = run(route, tok, ids, args.decode, args.draft_max)
                    compute.setdefault(name, plain.compute_ms)
                    bound = 1000.0 / (compute[name] + 4 * delay)
                    trips = spec.verify_steps + (len(spec.tokens) - 1 - spec.verify_steps - spec.accepted)
                    acc = f"{spec.accepted}/{spec.drafted}" + (
                        f" ({spec.accepted / spec.drafted:.0%})" if spec.drafted else ""
                    )
                    print(
                        f"| {name} | {delay:g} | {plain.decode_tok_s:.1f} | {bound:.1f} | {spec.decode_tok_s:.1f} | "
                        f"{spec.decode_tok_s / max(plain.decode_tok_s, 1e-9):.2f}x | {acc} | "
                        f"{(len(spec.tokens) - 1) / max(trips, 1):.2f} | {spec.tokens == plain.tokens} |",
                        flush=True,
                    )
    finally:
        stop_nodes(nodes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
