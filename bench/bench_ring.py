"""Ring decode benchmark: the 3-node route with ring decode (the default) against the same route without it
(``ring=False``), llama.cpp in-process and llama.cpp RPC, with and without a one-way delay per hop; one markdown
table from one run.

Ring decode (client/ring.py, node/ring.py): after the route's head samples a token it sends the next decode step
(that token, one position on) to the route's first node itself; the client only reads the tokens on its reply link
to the head and grants the head 16 steps ahead (again every 8 tokens). Without the ring the client sends every
step to the first node when the head's token reaches it.

Model: the embedded default (Gemma 3 270M). Three ``ggufswarm node`` processes (``even_split(18, 3)``: blocks 0-5
+ embed / 6-11 / 12-17 + head, 1 thread each, f32 frames) are started once and serve every route row. Each row
is one greedy generation: a --prefill-token prompt, then --decode one-token steps; decode tok/s = --decode / the
time of those steps at the client (``bench_llamacpp.run_session``; a route row drives its async session on the route
loop as the gateway does, ``agreedy``, not through the blocking client's thread hand-off). Engines run in turn in
interleaved rounds (--rounds, after an untimed warm-up round); each cell is the median over the rounds, and every
ratio is the median of the per-round ratios (a ratio inside one round compares runs seconds apart: the drift of a
shared machine mostly cancels).

Part 1, no added delay (loopback): (a) llama.cpp in-process (``LlamaSession``, 1 thread); (b) the route with
the ring; (c) the same route with ``ring=False``; (d) llama.cpp RPC: ``llama-bench --rpc`` over three local
``rpc-server -t 1`` processes cut as the route (``rpc_bench_args``; decode after a context of the prompt's
length), when the binaries exist under .cache/llamacpp-tools (``make llamacpp-tools``; otherwise the row is left
out with a note). Target: ring route decode >= 1.0x llama.cpp RPC.

Part 2, --delay-ms one-way latency per hop (0 skips it): a ``ggufswarm.netdelay.DelayProxy`` in front of each
node delays every byte by --delay-ms in each direction (as bench/bench_wan.py). The route is built from the proxies'
URLs, so the client's step link, the client's reply link to the head, every node's push to its next hop and the
head's ring steps to the first node all cross one proxy each. Per decode token the critical path crosses:

- ring: head -> node 1 (node 1's proxy), node 1 -> node 2 (node 2's proxy), node 2 -> head (the head's proxy):
  3 one-way delays. The head's reply to the client (head's proxy, back direction) and the client's grants (the same
  proxy, forward, every 8 tokens for the 16 steps ahead) run beside the steps.
- no ring: client -> node 1 (node 1's proxy), node 1 -> node 2, node 2 -> head, then the head's reply to the
  client on the reply link (the head's proxy, back direction): 4 one-way delays. The replies back along the route
  (per-hop telemetry) are off the critical path.

So decode cannot exceed ``1000 / (C + 3 * delay)`` tok/s with the ring and ``1000 / (C + 4 * delay)`` without it,
C = the sum over the 3 nodes of their mean decode compute_ms (``StepTiming.compute_ms`` of the steps with
``n_tokens == 1``, from the ring session's telemetry of the same round). The rest (framing, WebSockets, the
proxies, Python) is what "tok/s / bound" measures. Target: ring >= 0.9x its bound. The proxies are threads of this
process (asyncio loops), beside the client's route loop. With delay 0 the same bound (``1000 / C``) is shown for
part 1's route rows.

Also printed (no target): the split compute alone against llama.cpp in-process (the most the in-process ratio can
be with nothing between hops) and the same three shards run one after another in this process (``split_in_process``:
the split without processes that wait idle between steps), per hop of the ring=False route a node's own time
beside its compute (``hop_split``), and the floor of a hop on this machine
(``bench/bare_ring.py``: the same compute per node, busy-waited, in three bare aiohttp processes passing a message
round: what the operating system, the event loop and aiohttp cost a hop, the wake-up of an idle process included;
and the same over blocking TCP sockets: the operating system's part), and how much slower Python runs right after a
llama.cpp decode step than warm (``cold_python``): what a node does between frames.

``ring steps``: the steps the head sent itself and the client took (``RouteTelemetry.ring_steps``), of --decode;
the first few decode steps go without the ring while the client's reply link opens. 0 means the ring never
engaged (reported).

Usage:
    .venv/bin/python bench/bench_ring.py [--rounds 3] [--prefill 64] [--decode 64] [--delay-ms 25] [--json [FILE]]
    (--quick: --rounds 1 --decode 8, a smoke run)
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import math
import os
import statistics
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from pathlib import Path

from bare_ring import bare_ring
from bench_llamacpp import (
    GREEDY,
    N_LAYERS,
    NODE_CTX,
    TOOLS_BIN,
    LlamaSession,
    cpu_model,
    dump_json,
    llama_bench,
    prompt_ids,
    rpc_bench_args,
    rpc_servers,
    run_session,
    say,
)
from bench_wan import delayed
from prometheus_client.parser import text_string_to_metric_families

from ggufswarm.artifact.default_model import default_model_path
from ggufswarm.artifact.gguf_file import GGUFModelFile
from ggufswarm.client import loop as route_loop
from ggufswarm.client.route import RemoteRoute
from ggufswarm.client.tokenizer import Tokenizer
from ggufswarm.net.link import FrameLink
from ggufswarm.node.launch import start_nodes, stop_nodes
from ggufswarm.runtime.shard import even_split

N_NODES = 3
MESSAGE_KINDS = ("node frame", "node reply", "node direct", "client frame", "client grant")
RING_HOPS, NO_RING_HOPS = 3, 4  # one-way delays on the critical path of one decode token (module docstring)
NAMES = {
    "llama.cpp": ("llama.cpp in-process (llama-cpp-python)", "1"),
    "ring": ("route, 3 nodes, ring (default)", "4 (client + 3 nodes)"),
    "no_ring": ("route, 3 nodes, ring=False", "4 (client + 3 nodes)"),
    "rpc": ("llama.cpp RPC (llama-bench + 3 rpc-server)", "4 (llama-bench + 3 servers)"),
}


async def agreedy(route: RemoteRoute, ids: list[int], n_decode: int, ring: bool) -> tuple[float, float, object]:
    """One greedy generation on ``route`` as the gateway drives a session: the async session on one event loop (the
    route loop), no thread hand-off per token. (prefill tok/s, decode tok/s, its RouteTelemetry)."""
    session = await route.aopen(len(ids) + n_decode + 8, GREEDY, http=await route_loop.shared_http(), ring=ring)
    try:
        t0 = time.perf_counter()
        token = await session.step(ids)
        t1 = time.perf_counter()
        for _ in range(n_decode):
            token = await session.step([token])
        t2 = time.perf_counter()
        return len(ids) / (t1 - t0), n_decode / (t2 - t1), await session.telemetry()
    finally:
        await session.close()


def route_run(route: RemoteRoute, ids: list[int], n_decode: int, ring: bool) -> dict:
    """One greedy session on ``route`` (``ring`` on or off; ``agreedy``): prefill / decode tok/s, the head-sent steps
    taken (``ring_steps``), the decode steps with telemetry, and per hop its mean decode compute_ms (steps of 1
    token)."""
    prefill, decode, tele = route_loop.run(agreedy(route, ids, n_decode, ring))
    n_hops = len(route.hops)
    steps = [s for s in tele.steps if s.n_tokens == 1 and not s.verify and len(s.compute_ms) == n_hops]
    hop_ms = [statistics.fmean(s.compute_ms[k] for s in steps) if steps else math.nan for k in range(n_hops)]
    timed = [s for s in steps if len(s.outer_ms) == n_hops]
    return {
        **hop_split(timed, hop_ms),
        "prefill": prefill,
        "decode": decode,
        "ring_steps": tele.ring_steps,
        "ring_discarded": tele.ring_discarded,
        "direct_replies": tele.direct_replies,
        "decode_steps_timed": len(steps),
        "hop_compute_ms": hop_ms,
        "compute_ms": sum(hop_ms),
    }


def hop_split(steps: list, hop_ms: list[float]) -> dict:
    """Where a decode step's time goes at each hop, from the replies back along the route (``StepTiming``, means
    over ``steps``, ms): ``hop_beside_ms``, the node's time between reading the frame and answering it, less its
    compute and less what it waited for the next hop (framing, Python, writing the frame on); ``hop_network_ms``,
    what its caller waited beyond the node's own handling (both directions of the link, and the time the frame and
    its reply waited to be read). A ring step's first hop is measured by the head, not the client: read these of
    the ring=False route. (Its network part is not printed: a client that sends step n + 1 as soon as the head's
    reply of step n reaches it finds the nodes' replies of step n held up behind their compute of n + 1, off the
    critical path.)"""
    n = len(hop_ms)
    if not steps:
        return {"hop_beside_ms": [math.nan] * n, "hop_network_ms": [math.nan] * n}
    outer = [statistics.fmean(s.outer_ms[k] for s in steps) for k in range(n)]
    network = [statistics.fmean(s.network_ms[k] for s in steps) for k in range(n)]
    beside = [outer[k] - network[k] - hop_ms[k] - (outer[k + 1] if k + 1 < n else 0.0) for k in range(n)]
    return {"hop_beside_ms": beside, "hop_network_ms": network}


def rpc_run(path: str, ids: list[int], n_decode: int, addrs: list[str], env: dict) -> dict:
    """llama-bench over the rpc-servers ``addrs`` (one repetition): prefill from empty, decode after the prompt."""
    n = len(ids)
    out = llama_bench(path, ["-p", str(n), "-n", str(n_decode), "-d", f"0,{n}", *rpc_bench_args(1, addrs)], env, 1, n)[
        0
    ]
    return {"prefill": out["prefill"], "decode": out["decode"]}


def bound(compute_ms: float, delay_ms: float, hops: int) -> float:
    """The most decode tok/s a path of ``hops`` one-way delays and ``compute_ms`` of node compute per token allows."""
    total = compute_ms + hops * delay_ms
    return 1000.0 / total if total > 0 and not math.isnan(total) else math.nan


def round_line(r: int, runs: dict[str, dict]) -> str:
    parts = []
    for name, x in runs.items():
        s = f"{name} {x['prefill']:.1f} / {x['decode']:.1f}"
        if "ring_steps" in x:
            hops = " + ".join(f"{c:.1f}" for c in x["hop_compute_ms"])
            s += f" [ring steps {x['ring_steps']}, compute {hops} ms]"
        parts.append(s)
    return f"  round {r}{' (warm-up)' if not r else ''}: " + ", ".join(parts) + " tok/s (prefill / decode)"


def node_messages(urls: list[str]) -> Counter:
    """Messages the nodes ``urls`` have sent on links so far, by kind (``ggufswarm_node_link_messages_sent``)."""
    out: Counter = Counter()
    for url in urls:
        text = urllib.request.urlopen(url + "/metrics", timeout=30).read().decode()
        for family in text_string_to_metric_families(text):
            if family.name == "ggufswarm_node_link_messages_sent":
                for sample in family.samples:
                    if sample.name.endswith("_total"):
                        out["node " + sample.labels["kind"]] += int(sample.value)
    return out


def count_messages(route: RemoteRoute, ids: list[int], n_decode: int, ring: bool) -> dict:
    """Messages per decode token on ``route`` (untimed): the nodes' by kind (their counters) and the client's (its
    frames and ring grants, counted in this process), between the prompt's step and the session's close (which takes
    the ring's grant back: the steps the head sent past the last token are counted), each read once the steps in
    flight are done (0.3 s later)."""
    sent: Counter = Counter()
    send, send_text = FrameLink.send, FrameLink.send_text

    async def counted_send(self, frame, waiter, timeout=None):
        sent["client frame"] += 1
        return await send(self, frame, waiter, timeout)

    async def counted_text(self, text):
        ok = await send_text(self, text)
        sent["client grant"] += ok
        return ok

    urls = [h.url for h in route.hops]
    FrameLink.send, FrameLink.send_text = counted_send, counted_text
    try:
        session = route.open(len(ids) + n_decode + 8, GREEDY, ring=ring)
        try:
            token = session.step(ids)
            time.sleep(0.3)
            before, sent_before = node_messages(urls), Counter(sent)
            for _ in range(n_decode):
                token = session.step([token])
        finally:
            session.close()  # (its revoke and the steps the head sent past the last one are counted)
        time.sleep(0.3)
        after = node_messages(urls)
    finally:
        FrameLink.send, FrameLink.send_text = send, send_text
    by = (after - before) + (sent - sent_before)
    return {"per_token": sum(by.values()) / n_decode, "by": {k: v / n_decode for k, v in sorted(by.items())}}


def summarize(times: dict[str, list[dict]], delay_ms: float) -> dict:
    """Medians per engine, the ring route's per-round ratios to each engine, and each route's ratio to its bound
    (C: the ring session's compute of the same round)."""
    out: dict[str, dict] = {}
    ring = times["ring"]
    for name, runs in times.items():
        if not runs:
            continue
        e = {key: statistics.median(x[key] for x in runs) for key in ("prefill", "decode")}
        if name != "ring":
            e["ring_ratio"] = statistics.median(a["decode"] / b["decode"] for a, b in zip(ring, runs))
        if "ring_steps" in runs[0]:
            e["ring_steps"] = statistics.median(x["ring_steps"] for x in runs)
            e["ring_steps_min"] = min(x["ring_steps"] for x in runs)
            e["compute_ms"] = statistics.median(x["compute_ms"] for x in runs)
            for key in ("hop_compute_ms", "hop_beside_ms", "hop_network_ms"):
                e[key] = [statistics.median(h) for h in zip(*(x[key] for x in runs))]
            hops = RING_HOPS if name == "ring" else NO_RING_HOPS
            e["bound_compute_ms"] = statistics.median(x["compute_ms"] for x in ring)  # C: the ring's
            e["bound"] = bound(e["bound_compute_ms"], delay_ms, hops)
            e["bound_ratio"] = statistics.median(
                x["decode"] / bound(rx["compute_ms"], delay_ms, hops) for x, rx in zip(runs, ring)
            )
        out[name] = e
    return out


def part1(path: str, route: RemoteRoute, ids: list[int], n_decode: int, rounds: int, have_tools: bool) -> dict:
    """No added delay: llama.cpp, the route with and without the ring, and llama.cpp RPC, in interleaved rounds."""
    times: dict[str, list[dict]] = {"llama.cpp": [], "ring": [], "no_ring": [], "rpc": []}
    env = dict(os.environ)
    llm = LlamaSession(path, len(ids) + n_decode + 16, 1)
    try:
        with contextlib.ExitStack() as stack:
            addrs = stack.enter_context(rpc_servers(1, env))[1] if have_tools else None
            for r in range(rounds + 1):  # round 0 warms every engine up with the timed shapes
                t0 = time.perf_counter()
                prefill, decode = run_session(llm.reset(), ids, n_decode)
                runs = {"llama.cpp": {"prefill": prefill, "decode": decode}}
                runs["ring"] = route_run(route, ids, n_decode, True)
                runs["no_ring"] = route_run(route, ids, n_decode, False)
                if addrs is not None:
                    runs["rpc"] = rpc_run(path, ids, n_decode, addrs, env)
                say(round_line(r, runs) + f" ({time.perf_counter() - t0:.0f} s)")
                if r:
                    for name, x in runs.items():
                        times[name].append(x)
    finally:
        llm.close()
    messages = {name: count_messages(route, ids, n_decode, ring) for name, ring in (("ring", True), ("no_ring", False))}
    # the floor of a hop here: the same compute per node (busy-waited), no ggufswarm code between (bench/bare_ring.py)
    hop_compute = [statistics.median(h) for h in zip(*(x["hop_compute_ms"] for x in times["ring"]))]
    raw = bare_ring(hop_compute, raw=True)["hop_ms"]  # the same over blocking sockets: the operating system alone
    floor = {**bare_ring(hop_compute), "raw_hop_ms": raw, "compute_ms": hop_compute}
    return {
        "runs": times,
        "messages": messages,
        "bare_ring": floor,
        "cold_python": cold_python(path, ids),
        "split_in_process": split_in_process(path, ids, n_decode),
        **summarize(times, 0.0),
    }


def split_in_process(path: str, ids: list[int], n: int = 64) -> dict:
    """ms per decode token of the route's three shards (``even_split``, llama.cpp backend, 1 thread each) run one
    after another in this process: a greedy generation of ``n`` tokens after the prompt ``ids``, no network, no
    process waiting idle between steps; then the whole model in-process (``LlamaSession``) the same way. Medians over
    the tokens: ``{"split_ms", "whole_ms"}``."""
    import numpy as np

    from ggufswarm.runtime.backends import load_shard
    from ggufswarm.runtime.sampling import greedy

    model = GGUFModelFile(path)
    shards = [
        load_shard(model, spec, threads=1, max_length=len(ids) + n + 8, max_sessions=1)
        for spec in even_split(N_LAYERS, N_NODES)
    ]
    try:
        kvs = [shard.new_session(len(ids) + n + 8) for shard in shards]
        x = np.asarray(ids)
        for shard, kv in zip(shards, kvs):
            x = shard.forward(kv, x)
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            x = np.asarray([greedy(x[-1])])
            for shard, kv in zip(shards, kvs):
                x = shard.forward(kv, x)
            times.append((time.perf_counter() - t0) * 1e3)
    finally:
        for shard in shards:
            shard.close()
    llm = LlamaSession(path, len(ids) + n + 16, 1)
    try:
        token, whole = llm.step(ids), []
        for _ in range(n):
            t0 = time.perf_counter()
            token = llm.step([token])
            whole.append((time.perf_counter() - t0) * 1e3)
    finally:
        llm.close()
    return {"split_ms": statistics.median(times), "whole_ms": statistics.median(whole)}


def cold_python(path: str, ids: list[int], n: int = 64) -> dict:
    """What Python between frames costs on a node: one frame encoded and decoded (``encode_hidden`` +
    ``decode_frame``, an f32 ``[1, n_embd]`` step) right after a llama.cpp decode step of the whole model (1 thread),
    and the same again at once; medians over ``n`` steps, µs: ``{"cold_us", "warm_us"}``."""
    import uuid

    import numpy as np

    from ggufswarm.protocol import decode_frame, encode_hidden

    llm = LlamaSession(path, len(ids) + n + 16, 1)
    try:
        token = llm.step(ids)
        hidden = np.random.default_rng(0).standard_normal((1, llm.llm.n_embd()), dtype=np.float32)
        sid, cold, warm = uuid.uuid4(), [], []
        for i in range(n):
            token = llm.step([token])
            times = []
            for _ in range(2):
                t0 = time.perf_counter()
                decode_frame(encode_hidden(sid, i, len(ids) + i, hidden, "f32", [token]))
                times.append((time.perf_counter() - t0) * 1e6)
            cold.append(times[0])
            warm.append(times[1])
    finally:
        llm.close()
    return {"cold_us": statistics.median(cold), "warm_us": statistics.median(warm)}


def part2(nodes, ids: list[int], n_decode: int, rounds: int, delay_ms: float) -> dict:
    """--delay-ms one-way per hop (a DelayProxy in front of each node): the route with and without the ring."""
    times: dict[str, list[dict]] = {"ring": [], "no_ring": []}
    addrs = [(n.url.split("//")[1].rsplit(":", 1)[0], int(n.url.rsplit(":", 1)[1])) for n in nodes]
    with delayed(addrs, delay_ms) as hosts:
        route = RemoteRoute([f"http://{h}" for h in hosts], 60.0 + 20 * delay_ms / 1e3)
        for r in range(rounds + 1):
            t0 = time.perf_counter()
            runs = {"ring": route_run(route, ids, n_decode, True), "no_ring": route_run(route, ids, n_decode, False)}
            say(round_line(r, runs) + f" ({time.perf_counter() - t0:.0f} s)")
            if r:
                for name, x in runs.items():
                    times[name].append(x)
    return {"runs": times, **summarize(times, delay_ms)}


def fmt(x, spec: str = ".1f") -> str:
    return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def table(res: dict, n_decode: int, delay_ms: float) -> list[str]:
    lines = [
        "| one-way delay per hop | engine | processes | decode tok/s | prefill tok/s | ring route ÷ row "
        "| bound tok/s | row ÷ bound | Σ node compute ms / token | ring steps |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    parts = [(0.0, res["part1"])] + ([(delay_ms, res["part2"])] if res.get("part2") else [])
    for d, part in parts:
        for name in ("llama.cpp", "ring", "no_ring", "rpc"):
            e = part.get(name)
            if e is None:
                continue
            label, procs = NAMES[name]
            if d:
                procs += " + 3 proxies"
            formula = ""
            if "bound" in e:
                hops = RING_HOPS if name == "ring" else NO_RING_HOPS
                c = e["bound_compute_ms"]
                formula = f" (1000/({c:.1f}+{hops}·{d:g}))" if d else f" (1000/{c:.1f})"
            steps = f"{fmt(e.get('ring_steps'), 'g')} / {n_decode}" if "ring_steps" in e else "–"
            lines.append(
                f"| {d:g} ms | {label} | {procs} | {e['decode']:.1f} | {e['prefill']:.1f} "
                f"| {fmt(e.get('ring_ratio'), '.2f')} | {fmt(e.get('bound'))}{formula} "
                f"| {fmt(e.get('bound_ratio'), '.2f')} | {fmt(e.get('compute_ms'), '.2f')} | {steps} |"
            )
    return lines


def targets(res: dict, delay_ms: float) -> list[str]:
    out = ["Targets:"]

    def check(label: str, value: float | None, goal: float) -> None:
        if value is None or math.isnan(value):
            out.append(f"- {label}: n/a")
        else:
            out.append(f"- {label}: {value:.2f}x (target >= {goal:.2f}x) {'ok' if value >= goal else 'MISSED'}")

    p1 = res["part1"]
    check("ring route decode vs llama.cpp RPC (3 servers), no delay", p1.get("rpc", {}).get("ring_ratio"), 1.0)
    check("ring route decode vs llama.cpp in-process, no delay", p1["llama.cpp"]["ring_ratio"], 0.95)
    ring = p1["ring"]
    per_hop = (1000.0 / ring["decode"] - ring["compute_ms"]) / RING_HOPS
    out.append(
        f"- per-hop overhead, no delay ((1000 / ring decode - Σ node compute) / {RING_HOPS} hops): {per_hop:.2f} ms "
        f"(target <= 0.30 ms) {'ok' if per_hop <= 0.3 else 'MISSED'}"
    )
    if "messages" in p1:
        got = p1["messages"]["ring"]["per_token"]
        out.append(
            f"- messages per decode token, ring: {got:.1f} (goal {RING_HOPS + 1}: one per hop and one to the client) "
            f"{'ok' if got <= RING_HOPS + 1.05 else 'MISSED'}"
        )
    if res.get("part2"):
        check(f"ring route decode / its bound, {delay_ms:g} ms per hop", res["part2"]["ring"]["bound_ratio"], 0.9)
    out.append("Also (no target):")
    out.append(f"- ring route vs llama.cpp in-process, no delay: {fmt(p1['llama.cpp']['ring_ratio'], '.2f')}x")
    out.append(f"- ring vs ring=False, no delay: {fmt(p1['no_ring']['ring_ratio'], '.2f')}x")
    llama_ms = 1000.0 / p1["llama.cpp"]["decode"]
    out.append(
        f"- the split compute alone: llama.cpp in-process {llama_ms:.2f} ms / token, Σ node compute "
        f"{ring['compute_ms']:.2f} ms: the in-process ratio with no cost between hops would be "
        f"{llama_ms / ring['compute_ms']:.2f}x"
    )
    if "split_in_process" in p1:
        split = p1["split_in_process"]
        out.append(
            f"- the same three shards one after another in one process (no network, no process waiting idle between "
            f"steps): {split['split_ms']:.2f} ms / token against {split['whole_ms']:.2f} for the whole model measured "
            f"right after ({split['whole_ms'] / split['split_ms']:.2f}x): the rest of the shortfall above is the "
            "nodes' compute slowing as processes that sleep between steps"
        )
    if "bare_ring" in p1:
        floor = p1["bare_ring"]
        per_hop = (1000.0 / p1["ring"]["decode"] - p1["ring"]["compute_ms"]) / RING_HOPS
        busy = " + ".join(f"{c:.1f}" for c in floor["compute_ms"])
        out.append(
            f"- the floor of a hop on this machine (bench/bare_ring.py: {RING_HOPS} processes pass a 2.6 KB message "
            f"round, each busy-waiting the ring's compute, {busy} ms): {floor['raw_hop_ms']:.2f} ms a hop over "
            f"blocking TCP sockets (the operating system), {floor['hop_ms']:.2f} ms over aiohttp WebSockets on an "
            f"event loop; the route's per-hop overhead beyond the latter: {per_hop - floor['hop_ms']:.2f} ms "
            "(ggufswarm's own: framing, sessions, Python)"
        )
    if "cold_python" in p1:
        cold = p1["cold_python"]
        out.append(
            f"- Python right after a llama.cpp decode step (its weights stream through the caches): one frame "
            f"encoded and decoded (protocol/frame.py) takes {cold['cold_us']:.0f} µs, the same again at once "
            f"{cold['warm_us']:.0f} µs ({cold['cold_us'] / cold['warm_us']:.1f}x): what a node does between frames "
            "runs cold"
        )
    out.append(
        "- per hop, ring=False route, a node's own time per decode step (frame read to reply, less its compute and "
        "its wait for the next hop): "
        + ", ".join(f"node {k + 1} {fmt(b, '.2f')} ms" for k, b in enumerate(p1["no_ring"]["hop_beside_ms"]))
    )
    if res.get("part2"):
        p2 = res["part2"]
        out.append(f"- ring vs ring=False, {delay_ms:g} ms: {fmt(p2['no_ring']['ring_ratio'], '.2f')}x")
        out.append(
            f"- ring=False route decode / its bound, {delay_ms:g} ms: {fmt(p2['no_ring']['bound_ratio'], '.2f')}"
        )
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3, help="timed interleaved rounds, after a warm-up one (default 3)")
    ap.add_argument("--prefill", type=int, default=64, help="prompt tokens (default 64, at most 2048)")
    ap.add_argument("--decode", type=int, default=64, help="greedy tokens decoded after the prompt (default 64)")
    ap.add_argument("--delay-ms", type=float, default=25.0, help="one-way delay per hop of part 2 (25; 0 skips it)")
    ap.add_argument("--quick", action="store_true", help="smoke run: --rounds 1 --decode 8")
    ap.add_argument("--json", nargs="?", const="-", metavar="FILE", help="also dump the numbers as JSON (- = stdout)")
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.decode = 1, 8
    if not 1 <= args.prefill <= 2048:
        ap.error("--prefill must be in 1..2048 (one llama.cpp batch)")
    if args.rounds < 1 or args.decode < 1 or args.delay_ms < 0:
        ap.error("--rounds and --decode must be >= 1, --delay-ms >= 0")
    path = str(default_model_path())
    f = GGUFModelFile(path)
    ids = prompt_ids(Tokenizer(path, f.metadata), args.prefill)
    have_tools = all((TOOLS_BIN / b).is_file() for b in ("llama-bench", "rpc-server"))

    say(f"# Ring decode — {Path(path).name}")
    say(
        f"CPU: {cpu_model()}, {os.cpu_count()} logical cores; 1 thread per process; "
        f"{datetime.datetime.now().astimezone().isoformat(timespec='seconds')}"
    )
    say(
        f"{len(ids)}-token prompt, {args.decode} greedy decode tokens, {args.rounds} round(s) + warm-up; load average "
        f"{', '.join(f'{x:.2f}' for x in os.getloadavg())}"
    )
    need = len(ids) + args.decode + 8
    extra = ["--ctx-size", str(need)] if need > NODE_CTX else []
    res: dict = {}
    with tempfile.NamedTemporaryFile("w+", prefix="bench-ring-nodes-", suffix=".log") as log:
        nodes = []
        try:
            nodes = start_nodes(even_split(N_LAYERS, N_NODES), path, threads=1, extra=extra, stderr=log)
            say(f"nodes: {', '.join(n.url for n in nodes)}")
            say("Part 1: no added delay (llama.cpp, ring route, ring=False route" + (", RPC):" if have_tools else "):"))
            route = RemoteRoute([n.url for n in nodes], 120.0)
            res["part1"] = part1(path, route, ids, args.decode, args.rounds, have_tools)
            if args.delay_ms > 0:
                say(f"Part 2: {args.delay_ms:g} ms one-way per hop (a DelayProxy in front of each node):")
                res["part2"] = part2(nodes, ids, args.decode, args.rounds, args.delay_ms)
        except Exception:
            log.flush()
            log.seek(0)
            sys.stderr.write(log.read()[-4000:])
            raise
        finally:
            stop_nodes(nodes)

    say("")
    for line in table(res, args.decode, args.delay_ms):
        say(line)
    say("")
    say(
        "Cells: medians over the rounds. ring route ÷ row: median over the rounds of (ring route decode / row "
        "decode) at the same delay. Bound: 1000 / (C + k·delay) tok/s, C = Σ over the 3 nodes of the mean decode "
        "compute_ms of the ring session of the same round, k = 3 one-way delays per token with the ring (head -> "
        "1 -> 2 -> head), 4 without (client -> 1 -> 2 -> head -> client); row ÷ bound: median of the per-round "
        "ratios. Σ node compute: each row's own sessions. ring steps: head-sent steps taken, of the decode steps "
        "(the first ones go without the ring while the reply link opens: a short --decode understates the ring)."
    )
    if not have_tools:
        say(f"- llama.cpp RPC row left out: no llama-bench / rpc-server under {TOOLS_BIN} (make llamacpp-tools).")
    for d, key in ((0.0, "part1"), (args.delay_ms, "part2")):
        ring = res.get(key, {}).get("ring")
        if ring is not None and ring["ring_steps_min"] == 0:
            say(f"- WARNING: ring steps 0 at {d:g} ms in some round: the ring did not engage.")
    for key in ("part1", "part2"):
        no_ring = res.get(key, {}).get("no_ring")
        if no_ring is not None and no_ring["ring_steps"]:
            say(f"- WARNING: the ring=False route took {no_ring['ring_steps']:g} head-sent steps ({key}).")
    if "messages" in res["part1"]:
        say("")
        say("Messages per decode token (one counted session each, untimed; client frames and grants counted here):")
        say("")
        say("| route | total | " + " | ".join(MESSAGE_KINDS) + " |")
        say("|---|---:|" + "---:|" * len(MESSAGE_KINDS))
        for name, m in res["part1"]["messages"].items():
            cells = " | ".join(f"{m['by'].get(k, 0.0):.2f}" for k in MESSAGE_KINDS)
            say(f"| {NAMES[name][0]} | {m['per_token']:.2f} | {cells} |")
    say("")
    for line in targets(res, args.delay_ms):
        say(line)
    if args.json:
        dump_json(res, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
