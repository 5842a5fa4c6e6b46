"""The command line's parser: ``build_parser`` (every subcommand, its options and help; the services' options are
in ``servers.py``) and the one-shot commands' options (generate, perplexity, publish, status, plan)."""

from __future__ import annotations

import argparse

from ..artifact.planning import FIT_MARGIN_BYTES, GPU_SESSION_CELLS
from .args import model_args, node_memory, speculative_args, token_arg
from .servers import add_demo_parser, add_gateway_parser, add_node_parser
from .services import add_cache_parser, add_tracker_parser

EXAMPLES = """examples:
  ggufswarm generate "The capital of France is" --max-tokens 16
  ggufswarm generate "Write a haiku about rain" --model smollm2 --chat --temperature 0.7 --seed 1
  ggufswarm generate "Hello" --split 6,12          # run as chained shards [0,6)+[6,12)+[12,n)
  ggufswarm perplexity wiki.txt --ctx-size 512
  ggufswarm demo "Why is the sky blue?" --nodes 3   # 3 node processes + gateway on loopback
  ggufswarm node --layers 0:9 --embed --port 8471   # serve one shard (the first of a 2-node route)
  ggufswarm node --layers 9:18 --head --port 8472
  ggufswarm gateway --route http://127.0.0.1:8471,http://127.0.0.1:8472 --port 8000
  ggufswarm plan --model big.gguf --node-memory 24GiB   # nodes and layer ranges, from the header alone
With no --model, the embedded Gemma 3 270M Q4_K_M is used (assembled once into ~/.cache/ggufswarm).
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ggufswarm",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=EXAMPLES,
        description="Distributed runtime for GGUF language models: shards over a swarm, sticky routes, local KV cache.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    g = sub.add_parser(
        "generate",
        help="generate text in this process (streams the completion to stdout)",
        description="Generate a completion. Only the completion goes to stdout; telemetry "
        "(prompt tokens, TTFT, decode tok/s) goes to stderr.",
    )
    g.add_argument("prompt", help="prompt text ('-' reads standard input)")
    model_args(g)
    g.add_argument("--max-tokens", type=int, default=128, help="most tokens to generate (default 128)")
    g.add_argument("--temperature", type=float, default=0.8, help="0 = greedy (default 0.8)")
    g.add_argument("--top-k", type=int, default=40, help="keep the k most likely tokens; 0 = off (default 40)")
    g.add_argument("--top-p", type=float, default=0.95, help="nucleus sampling threshold (default 0.95)")
    g.add_argument(
        "--min-p", type=float, default=0.05, help="drop tokens below min-p x the top probability (default 0.05)"
    )
    g.add_argument("--repeat-penalty", type=float, default=1.0, help="penalty on recent tokens; 1 = off (default 1.0)")
    g.add_argument("--seed", type=int, default=None, help="sampling seed (same seed, same output)")
    g.add_argument("--stop", action="append", default=[], metavar="TEXT", help="stop string (repeatable)")
    g.add_argument(
        "--special",
        action="store_true",
        help="print control tokens and media markers (e.g. Gemma's "
        "<start_of_image>) as their text; by default they print nothing",
    )
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    speculative_args(g)

    p = sub.add_parser(
        "perplexity",
        help="perplexity of a text file, as llama.cpp's llama-perplexity defines it",
        description="Tokenize FILE once, cut it into chunks of --ctx-size tokens (first token of "
        "each replaced by BOS), score the second half of each chunk. The last line "
        "printed is 'perplexity: X'.",
    )
    p.add_argument("file", help="UTF-8 text file")
    model_args(p)
    p.add_argument("--ctx-size", type=int, default=512, help="tokens per chunk (default 512)")
    p.add_argument("--chunks", type=int, default=None, help="score only the first N chunks (N >= 1)")

    add_node_parser(sub)
    add_node_parser(sub, "join")
    add_gateway_parser(sub)
    add_demo_parser(sub)
    add_tracker_parser(sub)
    u = sub.add_parser(
        "publish",
        help="publish a GGUF to the swarm: manifest + torrent to the tracker, then seed",
        description="Index MODEL.gguf (or a split set), write its manifest (tensor index, layer byte "
        "ranges) and a hybrid v1+v2 torrent (SHA-256 verified pieces), register both with "
        "the tracker under NAME and seed until stopped (Ctrl-C).",
    )
    u.add_argument(
        "model",
        nargs="?",
        default=None,
        help="GGUF file, or smollm2 (SmolLM2-135M-Instruct, installed by the set-up); default: embedded Gemma 3 270M",
    )
    u.add_argument(
        "--name",
        default=None,
        help="published name (default: the file name without .gguf; for the "
        "embedded model gemma-3-270m-q4_k_m; for smollm2, smollm2)",
    )
    u.add_argument("--tracker", required=True, metavar="URL", help="tracker URL, e.g. http://127.0.0.1:8470")
    u.add_argument(
        "--data-dir", default="ggufswarm-data", metavar="DIR", help="where the manifest and torrent are written"
    )
    u.add_argument(
        "--web-seed", action="append", default=[], metavar="URL", help="HTTP URL serving the file (repeatable)"
    )
    u.add_argument(
        "--piece-size", type=int, default=256 * 1024, metavar="BYTES", help="torrent piece size (default 262144)"
    )
    u.add_argument("--no-seed", action="store_true", help="register and exit without seeding")
    u.add_argument(
        "--host",
        default=None,
        help="address the seeding BitTorrent session listens on (default: the address this machine reaches "
        "--tracker from, so that peers the tracker names it to can connect; 127.0.0.1 for a tracker on this machine)",
    )
    u.add_argument(
        "--dht",
        action="append",
        default=[],
        metavar="HOST:PORT",
        help="a DHT contact to put in the join link it prints: a node of the swarm started with --dht and "
        "--torrent-port PORT on HOST (repeatable); joiners then find nodes without the tracker",
    )

    add_cache_parser(sub)
    bn = sub.add_parser(
        "bans",
        help="a tracker's bans, with their evidence; --lift KEY lifts one (the operator only)",
        description="List the node keys a tracker banned: each with its reason, time and the signed evidence it "
        "was banned on (anyone can check it: docs/protocol.md, 'Bans by proof'). --lift KEY lifts a ban, "
        "with the tracker's operator credential (--operator-token or $GGUFSWARM_OPERATOR_TOKEN), not the swarm "
        "token.",
    )
    bn.add_argument("--tracker", required=True, metavar="URL", help="tracker URL")
    bn.add_argument("--lift", metavar="KEY", default=None, help="lift the ban of this node key (64 hex digits)")
    bn.add_argument(
        "--operator-token",
        metavar="SECRET",
        default=None,
        help="the tracker's operator credential (default $GGUFSWARM_OPERATOR_TOKEN)",
    )
    bn.add_argument("--json", action="store_true", help="print the bans as JSON, evidence included")
    st = sub.add_parser(
        "status",
        help="what a tracker sees: nodes, their layer ranges as coverage bars, capacity",
        description="Print, per published model, every node the tracker knows: its layer range as a "
        "coverage bar, state, free KV tokens, decode ms and URL, and whether the model "
        "can be served end to end (else which layers have no ready node).",
    )
    st.add_argument("--tracker", required=True, metavar="URL", help="tracker URL")

    pl = sub.add_parser(
        "plan",
        help="how many nodes of a given memory a model needs, and which layers each serves (header only)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Read a GGUF's header alone (metadata + tensor table; never the weights) and print:\n"
        "  * per block: encoded weight bytes, KV cache bytes per token (f16, as llama.cpp caches it: "
        "MLA blocks\n    the latent, recurrent blocks 0), recurrent state bytes per session (f32);\n"
        "  * the global tensors (embedding, output) and the tensor table's total;\n"
        "  * the boundary: hidden-state bytes one decode token sends between two nodes;\n"
        "  * a placement: the fewest nodes of --node-memory (or exactly --nodes), their layer ranges,\n"
        "    the longest context a session can have on that route, and its wire bytes per token.\n"
        "A node's memory is counted as its weights + KV of --context tokens + state, per session; "
        "compute\nbuffers and the OS are not: leave headroom. Sliding-window blocks count full KV "
        "(nodes keep every\nposition, so route repair can truncate exactly).",
        epilog="examples:\n"
        "  ggufswarm plan --model DeepSeek-V3-Q4_K_M-00001-of-00009.gguf --node-memory 24GiB\n"
        "  ggufswarm plan --model glm.gguf --node-memory 96G --context 32768 --nodes 4\n"
        "  ggufswarm plan --model big-model --tracker http://tracker:8470 --node-memory 48G --json\n"
        "A header-only copy is enough: e.g. the first megabytes of each file of a split set "
        "(curl -r 0-16777215).",
    )
    pl.add_argument(
        "--model",
        default=None,
        metavar="PATH|NAME",
        help="GGUF file or any file of a split set (every file's header is read; the tensor data may be "
        "absent), smollm2, or with --tracker a published model name (default: the embedded model)",
    )
    pl.add_argument(
        "--tracker",
        metavar="URL",
        default=None,
        help="tracker to read a published model's manifest (tensor table) from; the metadata comes from "
        "a node serving it",
    )
    pl.add_argument(
        "--node-memory",
        type=node_memory,
        default=None,
        metavar="SIZE[,gpu=SIZE]",
        help="memory of each node for weights + KV + state, e.g. 24GiB, 48G, 512M (K/M/G/T are "
        "powers of 1024), and its GPU's: 64GiB,gpu=24GiB also prints which of each node's blocks the GPU "
        f"holds (its last ones, as a node with --gpu auto places them, leaving {FIT_MARGIN_BYTES >> 20} MiB of the GPU "
        f"free for compute buffers and the driver and counting each session's KV there at up to {GPU_SESSION_CELLS} "
        "tokens; the cut itself is by the first SIZE, which holds all of a node's weights as its mapped file); "
        "without it only the per-block table is printed",
    )
    pl.add_argument(
        "--context",
        type=int,
        default=None,
        metavar="TOKENS",
        help="tokens of context each session is planned for (default: the model's trained context, at most 131072)",
    )
    pl.add_argument(
        "--nodes",
        type=int,
        default=None,
        metavar="N",
        help="place on at most N nodes, balanced by memory: the fullest node as empty as possible (a "
        "large embedding or output table can leave a node one block; default: the fewest that fit)",
    )
    pl.add_argument(
        "--sessions",
        type=int,
        default=1,
        metavar="N",
        help="concurrent sessions of --context tokens each node holds (default 1)",
    )
    pl.add_argument(
        "--wire-dtype",
        choices=["f32", "f16", "bf16"],
        default="f32",
        help="hidden-state frame dtype for the wire bytes (default f32, the route's default)",
    )
    pl.add_argument("--json", action="store_true", help="print the plan as JSON (bytes as integers)")
    for p in (u, st, pl, bn):
        token_arg(p)
    return parser
