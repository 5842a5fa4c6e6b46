"""Command line: ``ggufswarm demo | generate | perplexity | node | gateway``."""

from __future__ import annotations

import argparse
import os
import sys

EXAMPLES = """examples:
  ggufswarm generate "The capital of France is" --max-tokens 16
  ggufswarm generate "Write a haiku about rain" --chat --temperature 0.7 --seed 1
  ggufswarm generate "Hello" --split 6,12          # run as chained shards [0,6)+[6,12)+[12,n)
  ggufswarm perplexity wiki.txt --ctx-size 512
  ggufswarm demo "Why is the sky blue?" --nodes 3   # 3 node processes + gateway on loopback
  ggufswarm node --layers 0:9 --embed --port 8471   # serve one shard (the first of a 2-node route)
  ggufswarm node --layers 9:18 --head --port 8472
  ggufswarm gateway --route http://127.0.0.1:8471,http://127.0.0.1:8472 --port 8000
With no --model, the embedded Gemma 3 270M Q4_K_M is used (assembled once into ~/.cache/ggufswarm).
"""


def _split(text: str) -> list[int]:
    try:
        return [int(p) for p in text.split(",") if p.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--split takes comma-separated layer indices, got {text!r}") from None


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", metavar="PATH", help="GGUF file (or first file of a split set); default: embedded Gemma 3 270M")
    p.add_argument("--split", type=_split, metavar="A,B,...", default=None,
                   help="run the model as in-process chained shards cut at these layers")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="compute dtype (default float32)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads for PyTorch (default: all cores)")


DEMO_PROMPT = "Explain in two sentences why the sky is blue."


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
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")

    p = sub.add_parser("perplexity", help="perplexity of a text file, as llama.cpp's llama-perplexity defines it",
                       description="Tokenize FILE once, cut it into chunks of --ctx-size tokens (first token of "
                                   "each replaced by BOS), score the second half of each chunk. The last line "
                                   "printed is 'perplexity: X'.")
    p.add_argument("file", help="UTF-8 text file")
    _model_args(p)
    p.add_argument("--ctx-size", type=int, default=512, help="tokens per chunk (default 512)")
    p.add_argument("--chunks", type=int, default=None, help="score at most this many chunks")

    n = sub.add_parser("node", help="serve one shard (a layer range) over HTTP",
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       description="Serve layers START:END (half-open, as Python slices) of a GGUF model. The first "
                                   "shard of a route needs --embed, the last --head (norm + LM head + sampler). "
                                   "Each session keeps its KV cache here; frames go straight to the next hop. "
                                   "Prints 'ggufswarm node ready: URL ...' once listening. Protocol: docs/protocol.md.",
                       epilog="example, a 2-node route of an 18-layer model:\n"
                              "  ggufswarm node --layers 0:9 --embed --port 8471\n"
                              "  ggufswarm node --layers 9:18 --head --port 8472")
    n.add_argument("--layers", required=True, metavar="START:END", help="layer range to serve, e.g. 0:6")
    n.add_argument("--embed", action="store_true", help="also run the embedding stage (first shard of a route)")
    n.add_argument("--head", action="store_true", help="also run output norm, LM head and sampler (last shard)")
    n.add_argument("--model", metavar="PATH", help="GGUF file; default: embedded Gemma 3 270M")
    n.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    n.add_argument("--port", type=int, default=0, help="TCP port; 0 = any free port, printed in the ready line")
    n.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="compute dtype")
    n.add_argument("--threads", type=int, default=None, help="CPU threads for PyTorch (default: all cores)")
    n.add_argument("--kv-budget", type=int, default=262144, metavar="TOKENS",
                   help="KV budget: tokens all sessions may reserve together (each reserves its max_length); "
                        "an open that does not fit gets 429 (full, retry later) or 503 (never fits). Default 262144")
    n.add_argument("--kv-budget-mb", type=float, default=None, metavar="MB",
                   help="cap the KV budget in MiB too (converted with this shard's bytes per token)")
    n.add_argument("--session-ttl", type=float, default=300.0, metavar="S",
                   help="drop sessions idle this many seconds (default 300)")
    n.add_argument("--hop-timeout", type=float, default=30.0, metavar="S",
                   help="seconds to wait for the next hop before failing the step with 504, for sessions that "
                        "do not set hop_timeout_s at open (default 30)")
    n.add_argument("--max-step-tokens", type=int, default=4096, metavar="N",
                   help="most tokens one frame may carry; larger gets 413 (default 4096)")
    n.add_argument("--workers", type=int, default=4, help="threads running steps of different sessions (default 4)")
    n.add_argument("--exit-with-parent", action="store_true", help="exit when the parent process dies")

    w = sub.add_parser("gateway", help="OpenAI-compatible API over a route of nodes",
                       description="Serve /v1/chat/completions, /v1/completions and /v1/models over a route of "
                                   "nodes given by hand (first node has --embed, last --head). Streaming (SSE) and "
                                   "non-streamed; the last chunk / the body carries usage and a telemetry object.")
    w.add_argument("--route", required=True, metavar="URL1,URL2,...", help="node URLs in layer order")
    w.add_argument("--model", metavar="PATH", help="GGUF file for the tokenizer; default: embedded Gemma 3 270M")
    w.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    w.add_argument("--port", type=int, default=8000, help="TCP port (default 8000; 0 = any free port)")
    w.add_argument("--hop-timeout", type=float, default=30.0, metavar="S",
                   help="seconds one hop may take to answer a step; a dead or hung node fails the request "
                        "within this, naming the node (default 30)")
    w.add_argument("--wire-dtype", choices=["f16", "bf16", "f32"], default="f16",
                   help="hidden-state frame dtype between nodes (default f16, range-extended; see docs/protocol.md)")
    w.add_argument("--max-tokens", type=int, default=512, help="max_tokens when a request gives none (default 512)")

    d = sub.add_parser("demo", help="start N nodes + a gateway on loopback and stream one answer (the main job)",
                       description="Start --nodes node processes with an even layer split of the model, a gateway "
                                   "on free loopback ports, send PROMPT through the OpenAI API and stream the "
                                   "answer to stdout; telemetry goes to stderr. Everything stops at the end (or on "
                                   "Ctrl-C). --serve keeps the cluster up and prints the gateway URL.")
    d.add_argument("prompt", nargs="?", default=None, help=f"prompt (default: {DEMO_PROMPT!r})")
    d.add_argument("--nodes", type=int, default=3, help="node processes (default 3)")
    d.add_argument("--model", metavar="PATH", help="GGUF file; default: embedded Gemma 3 270M")
    d.add_argument("--max-tokens", type=int, default=128, help="most tokens to generate (default 128)")
    d.add_argument("--temperature", type=float, default=0.8, help="0 = greedy (default 0.8)")
    d.add_argument("--seed", type=int, default=None, help="sampling seed")
    d.add_argument("--raw", action="store_true", help="send the prompt as a plain completion (no chat template)")
    d.add_argument("--serve", action="store_true", help="keep the cluster up after the prompt; print the gateway URL")
    d.add_argument("--port", type=int, default=0, help="gateway port (default: any free port)")
    d.add_argument("--threads", type=int, default=None, help="PyTorch threads per node (default: cores / nodes)")
    d.add_argument("--timeout", type=float, default=30.0, metavar="S", help="per-hop timeout (default 30)")
    d.add_argument("--wire-dtype", choices=["f16", "bf16", "f32"], default="f16", help="frame dtype (default f16)")
    return parser


def cmd_generate(args) -> int:
    from .client.generate import GenerationStats, generate
    from .client.local import LocalModel
    from .client.sampling import SamplingParams

    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    if args.max_tokens < 0:
        raise ValueError("--max-tokens must be >= 0")
    sampling = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                              repeat_penalty=args.repeat_penalty, seed=args.seed).validate()
    model = LocalModel.load(args.model, args.split, args.dtype)
    ids = model.prompt_ids(prompt, chat=args.chat)
    limit = model.config.max_length
    if len(ids) >= limit:
        raise ValueError(f"prompt is {len(ids)} tokens; the limit for this model is {limit} tokens")
    session = model.session(min(limit, len(ids) + max(args.max_tokens, 1)), sampling)
    stats = GenerationStats()
    for delta in generate(session, model.tokenizer, ids, args.max_tokens, args.stop, stats):
        sys.stdout.write(delta)
        sys.stdout.flush()
    sys.stdout.write("\n")
    sys.stdout.flush()
    print(stats.summary(), file=sys.stderr)
    return 0


def cmd_perplexity(args) -> int:
    from .client.local import LocalModel
    from .client.perplexity import perplexity

    with open(args.file, encoding="utf-8") as f:
        text = f.read()
    model = LocalModel.load(args.model, args.split, args.dtype)
    tokens = model.tokenizer.encode(text)
    bos = model.tokenizer.bos_id if model.tokenizer.add_bos else None
    if args.chunks:
        tokens = tokens[:args.chunks * args.ctx_size]

    def all_logits(chunk):
        return model.session(len(chunk)).logits(chunk, all_positions=True)

    ppl = float("nan")
    for done, ppl in perplexity(all_logits, tokens, args.ctx_size, bos):
        print(f"[{done}] {ppl:.4f}", file=sys.stderr, flush=True)
    print(f"perplexity: {ppl:.4f}")
    return 0


def cmd_node(args) -> int:
    from .node import NodeConfig, run_node
    return run_node(NodeConfig(
        layers=args.layers, embed=args.embed, head=args.head, model=args.model, host=args.host, port=args.port,
        dtype=args.dtype, kv_budget_tokens=args.kv_budget, kv_budget_mb=args.kv_budget_mb,
        session_ttl_s=args.session_ttl, hop_timeout_s=args.hop_timeout, max_step_tokens=args.max_step_tokens,
        workers=args.workers, exit_with_parent=args.exit_with_parent))


def cmd_gateway(args) -> int:
    from .gateway import GatewayConfig, run_gateway
    route = [u.strip() for u in args.route.split(",") if u.strip()]
    return run_gateway(GatewayConfig(route=route, model=args.model, host=args.host, port=args.port,
                                     hop_timeout_s=args.hop_timeout, wire_dtype=args.wire_dtype,
                                     default_max_tokens=args.max_tokens))


def cmd_demo(args) -> int:
    from .gateway.demo import run_demo
    return run_demo(args)


COMMANDS = {"generate": cmd_generate, "perplexity": cmd_perplexity, "node": cmd_node, "gateway": cmd_gateway,
            "demo": cmd_demo}


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``ggufswarm`` console script; known errors become one line on stderr, exit 1."""
    args = build_parser().parse_args(argv)
    if getattr(args, "threads", None):
        import torch
        torch.set_num_threads(args.threads)
    from .artifact.gguf_file import GGUFError
    from .model import UnsupportedArchitecture
    from .runtime.kv import ContextOverflow
    try:
        return COMMANDS[args.command](args)
    except (GGUFError, UnsupportedArchitecture, ContextOverflow, ValueError, OSError, RuntimeError) as exc:
        print(f"ggufswarm {args.command}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"ggufswarm {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
