"""Benchmark (issue 12): a tiny mixture-of-experts model through a 3-node route on both backends — decode tok/s
and each node's RSS next to its shard's tensor bytes, with llama.cpp in-process as the anchor. Not a test.

The model is a random-weight GGUF written with the tests' writer (``tests/tinymoe.py``: F32 tensors, experts as
3-D tensors): no real MoE GGUF small enough for this machine is on the package registries. Architectures:
``qwen3moe`` (routed experts) and ``deepseek2`` (MLA latent cache, leading dense block, shared expert) — the two
the torch reference also runs — and, llama.cpp only, ``qwen3next`` (hybrid recurrent + attention, MoE).

Every process runs 1 thread; the route is ``even_split(n_layers, 3)`` with f32 frames. Each engine decodes
``--decode`` greedy tokens after a ``--prefill``-token prompt, after an untimed warm-up. One table, one run.

Usage:
    .venv/bin/python bench/bench_moe.py [--prefill 128] [--decode 64] [--arch qwen3moe deepseek2 qwen3next]
"""

from __future__ import annotations

import argparse
import datetime
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from tinymoe import write_tiny_moe_model

from ggufswarm.artifact.gguf_file import GGUFModelFile
from ggufswarm.client.route import RemoteRoute
from ggufswarm.node.launch import start_nodes, stop_nodes
from ggufswarm.runtime.llamacpp.range_checks import n_model_layers
from ggufswarm.runtime.sampling import SamplingParams
from ggufswarm.runtime.spec import even_split

MIB = 1024 * 1024
TORCH_ARCHS = ("qwen3moe", "deepseek2")


def timed(step, ids: list[int], n_decode: int) -> tuple[float, float]:
    """(prefill tok/s, decode tok/s) of one greedy generation through ``step(tokens) -> next token``."""
    t0 = time.perf_counter()
    token = step(ids)
    t1 = time.perf_counter()
    for _ in range(n_decode):
        token = step([token])
    return len(ids) / (t1 - t0), n_decode / (time.perf_counter() - t1)


def llama_cpp(path: Path, ids: list[int], n_decode: int) -> tuple[float, float]:
    """llama.cpp in-process (llama-cpp-python), greedy on the last position's logits."""
    import llama_cpp as L
    import numpy as np

    llm = L.Llama(
        str(path),
        n_ctx=len(ids) + n_decode + 16,
        n_batch=512,
        n_threads=1,
        n_threads_batch=1,
        flash_attn=True,
        verbose=False,
    )

    def step(tokens):
        llm.eval(tokens)
        return int(np.argmax(llm.scores[llm.n_tokens - 1]))

    try:
        timed(step, ids[:16], 4)
        llm.reset()
        return timed(step, ids, n_decode)
    finally:
        llm.close()


def shard_bytes(model: GGUFModelFile, start: int, end: int, embed: bool, head: bool) -> int:
    """Tensor bytes of blocks [start, end) plus the embedding / output tensors the shard holds."""
    total = 0
    for name, info in model.tensors.items():
        if name.startswith("blk."):
            total += info.n_bytes if start <= int(name.split(".")[1]) < end else 0
        elif (embed and name.startswith("token_embd")) or (head and not name.startswith("token_embd")):
            total += info.n_bytes
    return total


def route(path: Path, backend: str, ids: list[int], n_decode: int) -> dict:
    model = GGUFModelFile(path)
    specs = even_split(n_model_layers(model), 3)
    extra = ["--backend", backend] if backend != "llama.cpp" else []
    with tempfile.NamedTemporaryFile("w+", suffix=".log") as log:
        nodes = start_nodes(specs, str(path), threads=1, extra=extra, stderr=log)
        try:
            r = RemoteRoute([n.url for n in nodes], 60.0)
            warm = r.open(64, SamplingParams(temperature=0))
            timed(warm.step, ids[:16], 4)
            warm.close()
            session = r.open(len(ids) + n_decode + 8, SamplingParams(temperature=0))
            prefill, decode = timed(session.step, ids, n_decode)
            session.close()
            rss = [psutil.Process(n.proc.pid).memory_info().rss for n in nodes]
        finally:
            stop_nodes(nodes)
    mem = [(r_, shard_bytes(model, s.start, s.end, s.embed, s.head)) for r_, s in zip(rss, specs)]
    return {"prefill": prefill, "decode": decode, "mem": mem}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prefill", type=int, default=128)
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--arch", nargs="+", default=["qwen3moe", "deepseek2", "qwen3next"])
    args = ap.parse_args()
    ids = [1 + (i * 37) % 200 for i in range(args.prefill)]
    print(
        f"# tiny MoE through a 3-node route, 1 thread per process ({datetime.date.today()}, "
        f"prefill {args.prefill}, decode {args.decode})\n"
    )
    print("| model | engine | prefill tok/s | decode tok/s | decode vs llama.cpp | node RSS / shard MiB |")
    print("|---|---|---:|---:|---:|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for arch in args.arch:
            # 9 blocks, 3 per node: each qwen3next shard then holds a full-attention block (every 3rd)
            path = write_tiny_moe_model(Path(tmp) / f"{arch}.gguf", arch, n_layers=9)
            ref = llama_cpp(path, ids, args.decode)
            print(f"| {arch} | llama.cpp in-process | {ref[0]:.0f} | {ref[1]:.1f} | 1.00 | |", flush=True)
            for backend in ("llama.cpp", "torch") if arch in TORCH_ARCHS else ("llama.cpp",):
                out = route(path, backend, ids, args.decode)
                mem = ", ".join(f"{r / MIB:.0f} / {b / MIB:.1f}" for r, b in out["mem"])
                print(
                    f"| {arch} | route, 3 {backend} nodes | {out['prefill']:.0f} | {out['decode']:.1f} | "
                    f"{out['decode'] / ref[1]:.2f} | {mem} |",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
