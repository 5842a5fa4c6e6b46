"""Benchmark of ``/v1/responses`` conversations: TTFT of a second turn sent by ``previous_response_id`` against the
same turn with the whole conversation resent as input, and against a cold turn of the same length (no prefix of
it cached), in one run.

Turn 1 is a ~250-token excerpt plus a question (its answer cut at --answer tokens); turn 2 a short follow-up. The
nodes snapshot their KV into a snapshot cache (``--cache``), so a turn 2 whose prompt starts with turn 1's prompt
and answer restores that prefix instead of computing it (``usage.input_tokens_details.cached_tokens``). Also says
how many of turn 1's tokens (prompt + answer, as stored) turn 2's rendered prompt starts with.

3 node processes (even split, --threads each) with a cache server, an in-process gateway on the fixed route, the
official openai client streaming. Usage:
    .venv/bin/python bench/bench_responses.py [--threads 1] [--reps 3] [--answer 24]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import openai

from ggufswarm.artifact.default_model import default_model_path
from ggufswarm.cache.app import CacheConfig
from ggufswarm.cache.app import make_app as make_cache_app
from ggufswarm.gateway import GatewayConfig, make_app
from ggufswarm.gateway.app import GATEWAY
from ggufswarm.net.http import ServerThread
from ggufswarm.node.launch import start_nodes, stop_nodes
from ggufswarm.runtime.shard import even_split

TEXT = (Path(__file__).parent.parent / "tests" / "data" / "gpl-3.0-excerpt.txt").read_text(encoding="utf-8")
EXCERPT_CHARS = 1000  # about 250 Gemma tokens (3 per conversation: the text holds 3 conversations)
FOLLOW_UP = "Now say it again in fewer words."


def turn(client, model: str, **kw) -> tuple[float, object]:
    """Stream one response: (ms to its first text delta, the final response object)."""
    t0, first = time.perf_counter(), None
    with client.responses.stream(model=model, temperature=0, **kw) as stream:
        for event in stream:
            if event.type == "response.output_text.delta" and first is None:
                first = (time.perf_counter() - t0) * 1e3
            if event.type in ("response.completed", "response.incomplete"):
                final = event.response
    return first, final


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=3, help="conversations per row (medians reported)")
    ap.add_argument("--answer", type=int, default=24, help="turn 1's answer length in tokens")
    args = ap.parse_args()
    path = default_model_path()
    work = Path(tempfile.mkdtemp(prefix="ggufswarm-bench-responses-"))
    cache = ServerThread(make_cache_app(CacheConfig(dir=str(work / "cache"))))
    nodes, gateway = [], None
    try:
        cache_url = cache.start()
        nodes = start_nodes(
            even_split(18, 3),
            str(path),
            threads=args.threads,
            extra=["--cache", cache_url, "--snapshot-every", "16"],
            per_node=lambda i: ["--data-dir", str(work / f"node{i}")],
        )
        app = make_app(GatewayConfig([n.url for n in nodes], model=str(path), hop_timeout_s=30))
        gateway = ServerThread(app)
        client = openai.OpenAI(base_url=gateway.start() + "/v1", api_key="none", max_retries=0, timeout=300)
        model = client.models.list().data[0].id
        turn(client, model, input="Warm-up.", max_output_tokens=2, store=False)
        rows = {"previous_response_id": [], "whole conversation resent": [], "cold (no cached prefix)": []}
        shared = []
        for rep in range(args.reps):
            excerpts = [TEXT[(3 * rep + k) * EXCERPT_CHARS :][:EXCERPT_CHARS] for k in range(3)]
            firsts = []
            for excerpt in excerpts[:2]:
                question = excerpt + "\n\nIn one sentence, what is this about?"
                _, first = turn(client, model, input=question, max_output_tokens=args.answer)
                firsts.append((question, first))
            time.sleep(1.0)  # let the snapshots of turn 1 land in the cache
            (q_a, first_a), (q_b, first_b) = firsts
            ms, second = turn(
                client, model, previous_response_id=first_a.id, input=FOLLOW_UP, max_output_tokens=4, store=True
            )
            rows["previous_response_id"].append((ms, second))
            store, owner = app[GATEWAY].responses, ""
            t1, t2 = store.get(owner, first_a.id).token_ids, store.get(owner, second.id).token_ids
            shared.append((next((i for i, (a, b) in enumerate(zip(t1, t2)) if a != b), len(t1)), len(t1)))
            whole = [{"role": "user", "content": q_b}] + [i.model_dump(exclude_none=True) for i in first_b.output]
            whole.append({"role": "user", "content": FOLLOW_UP})
            rows["whole conversation resent"].append(turn(client, model, input=whole, max_output_tokens=4, store=False))
            # the same conversation shape over text no turn 1 ran on: nothing of it is cached
            cold = [{"role": "user", "content": excerpts[2] + "\n\nIn one sentence, what is this about?"}]
            cold += [i.model_dump(exclude_none=True) for i in first_b.output]
            cold.append({"role": "user", "content": FOLLOW_UP})
            rows["cold (no cached prefix)"].append(turn(client, model, input=cold, max_output_tokens=4, store=False))
        print(
            f"\n/v1/responses turn 2 TTFT: 3 nodes, threads {args.threads}, turn 1 answer {args.answer} tokens, "
            f"medians of {args.reps}"
        )
        print("| turn 2 sent as | prompt tokens | cached tokens | TTFT ms (client) | TTFT ms (gateway telemetry) |")
        print("|---|---|---|---|---|")
        for name, runs in rows.items():

            def med(f, runs=runs):
                return statistics.median(f(ms, r) for ms, r in runs)

            print(
                f"| {name} | {med(lambda ms, r: r.usage.input_tokens):.0f} | "
                f"{med(lambda ms, r: r.usage.input_tokens_details.cached_tokens):.0f} | {med(lambda ms, r: ms):.0f} | "
                f"{med(lambda ms, r: r.model_extra['telemetry']['ttft_ms']):.0f} |"
            )
        print(
            "turn 2's rendered prompt starts with (of turn 1's prompt + answer tokens): "
            + ", ".join(f"{s}/{n}" for s, n in shared)
        )
    finally:
        if gateway is not None:
            gateway.stop()
        stop_nodes(nodes)
        cache.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
