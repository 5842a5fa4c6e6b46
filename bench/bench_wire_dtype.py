"""Measurement behind docs/protocol.md "f16 and large activations": how large the hidden states at the shard
boundaries get, and whether greedy output survives each wire dtype. One run, in process, no network.

Gemma 3 270M cut at layers 6 and 12 (the route's default 3-node split), llama.cpp backend. Between shards the
hidden states go through the real frame codec (``encode_hidden`` → ``decode_frame``) in each wire dtype:

* f32 — the default, exact;
* f16 with range extension (the protocol's: divide by a power of two when ``max|h|`` exceeds 65,504);
* bf16;
* plain f16 without range extension (what a naive f16 cast would do), for comparison.

Prints ``max|h|`` at each boundary over the prompt and the generated tokens, and for each prompt and dtype the
number of greedy tokens (of --tokens) equal to the f32 run's, up to the first difference.

Not a test. Usage: .venv/bin/python bench/bench_wire_dtype.py [--tokens 100] [--threads 1]
"""

from __future__ import annotations

import argparse
import uuid
from pathlib import Path

import torch

PROMPTS = ["The capital of France is", "Write a short poem about the sea and the wind."]
TEXT = Path(__file__).resolve().parent.parent / "tests" / "data" / "gpl-3.0-excerpt.txt"


def run(model, ids: list[int], n_tokens: int, wire: str, peaks: list[float]) -> list[int]:
    """Greedy ``n_tokens`` after ``ids`` with every boundary's hidden states sent through ``wire``."""
    from ggufswarm.protocol import decode_frame, encode_hidden

    kvs = [s.new_session(len(ids) + n_tokens + 1) for s in model.shards]
    sid = uuid.uuid4()
    out: list[int] = []
    feed = ids
    try:
        for step in range(n_tokens):
            x = torch.tensor(feed, dtype=torch.long)
            for i, (shard, kv) in enumerate(zip(model.shards, kvs)):
                x = shard.forward(kv, x)
                if i + 1 < len(model.shards):
                    peaks[i] = max(peaks[i], float(x.abs().max()))
                    if wire == "f16-plain":
                        x = x.to(torch.float16).float()  # inf past 65,504
                    else:
                        x = decode_frame(encode_hidden(sid, step + 1, 0, x.float(), wire)).data
            token = int(torch.argmax(x[-1]))
            out.append(token)
            feed = [token]
    except Exception as exc:
        print(f"    {wire}: stopped after {len(out)} tokens: {type(exc).__name__}: {exc}")
    finally:
        for kv in kvs:
            if hasattr(kv, "close"):
                kv.close()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=100, help="greedy tokens per prompt (default 100)")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()

    from ggufswarm.client.local import LocalModel

    model = LocalModel.load(split=[6, 12], threads=args.threads, max_length=2048)
    long_ids = model.tokenizer.encode(TEXT.read_text(encoding="utf-8"))[:806]
    prompts = [(p, model.tokenizer.encode(p)) for p in PROMPTS] + [("GPL-3.0 excerpt", long_ids)]
    wires = ["f32", "f16", "bf16", "f16-plain"]
    peaks = [0.0, 0.0]
    rows = []
    for name, ids in prompts:
        runs = {w: run(model, ids, args.tokens, w, peaks if w == "f32" else [0.0, 0.0]) for w in wires}
        ref = runs["f32"]
        same = {}
        for w in wires:
            n = next((i for i, (a, b) in enumerate(zip(runs[w], ref)) if a != b), min(len(runs[w]), len(ref)))
            same[w] = n
        rows.append((name, len(ids), same))
    print(f"\nGemma 3 270M, split 6:12 (3 shards), llama.cpp backend, greedy {args.tokens} tokens per prompt")
    print(
        f"max |h| at the boundaries (f32 runs, prompts and generated tokens): layer 6: {peaks[0]:,.0f}, "
        f"layer 12: {peaks[1]:,.0f}; f16's largest finite value: 65,504"
    )
    print("| prompt | tokens | " + " | ".join(f"{w}: equal to f32" for w in wires) + " |")
    print("|---|---:|" + "---:|" * len(wires))
    for name, n, same in rows:
        print(f"| {name} | {n} | " + " | ".join(f"{same[w]}/{args.tokens}" for w in wires) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
