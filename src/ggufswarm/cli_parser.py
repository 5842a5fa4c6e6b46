"""The command line's arguments: ``build_parser`` (every subcommand, its options and help) and the argument
types and checks it shares between subcommands."""

from __future__ import annotations

import argparse
import re

EXAMPLES = """examples:
  ggufswarm generate "The capital of France is" --max-tokens 16
  ggufswarm generate "Write a haiku about rain" --chat --temperature 0.7 --seed 1
  ggufswarm generate "Hello" --split 6,12          # run as chained shards [0,6)+[6,12)+[12,n)
  ggufswarm perplexity wiki.txt --ctx-size 512
  ggufswarm demo "Why is the sky blue?" --nodes 3   # 3 node processes + gateway on loopback
  ggufswarm node --layers 0:9 --embed --port 8471   # serve one shard (the first of a 2-node route)
  ggufswarm node --layers 9:18 --head --port 8472
  ggufswarm gateway --route http://127.0.0.1:8471,http://127.0.0.1:8472 --port 8000
  ggufswarm plan --model big.gguf --node-memory 24GiB   # nodes and layer ranges, from the header alone
With no --model, the embedded Gemma 3 270M Q4_K_M is used (assembled once into ~/.cache/ggufswarm).
"""


def _split(text: str) -> list[int]:
    try:
        return [int(p) for p in text.split(",") if p.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--split takes comma-separated layer indices, got {text!r}") from None


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", metavar="PATH", help="GGUF file (or first file of a split set), or smollm2 (SmolLM2-135M-"
                   "Instruct, installed by the set-up); default: embedded Gemma 3 270M")
    p.add_argument("--split", type=_split, metavar="A,B,...", default=None,
                   help="run the model as in-process chained shards cut at these layers")
    _backend_args(p)


def _backend_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", choices=["llama.cpp", "torch"], default="llama.cpp",
                   help="shard backend: llama.cpp (default: llama.cpp's own graphs and quantized kernels, bitwise "
                        "equal to llama.cpp) or torch (the PyTorch reference: dequantized weights, f32/bf16)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                   help="torch backend's compute dtype (default float32; with --backend torch only)")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads: llama.cpp's decode and batch threads, or PyTorch's (default: all cores)")




def _size(text: str) -> int:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([KMGT]?)(?:I?B)?", text.strip().upper())
    if not m or float(m.group(1)) <= 0:
        raise argparse.ArgumentTypeError(f"size must be a positive number of bytes, optionally with K/M/G/T, "
                                         f"got {text!r}")
    return int(float(m.group(1)) * 1024 ** " KMGT".index(m.group(2) or " "))


def _token_arg(p: argparse.ArgumentParser, unset: str = "none = an open swarm") -> None:
    p.add_argument("--token", default=None, metavar="SECRET",
                   help="swarm token: nodes, tracker and cache answer only requests carrying it (401 otherwise); "
                        f"default $GGUFSWARM_TOKEN, {unset}")


def _draft_max(text: str) -> int:
    from .client.speculative import MAX_DRAFT
    try:
        k = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer in 1..{MAX_DRAFT}, got {text!r}") from None
    if not 1 <= k <= MAX_DRAFT:
        raise argparse.ArgumentTypeError(f"must be in 1..{MAX_DRAFT} (tokens drafted per verify step; the head "
                                         f"verifies at most {MAX_DRAFT + 1} tokens in one step), got {k}")
    return k


def _speculative_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--speculative", choices=["none", "ngram", "draft"], default="none",
                   help="speculative decoding (default none). ngram: draft up to --draft-max tokens by prompt lookup "
                        "(the tokens that followed the latest earlier occurrence of the last 1-3 tokens); draft: the "
                        "greedy continuation of --draft-model, a small GGUF of the same vocabulary run in this "
                        "process. The drafts go with the last sampled token as one step in which the head samples "
                        "every position; the client keeps the drafts it confirms plus the head's next token: the "
                        "same tokens as without it (greedy or seeded sampling), in fewer trips through the route. "
                        "Pays off on code and repetitive text, most "
                        "over slow links; requests with logprobs decode plainly")
    p.add_argument("--draft-max", type=_draft_max, default=None, metavar="K",
                   help="most tokens drafted per step, 1..15 (default 2). Up to 2 the llama.cpp backend computes a "
                        "verify step bitwise as one-token steps (output identical to plain decoding); from 3 on "
                        "ggml's batched kernels round differently on some weight types (Gemma's Q4_K/Q8_0) and a "
                        "token can differ now and then (docs/protocol.md, \"Speculative decoding\")")
    p.add_argument("--draft-model", metavar="PATH|NAME", help="with --speculative draft: the draft GGUF (same "
                   "vocabulary as the served model, e.g. a smaller model of its family)")
    p.add_argument("--draft-threads", type=int, default=1, metavar="N", help="llama.cpp threads of the draft model "
                   "(default 1)")


def check_speculative(args) -> None:
    """ValueError for speculative settings that do not go together (a draft model without ``--speculative draft``
    or the reverse, ``--draft-max`` without ``--speculative``); ``args.draft_max`` gets its default (2)."""
    if (args.speculative == "draft") != bool(args.draft_model):
        raise ValueError("--speculative draft needs --draft-model PATH (and --draft-model needs --speculative draft)")
    if args.draft_max is not None and args.speculative == "none":
        raise ValueError("--draft-max sets the drafts of speculative decoding: give --speculative ngram or draft too")
    if args.draft_max is None:
        from .client.speculative import DEFAULT_DRAFT_MAX
        args.draft_max = DEFAULT_DRAFT_MAX


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ggufswarm", formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EXAMPLES,
        description="Distributed runtime for GGUF language models: shards over a swarm, sticky routes, local KV cache.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    g = sub.add_parser("generate", help="generate text in this process (streams the completion to stdout)",
                       description="Generate a completion. Only the completion goes to stdout; telemetry "
                                   "(prompt tokens, TTFT, decode tok/s) goes to stderr.")
    g.add_argument("prompt", help="prompt text ('-' reads standard input)")
    _model_args(g)
    g.add_argument("--max-tokens", type=int, default=128, help="most tokens to generate (default 128)")
    g.add_argument("--temperature", type=float, default=0.8, help="0 = greedy (default 0.8)")
    g.add_argument("--top-k", type=int, default=40, help="keep the k most likely tokens; 0 = off (default 40)")
    g.add_argument("--top-p", type=float, default=0.95, help="nucleus sampling threshold (default 0.95)")
    g.add_argument("--min-p", type=float, default=0.05, help="drop tokens below min-p x the top probability (default 0.05)")
    g.add_argument("--repeat-penalty", type=float, default=1.0, help="penalty on recent tokens; 1 = off (default 1.0)")
    g.add_argument("--seed", type=int, default=None, help="sampling seed (same seed, same output)")
    g.add_argument("--stop", action="append", default=[], metavar="TEXT", help="stop string (repeatable)")
    g.add_argument("--special", action="store_true", help="print control tokens and media markers (e.g. Gemma's "
                   "<start_of_image>) as their text; by default they print nothing")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    _speculative_args(g)

    p = sub.add_parser("perplexity", help="perplexity of a text file, as llama.cpp's llama-perplexity defines it",
                       description="Tokenize FILE once, cut it into chunks of --ctx-size tokens (first token of "
                                   "each replaced by BOS), score the second half of each chunk. The last line "
                                   "printed is 'perplexity: X'.")
    p.add_argument("file", help="UTF-8 text file")
    _model_args(p)
    p.add_argument("--ctx-size", type=int, default=512, help="tokens per chunk (default 512)")
    p.add_argument("--chunks", type=int, default=None, help="score only the first N chunks (N >= 1)")

    n = sub.add_parser("node", help="serve one shard (a layer range) over HTTP",
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       description="Serve layers START:END (half-open, as Python slices) of a GGUF model. The first "
                                   "shard of a route needs --embed, the last --head (norm + LM head + sampler). "
                                   "Each session keeps its KV cache here; frames go straight to the next hop. "
                                   "Prints 'ggufswarm node ready: URL ...' once listening. Protocol: docs/protocol.md.",
                       epilog="example, a 2-node route of an 18-layer model:\n"
                              "  ggufswarm node --layers 0:9 --embed --port 8471\n"
                              "  ggufswarm node --layers 9:18 --head --port 8472")
    n.add_argument("--layers", required=True, metavar="START:END",
                   help="layer range to serve, e.g. 0:6; with --tracker also 'auto': a range that fits in "
                        "--memory-budget, on the cuts the swarm's nodes already use (so it can replace or chain with "
                        "them) where the swarm has the fewest nodes (embed/head follow the range)")
    n.add_argument("--embed", action="store_true", help="also run the embedding stage (first shard of a route)")
    n.add_argument("--head", action="store_true", help="also run output norm, LM head and sampler (last shard)")
    n.add_argument("--model", metavar="PATH|NAME",
                   help="GGUF file; with --tracker the published model name. Default: embedded Gemma 3 270M")
    n.add_argument("--tracker", metavar="URL", help="fetch the shard from the swarm this tracker knows, "
                   "seed it, and advertise this node there (heartbeats; deregisters on shutdown)")
    n.add_argument("--data-dir", default="ggufswarm-data", metavar="DIR",
                   help="where swarm-fetched shards (sparse files) and the llama.cpp backend's derived shard GGUFs "
                        "(DIR/shards, one per layer range, reused across restarts) are kept; default ./ggufswarm-data")
    n.add_argument("--memory-budget", type=float, default=8192.0, metavar="MB",
                   help="with --layers auto: the most MiB of weights to take, embedding and LM head included "
                        "(default 8192)")
    n.add_argument("--fetch-timeout", type=float, default=1800.0, metavar="S",
                   help="with --tracker: give up fetching the shard after S seconds in all (default 1800)")
    n.add_argument("--fetch-stall", type=float, default=60.0, metavar="S",
                   help="with --tracker: when no new piece arrives for S seconds (its only seeder died, none is "
                        "up yet), say so and ask the tracker for peers again; repeats while stalled (default 60)")
    n.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    n.add_argument("--port", type=int, default=0, help="TCP port; 0 = any free port, printed in the ready line")
    _backend_args(n)
    n.add_argument("--ctx-size", type=int, default=8192, metavar="TOKENS",
                   help="the longest session this node takes (capped by the model's context); llama.cpp "
                        "backend: KV cells per session, allocated up front for --max-sessions; default 8192")
    n.add_argument("--max-sessions", type=int, default=4, metavar="N",
                   help="llama.cpp backend: sessions held at once (default 4); KV memory = N x --ctx-size x "
                        "this shard's KV bytes per token. Both backends: one session reserves at most 1/N of "
                        "the KV budget, so no single request takes all of it")
    n.add_argument("--batch-group", type=int, default=3, metavar="N",
                   help="llama.cpp backend: decode steps of different sessions that arrive while the shard is busy "
                        "run together; at most N sessions share one graph evaluation (default 3: each session's "
                        "result stays bitwise equal to running it alone; llama.cpp's CPU matmul rounds differently "
                        "from 4 rows on). Larger is the throughput mode: all sessions' KV cells in one llama.cpp "
                        "stream, so that any of them batch together (with one stream per session only consecutive "
                        "sequence ids can); much faster with many sessions, not bitwise")
    n.add_argument("--kv-budget", type=int, default=262144, metavar="TOKENS",
                   help="KV budget: tokens all sessions may reserve together (each reserves its max_length); "
                        "an open that does not fit gets 429 (full, retry later) or 503 (never fits). Default 262144; on "
                        "the llama.cpp backend also at most --max-sessions x --ctx-size, the KV it allocates")
    n.add_argument("--kv-budget-mb", type=float, default=None, metavar="MB",
                   help="cap the KV budget in MiB too (converted with this shard's bytes per token)")
    n.add_argument("--session-ttl", type=float, default=300.0, metavar="S",
                   help="drop sessions idle this many seconds (default 300)")
    n.add_argument("--hop-timeout", type=float, default=30.0, metavar="S",
                   help="seconds to wait for the next hop before failing the step with 504, for sessions that "
                        "do not set hop_timeout_s at open (default 30)")
    n.add_argument("--max-step-tokens", type=int, default=4096, metavar="N",
                   help="most tokens one frame may carry, at most the backend's batch (llama.cpp: 2048); larger gets "
                        "413, and clients send longer prompts in chunks of it (default 4096)")
    n.add_argument("--workers", type=int, default=4, help="threads running steps of different sessions (default 4)")
    n.add_argument("--exit-with-parent", action="store_true", help="exit when the parent process dies")
    n.add_argument("--cache", metavar="URL", help="snapshot cache server (ggufswarm cache): snapshot sessions' KV "
                   "there after prefill and every --snapshot-every tokens (in the background), and restore from it "
                   "when a route is repaired or a prompt starts with a cached prefix")
    n.add_argument("--snapshot-every", type=int, default=32, metavar="N",
                   help="with --cache: snapshot a session after its prefill and whenever it reaches a multiple "
                        "of N tokens (default 32; a multiple of 16 wastes nothing; 0 = after prefill only)")
    n.add_argument("--state-checkpoints", type=int, default=4, metavar="N",
                   help="llama.cpp shards of hybrid recurrent models and deepseek4 (which cannot roll a session back "
                        "partway): exact session states kept per session, at the snapshot positions, for route "
                        "repair and prefix reuse to return to (default 4; each costs the shard's recurrent state "
                        "plus its KV of the tokens held; 0 = none: a repair then recomputes from the start)")

    w = sub.add_parser("gateway", help="OpenAI-compatible API over a route of nodes",
                       description="Serve /v1/chat/completions, /v1/completions and /v1/models over a route of "
                                   "nodes: given by hand (--route; first node has --embed, last --head), or planned "
                                   "per session by a tracker (--tracker), which also repairs routes whose nodes "
                                   "fail. Streaming (SSE) and non-streamed; the body (the stream's last chunk) carries "
                                   "a telemetry object, and usage (a stream: with stream_options.include_usage). "
                                   "Every request parameter is implemented or refused with a 400: docs/protocol.md, "
                                   "\"Gateway\".")
    w.add_argument("--route", metavar="URL1,URL2,...", help="node URLs in layer order (or use --tracker)")
    w.add_argument("--tracker", metavar="URL", help="plan a route per session from this tracker instead of --route, and repair it when a node "
                   "fails (a replacement restores the failed layers' KV snapshot from the nodes' --cache)")
    w.add_argument("--model", metavar="PATH|NAME", help="GGUF file for the tokenizer; every node must serve the "
                   "same model (checked by GGUF header fingerprint). With --tracker: the published model name to serve (its "
                   "header is fetched from the swarm); without it, every model the swarm can serve end to end, "
                   "each request's model picking one. With --route and no "
                   "--model: the model the route's nodes serve (its headers are fetched from the first node)")
    w.add_argument("--data-dir", default="ggufswarm-data", metavar="DIR", help="where the fetched header goes")
    w.add_argument("--api-key", action="append", default=[], metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on /v1/* (repeatable; default: open API: anyone who "
                        "reaches the port can generate; the gateway warns when it listens beyond loopback without one)")
    w.add_argument("--literal-prompts", action="store_true",
                   help="/v1/completions: tokenize control-token text in a prompt (e.g. <start_of_turn>) as plain "
                        "text; by default it is read as the control token, as llama-server does (chat messages are "
                        "always plain text)")
    w.add_argument("--chat-template-file", metavar="FILE",
                   help="a jinja2 chat template (Hugging Face style) used instead of the GGUF's "
                        "tokenizer.chat_template, as llama-server's flag of that name: for a GGUF without one, or "
                        "to render tools (function calling) with a template that teaches the <tool_call> format")
    w.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    w.add_argument("--port", type=int, default=8000, help="TCP port (default 8000; 0 = any free port)")
    w.add_argument("--hop-timeout", type=float, default=30.0, metavar="S",
                   help="seconds one hop may take to answer a step; a dead or hung node fails the request "
                        "within this, naming the node (default 30)")
    w.add_argument("--wire-dtype", choices=["f16", "bf16", "f32"], default="f32",
                   help="hidden-state frame dtype between nodes (default f32: the route computes exactly what "
                        "llama.cpp computes; f16 (range-extended) or bf16 halve the bytes; see docs/protocol.md)")
    w.add_argument("--max-tokens", type=int, default=512, help="max_tokens when a request gives none (default 512)")
    w.add_argument("--session-lease", type=float, default=30.0, metavar="S",
                   help="nodes drop a request's session once idle this long: a gateway that dies frees its KV that "
                        "soon (default 30; the gateway renews it while a step takes long)")
    _speculative_args(w)

    d = sub.add_parser("demo", help="start N nodes + a gateway on loopback and stream one answer (the main job)",
                       description="The whole story on loopback: a tracker, a publisher seeding the model, --nodes "
                                   "node processes each fetching only its layers (even split) through the swarm, "
                                   "a gateway routing through the tracker; sends PROMPT through the OpenAI API and "
                                   "streams the answer to stdout; telemetry goes to stderr. Everything stops at the end (or on "
                                   "Ctrl-C). --serve keeps the cluster up and prints the gateway URL.")
    d.add_argument("prompt", nargs="?", default=None,
                   help="prompt (default: a question for chat models, 'Photosynthesis is the process by which' "
                        "for base models)")
    d.add_argument("--nodes", type=int, default=3, help="node processes (default 3)")
    d.add_argument("--model", metavar="PATH", help="GGUF file, or smollm2 (SmolLM2-135M-Instruct, a chat model "
                   "installed by the set-up); default: embedded Gemma 3 270M")
    d.add_argument("--max-tokens", type=int, default=128, help="most tokens to generate (default 128)")
    d.add_argument("--temperature", type=float, default=0.7, help="0 = greedy (default 0.7)")
    d.add_argument("--repeat-penalty", type=float, default=None, metavar="P",
                   help="repetition guard, llama.cpp's repeat penalty (default 1.15 for a base model, which loops "
                        "without one; 1.0, off, for a chat model). A base model's media markers (Gemma's "
                        "<start_of_image>, which a text-only route cannot follow) are also never drawn")
    d.add_argument("--seed", type=int, default=None, help="sampling seed")
    d.add_argument("--raw", action="store_true", help="send the prompt as a plain completion (no chat template; "
                   "automatic for base models, whose GGUF has no chat template)")
    d.add_argument("--serve", action="store_true", help="keep the cluster up (after PROMPT, when one is given; none is "
                   "sent by default) and print the gateway URL, the swarm token and how to add a node; a node that "
                   "dies is reported and the gateway keeps serving")
    d.add_argument("--port", type=int, default=0, help="gateway port (default: any free port)")
    d.add_argument("--threads", type=int, default=None, help="threads per node (default: cores / nodes)")
    d.add_argument("--backend", choices=["llama.cpp", "torch"], default="llama.cpp",
                   help="the nodes' shard backend (default llama.cpp)")
    d.add_argument("--timeout", type=float, default=30.0, metavar="S", help="per-hop timeout (default 30)")
    d.add_argument("--wire-dtype", choices=["f16", "bf16", "f32"], default="f32",
                   help="frame dtype (default f32: the route computes exactly what llama.cpp does; f16 halves the bytes)")
    d.add_argument("--no-swarm", action="store_true",
                   help="skip the tracker and swarm: nodes load the local file, the gateway gets the route by hand")
    _speculative_args(d)

    t = sub.add_parser("tracker", help="registry of nodes, manifests and routes; BitTorrent tracker of the swarms",
                       description="Serve the tracker: node registry with heartbeats (TTL expiry), shard "
                                   "advertisements, manifests by name, the BitTorrent announce endpoint (/announce), "
                                   "route queries (/route?model=NAME&max_length=N) and a live status page at /. "
                                   "State is kept in SQLite and survives a restart.")
    t.add_argument("--db", default="ggufswarm-tracker.sqlite", metavar="PATH", help="SQLite file (default ./ggufswarm-tracker.sqlite)")
    t.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    t.add_argument("--port", type=int, default=8470, help="TCP port (default 8470)")
    t.add_argument("--ttl", type=float, default=15.0, metavar="S", help="forget nodes silent this long (default 15)")

    u = sub.add_parser("publish", help="publish a GGUF to the swarm: manifest + torrent to the tracker, then seed",
                       description="Index MODEL.gguf (or a split set), write its manifest (tensor index, layer byte "
                                   "ranges) and a hybrid v1+v2 torrent (SHA-256 verified pieces), register both with "
                                   "the tracker under NAME and seed until stopped (Ctrl-C).")
    u.add_argument("model", nargs="?", default=None, help="GGUF file, or smollm2 (SmolLM2-135M-Instruct, installed "
                                                          "by the set-up); default: embedded Gemma 3 270M")
    u.add_argument("--name", default=None, help="published name (default: the file name without .gguf; for the "
                                                "embedded model gemma-3-270m-q4_k_m; for smollm2, smollm2)")
    u.add_argument("--tracker", required=True, metavar="URL", help="tracker URL, e.g. http://127.0.0.1:8470")
    u.add_argument("--data-dir", default="ggufswarm-data", metavar="DIR", help="where the manifest and torrent are written")
    u.add_argument("--web-seed", action="append", default=[], metavar="URL", help="HTTP URL serving the file (repeatable)")
    u.add_argument("--piece-size", type=int, default=256 * 1024, metavar="BYTES", help="torrent piece size (default 262144)")
    u.add_argument("--no-seed", action="store_true", help="register and exit without seeding")

    c = sub.add_parser("cache", help="prefix KV snapshot cache for nodes (route repair, prefix reuse)",
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       description="Serve prefix KV snapshots: nodes started with --cache URL store each\n"
                                   "session's KV of their layers here (content-addressed by model, layer range and\n"
                                   "token prefix; SHA-256 checked on every read; least recently used evicted past\n"
                                   "--max-bytes). A replacement node restores from it when the gateway repairs a\n"
                                   "route, and a new session whose prompt starts with a cached prefix skips\n"
                                   "recomputing it.",
                       epilog="example:\n  ggufswarm cache --dir ./ggufswarm-cache --port 8475 --max-bytes 8G\n"
                              "  ggufswarm node --layers 0:9 --embed --cache http://127.0.0.1:8475")
    c.add_argument("--dir", required=True, metavar="PATH", help="directory for snapshots and their index (created)")
    c.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    c.add_argument("--port", type=int, default=8475, help="TCP port (default 8475; 0 = any free port)")
    c.add_argument("--max-bytes", type=_size, default=4 * 2 ** 30, metavar="N",
                   help="size cap; least recently used snapshots are evicted past it (bytes, or with K/M/G; "
                        "default 4G)")

    st = sub.add_parser("status", help="what a tracker sees: nodes, their layer ranges as coverage bars, capacity",
                        description="Print, per published model, every node the tracker knows: its layer range as a "
                                    "coverage bar, state, free KV tokens, decode ms and URL, and whether the model "
                                    "can be served end to end (else which layers have no ready node).")
    st.add_argument("--tracker", required=True, metavar="URL", help="tracker URL")

    pl = sub.add_parser(
        "plan", help="how many nodes of a given memory a model needs, and which layers each serves (header only)",
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
               "(curl -r 0-16777215).")
    pl.add_argument("--model", default=None, metavar="PATH|NAME",
                    help="GGUF file or any file of a split set (every file's header is read; the tensor data may be "
                         "absent), smollm2, or with --tracker a published model name (default: the embedded model)")
    pl.add_argument("--tracker", metavar="URL", default=None,
                    help="tracker to read a published model's manifest (tensor table) from; the metadata comes from "
                         "a node serving it")
    pl.add_argument("--node-memory", type=_size, default=None, metavar="SIZE",
                    help="memory of each node for weights + KV + state, e.g. 24GiB, 48G, 512M (K/M/G/T are "
                         "powers of 1024); without it only the per-block table is printed")
    pl.add_argument("--context", type=int, default=None, metavar="TOKENS",
                    help="tokens of context each session is planned for (default: the model's trained context, "
                         "at most 131072)")
    pl.add_argument("--nodes", type=int, default=None, metavar="N",
                    help="place on at most N nodes, balanced by memory: the fullest node as empty as possible (a "
                         "large embedding or output table can leave a node one block; default: the fewest that fit)")
    pl.add_argument("--sessions", type=int, default=1, metavar="N",
                    help="concurrent sessions of --context tokens each node holds (default 1)")
    pl.add_argument("--wire-dtype", choices=["f32", "f16", "bf16"], default="f32",
                    help="hidden-state frame dtype for the wire bytes (default f32, the route's default)")
    pl.add_argument("--json", action="store_true", help="print the plan as JSON (bytes as integers)")
    for p in (n, w, t, u, st, c, pl):
        _token_arg(p)
    _token_arg(d, "else a fresh token the demo makes (a private swarm)")
    return parser
