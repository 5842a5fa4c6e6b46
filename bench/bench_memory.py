"""Node memory benchmark: what each node of a 3-node route holds, idle and with sessions, in one run.

Per node and scenario (0 sessions; 1, 4 and 16 sessions of --short tokens each; one session of --long tokens, within
the model's context), the table gives:

* **RSS**: the node process's resident memory (``/proc/PID/status`` VmRSS);
* **shard**: the bytes of its range's tensors (``artifact.accounting``: its blocks, the token embedding on the
  first node, the output norm and matrix on the head), read in place from the model file: mapped pages;
* **KV held**: the tokens its sessions hold times its KV bytes per token (``/health`` kv_tokens_held,
  kv_bytes_per_token): the KV memory the sessions use;
* **KV allocated**: llama.cpp's KV buffers (``--max-sessions`` + 1 streams of ``--ctx-size`` cells; 32 sessions
  here): what was resident from the start before llama.cpp patch 0007, address space only since; with ``--gpu``, a
  GPU's KV cache, sized to the open sessions;
* **compute**: llama.cpp's compute buffers (they grow with the ubatch);
* **other**: RSS - shard - KV held - compute (can be below 0: a mapped page nobody read is not resident, as the
  rows of the token embedding no prompt used).

The goal (issue 39): an idle node's RSS at most its shard + 120 MiB; with sessions at most shard + KV held +
compute + 120 MiB. The sessions are opened together and each prefilled (greedy, one sampled token); the row is read
while they are open, then they are closed and the next scenario starts, so a last "idle again" row shows whether
the memory went back. ``--waves SECONDS`` then opens and closes 32 sessions at a time for that long (issue 39: 10
minutes) and prints each node's RSS after the first and the last wave. A second table, when llama.cpp's tools are
built (``make llamacpp-tools``), gives llama.cpp's own ``rpc-server`` holding the same layers.

    .venv/bin/python bench/bench_memory.py                       # Gemma 3 270M (the default model)
    .venv/bin/python bench/bench_memory.py --model PATH --long 32768
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from ggufswarm.artifact.accounting import shard_account
from ggufswarm.artifact.default_model import resolve_model
from ggufswarm.artifact.gguf_file import GGUFModelFile
from ggufswarm.client.route import RemoteRoute
from ggufswarm.node.launch import start_nodes, stop_nodes
from ggufswarm.runtime.backends import model_config
from ggufswarm.runtime.sampling import SamplingParams
from ggufswarm.runtime.spec import even_split

MIB = 1 << 20
SLACK_MIB = 120  # the goal's allowance for the process itself


def rss_bytes(pid: int) -> int:
    """VmRSS of process ``pid`` (bytes)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def health(url: str) -> dict:
    with urllib.request.urlopen(url + "/health", timeout=30) as r:
        return json.loads(r.read())


def buffers(h: dict, what: str) -> int:
    """Bytes of llama.cpp's buffers of kind ``what`` (model, KV, compute, output, RS) on every device."""
    return sum(b.get(what, 0) for b in (h.get("placement") or {}).get("buffers", {}).values())


def row(nodes, label: str, shard_bytes: list[int]) -> list[tuple]:
    out = []
    for n, weights in zip(nodes, shard_bytes):
        h = health(n.url)
        rss = rss_bytes(n.proc.pid)
        kv_alloc = buffers(h, "KV")
        compute = buffers(h, "compute") + buffers(h, "output")
        kv_held = h["kv_tokens_held"] * h["kv_bytes_per_token"]
        out.append((label, f"{n.spec.start}:{n.spec.end}", rss, weights, kv_held, kv_alloc, compute))
    return out


async def open_and_prefill(urls: list[str], count: int, tokens: int):
    """``count`` sessions on the route, each prefilled with ``tokens`` token ids (one sampled token): the open
    sessions."""
    route = await RemoteRoute.connect(urls, 600.0)
    sessions = []
    for k in range(count):
        s = await route.aopen(tokens + 8, SamplingParams(temperature=0))
        sessions.append(s)
        ids = [5 + (i * 7 + k) % 300 for i in range(tokens)]
        step = route.max_step_tokens
        for lo in range(0, tokens, step):
            await s.step(ids[lo : lo + step], sample=lo + step >= tokens)
    return sessions


async def scenario(nodes, count: int, tokens: int, label: str, shard_bytes: list[int]) -> list[tuple]:
    sessions = await open_and_prefill([n.url for n in nodes], count, tokens)
    try:
        return row(nodes, label, shard_bytes)
    finally:
        for s in sessions:
            await s.close()


def rpc_rows(path: str, specs, tokens: list[int], threads: int) -> list[tuple]:
    """llama.cpp's own: 3 ``rpc-server`` processes holding the route's cut (llama-bench ``--rpc``, ``-ts`` as the
    route, flash attention), each one's peak RSS while llama-bench prefills ``n`` tokens (its context: exactly
    those), for each ``n`` of ``tokens``; nothing (a line says so) without the tools (``make llamacpp-tools``)."""
    from bench_llamacpp import TOOLS_BIN, llama_bench, peak_rss, rpc_servers

    if not all((TOOLS_BIN / b).is_file() for b in ("llama-bench", "rpc-server")):
        print(
            f"llama.cpp rpc-server rows left out: no llama-bench / rpc-server under {TOOLS_BIN} (make llamacpp-tools)"
        )
        return []
    split = "/".join(str(s.end - s.start + s.head) for s in specs)  # the head's server holds the output too
    out = []
    for n in tokens:
        with rpc_servers(threads, dict(os.environ)) as (servers, addrs), peak_rss(servers) as peak:
            args = ["-t", str(threads), "-fa", "1", "--rpc", ",".join(addrs), "-ngl", "99", "-ts", split]
            llama_bench(path, args + ["-p", str(n), "-n", "0"], dict(os.environ), 1)
        out += [(f"1 x {n}", f"{s.start}:{s.end}", rss) for s, rss in zip(specs, peak)]
    return out


async def waves(nodes, seconds: float, count: int, tokens: int) -> list[list[int]]:
    """Waves of ``count`` sessions (opened together, each prefilled with ``tokens`` tokens and decoded 8 more, then
    closed) for ``seconds``: each node's RSS after each wave."""
    urls, out = [n.url for n in nodes], []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        sessions = await open_and_prefill(urls, count, tokens)
        for s in sessions:
            token = 5  # (any token: memory does not depend on which)
            for _ in range(8):
                token = await s.step([token])
        for s in sessions:
            await s.close()
        out.append([rss_bytes(n.proc.pid) for n in nodes])
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="a GGUF path or smollm2 (default: the default model)")
    ap.add_argument("--short", type=int, default=512, help="tokens of each short session (default 512)")
    ap.add_argument("--long", type=int, default=32768, help="tokens of the long session (default 32768)")
    ap.add_argument("--threads", type=int, default=1, help="threads per node (default 1)")
    ap.add_argument("--waves", type=float, default=0, help="then waves of 32 sessions for this many seconds (RSS)")
    ap.add_argument(
        "--gpu",
        default="none",
        help="the nodes' --gpu (default none): with a GPU, 'KV allocated' is the KV cache llama.cpp made on it, sized "
        'to the open sessions (docs/memory.md, "A GPU\'s KV cache"); lavapipe: GGML_VK_VISIBLE_DEVICES=0 --gpu Vulkan0',
    )
    ap.add_argument("--max-sessions", type=int, default=32, help="the nodes' --max-sessions (default 32)")
    ap.add_argument("--no-rpc", action="store_true", help="leave out llama.cpp's rpc-server table")
    a = ap.parse_args()
    path = str(resolve_model(a.model))
    file = GGUFModelFile(path)
    specs = even_split(model_config(file, "llama.cpp").n_layers, 3)
    shard_bytes = [shard_account(file, s.start, s.end, s.embed, s.head).weight_bytes for s in specs]
    extra = ["--gpu", a.gpu, "--max-sessions", str(a.max_sessions)]  # the rest as a node's defaults
    nodes = start_nodes(specs, path, a.threads, extra, timeout=600)
    rows = []
    try:
        time.sleep(1.0)
        rows += row(nodes, "idle", shard_bytes)
        for count in (1, 4, 16):
            rows += asyncio.run(scenario(nodes, count, a.short, f"{count} x {a.short}", shard_bytes))
        long = min(a.long, min(health(n.url)["max_length"] for n in nodes) - 8)  # within the model's context
        rows += asyncio.run(scenario(nodes, 1, long, f"1 x {long}", shard_bytes))
        time.sleep(1.0)
        rows += row(nodes, "idle again", shard_bytes)
        rss_waves = asyncio.run(waves(nodes, a.waves, 32, a.short)) if a.waves > 0 else []
    finally:
        stop_nodes(nodes)
    rpc = [] if a.no_rpc else rpc_rows(path, specs, [a.short, long], a.threads)
    print(
        f"\nmodel {path}; 3 nodes, {a.threads} thread(s) each, --gpu {a.gpu} --max-sessions {a.max_sessions}, "
        "defaults otherwise\n"
    )
    print("| sessions | node | RSS MiB | shard MiB | KV held MiB | KV allocated MiB | compute MiB | other MiB | goal |")
    print("|---|---|---|---|---|---|---|---|---|")
    for label, layers, rss, weights, kv_held, kv_alloc, compute in rows:
        other = rss - weights - kv_held - compute
        bound = weights + (kv_held + compute if label not in ("idle", "idle again") else 0) + SLACK_MIB * MIB
        print(
            f"| {label} | {layers} | {rss / MIB:.0f} | {weights / MIB:.0f} | {kv_held / MIB:.1f} | "
            f"{kv_alloc / MIB:.0f} | {compute / MIB:.0f} | {other / MIB:.0f} | "
            f"{'met' if rss <= bound else 'missed'} (≤ {bound / MIB:.0f}) |"
        )
    if rss_waves:
        print(f"\n{len(rss_waves)} waves of 32 sessions of {a.short} tokens (+8 decoded) in {a.waves:g} s: RSS MiB\n")
        print("| node | after wave 1 | after the last | most |")
        print("|---|---|---|---|")
        for i, s in enumerate(specs):
            col = [w[i] / MIB for w in rss_waves]
            print(f"| {s.start}:{s.end} | {col[0]:.0f} | {col[-1]:.0f} | {max(col):.0f} |")
    if rpc:
        print("\nllama.cpp's rpc-server holding the same layers (peak RSS while llama-bench prefills into them)\n")
        print("| tokens | node | rpc-server RSS MiB | ggufswarm node RSS MiB (same tokens) |")
        print("|---|---|---|---|")
        ours = {(r[0], r[1]): r[2] for r in rows}
        for label, layers, peak in rpc:
            mine = ours.get((label, layers))
            print(f"| {label} | {layers} | {peak / MIB:.0f} | {'-' if mine is None else f'{mine / MIB:.0f}'} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
