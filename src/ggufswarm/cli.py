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


COMMANDS = {"generate": cmd_generate, "perplexity": cmd_perplexity}


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
