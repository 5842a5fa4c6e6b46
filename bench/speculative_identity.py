"""How often speculative greedy output differs from plain greedy on the llama.cpp backend, by --draft-max.

In process (one shard per model, 1 thread): for each prompt, plain greedy decoding of --tokens tokens, then the
same with the n-gram drafter at each draft_max; a run is "same" when every token equals the plain run's, else the
index of the first difference is shown. Also the row-level check behind it: for steps of T tokens, how many rows
of logits are bitwise equal to those of T one-token steps.

Usage: .venv/bin/python bench/speculative_identity.py [--model smollm2] [--tokens 64] [--draft 2,3,4,8]
"""

from __future__ import annotations

import argparse
import sys

from ggufswarm.client.generate import GenerationStats, generate
from ggufswarm.client.local import LocalModel
from ggufswarm.client.speculative import NgramDrafter
from ggufswarm.runtime.sampling import SamplingParams

PROMPTS = [
    "The capital of France is",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "Москва — столица",
    "東京は日本の",
    "I love pizza 🍕 because",
    "Translate to French: The cat sits on the mat.\nFrench:",
    "1, 2, 3, 5, 8, 13,",
    "<html>\n<head>\n<title>",
    "Once upon a time, in a small village,",
    "Monday, Tuesday, Wednesday, Thursday, Friday. Monday, Tuesday,",
]


def run(model, ids, n, k):
    stats = GenerationStats()
    session = model.session(len(ids) + n + 1, SamplingParams(temperature=0))
    try:
        list(generate(session, model.tokenizer, ids, n, None, stats, NgramDrafter(k) if k else None))
    finally:
        session.close()
    return stats


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--draft", default="2,3,4,8")
    args = ap.parse_args()
    ks = [int(k) for k in args.draft.split(",")]
    model = LocalModel.load(args.model, threads=1, max_length=1024, max_sessions=1)
    print(f"# {model.file.path.name}: speculative greedy vs plain greedy, {args.tokens} tokens, llama.cpp 1 thread")
    print("| prompt | " + " | ".join(f"k={k}" for k in ks) + " |")
    print("|---|" + "---|" * len(ks))
    same = {k: 0 for k in ks}
    for p in PROMPTS:
        ids = model.tokenizer.encode(p)
        ref = run(model, ids, args.tokens, 0).tokens
        cells = []
        for k in ks:
            got = run(model, ids, args.tokens, k)
            diff = next((i for i, (a, b) in enumerate(zip(got.tokens, ref)) if a != b), None)
            same[k] += diff is None
            cells.append(("same" if diff is None else f"differs at {diff}") + f" ({got.accepted}/{got.drafted})")
        print(f"| {p[:24]!r} | " + " | ".join(cells) + " |", flush=True)
    print("| all | " + " | ".join(f"{same[k]}/{len(PROMPTS)} same" for k in ks) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
