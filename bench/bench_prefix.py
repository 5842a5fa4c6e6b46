"""Benchmark of prefix reuse and route repair (issue 5): one table from one run.

* TTFT of a request with a 600-token prompt prefix (cold), then of a second request sharing that
  prefix (its snapshots restored from the cache), then of a third with an unrelated prompt of the
  same length (cold again, to show the first was not a warm-up effect);
* the same three prompts through llama.cpp (llama-cpp-python, one process; it keeps the previous
  prompt's KV in memory and reuses the common prefix itself, the single-machine best case);
* one route repair: the last node of a 3-node route is SIGKILLed mid-generation and a spare takes
  over: restored vs replayed tokens, repair ms, and whether the text equals the uninterrupted run.

3 node processes (even split) + a spare for 12:18, a cache server, a tracker and a gateway on
loopback; --threads PyTorch / llama.cpp threads per process. Usage:
    .venv/bin/python bench/bench_prefix.py [--threads 1] [--prefix 600]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))

from test_faults import stream, wait_for

from ggufswarm.artifact.default_model import default_model_path
from ggufswarm.artifact.gguf_file import GGUFModelFile
from ggufswarm.cache.app import CacheConfig
from ggufswarm.cache.app import make_app as make_cache_app
from ggufswarm.client.tokenizer import Tokenizer
from ggufswarm.directory.trackers import TrackerClient
from ggufswarm.gateway import GatewayConfig, make_app
from ggufswarm.net.http import ServerThread
from ggufswarm.node.launch import start_nodes, stop_nodes
from ggufswarm.runtime.shard import ShardSpec, even_split
from ggufswarm.swarm.publish import publish
from ggufswarm.swarm.torrent import Swarm, save_path_for
from ggufswarm.tracker.app import TrackerConfig
from ggufswarm.tracker.app import make_app as make_tracker_app

TEXT = (Path(__file__).parent.parent / "tests" / "data" / "gpl-3.0-excerpt.txt").read_text(encoding="utf-8")


def llama_cpp_ttft(path: Path, prompts: list[str], threads: int) -> list[float]:
    """ms to the first token for each prompt in turn, in one llama.cpp context (prefix KV reused)."""
    import llama_cpp

    llm = llama_cpp.Llama(str(path), n_ctx=2048, n_threads=threads, verbose=False)
    out = []
    for p in prompts:
        t0 = time.perf_counter()
        next(iter(llm.create_completion(p, max_tokens=1, temperature=0, stream=True)))
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--prefix", type=int, default=600, help="shared prefix length in tokens (default 600)")
    args = ap.parse_args()
    path = default_model_path()
    file = GGUFModelFile(path)
    tok = Tokenizer(str(path), file.metadata)
    ids = tok.encode(TEXT)
    shared = tok.decode(ids[1 : 1 + args.prefix])
    other = tok.decode(ids[1 + args.prefix : 1 + 2 * args.prefix])
    prompts = [
        shared + " In short, the first point is",
        shared + " Summarizing the second section:",
        other + " In short, the first point is",
    ]
    ref = llama_cpp_ttft(path, prompts, args.threads)  # before the cluster starts: the machine is idle
    work = Path(tempfile.mkdtemp(prefix="ggufswarm-bench-prefix-"))
    nodes, gateway, seeder = [], None, None
    tracker = ServerThread(make_tracker_app(TrackerConfig(db=":memory:", ttl_s=3.0)))
    cache = ServerThread(make_cache_app(CacheConfig(dir=str(work / "cache"))))
    try:
        tracker_url, cache_url = tracker.start(), cache.start()
        published = publish(path, tracker_url, "gemma", work / "publisher")
        seeder = Swarm()
        seeder.seed(published.torrent, save_path_for([path]))
        specs = even_split(18, 3) + [ShardSpec(12, 18, head=True)]
        nodes = start_nodes(
            specs,
            "gemma",
            threads=args.threads,
            timeout=600,
            extra=["--tracker", tracker_url, "--cache", cache_url, "--snapshot-every", "16"],
            per_node=lambda i: ["--data-dir", str(work / f"node{i}")],
        )
        wait_for(lambda: len(TrackerClient(tracker_url).nodes("gemma")) == len(nodes), 30)
        gateway = ServerThread(
            make_app(
                GatewayConfig([], model="gemma", tracker=tracker_url, hop_timeout_s=10, data_dir=str(work / "gateway"))
            )
        )
        base = gateway.start()
        stream(base, "Warm-up.", lambda i: None)
        ours = []
        for p in prompts:
            _, t = stream(base, p, lambda i: None)
            ours.append(t)
            time.sleep(1.0)  # let the post-prefill snapshots land
        print(f"\nPrefix reuse: {args.prefix}-token shared prefix, threads {args.threads}")
        print("| request | prompt tokens | ggufswarm TTFT ms (restored tokens) | llama.cpp TTFT ms |")
        print("|---|---|---|---|")
        for name, t, r in zip(("1: cold", "2: shares the prefix", "3: unrelated, cold"), ours, ref):
            print(f"| {name} | {t['prompt_tokens']} | {t['ttft_ms']:.0f} ({t['prefix_tokens_restored']}) | {r:.0f} |")
        print(
            f"ggufswarm second/first TTFT: {ours[1]['ttft_ms'] / ours[0]['ttft_ms']:.2f}x; "
            f"llama.cpp: {ref[1] / ref[0]:.2f}x"
        )

        # one repair: kill the head that serves a request mid-generation
        plain, _ = stream(base, prompts[2], lambda i: None)
        victim = {}

        def kill(i):
            if i == 8:
                from route_fixtures import health

                head = next(n for n in nodes if n.spec.head and health(n.url)["sessions"] > 0)
                victim["node"] = head
                head.kill()

        text, t = stream(base, prompts[2], kill)
        r = t["repairs"][0]
        print(
            f"\nRoute repair (SIGKILL of the head {victim['node'].url} after 8 tokens): restored "
            f"{r['restored_tokens']} tokens, replayed {r['tokens_replayed']} (a full replay: "
            f"{r['restored_tokens'] + r['tokens_replayed']}), {r['ms']:.0f} ms; text identical: {text == plain}"
        )
    finally:
        if gateway is not None:
            gateway.stop()
        stop_nodes(nodes)
        if seeder is not None:
            seeder.close()
        cache.stop()
        tracker.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
