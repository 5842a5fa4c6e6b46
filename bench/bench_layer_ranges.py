"""Benchmark: models that need ggufswarm's llama.cpp patch queue, as layer ranges across nodes, and what reading a
node's layers in place (patch 0004) saves. Not a test; one run, one table per part.

Part 1 — tiny ``deepseek4`` (DeepSeek-V4-Flash layout: 6 blocks, ratios 0/0/4/128/4/128, 4 hyper-connection
streams, 3 hash-routed blocks) and tiny ``glm4moe`` through a 3-node route (f32 frames, 1 thread per node) against
llama.cpp's whole model in-process (1 thread): decode tok/s and the payload bytes per decode token on each hop
(DeepSeek-V4 moves its 4 residual streams: 4 x n_embd f32 values + the token id per token).

Part 2 — node start and disk, for a node serving the middle third of the default model (Gemma 3 270M, the largest
real GGUF this machine has) and of SmolLM2-135M: seconds from "load the shard" to ready (``LlamaCppShard``; its
shard files written fresh) and the bytes the node keeps on disk besides the fetched model bytes, with one derived
copy of the layers (before: ``in_place=False``) and with the layers read in place from the model file (after).

Usage:
    .venv/bin/python bench/bench_layer_ranges.py [--prefill 64] [--decode 48]
"""

from __future__ import annotations

import argparse
import datetime
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from tinymoe import write_tiny_deepseek4_model, write_tiny_moe_model

from ggufswarm.artifact.default_model import default_model_path, smollm2_path
from ggufswarm.artifact.gguf_file import GGUFModelFile
from ggufswarm.client.route import RemoteRoute
from ggufswarm.node.launch import start_nodes, stop_nodes
from ggufswarm.runtime.llamacpp import derive
from ggufswarm.runtime.llamacpp.backend import LlamaCppShard
from ggufswarm.runtime.llamacpp.range_checks import n_model_layers
from ggufswarm.runtime.sampling import SamplingParams
from ggufswarm.runtime.shard import ShardSpec
from ggufswarm.runtime.spec import even_split


def llama_cpp_decode(path: Path, ids: list[int], n_decode: int) -> float:
    """llama.cpp whole model in-process, 1 thread, greedy: decode tok/s after the prompt."""
    import llama_cpp as L

    llm = L.Llama(str(path), n_ctx=512, n_batch=512, n_threads=1, n_threads_batch=1, flash_attn=True, verbose=False)
    try:
        llm.eval(ids)
        token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        t0 = time.perf_counter()
        for _ in range(n_decode):
            llm.eval([token])
            token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        return n_decode / (time.perf_counter() - t0)
    finally:
        llm.close()


def route_decode(path: Path, ids: list[int], n_decode: int, work: Path) -> tuple[float, list[float]]:
    """A 3-node route (even split, 1 thread each, f32 frames): decode tok/s and payload bytes per decode token per
    hop (what each node received)."""
    n = n_model_layers(GGUFModelFile(path))
    nodes = start_nodes(
        even_split(n, 3),
        str(path),
        threads=1,
        timeout=300,
        extra=["--ctx-size", "512", "--max-sessions", "1"],
        per_node=lambda i: ["--data-dir", str(work / f"node{i}")],
    )
    try:
        session = RemoteRoute([nd.url for nd in nodes], 30.0).open(
            len(ids) + n_decode + 8, SamplingParams(temperature=0)
        )
        token = session.step(ids)
        t0 = time.perf_counter()
        for _ in range(n_decode):
            token = session.step([token])
        tps = n_decode / (time.perf_counter() - t0)
        hops = session.telemetry.summary(session.route)["hops"]
        session.close()
        return tps, [h["payload_bytes_per_decode_token"] for h in hops]
    finally:
        stop_nodes(nodes)


def start_and_disk(path: Path, work: Path) -> list[tuple[str, float, int]]:
    """(mode, seconds writing the shard's files, seconds llama.cpp then takes to load them and make a context, bytes
    written besides the model, RSS growth after one 16-token step (bytes; KV cache included), the range's tensor
    bytes) for the middle third, as a fresh node would start."""
    model = GGUFModelFile(path)
    specs = even_split(n_model_layers(model), 3)
    mid = specs[1]
    out = []
    for label, in_place in (("derived copy (before)", False), ("in place, patch 0004 (after)", True)):
        cache = work / f"{path.stem}-{in_place}"
        t0 = time.perf_counter()
        paths = derive.shard_paths(model, mid.start, mid.end, mid.head, cache, in_place=in_place)
        dt_files = time.perf_counter() - t0
        rss0 = psutil.Process().memory_info().rss
        t1 = time.perf_counter()
        node = LlamaCppShard(
            model,
            ShardSpec(mid.start, mid.end),
            n_ctx_seq=512,
            n_seq_max=1,
            threads=1,
            cache_dir=cache,
            in_place=in_place,
        )
        dt_load = time.perf_counter() - t1
        assert [str(p) for p in node.paths] == [str(p) for p in paths]
        kv = node.new_session(512)
        node.forward(kv, np.zeros((16, node.cfg.n_embd), np.float32))  # touches every weight of the range once
        rss = psutil.Process().memory_info().rss - rss0
        node.close()
        written = sum(f.stat().st_blocks * 512 for f in cache.iterdir())
        tensor_bytes = sum(
            GGUFModelFile(path).tensors[src].n_bytes
            for src, _ in derive.shard_tensors(model, mid.start, mid.end, mid.head)
        )
        out.append((label, dt_files, dt_load, written, rss, tensor_bytes))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--prefill", type=int, default=64, help="prompt tokens (default 64)")
    ap.add_argument("--decode", type=int, default=48, help="decoded tokens timed (default 48)")
    ap.add_argument(
        "--part",
        choices=("route", "disk", "both"),
        default="both",
        help="route: part 1 (tiny deepseek4/glm4moe, 3-node route vs llama.cpp); disk: part 2 (node start "
        "and disk, the real models); both (default)",
    )
    args = ap.parse_args()
    print(f"# bench_layer_ranges {datetime.datetime.now().isoformat(timespec='seconds')}")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        models = (
            {}
            if args.part == "disk"
            else {
                "deepseek4": write_tiny_deepseek4_model(
                    work / "deepseek4.gguf", compress_ratios=[0, 0, 4, 128, 4, 128], hash_layers=3
                ),
                "glm4moe": write_tiny_moe_model(work / "glm4moe.gguf", "glm4moe"),
            }
        )
        ids = [1] + np.random.default_rng(0).integers(3, 384, args.prefill - 1).tolist()
        if models:
            print("\n## 3-node route vs llama.cpp whole model (1 thread each, f32 frames)")
            print(
                f"{'arch':<10} {'n_embd':>6} {'llama.cpp tok/s':>15} {'route tok/s':>11} {'ratio':>6}  "
                f"payload B/decode token per hop"
            )
        for arch, path in models.items():
            ref = llama_cpp_decode(path, ids, args.decode)
            tps, per_hop = route_decode(path, ids, args.decode, work / arch)
            n_embd = int(GGUFModelFile(path).metadata[f"{arch}.embedding_length"])
            print(
                f"{arch:<10} {n_embd:>6} {ref:>15.1f} {tps:>11.1f} {tps / ref:>6.2f}  "
                + " / ".join(f"{b:,.0f}" for b in per_hop)
            )
        if args.part != "route":
            print("\n## node start and disk: the middle third of a real model")
            print(
                f"{'model':<32} {'mode':<30} {'shard files s':>13} {'load s':>7} {'bytes written':>14} "
                f"{'RSS growth':>12} {'tensor bytes':>13}"
            )
        for path in (default_model_path(), smollm2_path()) if args.part != "route" else ():
            for label, dt_files, dt_load, written, rss, tensor_bytes in start_and_disk(path, work):
                print(
                    f"{path.name:<32} {label:<30} {dt_files:>13.3f} {dt_load:>7.3f} {written:>14,} {rss:>12,} "
                    f"{tensor_bytes:>13,}"
                )


if __name__ == "__main__":
    main()
