"""Benchmark: ggufswarm's in-process torch shard executor vs llama.cpp (llama-cpp-python) on the same GGUF.

Prints one table from one run, same machine, same thread count: model load time, prefill tok/s
(one prompt of --prompt-tokens tokens) and decode tok/s (--decode-tokens greedy tokens).
Not a test: speed goals live here. Usage: python bench/bench_generate.py [--model PATH] [--threads 2]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch


def bench_ours(path, ids, n_decode, split, dtype):
    from ggufswarm.client.local import LocalModel
    from ggufswarm.runtime.sampling import SamplingParams

    t0 = time.perf_counter()
    model = LocalModel.load(path, split, dtype)
    load_s = time.perf_counter() - t0
    session = model.session(len(ids) + n_decode + 1, SamplingParams(temperature=0))
    t0 = time.perf_counter()
    tok = session.step(ids)
    prefill_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(n_decode):
        tok = session.step([tok])
    decode_s = time.perf_counter() - t0
    return load_s, len(ids) / prefill_s, n_decode / decode_s


def bench_llama_cpp(path, ids, n_decode, threads):
    import llama_cpp

    t0 = time.perf_counter()
    llm = llama_cpp.Llama(
        str(path), n_ctx=len(ids) + n_decode + 8, n_batch=512, n_threads=threads, n_threads_batch=threads, verbose=False
    )
    load_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    llm.eval(ids)
    prefill_s = time.perf_counter() - t0
    n_vocab = llm.n_vocab()

    def last_logits():  # the last evaluated position's logits, straight from llama.cpp
        return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(n_vocab,))

    t0 = time.perf_counter()
    for _ in range(n_decode):
        tok = int(np.argmax(last_logits()))
        llm.eval([tok])
    decode_s = time.perf_counter() - t0
    return load_s, len(ids) / prefill_s, n_decode / decode_s


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="GGUF path (default: embedded Gemma 3 270M Q4_K_M)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--decode-tokens", type=int, default=64)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from ggufswarm.artifact.default_model import resolve_model
    from ggufswarm.artifact.gguf_file import GGUFModelFile
    from ggufswarm.client.tokenizer import Tokenizer

    path = resolve_model(args.model)
    tok = Tokenizer(str(path), GGUFModelFile(path).metadata)
    text = open(__file__.replace("bench/bench_generate.py", "tests/data/gpl-3.0-excerpt.txt")).read()
    ids = tok.encode(text)[: args.prompt_tokens]

    rows = [
        ("llama.cpp (llama-cpp-python)", bench_llama_cpp(path, ids, args.decode_tokens, args.threads)),
        ("ggufswarm torch f32, 1 shard", bench_ours(path, ids, args.decode_tokens, None, "float32")),
        ("ggufswarm torch f32, 3 shards", bench_ours(path, ids, args.decode_tokens, [6, 12], "float32")),
        ("ggufswarm torch bf16, 1 shard", bench_ours(path, ids, args.decode_tokens, None, "bfloat16")),
    ]
    print(
        f"model: {path.name}, threads: {args.threads}, prompt: {len(ids)} tokens, decode: {args.decode_tokens} tokens"
    )
    print(f"{'engine':32s} {'load s':>8s} {'prefill tok/s':>14s} {'decode tok/s':>13s}")
    for name, (load_s, pre, dec) in rows:
        print(f"{name:32s} {load_s:8.2f} {pre:14.1f} {dec:13.1f}")


if __name__ == "__main__":
    main()
