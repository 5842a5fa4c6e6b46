"""NAT benchmark (issue 25): a swarm across home NATs in the namespace test internet (tests/netlab.py), one markdown
table from one run.

Model: the embedded Gemma 3 270M; every node and the llama.cpp anchor run 1 thread; greedy, one prompt, --decode
tokens (``ignore_eos``), each timed configuration run --reps times in interleaved rounds (the median is shown).

The route nodes (rows 1-3) serve the local file and join no swarm: a swarm node sends frames only to next hops its
tracker or the DHT lists (next_hop_unknown otherwise), which a delay proxy is not. On ``pub`` (10.77.0.1): P (0:6 +
embed, ``--relay``), Q (6:12), R (12:18 + head); in home A (behind the UPnP / NAT-PMP router) A (6:12); in home B
(behind the strict NAT) B (12:18 + head). A and B run ``--reach auto --relay-via P``, the code path joined nodes take:
P's dial-back fails, A's router maps its port (``mapped``), B gets none and attaches to P's relay (``relayed``).

The swarm (row 4), as tests/test_nat_swarm.py: on pub a tracker, a publisher, node SP (``node --join LINK``, 0:6,
``--relay``, ``--dht -``: the DHT's first contact) and a planning gateway (``gateway --join LINK``); in home B node SB
(``join LINK``, 12:18 + head, relayed through SP). No node serves 6:12 until the joiner of row 4 does.

Rows:

1. route shapes, each a gateway on pub with a fixed ``--route`` (no planning): ``direct`` P -> Q -> R, ``mapped``
   P -> A -> R, ``relayed`` P -> Q -> B, ``story`` P -> A -> B. Decode tok/s, TTFT and per-hop network / compute ms
   are the gateway's own telemetry (``decode_tok_s``, ``ttft_ms``, ``hops[].network_ms.mean``, ``compute_ms.mean``).
2. the same with --delay-ms one-way latency per hop: this kernel has no sch_netem, so a ``ggufswarm.netdelay``
   proxy (in pub) sits in front of every node and the gateway's ``--route`` names the proxies; nodes push frames to
   the URLs the route gives, so gateway -> node, node -> node and the head's reply link all cross one proxy each.
3. relay bytes per decode token: P's ``/health`` ``relay`` totals (bytes_in + bytes_out) read before and after each
   ``relayed`` (0 ms) generation; per token = (bytes of a --decode run - bytes of a 16-token run) / (--decode - 16),
   next to the hidden-state payload the telemetry reports going into the relayed hop
   (``hops[].payload_bytes_per_decode_token``).
4. join to serving: ``ggufswarm join LINK --layers 6:12`` started on pub (a) with the tracker up, (b) with tracker and
   publisher SIGKILLed (manifest from a peer, layers from the (a) joiner, found on the DHT); seconds from the start
   to its ready line, and to the first request (4 tokens, retried every 0.5 s) that the planning gateway routes
   through it. In (b) the (a) joiner is SIGKILLed at the new node's ready line, so the gateway has to find the new one.
5. the anchor: llama.cpp in-process (``llama_cpp.Llama``, 1 thread, as bench/bench_llamacpp.py), same prompt tokens,
   timed once per round between the route runs; every decode tok/s is also shown as a ratio to it.

Usage: .venv/bin/python bench/bench_nat.py [--reps 3] [--decode 64] [--delay-ms 25] [--quick] [--json [FILE]]
(root, Linux, nft, miniupnpd: what ``make netlab`` needs). Everything is torn down on exit, Ctrl-C included.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from bench_llamacpp import dump_json
from natswarm import CLI, CLIENT, PUB, PY, Proc, node_ready, start_published

TOKEN = "bench-nat-token"
PROMPT = (
    "The old lighthouse keeper climbed the spiral stairs every evening at dusk, carrying a lantern and a "
    "notebook in which he wrote down the ships he saw. One stormy night in October,"
)
SHORT = 16  # tokens of the relay-bytes reference run
PORTS = {"tracker": 8470, "SP": 8471, "P": 8474, "Q": 8472, "R": 8473, "J1": 8481, "J2": 8482, "planner": 8100}
SHAPES = {  # name -> nodes in route order
    "direct": ("P", "Q", "R"),
    "mapped": ("P", "A", "R"),
    "relayed": ("P", "Q", "B"),
    "story": ("P", "A", "B"),
}


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# -- run inside the lab (this file is also the health reader: ``bench_nat.py _health URL``) ---------------------------
def _health(url: str) -> int:
    import urllib.request

    req = urllib.request.Request(url + "/health", headers={"X-Ggufswarm-Token": TOKEN})
    print(json.dumps(json.load(urllib.request.urlopen(req, timeout=20))))
    return 0


def request(lab, base: str, n: int) -> dict:
    """One streamed completion of ``n`` tokens from a client on pub: ``{"text", "telemetry", "seconds"}``."""
    r = lab.run("pub", [PY, CLIENT, base, PROMPT, str(n), "--ignore-eos"], timeout=300, check=False)
    try:
        out = json.loads(r.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        out = {"error": f"client exited {r.returncode}: {r.stdout[-500:]} {r.stderr[-1500:]}"}
    return out


def relay_bytes(lab, url: str) -> int:
    r = lab.run("pub", [PY, __file__, "_health", url], timeout=60)
    relay = json.loads(r.stdout)["relay"]
    return int(relay["bytes_in"]) + int(relay["bytes_out"])


# -- the anchor ------------------------------------------------------------------------------------------------------
class Anchor:
    """llama.cpp in-process through llama-cpp-python (bench_llamacpp.LlamaSession), 1 thread; ``run()`` is one timed
    greedy generation of the prompt: (TTFT ms, decode tok/s)."""

    def __init__(self, path: str, n_decode: int):
        from bench_llamacpp import LlamaSession

        from ggufswarm.artifact.gguf_file import GGUFModelFile
        from ggufswarm.client.tokenizer import Tokenizer

        self.ids = Tokenizer(path, GGUFModelFile(path).metadata).encode(PROMPT)
        self.n_decode = n_decode
        self.session = LlamaSession(path, len(self.ids) + n_decode + 16, 1)
        self.run(4)  # warm-up with the timed shapes

    def run(self, n_decode: int | None = None) -> tuple[float, float]:
        n = self.n_decode if n_decode is None else n_decode
        s = self.session.reset()
        t0 = time.perf_counter()
        token = s.step(self.ids)
        t1 = time.perf_counter()
        for _ in range(n):
            token = s.step([token])
        return (t1 - t0) * 1e3, n / (time.perf_counter() - t1)

    def close(self) -> None:
        self.session.close()


# -- the bench -------------------------------------------------------------------------------------------------------
def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def summarize(runs: list[dict]) -> dict:
    """Median over runs of a configuration's telemetry numbers."""
    tels = [r["telemetry"] for r in runs]
    n_hops = len(tels[0]["hops"])
    return {
        "decode_tok_s": median([t["decode_tok_s"] for t in tels]),
        "ttft_ms": median([t["ttft_ms"] for t in tels]),
        "network_ms": [median([t["hops"][i]["network_ms"]["mean"] for t in tels]) for i in range(n_hops)],
        "compute_ms": [median([t["hops"][i]["compute_ms"]["mean"] for t in tels]) for i in range(n_hops)],
        "paths": [h["path"] for h in tels[0]["hops"]],
        "direct_replies": median([t.get("direct_replies", 0) for t in tels]),
        "payload_bytes_per_decode_token": [h["payload_bytes_per_decode_token"] for h in tels[0]["hops"]],
        "prompt_tokens": tels[0]["prompt_tokens"],
        "completion_tokens": tels[0]["completion_tokens"],
        "runs": [
            {k: t.get(k) for k in ("decode_tok_s", "ttft_ms", "prefill_tok_s", "direct_replies", "hops", "route")}
            for t in tels
        ],
    }


def check(out: dict, what: str) -> dict:
    if "error" in out or not out.get("telemetry"):
        raise RuntimeError(f"{what}: {str(out.get('error', out))[:3000]}")
    return out


def bench(args, lab, tmp: Path, model_path: str, anchor: Anchor) -> dict:
    procs: dict[str, Proc] = {}
    t_start = time.monotonic()

    def start(name: str, role: str, argv: list[str]) -> Proc:
        procs[name] = Proc(lab, role, argv, name, tmp, TOKEN)
        return procs[name]

    common = ["--threads", "1", "--host", "0.0.0.0"]
    # the route nodes (rows 1-3): serve the local file, in no swarm (a swarm node sends frames only to next hops its
    # tracker / the DHT lists, so not to a delay proxy); A and B find their reach as joined nodes do (--reach auto:
    # dial-back by the relay, UPnP / NAT-PMP mapping, else the relay)
    local = ["--model", model_path] + common
    start("P", "pub", CLI + ["node", "--layers", "0:6", "--embed", "--relay", "--port", str(PORTS["P"])]
          + ["--reach", "direct", "--public-host", PUB, "--data-dir", str(tmp / "P")] + local)  # fmt: skip
    for name, layers in (("Q", ["6:12"]), ("R", ["12:18", "--head"])):
        start(name, "pub", CLI + ["node", "--layers", *layers, "--port", str(PORTS[name])]
              + ["--reach", "direct", "--public-host", PUB, "--data-dir", str(tmp / name)] + local)  # fmt: skip
    urls, paths = {"P": node_ready(procs["P"])[0]}, {"P": "direct"}  # A and B need their helper / relay up
    relay_via = ["--reach", "auto", "--relay-via", f"http://{PUB}:{PORTS['P']}"]
    start("A", "hA", CLI + ["node", "--layers", "6:12", "--data-dir", str(tmp / "A")] + relay_via + local)
    start("B", "hB", CLI + ["node", "--layers", "12:18", "--head", "--data-dir", str(tmp / "B")] + relay_via + local)

    # the swarm (row 4): tracker, publisher, its node SP (0:6, relay, DHT contact), SB (home B, 12:18 + head, joined)
    link = start_published(start, tmp, model_path, TOKEN, PORTS["tracker"], PORTS["SP"])
    sp = start(
        "SP",
        "pub",
        CLI + ["node", "--join", link, "--dht", "-", "--torrent-port", "6881", "--port", str(PORTS["SP"]), "--relay"]
        + ["--public-host", PUB, "--layers", "0:6", "--embed", "--data-dir", str(tmp / "SP")] + common,
    )  # fmt: skip
    node_ready(sp)
    start("SB", "hB", CLI + ["join", link, "--layers", "12:18", "--head", "--data-dir", str(tmp / "SB")] + common)

    for name in ("Q", "R", "A", "B", "SB"):
        urls[name], paths[name] = node_ready(procs[name])
    if (paths["A"], paths["B"], paths["SB"]) != ("mapped", "relayed", "relayed"):
        raise RuntimeError(f"reach paths {paths}: want A mapped, B and SB relayed")
    urls["SP"] = f"http://{PUB}:{PORTS['SP']}"
    say(f"nodes up in {time.monotonic() - t_start:.0f} s: {urls}")

    # a delay proxy on pub in front of every node; node i's proxy listens on 10.77.0.1:9000+i
    proxied = {}
    for i, name in enumerate(("P", "Q", "R", "A", "B")):
        target = urls[name].split("//", 1)[1]
        listen = f"{PUB}:{9000 + i}"
        start(f"delay-{name}", "pub", [PY, "-m", "ggufswarm.netdelay", "--listen", listen, "--target", target]
              + ["--delay-ms", str(args.delay_ms)]).wait_for(r"delaying", 30)  # fmt: skip
        proxied[name] = f"http://{listen}"

    configs = {}  # key -> (shape, delay, gateway base URL)
    for j, (shape, nodes) in enumerate(SHAPES.items()):
        for k, delay in enumerate((0.0, args.delay_ms)):
            route = ",".join((proxied if delay else urls)[n] for n in nodes)
            port = 8000 + 2 * j + k
            key = f"{shape}@{delay:g}"
            start(f"gw-{key}", "pub", CLI + ["gateway", "--route", route, "--host", PUB, "--port", str(port)]
                  + ["--data-dir", str(tmp / f"gw{port}"), "--hop-timeout", "60"])  # fmt: skip
            configs[key] = (shape, delay, f"http://{PUB}:{port}")
    start(
        "planner",
        "pub",
        CLI + ["gateway", "--join", link, "--host", PUB, "--port", str(PORTS["planner"])]
        + ["--data-dir", str(tmp / "planner")],
    )  # fmt: skip
    for key in configs:
        procs[f"gw-{key}"].wait_for(r"ggufswarm gateway ready", 120)
    procs["planner"].wait_for(r"ggufswarm gateway ready", 120)
    for key, (_, _, base) in configs.items():  # warm-up: links opened, pages faulted in
        check(request(lab, base, 8), f"warm-up of {key}")
    say(f"gateways up and warm at {time.monotonic() - t_start:.0f} s")

    # rows 1, 2, 3, 5: interleaved rounds
    runs: dict[str, list[dict]] = {k: [] for k in configs}
    anchor_runs: list[tuple[float, float]] = []
    relay_url = urls["P"]
    relay_long: list[int] = []
    relay_short = None
    for rnd in range(args.reps):
        anchor_runs.append(anchor.run())
        for key, (shape, delay, base) in configs.items():
            measure_relay = shape == "relayed" and not delay
            before = relay_bytes(lab, relay_url) if measure_relay else 0
            out = check(request(lab, base, args.decode), key)
            if measure_relay:
                relay_long.append(relay_bytes(lab, relay_url) - before)
                if rnd == 0:
                    before = relay_bytes(lab, relay_url)
                    check(request(lab, base, SHORT), f"{key} ({SHORT} tokens)")
                    relay_short = relay_bytes(lab, relay_url) - before
            runs[key].append(out)
            t = out["telemetry"]
            say(f"  round {rnd + 1}: {key}: {t['decode_tok_s']:.2f} tok/s, TTFT {t['ttft_ms']:.0f} ms")
        say(f"  round {rnd + 1}: llama.cpp: {anchor_runs[-1][1]:.2f} tok/s")
    rows = {key: summarize(r) | {"shape": configs[key][0], "delay_ms": configs[key][1]} for key, r in runs.items()}
    relayed = rows["relayed@0"]
    relay_hop = relayed["paths"].index("relayed")
    relay = {
        "bytes_per_run": relay_long,
        "bytes_short_run": relay_short,
        "decode_tokens": args.decode,
        "short_tokens": SHORT,
        "bytes_per_decode_token": (median(relay_long) - relay_short) / (args.decode - SHORT),
        "bytes_per_token_whole_run": median(relay_long) / args.decode,
        "payload_bytes_per_decode_token_relayed_hop": relayed["payload_bytes_per_decode_token"][relay_hop],
        "payload_bytes_per_decode_token_route": sum(relayed["payload_bytes_per_decode_token"]),
    }
    for key in configs:
        procs[f"gw-{key}"].stop()
    for i in range(5):
        procs[f"delay-{'PQRAB'[i]}"].stop()

    # row 4: join to serving
    planner = f"http://{PUB}:{PORTS['planner']}"
    join = {}
    node_args = ["--threads", "1", "--host", "0.0.0.0", "--public-host", PUB]

    def join_once(name: str, previous: Proc | None) -> dict:
        t0 = time.monotonic()
        j = start(name, "pub", CLI + ["join", link, "--layers", "6:12", "--port", str(PORTS[name])]
                  + ["--data-dir", str(tmp / name)] + node_args)  # fmt: skip
        url, path = node_ready(j, 240)
        ready_s = time.monotonic() - t0
        if previous is not None:
            previous.stop(signal.SIGKILL)
        tries, last = 0, ""
        while True:
            tries += 1
            out = request(lab, planner, 4)
            route = [h["node"].rstrip("/") for h in (out.get("telemetry") or {}).get("route", [])]
            if "error" not in out and url in route:
                break
            last = str(out.get("error") or route)[:300]
            if time.monotonic() - t0 > ready_s + 180:
                raise RuntimeError(f"the planning gateway never routed through {name} ({url}): {last}")
            time.sleep(0.5)
        routed_s = time.monotonic() - t0
        fetched = re.search(r"fetched layers 6:12 of \S+: (\d+) bytes", j.stderr(1 << 20))
        say(f"  {name}: ready {ready_s:.1f} s, routed {routed_s:.1f} s ({tries} requests; last miss: {last})")
        return {
            "ready_s": ready_s,
            "routed_s": routed_s,
            "requests": tries,
            "url": url,
            "path": path,
            "fetched_bytes": int(fetched.group(1)) if fetched else None,
            "route": route,
            "stderr": j.stderr(1 << 16),
        }

    join["tracker_up"] = join_once("J1", None)
    procs["tracker"].stop(signal.SIGKILL)
    procs["publisher"].stop(signal.SIGKILL)
    join["tracker_dead"] = join_once("J2", procs["J1"])

    escaped = lab.escaped_packets()
    return {
        "rows": rows,
        "anchor": {
            "decode_tok_s": median([a[1] for a in anchor_runs]),
            "ttft_ms": median([a[0] for a in anchor_runs]),
            "runs": anchor_runs,
            "prompt_tokens": len(anchor.ids),
        },
        "relay": relay,
        "join": join,
        "urls": urls,
        "escaped_packets": escaped,
        "seconds": time.monotonic() - t_start,
    }


def fmt_ms(xs: list[float]) -> str:
    return " / ".join(f"{x:.1f}" for x in xs)


def table(res: dict, args, model: str) -> str:
    a = res["anchor"]
    out = [
        f"# ggufswarm across home NATs (namespace test internet, tests/netlab.py) — {model}, 1 thread per process, "
        f"{a['prompt_tokens']}-token prompt, {args.decode} greedy decode tokens, median of {args.reps} interleaved "
        f"rounds; delay rows: a ggufswarm.netdelay proxy (no sch_netem here) in front of every node adds "
        f"{args.delay_ms:g} ms one way to every byte, each direction; load {os.getloadavg()[0]:.2f}",
        "",
        "| row | route (hop paths) | added one-way delay per hop | decode tok/s | × llama.cpp | TTFT ms "
        "| network ms per hop (mean) | compute ms per hop (mean) |",
        "|---|---|---|---|---|---|---|---|",
        f"| llama.cpp in-process (llama_cpp.Llama) | one process | - | {a['decode_tok_s']:.2f} | 1.00 "
        f"| {a['ttft_ms']:.0f} | - | - |",
    ]
    names = {"direct": "P→Q→R", "mapped": "P→A→R", "relayed": "P→Q→B", "story": "P→A→B"}
    for r in sorted(res["rows"].values(), key=lambda r: (r["delay_ms"], list(SHAPES).index(r["shape"]))):
        out.append(
            f"| {r['shape']} | {names[r['shape']]} ({', '.join(r['paths'])}) | {r['delay_ms']:g} ms "
            f"| {r['decode_tok_s']:.2f} | {r['decode_tok_s'] / a['decode_tok_s']:.2f} | {r['ttft_ms']:.0f} "
            f"| {fmt_ms(r['network_ms'])} | {fmt_ms(r['compute_ms'])} |"
        )
    rl = res["relay"]
    out.append(
        f"| relay bytes per decode token (relayed, 0 ms) | P→Q→B (relayed hop B) | 0 ms "
        f"| {rl['bytes_per_decode_token']:.0f} B/token through P's relay (in+out; {rl['bytes_per_token_whole_run']:.0f}"
        f" B/token over the whole {rl['decode_tokens']}-token request) | "
        f"{rl['bytes_per_decode_token'] / rl['payload_bytes_per_decode_token_relayed_hop']:.2f}× the hop's payload "
        f"| hidden-state payload into B: {rl['payload_bytes_per_decode_token_relayed_hop']:.0f} B/token "
        f"(route total {rl['payload_bytes_per_decode_token_route']:.0f}) | - | - |"
    )
    for key, label in (("tracker_up", "tracker up"), ("tracker_dead", "tracker killed: manifest + layers via DHT")):
        j = res["join"][key]
        mib = f", {j['fetched_bytes'] / 2**20:.1f} MiB fetched" if j["fetched_bytes"] else ""
        out.append(
            f"| join --layers 6:12 → serving ({label}) | planned: {' → '.join(u.split('//')[1] for u in j['route'])} "
            f"| 0 ms | ready line {j['ready_s']:.1f} s, first routed through it {j['routed_s']:.1f} s after start "
            f"({j['requests']} requests{mib}) | - | - | - | - |"
        )
    esc = sum(res["escaped_packets"].values())
    d = args.delay_ms
    direct = [r for r in res["rows"].values() if r["delay_ms"] == 0 and r["shape"] == "direct"][0]
    step0 = 1000 / direct["decode_tok_s"]
    out += [
        "",
        f"Route nodes (no swarm; rows 1-3): P {res['urls']['P']} (pub, 0:6+embed, relay), Q {res['urls']['Q']} / "
        f"R {res['urls']['R']} (pub, 6:12 / 12:18+head), A {res['urls']['A']} (home A, 6:12, mapped), "
        f"B {res['urls']['B']} (home B, 12:18+head, relayed through P). Swarm (join rows): SP {res['urls']['SP']} "
        f"(pub, 0:6, relay, DHT contact), SB {res['urls']['SB']} (home B, 12:18+head, relayed through SP), the joiner "
        f"on pub, a planning gateway (--join). Packets that left the test nets: {esc}. {res['seconds']:.0f} s in "
        "the lab.",
        "Decode tok/s, TTFT and per-hop ms: the gateway's telemetry (TTFT = the prefill step, session open "
        "included). A hop's network ms is what its caller waited beyond the hop's own handling: a round trip "
        f"(about 2 × {d:g} ms with the delay). With the head's reply link a decode step crosses 4 one-way delays "
        f"(gateway → P → 2nd → head, head → gateway): {d:g} ms adds ≥ {4 * d:g} ms to the {step0:.0f} ms step of the "
        f"0 ms direct route, a bound of {1000 / (step0 + 4 * d):.1f} tok/s.",
    ]
    return "\n".join(out)


def main() -> int:
    if len(sys.argv) >= 2 and sys.argv[1] == "_health":
        return _health(sys.argv[2])
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=3, help="interleaved rounds; the median is shown (default 3)")
    ap.add_argument("--decode", type=int, default=64, help="greedy decode tokens per request (default 64)")
    ap.add_argument("--delay-ms", type=float, default=25.0, help="one-way delay per hop of the delay rows (25)")
    ap.add_argument("--quick", action="store_true", help="1 round of 32 tokens: a smoke run")
    ap.add_argument("--json", nargs="?", const="-", metavar="FILE", help="also dump the numbers as JSON (- = stdout)")
    args = ap.parse_args()
    if args.quick:
        args.reps, args.decode = 1, 32
    if args.decode <= SHORT:
        ap.error(f"--decode must exceed {SHORT} (the relay reference run)")

    from netlab import NetLab, netlab_available

    from ggufswarm.artifact.default_model import default_model_path

    reason = netlab_available()
    if reason:
        say(f"bench_nat: the namespace test internet is not available: {reason}")
        return 2
    model_path = str(default_model_path())

    def on_term(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_term)
    anchor = Anchor(model_path, args.decode)
    try:
        with tempfile.TemporaryDirectory(prefix="bench-nat-") as tmp, NetLab() as lab:
            res = bench(args, lab, Path(tmp), model_path, anchor)
    finally:
        anchor.close()
    print(table(res, args, os.path.basename(model_path)))
    if args.json:
        dump_json(res, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
