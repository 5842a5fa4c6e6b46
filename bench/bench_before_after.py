"""Benchmark: the per-token path of two source trees side by side, in one run: decode tok/s of a 3-node llama.cpp
route and TTFT of a short prompt, as an OpenAI client sees them through the gateway, and the route's decode tok/s
through the blocking route client alone (``RemoteRoute(...).open``, greedy; the embedded Gemma 3 270M, loopback,
one thread per node). Trees alternate request by request so that machine drift hits both alike.

``--before REF`` checks the git revision REF out into a temporary worktree (its graph tap extension built there);
"after" is this checkout. Each server runs with ``PYTHONPATH`` set
to its tree's ``src``, on this checkout's virtual environment (the same llama.cpp).

Not a test. Usage: .venv/bin/python bench/bench_before_after.py --before HEAD~5 [--rounds 5] [--tokens 96]
"""

from __future__ import annotations

import argparse
import http.client
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import urlsplit

from bench_llamacpp import free_port
from bench_ttft import stream_deltas

ROOT = Path(__file__).resolve().parents[1]
SHORT_PROMPT = "The capital of France is"
DECODE_PROMPT = "Photosynthesis is the process by which"
LAYERS = ("0:6", "6:12", "12:18")  # Gemma 3 270M: 18 blocks
# Run with the tree's python path: decode ``n`` greedy tokens through the route client alone; prints tok/s.
# (The route client moved from client/remote.py to client/route.py in issue 24: either tree works.)
DIRECT = """
import sys, time
try:
    from ggufswarm.client.route import RemoteRoute
except ImportError:
    from ggufswarm.client.remote import RemoteRoute
from ggufswarm.runtime.sampling import SamplingParams
urls, n = sys.argv[1].split(","), int(sys.argv[2])
session = RemoteRoute(urls, hop_timeout_s=60.0).open(n + 64, SamplingParams(temperature=0.0))
try:
    token = session.step(list(range(2, 18)))
    t0 = time.perf_counter()
    for _ in range(n):
        token = session.step([token])
    print(n / (time.perf_counter() - t0))
finally:
    session.close()
"""


def wait_healthy(url: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            conn = http.client.HTTPConnection(urlsplit(url).hostname, urlsplit(url).port, timeout=2)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} not healthy within {timeout_s:g} s")


class Stack:
    """Three nodes and a gateway started from source tree ``tree``."""

    def __init__(self, tree: Path, name: str):
        self.name = name
        env = {**os.environ, "PYTHONPATH": str(tree / "src")}
        cli = [sys.executable, "-m", "ggufswarm.cli"]
        self.env = env
        self.procs, urls = [], []
        for i, layers in enumerate(LAYERS):
            port = free_port()
            flags = (["--embed"] if i == 0 else []) + (["--head"] if i == len(LAYERS) - 1 else [])
            self.procs.append(
                subprocess.Popen(
                    cli + ["node", "--layers", layers, *flags, "--port", str(port), "--threads", "1"],
                    env=env,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            )
            urls.append(f"http://127.0.0.1:{port}")
        for url in urls:
            wait_healthy(url)
        port = free_port()
        self.procs.append(
            subprocess.Popen(
                cli + ["gateway", "--route", ",".join(urls), "--port", str(port)],
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )
        self.url = f"http://127.0.0.1:{port}"
        self.node_urls = urls
        wait_healthy(self.url)

    def direct_tok_s(self, n_tokens: int) -> float:
        """Decode tok/s of ``n_tokens`` greedy steps through the route client alone, in a process of this tree."""
        out = subprocess.run(
            [sys.executable, "-c", DIRECT, ",".join(self.node_urls), str(n_tokens)],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=600,
            check=True,
        )
        return float(out.stdout.strip().splitlines()[-1])

    def stream(self, prompt: str, max_tokens: int) -> tuple[float, list[float]]:
        """(ms to the first text delta, perf_counter s of every delta) of one streamed greedy completion."""
        t0, times, _ = stream_deltas(self.url, prompt, max_tokens, timeout_s=300)
        return (times[0] - t0) * 1e3, times

    def close(self) -> None:
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            p.wait(timeout=30)


def worktree(ref: str, dest: Path) -> Path:
    subprocess.run(
        ["git", "-C", str(ROOT), "worktree", "add", "--detach", str(dest), ref], check=True, capture_output=True
    )
    # the graph tap (a C extension) of that tree, built in place as `pip install -e` does here
    subprocess.run(
        [sys.executable, "setup.py", "-q", "build_ext", "--inplace"], cwd=dest, check=True, capture_output=True
    )
    return dest


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", required=True, metavar="REF", help="git revision of the 'before' tree")
    ap.add_argument("--rounds", type=int, default=5, help="requests of each kind per tree (default 5)")
    ap.add_argument("--tokens", type=int, default=96, help="tokens of each decode request (default 96)")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="ggufswarm-before-"))
    before = worktree(args.before, tmp / "tree")
    stacks = []
    try:
        stacks = [Stack(before, f"before ({args.before})"), Stack(ROOT, "after (this checkout)")]
        ttft = {s.name: [] for s in stacks}
        tps = {s.name: [] for s in stacks}
        direct = {s.name: [] for s in stacks}
        for s in stacks:  # warm-up
            s.stream(SHORT_PROMPT, 4)
        for _ in range(args.rounds):
            for s in stacks:
                ttft[s.name].append(s.stream(SHORT_PROMPT, 2)[0])
                _, times = s.stream(DECODE_PROMPT, args.tokens)
                tps[s.name].append((len(times) - 1) / (times[-1] - times[0]))
                direct[s.name].append(s.direct_tok_s(args.tokens))
        print(
            f"3-node llama.cpp route (Gemma 3 270M, {', '.join(LAYERS)}), through the gateway, loopback, "
            f"medians of {args.rounds}"
        )
        print(f"{'tree':<32} {'TTFT ms (short prompt)':>24} {'decode tok/s':>14} {'route client tok/s':>20}")
        for s in stacks:
            print(
                f"{s.name:<32} {statistics.median(ttft[s.name]):>24.1f} {statistics.median(tps[s.name]):>14.1f} "
                f"{statistics.median(direct[s.name]):>20.1f}"
            )
    finally:
        for s in stacks:
            s.close()
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(before)], capture_output=True)
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
