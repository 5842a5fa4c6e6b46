"""How far apart two honest CPU kinds compute the same shard: the tolerance a cross-kind check would need.

Runs the embedded Gemma 3 270M cut at layers 6 and 12 in two processes: this machine's native llama.cpp build and
the same llama.cpp with AVX-only CPU kernels (``scripts/build_llama_cpp_python.sh cpu-variant``, loaded through
``LLAMA_CPP_LIB_PATH``). The first process decodes ``--tokens`` tokens of README.md one at a time and saves each
stage's input; the second computes every stage on exactly those inputs. Printed: per decode row, the relative L2
difference ``|a - b| / |a|`` of each stage's output hidden state [n_embd] (max, p99, median), next to what a liar
adding Gaussian noise of 5 % of the row's rms (``--test-lie noise``) gives, and whether a second native process is
bitwise equal (it must be).

    .venv/bin/python bench/bench_numerics_kinds.py [--tokens 600]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
SPLIT = [6, 12]


def stage_outputs(out: str, inputs: str | None, n_tokens: int) -> None:
    """In this process: decode README tokens one by one through the three shards; save ``[n, n_embd]`` outputs of
    stages 0:6 and 6:12 (and the inputs stage 6:12 got); with ``inputs`` stage 6:12 takes the saved ones."""
    from ggufswarm.client.local import LocalModel

    m = LocalModel.load(split=SPLIT, threads=1, max_length=1024)
    ids = np.asarray(m.prompt_ids((ROOT / "README.md").read_text()[:8000]), dtype=np.int64)[:n_tokens]
    given = np.load(inputs) if inputs else None
    kv0, kv1 = m.shards[0].new_session(1024), m.shards[1].new_session(1024)
    first, second = [], []
    for i in range(len(ids)):
        h = np.asarray(m.shards[0].forward(kv0, ids[i : i + 1], logits="last"))
        first.append(h[-1])
        x = given[i : i + 1] if given is not None else h
        second.append(np.asarray(m.shards[1].forward(kv1, x, logits="last"))[-1])
    np.save(out + "_0.npy", np.stack(first))
    np.save(out + "_1.npy", np.stack(second))


def rel(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.linalg.norm(a - b, axis=-1) / np.linalg.norm(a, axis=-1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=600, help="decode steps compared (default 600)")
    ap.add_argument("--stage", nargs=2, help=argparse.SUPPRESS)  # internal: OUT INPUTS|-
    args = ap.parse_args()
    if args.stage:
        stage_outputs(args.stage[0], None if args.stage[1] == "-" else args.stage[1], args.tokens)
        return
    variant = subprocess.run(
        ["bash", str(ROOT / "scripts/build_llama_cpp_python.sh"), "cpu-variant", sys.executable],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()[-1]
    with tempfile.TemporaryDirectory() as tmp:
        runs = {"native": {}, "native, 2nd process": {}, "AVX-only kernels": {"LLAMA_CPP_LIB_PATH": variant}}
        for i, env in enumerate(runs.values()):
            inputs = "-" if i == 0 else f"{tmp}/r0_0.npy"
            cmd = [sys.executable, __file__, "--tokens", str(args.tokens), "--stage", f"{tmp}/r{i}", inputs]
            subprocess.run(cmd, check=True, env={**os.environ, **env}, stdout=subprocess.DEVNULL)
        base = [np.load(f"{tmp}/r0_{s}.npy") for s in (0, 1)]
        rng = np.random.default_rng(0)
        print(f"{args.tokens} decode rows of Gemma 3 270M Q4_K_M, stage outputs vs the native process (same inputs)")
        print(f"{'compared with native':28} {'stage':6} {'bitwise':8} {'max':>8} {'p99':>8} {'median':>8}")
        for i, name in enumerate(runs):
            if i == 0:
                continue
            for s, label in enumerate(("0:6", "6:12")):
                other = np.load(f"{tmp}/r{i}_{s}.npy")
                r = rel(base[s], other)
                same = np.array_equal(base[s], other)
                q = np.quantile(r, 0.99)
                print(f"{name:28} {label:6} {str(same):8} {r.max():8.4f} {q:8.4f} {np.median(r):8.4f}")
        for s, label in enumerate(("0:6", "6:12")):
            x = base[s]
            rms = np.sqrt((x**2).mean(axis=-1, keepdims=True))
            r = rel(x, x + rng.normal(0.0, 1.0, x.shape) * 0.05 * rms)
            q = np.quantile(r, 0.99)
            print(f"{'liar: noise 5 % of rms':28} {label:6} {'False':8} {r.max():8.4f} {q:8.4f} {np.median(r):8.4f}")


if __name__ == "__main__":
    main()
