"""Verification benchmark (issue 26): what shadow-replay auditing costs a route, and how fast it catches a liar.

Swarm on loopback: an in-process tracker, Gemma 3 270M published and seeded, six ``ggufswarm node`` processes (two per
span 0:6 +embed / 6:12 / 12:18 +head, 1 thread each), so a route has 3 nodes and every hop has a spare of the same
numerics to replay on. One in-process gateway per ``--verify-rate`` (0, 0.02, 0.1 by default):

* single-session decode tok/s: ``--sessions`` greedy requests of ``--decode`` tokens one after the other (the
  generations' own ``decode_tok_s``, mean);
* aggregate: ``--concurrent`` requests at once, twice; tokens / wall time until the last answer, and tokens / wall
  time until the verifier is idle too (its shadow replays done: the whole cost of the audits these sessions drew);
* audits by result in that gateway.

Anchor, measured in the same run: llama.cpp in-process (llama-cpp-python, 1 thread), the same prompt and length.

Then, with a gateway at rate 1 (every session audited), the time from the start of a session through a liar to its
ban, for each kind of ``--test-lie``: ``noise`` (every step), ``noise-every:16`` (a session of ``--decode`` >= 16
steps), ``weights:`` a Q8_0 requantization of the model (made here with llama.cpp). At a rate R a liar is audited in
a given session through it with probability R: expect 1/R sessions before this time, and ceil(ln(1e-6)/ln(1-R)) for
probability 1 - 1e-6 (verify.sessions_to_catch).

Usage: .venv/bin/python bench/bench_verify.py [--rates 0,0.02,0.1] [--decode 32] [--sessions 4] [--concurrent 4]
Not a test: numbers depend on an idle machine.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from bench_llamacpp import LlamaSession, run_session

from ggufswarm.artifact.default_model import default_model_path
from ggufswarm.artifact.gguf_file import GGUFModelFile
from ggufswarm.client.tokenizer import Tokenizer
from ggufswarm.gateway import GatewayConfig, make_app
from ggufswarm.gateway.app import GATEWAY
from ggufswarm.gateway.verify import sessions_to_catch
from ggufswarm.net.http import ServerThread
from ggufswarm.node.launch import start_nodes, stop_nodes
from ggufswarm.runtime.shard import ShardSpec, even_split
from ggufswarm.swarm.publish import publish
from ggufswarm.swarm.torrent import Swarm, save_path_for
from ggufswarm.tracker.app import TrackerConfig
from ggufswarm.tracker.app import make_app as make_tracker_app

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def post(base: str, body: dict) -> dict:
    req = urllib.request.Request(
        base + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}, method="POST"
    )
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())


def get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=60) as r:
        return json.loads(r.read())


def listed(tracker: str) -> dict[str, str]:
    """Node key by URL, of the nodes the tracker lists."""
    return {a["url"]: a["node_id"] for a in get(f"{tracker}/nodes?model=gemma")["nodes"]}


def request(n: int) -> dict:
    return {"prompt": PROMPT, "max_tokens": n, "temperature": 0, "ignore_eos": True}


def wait_idle(base: str, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while get(base + "/v1/verify")["waiting"]:
        if time.monotonic() > deadline:
            raise RuntimeError("the verifier did not finish its audits")
        time.sleep(0.1)


def gateway(tracker: str, work: Path, rate: float):
    """(ServerThread, base URL, Gateway) of an in-process gateway at verify rate ``rate``."""
    app = make_app(
        GatewayConfig([], model="gemma", tracker=tracker, hop_timeout_s=30, data_dir=str(work / "gw"), verify_rate=rate)
    )
    server = ServerThread(app)
    return server, server.start(), app[GATEWAY]


def measure(tracker: str, work: Path, rate: float, args) -> dict:
    server, base, _ = gateway(tracker, work, rate)
    try:
        post(base, request(4))  # warm-up: links, the header
        wait_idle(base)
        single = [post(base, request(args.decode))["telemetry"]["decode_tok_s"] for _ in range(args.sessions)]
        wait_idle(base)
        tokens, t0 = 0, time.perf_counter()
        for _ in range(2):
            bodies: list[dict] = []
            threads = [
                threading.Thread(target=lambda out=bodies: out.append(post(base, request(args.decode))))
                for _ in range(args.concurrent)
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            tokens += sum(b["usage"]["completion_tokens"] for b in bodies)
        answered = time.perf_counter() - t0
        wait_idle(base)
        drained = time.perf_counter() - t0
        audits = get(base + "/v1/verify")["audits"]
    finally:
        server.stop()
    return {
        "single": sum(single) / len(single),
        "answers": tokens / answered,
        "drained": tokens / drained,
        "audits": audits,
    }


def detection(tracker: str, work: Path, honest_6_12: list[str], kind: str, i: int, n: int) -> dict:
    """Start a liar for 6:12, steer a session of ``n`` tokens through it (the honest 6:12 nodes suspected), and time
    from the session's start to its ban."""
    liar = start_nodes(
        [ShardSpec(6, 12)],
        "gemma",
        threads=1,
        timeout=600,
        extra=["--tracker", tracker, "--hop-timeout", "30"],
        per_node=lambda _: ["--data-dir", str(work / f"liar{i}"), "--test-lie", kind],
    )[0]
    server, base, gw = gateway(tracker, work, 1.0)
    try:
        deadline = time.monotonic() + 60
        while not (key := listed(tracker).get(liar.url)):
            if time.monotonic() > deadline:
                raise RuntimeError("the liar did not advertise")
            time.sleep(0.2)
        gw.suspects.tracker = None  # steering only: the tracker is not asked to probe (and perhaps drop) them
        for url in honest_6_12:
            gw.suspects.add(url)
        t0 = time.perf_counter()
        body = post(base, request(n))
        session_s = time.perf_counter() - t0
        through = liar.url in [h["node"] for h in body["telemetry"]["route"]]
        deadline = time.monotonic() + 300
        while key not in (view := get(base + "/v1/verify"))["banned"]:  # or all 3 hops' audits done without a ban
            if time.monotonic() > deadline or (not view["waiting"] and sum(view["audits"].values()) >= 3):
                break
            time.sleep(0.1)
        banned = key in view["banned"]
        ban = next((b for b in view["bans"] if b["key"] == key), None)
        if key not in view["banned"]:  # say why
            for audit in view["recent"]:
                print(f"  audit of {audit['node']}: {audit['result']} {audit.get('reason', '')}", flush=True)
        return {
            "through": through,
            "session_s": session_s,
            "ban_s": time.perf_counter() - t0 if banned else None,
            "step": ban["evidence"]["step"] if ban else None,
            "audits": view["audits"],
        }
    finally:
        server.stop()
        stop_nodes([liar])


def requantized(path: str, out: Path) -> Path:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0
    params.allow_requantize = True
    params.nthread = 2
    if llama_cpp.llama_model_quantize(path.encode(), str(out).encode(), params) != 0:
        raise RuntimeError("llama_model_quantize failed")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rates", default="0,0.02,0.1", help="verify rates to measure (default 0,0.02,0.1)")
    ap.add_argument("--decode", type=int, default=32, help="greedy tokens per request (default 32)")
    ap.add_argument("--sessions", type=int, default=4, help="sequential requests for single-session tok/s")
    ap.add_argument("--concurrent", type=int, default=4, help="concurrent requests for aggregate tok/s")
    ap.add_argument("--no-liars", action="store_true", help="skip the detection times")
    args = ap.parse_args()
    path = str(default_model_path())
    tok = Tokenizer(path, GGUFModelFile(path).metadata)
    ids = tok.encode(PROMPT)
    ref = LlamaSession(path, len(ids) + args.decode + 16, 1)
    run_session(ref.reset(), ids, 4)
    anchor = run_session(ref.reset(), ids, args.decode)[1]
    ref.close()
    work = Path(tempfile.mkdtemp(prefix="bench-verify-"))
    tracker_server = ServerThread(make_tracker_app(TrackerConfig(db=":memory:")))
    tracker = tracker_server.start()
    published = publish(path, tracker, "gemma", work / "publisher")
    seeder = Swarm()
    seeder.seed(published.torrent, save_path_for([Path(path)]))
    specs = even_split(18, 3) * 2
    nodes = start_nodes(
        specs,
        "gemma",
        threads=1,
        timeout=600,
        extra=["--tracker", tracker, "--hop-timeout", "30"],
        per_node=lambda i: ["--data-dir", str(work / f"node{i}")],
    )
    try:
        deadline = time.monotonic() + 60
        while len(get(f"{tracker}/nodes?model=gemma")["nodes"]) < len(nodes):
            if time.monotonic() > deadline:
                raise RuntimeError("the nodes did not advertise")
            time.sleep(0.2)
        print(
            f"# shadow-replay verification — {os.path.basename(path)}, 3-node route (+1 spare per span), 1 thread per "
            f"node, {args.decode} greedy tokens per request, cpus {os.cpu_count()}"
        )
        print("| setting | decode tok/s, 1 session | aggregate tok/s | aggregate tok/s, audits done | audits |")
        print("|---|---:|---:|---:|---|")
        print(f"| llama.cpp in-process, 1 thread | {anchor:.1f} | – | – | – |", flush=True)
        for rate in (float(r) for r in args.rates.split(",")):
            m = measure(tracker, work, rate, args)
            audits = ", ".join(f"{k} {v}" for k, v in m["audits"].items() if v) or "none"
            print(
                f"| route, --verify-rate {rate:g} | {m['single']:.1f} | {m['answers']:.1f} | {m['drained']:.1f} | "
                f"{audits} |",
                flush=True,
            )
        if args.no_liars:
            return 0
        print("\n| liar (6:12) | session tokens | session s | banned after s | mismatch at step | sessions, R=0.02 |")
        print("|---|---:|---:|---:|---:|---|")
        q8 = requantized(path, work / "gemma-q8_0.gguf")
        honest = [n.url for n in nodes if n.spec.start == 6]
        kinds = ["noise", f"noise-every:{min(16, args.decode)}", f"weights:{q8}"]
        for i, kind in enumerate(kinds):
            d = detection(tracker, work, honest, kind, i, args.decode)
            ban = f"{d['ban_s']:.1f}" if d["ban_s"] is not None else f"not banned ({d['audits']})"
            label = kind if not kind.startswith("weights:") else "weights:Q8_0"
            if not d["through"]:
                ban += " (session not routed through it)"
            print(
                f"| {label} | {args.decode} | {d['session_s']:.1f} | {ban} | {d['step']} | mean {1 / 0.02:.0f}, "
                f"{sessions_to_catch(0.02)} for 1-1e-6 |",
                flush=True,
            )
    finally:
        stop_nodes(nodes)
        seeder.close()
        tracker_server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
