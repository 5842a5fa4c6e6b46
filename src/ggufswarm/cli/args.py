"""Argument types and option groups the command line's subcommands share: layer cuts, byte sizes, the model and
backend options, the swarm token, speculative decoding."""

from __future__ import annotations

import argparse
import re


def layer_cuts(text: str) -> list[int]:
    """``--split A,B,...``: the layer indices to cut at, ascending and above 0. ArgumentTypeError for anything else
    (an empty item such as ``6,,12``, a repeated or descending index)."""
    try:
        cuts = [int(p) for p in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--split takes split points, comma-separated layer indices such as 6,12; got {text!r}"
        ) from None
    if any(c <= 0 for c in cuts) or any(b <= a for a, b in zip(cuts, cuts[1:])):
        raise argparse.ArgumentTypeError(
            f"--split takes split points above 0 in ascending order, each once, such as 6,12; got {text!r}"
        )
    return cuts


def model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        metavar="PATH",
        help="GGUF file (or first file of a split set), or smollm2 (SmolLM2-135M-"
        "Instruct, installed by the set-up); default: embedded Gemma 3 270M",
    )
    p.add_argument(
        "--split",
        type=layer_cuts,
        metavar="A,B,...",
        default=None,
        help="run the model as in-process chained shards cut at these layers",
    )
    backend_args(p)


def backend_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--backend",
        choices=["llama.cpp", "torch"],
        default="llama.cpp",
        help="shard backend: llama.cpp (default: llama.cpp's own graphs and quantized kernels, bitwise "
        "equal to llama.cpp) or torch (the PyTorch reference: dequantized weights, f32/bf16)",
    )
    p.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        default="float32",
        help="torch backend's compute dtype (default float32; with --backend torch only)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="CPU threads: llama.cpp's decode and batch threads, or PyTorch's (default: all cores)",
    )


def node_memory(text: str) -> tuple[int, int | None]:
    """``SIZE`` or ``SIZE,gpu=SIZE`` (``64GiB,gpu=24GiB``): a node's memory and its GPU's, in bytes."""
    main, _, rest = text.partition(",")
    gpu = None
    if rest:
        key, _, value = rest.partition("=")
        if key.strip().lower() != "gpu" or not value or "," in value:
            raise argparse.ArgumentTypeError(f"expected SIZE or SIZE,gpu=SIZE (e.g. 64GiB,gpu=24GiB), got {text!r}")
        try:
            gpu = byte_size(value)
        except argparse.ArgumentTypeError:
            raise argparse.ArgumentTypeError(
                f"the GPU's size {value!r} in {text!r} is not a size (e.g. 24GiB)"
            ) from None
    return byte_size(main), gpu


def byte_size(text: str) -> int:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([KMGT]?)(?:I?B)?", text.strip().upper())
    if not m or float(m.group(1)) <= 0:
        raise argparse.ArgumentTypeError(
            f"size must be a positive number of bytes, optionally with K/M/G/T, got {text!r}"
        )
    return int(float(m.group(1)) * 1024 ** " KMGT".index(m.group(2) or " "))


def token_arg(p: argparse.ArgumentParser, unset: str = "none = an open swarm") -> None:
    p.add_argument(
        "--token",
        default=None,
        metavar="SECRET",
        help="swarm token: nodes, tracker and cache answer only requests carrying it (401 otherwise); "
        f"default $GGUFSWARM_TOKEN, {unset}",
    )


def draft_max(text: str) -> int:
    from ..client.speculative import MAX_DRAFT

    try:
        k = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer in 1..{MAX_DRAFT}, got {text!r}") from None
    if not 1 <= k <= MAX_DRAFT:
        raise argparse.ArgumentTypeError(
            f"must be in 1..{MAX_DRAFT} (tokens drafted per verify step; the head "
            f"verifies at most {MAX_DRAFT + 1} tokens in one step), got {k}"
        )
    return k


def speculative_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--speculative",
        choices=["none", "ngram", "draft"],
        default="none",
        help="speculative decoding (default none). ngram: draft up to --draft-max tokens by prompt lookup "
        "(the tokens that followed the latest earlier occurrence of the last 1-3 tokens); draft: the "
        "greedy continuation of --draft-model, a small GGUF of the same vocabulary run in this "
        "process. The drafts go with the last sampled token as one step in which the head samples "
        "every position; the client keeps the drafts it confirms plus the head's next token: the "
        "same tokens as without it (greedy or seeded sampling), in fewer trips through the route. "
        "Pays off on code and repetitive text, most "
        "over slow links; requests with logprobs decode plainly",
    )
    p.add_argument(
        "--draft-max",
        type=draft_max,
        default=None,
        metavar="K",
        help="most tokens drafted per step, 1..15 (default 2). Up to 2 the llama.cpp backend computes a "
        "verify step bitwise as one-token steps (output identical to plain decoding); from 3 on "
        "ggml's batched kernels round differently on some weight types (Gemma's Q4_K/Q8_0) and a "
        'token can differ now and then (docs/protocol.md, "Speculative decoding")',
    )
    p.add_argument(
        "--draft-model",
        metavar="PATH|NAME",
        help="with --speculative draft: the draft GGUF (same "
        "vocabulary as the served model, e.g. a smaller model of its family)",
    )
    p.add_argument(
        "--draft-threads", type=int, default=1, metavar="N", help="llama.cpp threads of the draft model (default 1)"
    )


def check_speculative(args) -> None:
    """ValueError for speculative settings that do not go together (a draft model without ``--speculative draft``
    or the reverse, ``--draft-max`` without ``--speculative``); ``args.draft_max`` gets its default (2)."""
    if (args.speculative == "draft") != bool(args.draft_model):
        raise ValueError("--speculative draft needs --draft-model PATH (and --draft-model needs --speculative draft)")
    if args.draft_max is not None and args.speculative == "none":
        raise ValueError("--draft-max sets the drafts of speculative decoding: give --speculative ngram or draft too")
    if args.draft_max is None:
        from ..client.speculative import DEFAULT_DRAFT_MAX

        args.draft_max = DEFAULT_DRAFT_MAX
