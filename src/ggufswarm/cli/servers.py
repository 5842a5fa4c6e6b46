"""The command line's long-running services: the options of ``ggufswarm node``, ``join``, ``gateway`` and ``demo``
(``tracker`` and ``cache``: services.py)."""

from __future__ import annotations

import argparse

from .args import backend_args, speculative_args, token_arg


def add_node_parser(sub, command: str = "node") -> argparse.ArgumentParser:
    """Add ``ggufswarm node`` (or ``ggufswarm join LINK``, the same node joining by a link) to the subparsers
    ``sub``; its parser."""
    if command == "join":
        n = sub.add_parser(
            "join",
            help="run a node that joins a swarm by its join link (from 'demo --serve' or a swarm's operator)",
            formatter_class=argparse.RawDescriptionHelpFormatter,
            description="Join the swarm a link names: find its nodes (its trackers, else the BitTorrent DHT from "
            "the link's contacts), take the least-covered layer range that fits --memory-budget (or --layers "
            "START:END, with the embedding / head stage when it starts at 0 / ends at the last layer), "
            "fetch only those layers from peers, find out how it can be dialled (--reach auto: a dial-back, "
            "a UPnP/NAT-PMP port mapping on the home router, else a relay) and serve. Same options as "
            "'ggufswarm node'. The link carries the swarm's secret: share it like a password.",
            epilog="example:\n  ggufswarm join 'ggufswarm://join?v=1&model=...&id=...&dht=203.0.113.5:6881&secret=...'",
        )
        n.add_argument("link", help="the join link (ggufswarm://join?...)")
    else:
        n = sub.add_parser(
            "node",
            help="serve one shard (a layer range) over HTTP",
            formatter_class=argparse.RawDescriptionHelpFormatter,
            description="Serve layers START:END (half-open, as Python slices) of a GGUF model. The first "
            "shard of a route needs --embed, the last --head (norm + LM head + sampler). "
            "Each session keeps its KV cache here; frames go straight to the next hop. "
            "Prints 'ggufswarm node ready: URL ...' once listening. Protocol: docs/protocol.md.",
            epilog="example, a 2-node route of an 18-layer model:\n"
            "  ggufswarm node --layers 0:9 --embed --port 8471\n"
            "  ggufswarm node --layers 9:18 --head --port 8472",
        )
    n.add_argument(
        "--layers",
        required=command != "join",
        default="auto" if command == "join" else None,
        metavar="START:END",
        help="layer range to serve, e.g. 0:6; with --tracker or a join link also 'auto' (join's default): "
        "a range that fits in --memory-budget, on the cuts the swarm's nodes already use (so it can replace or "
        "chain with them) where the swarm has the fewest nodes (embed/head follow the range)",
    )
    n.add_argument("--embed", action="store_true", help="also run the embedding stage (first shard of a route)")
    n.add_argument("--head", action="store_true", help="also run output norm, LM head and sampler (last shard)")
    n.add_argument(
        "--model",
        metavar="PATH|NAME",
        help="GGUF file; with --tracker the published model name (join: the link names it). "
        "Default: embedded Gemma 3 270M",
    )
    n.add_argument(
        "--tracker",
        metavar="URL",
        help="fetch the shard from the swarm this tracker knows, "
        "seed it, and advertise this node there (heartbeats; deregisters on shutdown)",
    )
    n.add_argument(
        "--data-dir",
        default="ggufswarm-data",
        metavar="DIR",
        help="where swarm-fetched shards (sparse files), the llama.cpp backend's derived shard GGUFs "
        "(DIR/shards, one per layer range, reused across restarts) and the node's identity key (DIR/identity.key: "
        "its id in the swarm, kept across restarts; nodes sharing a DIR take identity-1.key, identity-2.key, ... "
        "in start order) are kept; default ./ggufswarm-data. Give each node its own DIR to keep its own key",
    )
    n.add_argument(
        "--memory-budget",
        type=float,
        default=None,
        metavar="MB",
        help="with --layers auto: the most MiB of weights to take, embedding and LM head included (default: "
        "with a GPU (--gpu), 3/4 of its free memory less 512 MiB, the rest for their KV cache; else 8192)",
    )
    n.add_argument(
        "--fetch-timeout",
        type=float,
        default=1800.0,
        metavar="S",
        help="with --tracker: give up fetching the shard after S seconds in all (default 1800)",
    )
    n.add_argument(
        "--fetch-stall",
        type=float,
        default=60.0,
        metavar="S",
        help="with --tracker: when no new piece arrives for S seconds (its only seeder died, none is "
        "up yet), say so and ask the tracker for peers again; repeats while stalled (default 60)",
    )
    if command == "join":  # a joining node is dialled from other machines (--reach auto finds the address)
        n.add_argument("--host", default="0.0.0.0", help="address to listen on (default 0.0.0.0)")
    else:
        n.add_argument(
            "--host",
            default=None,
            help="address to listen on (default: the address this machine reaches its --tracker, join link or "
            "--cache from, so other machines can dial it; 127.0.0.1 when they are all on this machine or none is "
            "given); 0.0.0.0 listens everywhere (then give --public-host)",
        )
    n.add_argument("--port", type=int, default=0, help="TCP port (default 0: any free port, printed in the ready line)")
    backend_args(n)
    n.add_argument(
        "--gpu",
        default="auto",
        metavar="auto|none|DEVICE",
        help="llama.cpp backend: where this node's blocks, their KV cache and (on the head) the LM head run. "
        "auto (default): the first GPU llama.cpp sees, as many blocks as fit in its free memory, the rest on "
        "the CPU (said in one line at start; a machine with no GPU device file loads no GPU driver); none: the CPU, "
        "no GPU driver loaded (Mesa's take ~55 MiB); DEVICE: that GPU, by llama.cpp's name (CUDA0, "
        "Vulkan0, ROCm0, Metal). make setup builds the GPU backend the machine has (GGUFSWARM_GPU chooses)",
    )
    n.add_argument(
        "--gpu-blocks",
        type=int,
        default=None,
        metavar="N",
        help="with a GPU: put only the range's last N blocks on it (default: as many as fit)",
    )
    n.add_argument(
        "--ctx-size",
        type=int,
        default=None,
        metavar="TOKENS",
        help="the longest session this node takes (capped by the model's context and the KV budget). "
        "Default: the model's context on a llama.cpp node, whose KV cache holds what its sessions use (in "
        "host memory its pages are resident only as sessions write them: ggufswarm's llama.cpp patch 0007; "
        "on a GPU it is sized to the open sessions, copied into a larger or smaller one as they come and "
        "go), else 8192 (llama.cpp without the patch, or --batching throughput on a GPU, allocates the KV "
        "cache up front for --max-sessions)",
    )
    n.add_argument(
        "--max-sessions",
        type=int,
        default=4,
        metavar="N",
        help="llama.cpp backend: sessions held at once (default 4). KV memory: what the sessions hold, "
        "up to the KV budget (KV in host memory with patch 0007, or on a GPU); else N x --ctx-size x this "
        "shard's KV bytes per token allocated up front, and one session reserves at most 1/N of the budget",
    )
    n.add_argument(
        "--batching",
        choices=("exact", "throughput"),  # node.state.BATCHING_MODES (not imported: --help stays light)
        default="exact",
        help="llama.cpp backend: decode steps of different sessions that arrive while the shard is busy "
        "run together. exact (default): each session's result stays bitwise equal to running it alone "
        "(one KV stream per session; with ggufswarm's llama.cpp patch 0005 any number of sessions per "
        "graph evaluation, without it at most 3: llama.cpp's CPU matmul rounds differently from 4 rows "
        "on). throughput: all sessions' KV cells in one llama.cpp stream, so that any of them batch "
        "together (with one stream per session only consecutive sequence ids can); faster with many "
        "sessions, not bitwise",
    )
    n.add_argument(
        "--batch-group",
        type=int,
        default=None,
        metavar="N",
        help="llama.cpp backend: at most N sessions share one graph evaluation (default: exact mode 64 "
        "with patch 0005, else 3; throughput mode 32)",
    )
    n.add_argument(
        "--kv-budget",
        type=int,
        default=262144,
        metavar="TOKENS",
        help="KV budget: tokens all sessions may reserve together (each reserves its max_length); "
        "an open that does not fit gets 429 (full, retry later) or 503 (never fits). Default 262144; on "
        "the llama.cpp backend also at most --max-sessions x --ctx-size, the KV it allocates",
    )
    n.add_argument(
        "--kv-budget-mb",
        type=float,
        default=None,
        metavar="MB",
        help="cap the KV budget in MiB too (converted with this shard's bytes per token). Default on a "
        "llama.cpp node with its KV cache in host memory: half the memory available when it starts",
    )
    n.add_argument(
        "--session-ttl",
        type=float,
        default=300.0,
        metavar="S",
        help="drop sessions idle this many seconds (default 300)",
    )
    n.add_argument(
        "--hop-timeout",
        type=float,
        default=30.0,
        metavar="S",
        help="seconds to wait for the next hop before failing the step with 504, for sessions that "
        "do not set hop_timeout_s at open (default 30)",
    )
    n.add_argument(
        "--max-step-tokens",
        type=int,
        default=4096,
        metavar="N",
        help="most tokens one frame may carry; larger gets 413, and clients send longer prompts in chunks of "
        "it. Default 4096, capped by the backend's batch: 2048 on llama.cpp (its /health says which)",
    )
    n.add_argument("--workers", type=int, default=4, help="threads running steps of different sessions (default 4)")
    n.add_argument("--exit-with-parent", action="store_true", help="exit when the parent process dies")
    n.add_argument(
        "--cache",
        metavar="URL",
        help="snapshot cache server (ggufswarm cache): snapshot sessions' KV "
        "there after prefill and every --snapshot-every tokens (in the background), and restore from it "
        "when a route is repaired or a prompt starts with a cached prefix",
    )
    n.add_argument(
        "--snapshot-every",
        type=int,
        default=32,
        metavar="N",
        help="with --cache: snapshot a session after its prefill and whenever it reaches a multiple "
        "of N tokens (default 32; a multiple of 16 wastes nothing; 0 = after prefill only)",
    )
    n.add_argument(
        "--state-checkpoints",
        type=int,
        default=4,
        metavar="N",
        help="llama.cpp shards of hybrid recurrent models and deepseek4 (which cannot roll a session back "
        "partway): exact session states kept per session, at the snapshot positions, for route "
        "repair and prefix reuse to return to (default 4; each costs the shard's recurrent state "
        "plus its KV of the tokens held; 0 = none: a repair then recomputes from the start)",
    )
    n.add_argument(
        "--test-lie",
        metavar="KIND",
        default=None,
        help="testing only: make this node lie, to test that clients catch it. 'noise': Gaussian noise (0.05 x "
        "each row's RMS, seeded) on the hidden states it sends on, every step; 'noise-every:N': only on steps "
        "numbered a multiple of N; 'weights:PATH': compute the shard from the GGUF at PATH (another quantization) "
        "while claiming the published model; 'slow:MS': MS ms slower per step while advertising a decode time of "
        "0.01 ms (a false claim of speed). Noise needs a node that is not --head. Never on a real swarm",
    )
    token_arg(n)
    reach_args(n, command)
    return n


def reach_args(n: argparse.ArgumentParser, command: str) -> None:
    """A node's options for joining across NATs and without a tracker (node/reach.py, net/)."""
    g = n.add_argument_group("reaching this node, finding the swarm (home NATs, no tracker)")
    if command == "node":
        g.add_argument(
            "--join",
            metavar="LINK",
            help="join the swarm this link names (as 'ggufswarm join LINK'): model, trackers, DHT contacts, secret",
        )
    g.add_argument(
        "--reach",
        choices=["direct", "auto"],
        default="auto" if command == "join" else "direct",
        help="direct: others dial --public-host (or --host) as given; auto: ask a tracker, relay or peer to dial "
        "this node back, else map the port on the home router (UPnP IGD / NAT-PMP), else attach to a relay "
        f"(default {'auto' if command == 'join' else 'direct'})",
    )
    g.add_argument(
        "--public-host", metavar="HOST", help="the address others dial (default: --host, or what a dial-back saw)"
    )
    g.add_argument(
        "--relay",
        action="store_true",
        help="also relay for nodes that cannot be dialled (they keep one websocket here; this node listens on a "
        "port for each and carries its connections) — give it to reachable nodes",
    )
    g.add_argument(
        "--relay-via",
        action="append",
        default=[],
        metavar="URL",
        help="a relay (a node or tracker started with --relay) to attach to when this node cannot be dialled "
        "(repeatable; a join link's relays are added)",
    )
    g.add_argument(
        "--dht",
        metavar="HOST:PORT,...",
        help="use the BitTorrent DHT, bootstrapped from these contacts only (never a public router): torrent peers "
        "are found without a tracker, and with a join link (which names the model's identity, the DHT key) nodes "
        "too; '-' turns it on with no contact (the swarm's first node). Default with a join link: its contacts",
    )
    g.add_argument(
        "--torrent-port",
        type=int,
        default=0,
        metavar="PORT",
        help="the BitTorrent and DHT port (TCP and UDP; default any): the DHT contact other nodes bootstrap from",
    )


def add_gateway_parser(sub) -> argparse.ArgumentParser:
    """Add ``ggufswarm gateway`` to the subparsers ``sub``; its parser."""
    w = sub.add_parser(
        "gateway",
        help="OpenAI- and Anthropic-compatible API over a route of nodes",
        description="Serve OpenAI's /v1/chat/completions, /v1/completions, /v1/responses and /v1/models, and "
        "Anthropic's /v1/messages and /v1/messages/count_tokens (an Anthropic SDK's base_url is the gateway's "
        "URL without /v1), with their request schemas at /openapi.json, over a route of nodes: given by hand "
        "(--route; first node has --embed, last --head), or planned "
        "per session by a tracker (--tracker), which also repairs routes whose nodes "
        "fail. Streaming (SSE) and non-streamed; the body (the stream's last chunk) carries "
        "a telemetry object, and usage (a stream: with stream_options.include_usage). "
        "Every request parameter is implemented or refused with a 400: docs/protocol.md, "
        '"Gateway".',
    )
    w.add_argument("--route", metavar="URL1,URL2,...", help="node URLs in layer order (or use --tracker)")
    w.add_argument(
        "--tracker",
        metavar="URL",
        help="plan a route per session from this tracker instead of --route, and repair it when a node "
        "fails (a replacement restores the failed layers' KV snapshot from the nodes' --cache)",
    )
    w.add_argument(
        "--model",
        metavar="PATH|NAME",
        help="GGUF file for the tokenizer; every node must serve the "
        "same model (checked by GGUF header fingerprint). With --tracker: the published model name to serve (its "
        "header is fetched from the swarm); without it, every model the swarm can serve end to end, "
        "each request's model picking one. With --route and no "
        "--model: the model the route's nodes serve (its headers are fetched from the first node)",
    )
    w.add_argument("--data-dir", default="ggufswarm-data", metavar="DIR", help="where the fetched header goes")
    w.add_argument(
        "--api-key",
        action="append",
        default=[],
        metavar="KEY",
        help="require 'Authorization: Bearer KEY' or 'x-api-key: KEY' on /v1/* (repeatable; default: open API: "
        "anyone who reaches the port can generate; the gateway warns when it listens beyond loopback without one)",
    )
    w.add_argument(
        "--literal-prompts",
        action="store_true",
        help="/v1/completions: tokenize control-token text in a prompt (e.g. <start_of_turn>) as plain "
        "text; by default it is read as the control token, as llama-server does (chat messages are "
        "always plain text)",
    )
    w.add_argument(
        "--chat-template-file",
        metavar="FILE",
        help="a jinja2 chat template (Hugging Face style) used instead of the GGUF's "
        "tokenizer.chat_template, as llama-server's flag of that name: for a GGUF without one, or "
        "to render tools (function calling) with a template that teaches the <tool_call> format",
    )
    w.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    w.add_argument("--port", type=int, default=8000, help="TCP port (default 8000; 0 = any free port)")
    w.add_argument(
        "--hop-timeout",
        type=float,
        default=30.0,
        metavar="S",
        help="seconds one hop may take to answer a step; a dead or hung node fails the request "
        "within this, naming the node (default 30)",
    )
    w.add_argument(
        "--wire-dtype",
        choices=["f16", "bf16", "f32"],
        default="f32",
        help="hidden-state frame dtype between nodes (default f32: the route computes exactly what "
        "llama.cpp computes; f16 (range-extended) or bf16 halve the bytes; see docs/protocol.md)",
    )
    w.add_argument("--max-tokens", type=int, default=512, help="max_tokens when a request gives none (default 512)")
    w.add_argument(
        "--session-lease",
        type=float,
        default=30.0,
        metavar="S",
        help="nodes drop a request's session once idle this long: a gateway that dies frees its KV that "
        "soon (default 30; the gateway renews it while a step takes long)",
    )
    w.add_argument(
        "--no-ring",
        dest="ring",
        action="store_false",
        help="send every decode step from the gateway (by default the route's head sends the next step to the "
        "first node itself as soon as it sampled, the gateway granting it 16 steps ahead: ring decode, one "
        "network leg less per token; the tokens are the same either way; speculative requests always send their "
        'own). docs/protocol.md, "Ring decode"',
    )
    speculative_args(w)
    token_arg(w)
    w.add_argument(
        "--join",
        metavar="LINK",
        help="serve the swarm a join link names: its model, trackers and secret; routes are planned from the "
        "BitTorrent DHT (the link's contacts) whenever no tracker answers",
    )
    w.add_argument("--dht-port", type=int, default=0, metavar="PORT", help="with --join: the gateway's DHT port")
    w.add_argument(
        "--verify-rate",
        type=float,
        default=0.02,  # gateway.config.DEFAULT_VERIFY_RATE
        metavar="R",
        help="fraction 0..1 of (session, hop) pairs audited by shadow replay on another node of the same numerics; "
        "a node caught lying and confirmed by a third is banned (default 0.02; 0 = off, no cost). A node that "
        "corrupts every step is caught with probability 1-1e-6 within ceil(ln(1e-6)/ln(1-R)) sessions through it "
        "(684 at 0.02, 132 at 0.1); one lying every K-th step only by sessions of K steps or more. Each audit costs "
        "one more session on the route's other nodes (~R x hops sessions per session). docs/protocol.md, "
        '"Verification by shadow replay"',
    )
    return w


def add_demo_parser(sub) -> argparse.ArgumentParser:
    """Add ``ggufswarm demo`` to the subparsers ``sub``; its parser."""
    d = sub.add_parser(
        "demo",
        help="start N nodes + a gateway on loopback and stream one answer (the main job); --serve keeps the "
        "swarm up behind an OpenAI-compatible API",
        description="The whole story on loopback: a tracker, a publisher seeding the model, --nodes "
        "node processes each fetching only its layers (even split) through the swarm, "
        "a gateway routing through the tracker; sends PROMPT through the OpenAI API and "
        "streams the answer to stdout; telemetry goes to stderr. Everything stops at the end (or on "
        "Ctrl-C). --serve keeps the cluster up and prints the gateway URL.",
    )
    d.add_argument(
        "prompt",
        nargs="?",
        default=None,
        help="prompt (default: a question for chat models, 'Photosynthesis is the process by which' for base models)",
    )
    d.add_argument("--nodes", type=int, default=3, help="node processes (default 3)")
    d.add_argument(
        "--model",
        metavar="PATH",
        help="GGUF file, or smollm2 (SmolLM2-135M-Instruct, a chat model "
        "installed by the set-up); default: embedded Gemma 3 270M",
    )
    d.add_argument("--max-tokens", type=int, default=128, help="most tokens to generate (default 128)")
    d.add_argument("--temperature", type=float, default=0.7, help="0 = greedy (default 0.7)")
    d.add_argument(
        "--repeat-penalty",
        type=float,
        default=None,
        metavar="P",
        help="repetition guard, llama.cpp's repeat penalty (default 1.15 for a base model, which loops "
        "without one; 1.0, off, for a chat model). A base model's media markers (Gemma's "
        "<start_of_image>, which a text-only route cannot follow) are also never drawn",
    )
    d.add_argument("--seed", type=int, default=None, help="sampling seed")
    d.add_argument(
        "--raw",
        action="store_true",
        help="send the prompt as a plain completion (no chat template; "
        "automatic for base models, whose GGUF has no chat template)",
    )
    d.add_argument(
        "--serve",
        action="store_true",
        help="keep the cluster up (after PROMPT, when one is given; none is "
        "sent by default) and print the gateway URL, the swarm token and how to add a node; a node that "
        "dies is reported and the gateway keeps serving",
    )
    d.add_argument("--port", type=int, default=0, help="gateway port (default: any free port)")
    d.add_argument("--threads", type=int, default=None, help="threads per node (default: cores / nodes)")
    d.add_argument(
        "--backend",
        choices=["llama.cpp", "torch"],
        default="llama.cpp",
        help="the nodes' shard backend (default llama.cpp)",
    )
    d.add_argument("--timeout", type=float, default=30.0, metavar="S", help="per-hop timeout (default 30)")
    d.add_argument(
        "--wire-dtype",
        choices=["f16", "bf16", "f32"],
        default="f32",
        help="frame dtype (default f32: the route computes exactly what llama.cpp does; f16 halves the bytes)",
    )
    d.add_argument(
        "--no-swarm",
        action="store_true",
        help="skip the tracker and swarm: nodes load the local file, the gateway gets the route by hand",
    )
    speculative_args(d)
    token_arg(d, "else a fresh token the demo makes (a private swarm)")
    return d
