"""``ggufswarm demo``: N node processes (even layer split) + a gateway on loopback, one prompt streamed through it."""

from __future__ import annotations

import http.client
import json
import os
import secrets
import shutil
import signal
import socket
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import urlsplit

from ..artifact.default_model import model_name, resolve_model
from ..artifact.gguf_file import GGUFModelFile
from ..cache.app import CacheConfig
from ..cache.app import make_app as make_cache_app
from ..client.tokenizer import media_marker_ids
from ..net.auth import TOKEN_ENV
from ..net.http import ServerThread
from ..net.invite import JoinLink, manifest_digest
from ..node.launch import start_nodes, stop_nodes
from ..runtime.backends import model_config
from ..runtime.spec import even_split
from ..swarm.publish import publish
from ..swarm.torrent import Swarm, save_path_for
from ..tracker.app import TrackerConfig
from ..tracker.app import make_app as make_tracker_app
from .app import GatewayConfig, make_app
from .config import DEFAULT_VERIFY_RATE

DEFAULT_PROMPT = "Explain in two sentences why the sky is blue."  # for chat (instruction-tuned) models
DEFAULT_COMPLETION = "Photosynthesis is the process by which"  # for base models (no chat template)
BASE_REPEAT_PENALTY = 1.15  # a base model's default repetition guard (Gemma 3 270M loops without one)


def _free_udp_tcp_port() -> int:
    """A port free for both TCP and UDP on 127.0.0.1 now (a node's BitTorrent + DHT port)."""
    for _ in range(50):
        with socket.socket() as t, socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as u:
            t.bind(("127.0.0.1", 0))
            port = t.getsockname()[1]
            try:
                u.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise OSError("no port free for both TCP and UDP on 127.0.0.1")


def stream_completion(base_url: str, body: dict, chat: bool = True, out=sys.stdout, timeout: float = 600.0) -> dict:
    """POST a streamed OpenAI request to ``base_url`` (…/v1), write text deltas to ``out``; the final chunk.

    Raises RuntimeError with the gateway's message on an HTTP error or an error event in the stream.
    """
    parts = urlsplit(base_url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout)
    path = parts.path.rstrip("/") + ("/chat/completions" if chat else "/completions")
    conn.request("POST", path, json.dumps({**body, "stream": True}), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"gateway answered {resp.status}: {resp.read().decode(errors='replace')}")
    final = {}
    try:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            choice = chunk["choices"][0]
            text = choice["delta"].get("content") if chat else choice.get("text")
            if text:
                out.write(text)
                out.flush()
            if choice.get("finish_reason"):
                final = chunk
    finally:
        conn.close()
    return final


def telemetry_summary(t: dict) -> str:
    """A few lines for stderr from a ``telemetry`` object."""
    lines = [
        "route: " + " → ".join(f"{h['node']} [{h['layers'][0]}:{h['layers'][1]}]" for h in t["route"]),
        f"prompt {t['prompt_tokens']} tokens, completion {t['completion_tokens']} tokens, "
        f"TTFT {t['ttft_ms']:.0f} ms, prefill {t['prefill_tok_s']:.1f} tok/s, decode {t['decode_tok_s']:.1f} tok/s, "
        f"{t['payload_bytes_per_decode_token']:.0f} payload B per decode token ({t['wire_dtype']} frames)"
        + (
            f", {t['prefix_tokens_restored']} prompt tokens restored from the snapshot cache"
            if t.get("prefix_tokens_restored")
            else ""
        ),
    ]
    if t.get("ring_steps"):
        decode = max(t["completion_tokens"] - 1, 1)
        lines.append(
            f"ring decode: the head sent {t['ring_steps']} of {decode} decode steps to the first node itself"
            + (f" ({t['ring_discarded']} rolled back)" if t.get("ring_discarded") else "")
            + (
                "; the client sent the others (the first while its reply link to the head opened, and any whose "
                "grant had not reached the head when it sampled)"
                if t["ring_steps"] < decode
                else ""
            )
        )
    spec = t.get("speculative") or {}
    if spec.get("method") not in (None, "none"):
        rate = f" ({100 * spec['acceptance']:.0f}%)" if spec.get("acceptance") is not None else ""
        lines.append(f"speculative {spec['method']}: drafted {spec['drafted']}, accepted {spec['accepted']}{rate}")
    for i, h in enumerate(t["hops"], 1):
        lines.append(
            f"  hop {i} {h['node']}: compute {h['compute_ms']['mean']:.1f} ms "
            f"(p95 {h['compute_ms']['p95']:.1f}), network {h['network_ms']['mean']:.1f} ms "
            f"(p95 {h['network_ms']['p95']:.1f}), {h['payload_bytes_per_decode_token']:.0f} B/token, "
            f"KV {h['kv_tokens']} tokens"
        )
    for r in t.get("repairs", []):
        lines.append(
            f"  repair: {r['hop']} [{r['layers'][0]}:{r['layers'][1]}] failed ({r['cause']}) → "
            f"{', '.join(r['replacement'])}: {r['restored_tokens']} tokens restored, "
            f"{r['tokens_replayed']} replayed, {r['ms']:.0f} ms"
        )
    return "\n".join(lines)


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def wait_servable(tracker_url: str, name: str, timeout: float, token: str | None = None) -> None:
    """Wait until the tracker can route ``name`` end to end (nodes advertise right after they listen)."""
    from ..directory.trackers import TrackerClient

    deadline = time.monotonic() + timeout
    while name not in TrackerClient(tracker_url, token).models():
        if time.monotonic() > deadline:
            raise RuntimeError(f"the tracker cannot route {name} after {timeout:g} s")
        time.sleep(0.1)


def _speculative(args) -> dict:
    """The gateway's speculative decoding settings from the demo's ``--speculative``, ``--draft-max``,
    ``--draft-model`` and ``--draft-threads`` (checked by the CLI: ``cli._check_speculative``)."""
    method = getattr(args, "speculative", "none")
    if method == "none":
        return {}
    return {
        "speculative": method,
        "draft_max": args.draft_max,
        "draft_model": args.draft_model,
        "draft_threads": args.draft_threads,
    }


def run_demo(args) -> int:
    """Start the cluster, stream ``args.prompt``, print telemetry, stop everything (also on Ctrl-C/SIGTERM).
    ``args.token``: the swarm token (None: the demo makes one)."""
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # even when started with SIGINT ignored
    path = resolve_model(args.model)
    file = GGUFModelFile(path)
    cfg = model_config(file, args.backend)
    chat = not args.raw and bool(file.metadata.get("tokenizer.chat_template"))
    if not args.raw and not chat:
        print(
            "ggufswarm demo: the model has no chat template (a base model): sending the prompt as a plain completion",
            file=sys.stderr,
            flush=True,
        )
    specs = even_split(cfg.n_layers, args.nodes)
    threads = args.threads or max(1, (os.cpu_count() or 1) // args.nodes)
    print(
        f"ggufswarm demo: starting {args.nodes} {args.backend} nodes ({threads} thread(s) each): "
        + ", ".join(f"{s.start}:{s.end}" for s in specs),
        file=sys.stderr,
        flush=True,
    )
    token = getattr(args, "token", None)
    if not token:  # the demo's swarm is private: a fresh token, given to every server and node process
        token = secrets.token_urlsafe(24)
        print(
            "ggufswarm demo: private swarm: made a swarm token (nodes, tracker and cache answer 401 without it)",
            file=sys.stderr,
            flush=True,
        )
    t0 = time.perf_counter()
    nodes, gateway, tracker, seeder, work, cache = [], None, None, None, None, None
    try:
        if args.no_swarm:
            nodes = start_nodes(
                specs,
                str(path),
                threads,
                extra=["--hop-timeout", str(args.timeout), "--backend", args.backend],
                token=token,
            )
            config = GatewayConfig(
                [n.url for n in nodes],
                model=str(path),
                hop_timeout_s=args.timeout,
                wire_dtype=args.wire_dtype,
                token=token,
                **_speculative(args),
            )
        else:
            # the whole story: tracker, a publisher seeding the model, nodes fetching only their layers
            work = Path(tempfile.mkdtemp(prefix="ggufswarm-demo-"))
            # witnesses of any age: a lying node added to try shadow replay is banned here as soon as it is caught
            config = TrackerConfig(db=str(work / "tracker.sqlite"), token=token, witness_age_s=0.0)
            tracker = ServerThread(make_tracker_app(config), port=0)
            tracker_url = tracker.start()
            cache = ServerThread(
                make_cache_app(CacheConfig(dir=str(work / "cache"), max_bytes=2**30, token=token)), port=0
            )
            cache_url = cache.start()
            name = model_name(args.model, path)
            published = publish(path, tracker_url, name, work / "publisher", token=token)
            seeder = Swarm()
            seeder.seed(published.torrent, save_path_for([path]))
            print(
                f"ggufswarm demo: tracker {tracker_url}; snapshot cache {cache_url}; published {name} "
                f"({published.manifest.files[0]['bytes'] / 2**20:.0f} MiB) and seeding it",
                file=sys.stderr,
                flush=True,
            )
            # the nodes also run the BitTorrent DHT (node 0 its first contact): the join link printed with --serve
            # lets more nodes and gateways join, and keeps the swarm routable should the tracker go away
            dht_port = _free_udp_tcp_port()
            link = JoinLink(
                name,
                manifest_digest(json.loads(published.manifest.to_json())),
                dht=(f"127.0.0.1:{dht_port}",),
                trackers=(tracker_url,),
                secret=token,
                caches=(cache_url,),
            ).format()
            nodes = start_nodes(
                specs,
                name,
                threads,
                extra=[
                    "--hop-timeout",
                    str(args.timeout),
                    "--backend",
                    args.backend,
                    "--tracker",
                    tracker_url,
                    "--cache",
                    cache_url,
                    "--join",
                    link,
                ],
                per_node=lambda i: (
                    ["--data-dir", str(work / f"node{i}")]
                    + (["--dht", "-", "--torrent-port", str(dht_port)] if i == 0 else [])
                ),
                timeout=600,
                token=token,
            )
            fetched = [
                sum(f.stat().st_blocks * 512 for f in (work / f"node{i}").rglob("*.gguf") if "shards" not in f.parts)
                for i in range(len(nodes))
            ]
            print(  # (bytes on disk; a node's own line counts what it downloaded, pieces received twice included)
                "ggufswarm demo: from the swarm, the nodes hold on disk "
                + ", ".join(f"{s.start}:{s.end} {b / 2**20:.0f} MiB" for s, b in zip(specs, fetched)),
                file=sys.stderr,
                flush=True,
            )
            wait_servable(tracker_url, name, timeout=30, token=token)
            config = GatewayConfig(
                [],
                model=name,
                tracker=tracker_url,
                data_dir=str(work / "gateway"),
                hop_timeout_s=args.timeout,
                wire_dtype=args.wire_dtype,
                token=token,
                verify_rate=DEFAULT_VERIFY_RATE,  # as `ggufswarm gateway`: audits once a range has a second node
                **_speculative(args),
            )
        gateway = ServerThread(make_app(config), port=args.port)
        base = gateway.start() + "/v1"
        print(
            f"ggufswarm demo: cluster up in {time.perf_counter() - t0:.1f} s; gateway {base}",
            file=sys.stderr,
            flush=True,
        )
        print(  # a node's /health and /metrics take the swarm token (header X-Ggufswarm-Token)
            "ggufswarm demo: nodes "
            + ", ".join(f"{n.spec.start}:{n.spec.end} {n.url} (pid {n.proc.pid})" for n in nodes)
            + "; their /health and /metrics take the swarm token (header X-Ggufswarm-Token)",
            file=sys.stderr,
            flush=True,
        )
        default = DEFAULT_PROMPT if chat else DEFAULT_COMPLETION
        prompt = args.prompt if args.prompt is not None else (None if args.serve else default)
        if prompt is not None:
            print(
                f"ggufswarm demo: {'chat message' if chat else 'prompt'}: {prompt!r}"
                + (" (the default; give your own as the demo's argument)" if args.prompt is None else ""),
                file=sys.stderr,
                flush=True,
            )
            body = {"max_tokens": args.max_tokens, "temperature": args.temperature}
            repeat_penalty = (
                args.repeat_penalty if args.repeat_penalty is not None else (1.0 if chat else BASE_REPEAT_PENALTY)
            )
            if repeat_penalty != 1.0:
                body["repeat_penalty"] = repeat_penalty
            if not chat:  # a base model's media markers start an image the route cannot give: never drawn
                body["logit_bias"] = {str(t): -100 for t in sorted(media_marker_ids(file.metadata))}
            if args.seed is not None:
                body["seed"] = args.seed
            how = (
                ["greedy"]
                if args.temperature == 0
                else [
                    f"sampled at temperature {args.temperature:g}",
                    f"seed {args.seed}" if args.seed is not None else "a random seed (--seed N repeats an answer)",
                ]
            )
            if repeat_penalty != 1.0:
                how.append(f"repeat penalty {repeat_penalty:g}")
            if not chat:
                how.append("media markers never drawn (a base model's defaults)")
            print("ggufswarm demo: " + ", ".join(how), file=sys.stderr, flush=True)
            if chat:
                body["messages"] = [{"role": "user", "content": prompt}]
            else:
                body["prompt"] = prompt
            final = stream_completion(base, body, chat=chat)
            sys.stdout.write("\n")
            sys.stdout.flush()
            if final.get("telemetry"):
                print(telemetry_summary(final["telemetry"]), file=sys.stderr, flush=True)
        if args.serve:
            print(base, flush=True)
            print(
                f"ggufswarm demo: that is the OpenAI API's base URL (chat completions, completions, responses); "
                f"Anthropic's Messages API is at {base.removesuffix('/v1')} (an Anthropic SDK's base_url). The API is "
                "open (any API key works; `ggufswarm gateway --api-key KEY` requires one); the swarm token below is "
                "for nodes, not for API clients. For function calling with a model whose template renders no tools, "
                "run a gateway of your own with --join LINK --chat-template-file FILE (tests/data/qwen2.5-tools.jinja "
                "renders them for SmolLM2)",
                file=sys.stderr,
                flush=True,
            )
            if tracker is not None:  # what a user needs to watch the swarm or add a node to it
                last = specs[-1]  # with 2 nodes or more: a range with --head
                example = (
                    f", e.g. --layers {last.start}:{last.end} --head for the last; a spare of the first range "
                    f"adds --embed"
                    if len(specs) > 1
                    else ""
                )
                same = (
                    f"--threads {threads} --data-dir DIR (the demo's nodes' thread count: nodes of the same numerics "
                    f"audit each other; a --data-dir of its own: its own identity key)"
                )
                print(
                    f"ggufswarm demo: join link (it carries the swarm token: share it like a password):\n"
                    f"  LINK='{link}'\n"
                    f'ggufswarm demo: add a node: ggufswarm join "$LINK" {same} (the least-covered layers that fit '
                    f"--memory-budget; --layers START:END for a spare); another gateway: ggufswarm gateway --join "
                    f'"$LINK" --port 8001. The gateway audits {DEFAULT_VERIFY_RATE:.0%} of (session, hop) pairs by '
                    f"shadow replay once a range has a second node (--verify-rate)",
                    file=sys.stderr,
                    flush=True,
                )
                print(
                    f"ggufswarm demo: to add a node or watch the swarm: export {TOKEN_ENV}={token}; "
                    f"ggufswarm node --tracker {tracker_url} --model {name} --layers auto --cache {cache_url} "
                    f"--port 0 --threads {threads} --data-dir DIR "
                    f"(the least-covered range that fits --memory-budget MiB, the whole model when it "
                    f"fits: for a spare of one node give its range{example}); "
                    f"ggufswarm status --tracker {tracker_url}",
                    file=sys.stderr,
                    flush=True,
                )
            print("ggufswarm demo: serving; Ctrl-C stops the cluster", file=sys.stderr, flush=True)
            gone: set[int] = set()
            while True:  # a node that dies is reported; the gateway keeps serving (and repairs, given a spare)
                for i, n in enumerate(nodes):
                    if i not in gone and n.proc.poll() is not None:
                        gone.add(i)
                        code = n.proc.returncode
                        how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with {code}"
                        print(
                            f"ggufswarm demo: node {n.url} (layers {n.spec.start}:{n.spec.end}) {how}; sessions "
                            f"through it repair with another node serving those layers, or on a re-planned route, "
                            f"if the swarm has one"
                            + ("" if tracker is not None else " (no tracker: restart the demo)"),
                            file=sys.stderr,
                            flush=True,
                        )
                time.sleep(0.5)
        return 0
    finally:
        if gateway is not None:
            gateway.stop()
        stop_nodes(nodes)
        if seeder is not None:
            seeder.close()
        if tracker is not None:
            tracker.stop()
        if cache is not None:
            cache.stop()
        if work is not None:
            shutil.rmtree(work, ignore_errors=True)
