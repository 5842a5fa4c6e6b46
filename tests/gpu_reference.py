"""llama.cpp's own runs with blocks on a GPU, in a process of their own (tests/test_gpu.py).

ggml-vulkan lists Mesa's lavapipe (a software Vulkan device on the CPU) only when ``GGML_VK_VISIBLE_DEVICES``
names it, and reads that once, when the process first touches ggml's backend registry: so the GPU runs happen in a
child process started with it, never in the test process (whose CPU references must not see a GPU).

    python tests/gpu_reference.py MODEL OUT.npz --ids 1,2,3 --n-decode 8 --gpu-blocks K [--cuts A,B] [--prompt P]

Writes to OUT.npz: ``prefill`` (all prefill logits ``[T, n_vocab]`` float32), ``tokens`` (greedy ids) and
``decode`` (their logits) of llama.cpp's whole model (llama-cpp-python) with its last K blocks and the output head
on the GPU (``n_gpu_layers`` K+1), the others as a CPU-only run keeps them (``no_host``), no op offload; with
``--cuts``, ``chain_*``: the same from ggufswarm's 3-shard chain, its last shard (+head; ``--chain-gpu all``: every
shard) on the GPU (``LlamaCppShard(gpu=...)``), run twice (``chain2_*``: run-to-run determinism); with
``--prompt``, ``text``: llama.cpp's greedy completion.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

N_CTX = 512
THREADS = 1


def whole_model(path: str, ids: list[int], n_decode: int, gpu_blocks: int, n_layers: int, prompt: str | None):
    import llama_cpp
    import llama_cpp.llama_cpp as low  # what llama_cpp.Llama calls

    # the CPU blocks' weights where a CPU-only run keeps them (CPU_REPACK), not in the GPU's pinned host buffer
    # (llama_model_params.no_host; src/llama-model.cpp make_cpu_buft_list): so they compute a CPU node's bits
    defaults = low.llama_model_default_params

    def no_host():
        params = defaults()
        params.no_host = True
        return params

    low.llama_model_default_params = no_host
    llm = llama_cpp.Llama(
        path,
        n_ctx=N_CTX,
        n_batch=N_CTX,
        n_ubatch=512,
        logits_all=True,
        n_threads=THREADS,
        n_threads_batch=THREADS,
        flash_attn=True,
        swa_full=True,
        n_gpu_layers=gpu_blocks + 1 if gpu_blocks else 0,  # the output layer counts as one past the last block
        split_mode=llama_cpp.LLAMA_SPLIT_MODE_NONE,
        main_gpu=0,
        op_offload=False,
        verbose=False,
    )
    try:
        llm.eval(ids)
        prefill = np.array(llm.scores[: len(ids)])
        tokens, decode = [], []
        for _ in range(n_decode):
            tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
            tokens.append(tok)
            llm.eval([tok])
            decode.append(np.array(llm.scores[llm.n_tokens - 1]))
        text = None
        if prompt is not None:
            llm.reset()
            out = llm.create_completion(prompt, max_tokens=n_decode, temperature=0.0, repeat_penalty=1.0, top_k=1)
            text = out["choices"][0]["text"]
        return prefill, np.array(tokens), np.array(decode), text
    finally:
        llm.close()


def chain(path: str, ids: list[int], tokens, cuts: list[int], tmp: Path, on_gpu: str = "head"):
    from ggufswarm.artifact.gguf_file import GGUFModelFile
    from ggufswarm.runtime.llamacpp.backend import LlamaCppShard, model_info
    from ggufswarm.runtime.shard import split_at

    file = GGUFModelFile(path)
    specs = split_at(model_info(file).n_layers, cuts)
    shards = [
        LlamaCppShard(
            file,
            s,
            n_ctx_seq=N_CTX,
            n_seq_max=1,
            threads=THREADS,
            all_logits=True,
            cache_dir=tmp,
            gpu="auto" if s.head or on_gpu == "all" else "none",
        )
        for s in specs
    ]
    idle = [s.placement.to_json() for s in shards]
    kvs = [s.new_session(N_CTX) for s in shards]
    placement = [dict(s.placement.to_json(), idle_buffers=before["buffers"]) for s, before in zip(shards, idle)]

    def run(x, logits):
        for shard, kv in zip(shards, kvs):
            x = shard.forward(kv, np.asarray(x), logits=logits)
        return x

    prefill = run(ids, "all")
    decode = [run([int(t)], "last")[0] for t in tokens]
    for s in shards:
        s.close()
    return prefill, np.array(decode), placement


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("out")
    ap.add_argument("--ids", required=True)
    ap.add_argument("--n-decode", type=int, default=8)
    ap.add_argument("--gpu-blocks", type=int, required=True)
    ap.add_argument("--n-layers", type=int, required=True)
    ap.add_argument("--cuts", default="")
    ap.add_argument("--prompt", default=None)
    ap.add_argument("--chain-gpu", choices=("head", "all"), default="head", help="the chain's shards on the GPU")
    a = ap.parse_args()
    ids = [int(i) for i in a.ids.split(",")]
    prefill, tokens, decode, text = whole_model(a.model, ids, a.n_decode, a.gpu_blocks, a.n_layers, a.prompt)
    out = {"prefill": prefill, "tokens": tokens, "decode": decode}
    meta = {"text": text}
    if a.cuts:
        tmp = Path(a.out).parent / "shards"
        cuts = [int(c) for c in a.cuts.split(",")]
        out["chain_prefill"], out["chain_decode"], meta["placement"] = chain(
            a.model, ids, tokens, cuts, tmp, a.chain_gpu
        )
        out["chain2_prefill"], out["chain2_decode"], _ = chain(a.model, ids, tokens, cuts, tmp, a.chain_gpu)
    np.savez(a.out, **out)
    Path(a.out).with_suffix(".json").write_text(json.dumps(meta))


if __name__ == "__main__":
    sys.exit(main())
