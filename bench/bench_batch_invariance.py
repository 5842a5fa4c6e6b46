"""Batch-invariant decode (llama.cpp patch 0005, issue 27 item 2): do sessions sharing one ubatch get the bits they get
alone, and what does it cost?

Model: the embedded default (Gemma 3 270M Q4_K_M), as three chained llama.cpp shards (blocks 0-5 / 6-11 / 12-17) in
this process. ``--sessions`` sessions are prefilled with random prompts of 3..250 tokens (under 256, where llama.cpp's
attention does not split the cells across threads), then decode ``--steps`` steps: one chain runs each session's step
alone, another runs all of them in one ``forward_batch`` (consecutive sequence ids: one ubatch). Printed per setting:
the largest |difference| / max |row| between a session's batched row and its row alone (0 = bitwise), and the time of
one step of all sessions through the three shards, batched and one by one.

Each setting runs in a child process (``LLAMA_BATCH_INVARIANT`` is read when a llama.cpp context is created): with the
variable on (the node's default) and off (stock kernels: they switch at 4 and 8 rows and round differently).
``LLAMA_CPP_LIB_PATH`` picks another build of llama.cpp's libraries, e.g. ggml's CPU backend for another kernel set
(``scripts/build_llama_cpp_python.sh cpu-variant``).

Usage: .venv/bin/python bench/bench_batch_invariance.py [--sessions 16] [--steps 4] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time


def measure(n: int, steps: int, threads: int) -> dict:
    """In this process: worst relative difference and ms per step (batched, alone) for ``n`` sessions."""
    import numpy as np

    from ggufswarm.artifact.default_model import default_model_path
    from ggufswarm.artifact.gguf_file import GGUFModelFile
    from ggufswarm.runtime.llamacpp.backend import LlamaCppShard
    from ggufswarm.runtime.shard import ShardSpec

    specs = [ShardSpec(0, 6, embed=True), ShardSpec(6, 12), ShardSpec(12, 18, head=True)]
    f = GGUFModelFile(default_model_path())

    def chain():
        return [LlamaCppShard(f, s, n_ctx_seq=512, n_seq_max=n, threads=threads) for s in specs]

    alone, batched = chain(), chain()
    for sh in batched:
        sh.batch_group = n  # one ubatch, whatever the build keeps bitwise
    rng = np.random.default_rng(0)
    kv_a = [[sh.new_session(512) for sh in alone] for _ in range(n)]
    kv_b = [[sh.new_session(512) for sh in batched] for _ in range(n)]
    toks = []
    for i in range(n):
        x = rng.integers(10, 20000, int(rng.integers(3, 250)))
        for k in range(3):
            batched[k].forward(kv_b[i][k], x)
            x = alone[k].forward(kv_a[i][k], x)
        toks.append(int(x[-1].argmax()))
    worst, t_batch, t_alone = 0.0, 0.0, 0.0
    for _ in range(steps):
        ins = [np.array([t]) for t in toks]
        for k in range(3):
            t0 = time.perf_counter()
            want = [alone[k].forward(kv_a[i][k], ins[i]) for i in range(n)]
            t1 = time.perf_counter()
            got = batched[k].forward_batch([(kv_b[i][k], ins[i]) for i in range(n)])
            t_alone, t_batch = t_alone + t1 - t0, t_batch + time.perf_counter() - t1
            for w, g in zip(want, got):
                worst = max(worst, float(np.abs(g - w).max() / np.abs(w).max()))
            ins = want
        toks = [int(w[-1].argmax()) for w in want]
    return {
        "invariant": batched[0].batch_invariant,
        "worst": worst,
        "batched_ms": 1e3 * t_batch / steps,
        "alone_ms": 1e3 * t_alone / steps,
        "ubatch": batched[0].largest_ubatch,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sessions", type=int, default=16, help="sessions in the ubatch (default 16)")
    ap.add_argument("--steps", type=int, default=4, help="decode steps (default 4)")
    ap.add_argument("--threads", type=int, default=1, help="llama.cpp threads per shard (default 1)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(measure(args.sessions, args.steps, args.threads)))
        return 0
    import llama_cpp as L

    cpu = L.llama_print_system_info().decode(errors="replace").split("|")
    kernels = ",".join(p.split("=")[0].strip() for p in cpu if p.strip().endswith("= 1"))
    lib = os.environ.get("LLAMA_CPP_LIB_PATH", "llama-cpp-python's own")
    print(f"# {args.sessions} sessions in one ubatch, {args.threads} thread(s); libraries: {lib}; CPU: {kernels}")
    print("\n| LLAMA_BATCH_INVARIANT | batch-invariant | max diff / max row | batched ms/step | alone ms/step |")
    print("|---|---|---|---|---|")
    for value in ("1", "0"):
        env = dict(os.environ, LLAMA_BATCH_INVARIANT=value)
        cmd = [sys.executable, __file__, "--child", "--sessions", str(args.sessions), "--steps", str(args.steps)]
        out = subprocess.run(cmd + ["--threads", str(args.threads)], env=env, capture_output=True, text=True)
        if out.returncode:
            print(out.stderr[-2000:], file=sys.stderr)
            return out.returncode
        r = json.loads(out.stdout.strip().splitlines()[-1])
        print(
            f"| {value} | {'yes' if r['invariant'] else 'no'} | {r['worst']:.3g} | {r['batched_ms']:.0f} "
            f"| {r['alone_ms']:.0f} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
