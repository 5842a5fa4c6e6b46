"""GPU benchmark: llama.cpp's own whole-model run on a GPU against a 3-node ggufswarm route on the same GPU, and
the same route with its middle node on the CPU; one table from one run (docs/gpu.md).

Rows (greedy, a --prefill-token prompt then --decode one-token steps, timed at the client as
bench/bench_llamacpp.py's ``run_session``; one untimed warm-up generation first):

1. llama.cpp in-process (llama-cpp-python), every block and the output on the GPU (``n_gpu_layers`` -1);
2. the route: three ``ggufswarm node`` processes (``even_split``), each ``--gpu DEVICE``;
3. the route with the middle node ``--gpu none``.

Columns: prefill and decode tok/s, the decode ratio to row 1, whether the greedy tokens equal row 1's, and per node
what llama.cpp allocated on the GPU (``/health`` placement) against the shard's weights.

The model: ``--model PATH``, or ``--layout 8b`` (a random-weight GGUF of Llama 3 8B's shape, F16, 16 GB, written
under --dir once: speed does not depend on weight values; its vocabulary is the tests' 384 tokens, so the LM head
is small) or ``--layout tiny`` (for checking the script on a machine without a GPU: Mesa's lavapipe, with
``GGML_VK_VISIBLE_DEVICES=0``).

    GGUFSWARM_GPU=cuda CUDA_ARCHITECTURES=90 make setup        # on the GPU machine: the CUDA wheel (sm_90 only)
    .venv/bin/python bench/bench_gpu.py --layout 8b --dir /tmp/gpu-bench --device CUDA0
    GGML_VK_VISIBLE_DEVICES=0 .venv/bin/python bench/bench_gpu.py --layout tiny --device Vulkan0
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import urllib.request
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))

from bench_llamacpp import GREEDY, run_session
from tinymodels import add_test_vocab

from ggufswarm.artifact.gguf_file import GGUFModelFile
from ggufswarm.client.route import RemoteRoute
from ggufswarm.node.launch import start_nodes, stop_nodes
from ggufswarm.runtime.llamacpp.backend import model_info
from ggufswarm.runtime.shard import even_split

MIB = 1 << 20
LAYOUTS = {  # Llama 3 8B's shape (config.json of meta-llama/Meta-Llama-3-8B), and a tiny one
    "8b": {"n_layers": 32, "n_embd": 4096, "n_head": 32, "n_head_kv": 8, "n_ff": 14336},
    "tiny": {"n_layers": 6, "n_embd": 256, "n_head": 4, "n_head_kv": 2, "n_ff": 512},
}


def write_layout(path: Path, layout: str) -> Path:
    """A random-weight ``llama`` GGUF of ``LAYOUTS[layout]`` (F16 matrices, F32 norms) at ``path`` (kept if there)."""
    if path.exists():
        return path
    from gguf import GGUFWriter

    shape = LAYOUTS[layout]
    n_embd, n_ff, head_dim = shape["n_embd"], shape["n_ff"], shape["n_embd"] // shape["n_head"]
    rng = np.random.default_rng(0)
    w = GGUFWriter(str(path), "llama")
    w.add_block_count(shape["n_layers"])
    w.add_context_length(8192)
    w.add_embedding_length(n_embd)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(shape["n_head"])
    w.add_head_count_kv(shape["n_head_kv"])
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(500000.0)
    w.add_file_type(1)
    add_test_vocab(w)

    def f16(rows: int, cols: int) -> np.ndarray:  # small random values without drawing 8e9 normals
        bits = rng.integers(0x1C00, 0x2C00, size=(rows, cols), dtype=np.uint16)  # |x| in about [0.004, 0.06)
        bits |= rng.integers(0, 2, size=(rows, cols), dtype=np.uint16) << 15
        return bits.view(np.float16)

    n_vocab = 384
    w.add_tensor("token_embd.weight", f16(n_vocab, n_embd))
    w.add_tensor("output_norm.weight", np.ones(n_embd, dtype=np.float32))
    w.add_tensor("output.weight", f16(n_vocab, n_embd))
    kv = shape["n_head_kv"] * head_dim
    for il in range(shape["n_layers"]):
        p = f"blk.{il}."
        w.add_tensor(p + "attn_norm.weight", np.ones(n_embd, dtype=np.float32))
        w.add_tensor(p + "attn_q.weight", f16(n_embd, n_embd))
        w.add_tensor(p + "attn_k.weight", f16(kv, n_embd))
        w.add_tensor(p + "attn_v.weight", f16(kv, n_embd))
        w.add_tensor(p + "attn_output.weight", f16(n_embd, n_embd))
        w.add_tensor(p + "ffn_norm.weight", np.ones(n_embd, dtype=np.float32))
        w.add_tensor(p + "ffn_gate.weight", f16(n_ff, n_embd))
        w.add_tensor(p + "ffn_up.weight", f16(n_ff, n_embd))
        w.add_tensor(p + "ffn_down.weight", f16(n_embd, n_ff))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file(progress=True)
    w.close()
    return path


class GpuLlama:
    """llama.cpp in-process with every layer on the GPU, as a RouteSession (greedy on the last logits)."""

    def __init__(self, path: str, n_ctx: int, threads: int):
        import llama_cpp

        self._lib = llama_cpp
        self.llm = llama_cpp.Llama(
            path,
            n_ctx=n_ctx,
            n_batch=2048,
            n_ubatch=512,
            n_threads=threads,
            n_threads_batch=threads,
            flash_attn=True,
            n_gpu_layers=-1,
            verbose=False,
        )
        self.n_vocab = self.llm.n_vocab()
        self.tokens: list[int] = []

    def step(self, tokens: list[int]) -> int:
        self.llm.eval(tokens)
        ptr = self._lib.llama_get_logits_ith(self.llm.ctx, -1)
        token = int(np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).argmax())
        self.tokens.append(token)
        return token

    def reset(self) -> None:
        self.llm.reset()
        self.tokens = []


class Traced:
    """A route session that remembers the tokens it returned."""

    def __init__(self, session):
        self.session, self.tokens = session, []

    def step(self, tokens: list[int]) -> int:
        token = self.session.step(tokens)
        self.tokens.append(token)
        return token


def route_row(path: str, device: str, cpu_middle: bool, ids: list[int], n_decode: int, threads: int) -> dict:
    """One route row: three nodes on ``device`` (the middle one on the CPU when ``cpu_middle``)."""
    specs = even_split(model_info(GGUFModelFile(path)).n_layers, 3)
    need = len(ids) + n_decode + 16
    extra = ["--ctx-size", str(max(need, 1024)), "--max-sessions", "1", "--hop-timeout", "600"]
    with tempfile.NamedTemporaryFile("w+", prefix="bench-gpu-", suffix=".log") as log:
        nodes = start_nodes(
            specs,
            path,
            threads=threads,
            extra=extra,
            per_node=lambda i: ["--gpu", "none" if cpu_middle and i == 1 else device],
            stderr=log,
            timeout=1800,
        )
        try:
            route = RemoteRoute([n.url for n in nodes], 600.0)
            warm = route.open(need, GREEDY)
            run_session(warm, ids, 4)
            warm.close()
            session = Traced(route.open(need, GREEDY))
            prefill, decode = run_session(session, ids, n_decode)
            session.session.close()
            placements = []
            for n in nodes:
                with urllib.request.urlopen(f"{n.url}/health", timeout=30) as r:
                    h = json.loads(r.read())
                placements.append((h["placement"], h.get("kv_bytes_per_token")))
        finally:
            stop_nodes(nodes)
            log.seek(0)
            sys.stderr.write("".join(line for line in log if "ggufswarm node:" in line))
    weights = [GGUFModelFile(path).layer_tensor_bytes(s.start, s.end) for s in specs]
    vram = [f"{p['device_bytes'] / MIB:.0f}/{w / MIB:.0f}" for (p, _), w in zip(placements, weights)]
    return {"prefill": prefill, "decode": decode, "tokens": session.tokens, "vram": " ".join(vram)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="a GGUF (default: --layout's random one)")
    ap.add_argument("--layout", choices=sorted(LAYOUTS), default="tiny")
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="where --layout's GGUF is written (kept)")
    ap.add_argument("--device", default="auto", help="the nodes' --gpu (CUDA0, Vulkan0; default auto)")
    ap.add_argument("--prefill", type=int, default=256, help="prompt tokens (default 256)")
    ap.add_argument("--decode", type=int, default=64, help="decode steps (default 64)")
    ap.add_argument("--threads", type=int, default=2, help="CPU threads per process (default 2)")
    a = ap.parse_args()
    path = a.model or str(write_layout(Path(a.dir) / f"random-llama-{a.layout}.gguf", a.layout))
    ids = [1] + [int(i) for i in np.random.default_rng(1).integers(3, 384, a.prefill - 1)]
    ref = GpuLlama(path, a.prefill + a.decode + 64, a.threads)
    run_session(ref, ids, 4)  # warm-up
    ref.reset()
    prefill, decode = run_session(ref, ids, a.decode)
    rows = [("llama.cpp, whole model on the GPU", prefill, decode, "-", "-")]
    reference = ref.tokens
    ref.llm.close()
    for name, cpu_middle in (("route, 3 nodes on the GPU", False), ("route, middle node on the CPU", True)):
        r = route_row(path, a.device, cpu_middle, ids, a.decode, a.threads)
        same = "yes" if r["tokens"] == reference else f"no ({sum(x == y for x, y in zip(r['tokens'], reference))})"
        rows.append((name, r["prefill"], r["decode"], same, r["vram"]))
    print(f"\nmodel {path}; prompt {a.prefill} tokens, {a.decode} decode steps, {a.threads} threads per process\n")
    print("| engine | prefill tok/s | decode tok/s | decode vs llama.cpp | same tokens | GPU MiB / weights MiB |")
    print("|---|---|---|---|---|---|")
    for name, p, d, same, vram in rows:
        print(f"| {name} | {p:.1f} | {d:.1f} | {d / rows[0][2]:.2f}x | {same} | {vram} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
