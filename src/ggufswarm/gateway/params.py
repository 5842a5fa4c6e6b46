"""Checking an OpenAI request body's parameters: the sets each endpoint implements, ignores or refuses, and
``parse_params`` (a body to RequestOptions, or a RequestError naming the parameter at fault)."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, replace

from ..artifact.accounting import MAX_CONTEXT
from ..client.grammar import SchemaNotEnforceable, response_format_grammar
from ..client.speculative import MAX_DRAFT
from ..client.tools import ToolRequest
from ..runtime.sampling import MAX_GRAMMAR_CHARS, SamplingParams
from .errors import RequestError

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
MAX_STOP_STRINGS = 16  # entries of one request's ``stop``
MAX_TOP_LOGPROBS_CHAT = 20  # OpenAI's bounds of top_logprobs (chat) and logprobs (completions)
MAX_TOP_LOGPROBS_COMPLETION = 5
INT32_MAX = 2**31 - 1
MAX_CHOICES = 8  # n: choices of one request, each its own route session (KV on every node)


def _number(body: dict, name: str, default, lo=None, hi=None, kind=float):
    """``body[name]`` checked as a number (``kind`` int: an integer) in ``[lo, hi]``; ``default`` when absent or
    null. RequestError naming it otherwise."""
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and not isinstance(value, int)):
        raise RequestError(f"{name} must be {'an integer' if kind is int else 'a number'}, got {value!r}", param=name)
    if value != value or (lo is not None and value < lo) or (hi is not None and value > hi):
        if lo is not None and hi is not None:
            bound = f"in [{lo}, {hi}]"
        else:
            bound = f">= {lo}" if lo is not None else f"<= {hi}"
        raise RequestError(f"{name} must be {bound}, got {value!r}", param=name)
    return kind(value)


# OpenAI parameters that change nothing in what one locally served model generates: accepted and ignored.
IGNORED_PARAMS = frozenset(
    {
        "user",
        "store",
        "metadata",
        "service_tier",
        "safety_identifier",
        "prompt_cache_key",
        "parallel_tool_calls",
        "cache_prompt",
    }
)
# llama-server sampler settings this gateway does not implement: accepted only at the value that turns them off.
NEUTRAL_EXTRAS = {
    "typical_p": 1.0,
    "mirostat": 0,
    "dry_multiplier": 0.0,
    "xtc_probability": 0.0,
    "top_n_sigma": -1.0,
    "dynatemp_range": 0.0,
    "n_probs": 0,
    "min_keep": 0,
}
# ... and their sub-settings, which do nothing while the setting above is off: accepted and ignored.
DEPENDENT_EXTRAS = frozenset(
    {
        "mirostat_tau",
        "mirostat_eta",
        "dry_base",
        "dry_allowed_length",
        "dry_penalty_last_n",
        "dry_sequence_breakers",
        "xtc_threshold",
        "dynatemp_exponent",
    }
)
_COMMON_PARAMS = frozenset(
    {
        "model",
        "max_tokens",
        "max_completion_tokens",
        "temperature",
        "top_p",
        "n",
        "stream",
        "stream_options",
        "stop",
        "seed",
        "presence_penalty",
        "frequency_penalty",
        "logit_bias",
        "logprobs",
        "top_k",
        "min_p",
        "repeat_penalty",
        "repeat_last_n",
        "ignore_eos",
        "speculative.n_max",
        "skip_special_tokens",
        "grammar",
        "timings_per_token",
    }
)
CHAT_PARAMS = _COMMON_PARAMS | {
    "messages",
    "top_logprobs",
    "response_format",
    "tools",
    "tool_choice",
    "functions",
    "function_call",
}
COMPLETION_PARAMS = _COMMON_PARAMS | {"prompt", "echo", "suffix", "best_of"}
MAX_LOGIT_BIAS = 1024  # entries of one request's logit_bias
EOG_BIAS = -1e30  # ignore_eos: llama-server biases end-of-generation tokens by -inf; a finite "never" here


@dataclass
class RequestOptions:
    """What an OpenAI request body asks for, checked (see ``parse_params``).

    ``logprobs``: report the sampled tokens' logprobs; ``top_logprobs``: that many most likely alternatives per
    token (chat 0..20, completions 0..5); ``include_usage``: a final stream chunk with empty ``choices`` and
    ``usage``; ``echo``: the completion's text starts with the prompt; ``ignore_eos``: end-of-generation tokens
    are never drawn (llama-server's extension; ``Gateway.run`` adds their logit bias); ``n``: choices, each its
    own route session (choice i's seed: ``choice_seed``); ``timings_per_token``: every stream chunk carries
    llama-server's ``timings`` object (llama-server's extension; the final chunk and a whole body always do).
    """

    params: SamplingParams
    max_tokens: int
    stop: list[str]
    stream: bool
    include_usage: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    echo: bool = False
    ignore_eos: bool = False
    special: bool = False  # vLLM's skip_special_tokens false: control tokens and media markers rendered as text
    draft_max: int | None = None  # llama-server's speculative.n_max: at most this many drafts per step (0: none)
    n: int = 1
    timings_per_token: bool = False


SEED_SPACE = 2**63  # SamplingParams.seed's range


def choice_seed(seed: int | None, index: int) -> int | None:
    """The seed of choice ``index`` of a request asking for ``seed``: ``(seed + index) mod 2^63`` (choice 0 keeps
    the request's seed, so n = 1 draws as before); None (each choice draws its own random seed) without one."""
    return None if seed is None else (seed + index) % SEED_SPACE


def _flag(body: dict, name: str) -> bool:
    """``body[name]`` checked as a boolean (False when absent or null)."""
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise RequestError(f"{name} must be true or false, got {value!r}", param=name)
    return value


def _check_known(body: dict, chat: bool) -> None:
    """RequestError naming the first parameter that is not implemented (or not neutral) for this endpoint."""
    known = CHAT_PARAMS if chat else COMPLETION_PARAMS
    where = CHAT_PATH if chat else COMPLETIONS_PATH
    for name, value in body.items():
        if name in known or name in IGNORED_PARAMS or name in DEPENDENT_EXTRAS:
            continue
        if name in NEUTRAL_EXTRAS:
            neutral = NEUTRAL_EXTRAS[name]
            same_kind = isinstance(value, (bool, int, float)) and isinstance(value, bool) == isinstance(neutral, bool)
            if value is None or (same_kind and value == neutral):
                continue
            raise RequestError(
                f"{name} (a llama-server sampler setting) is not implemented by this gateway; omit it "
                f"or leave it at {json.dumps(neutral)}",
                param=name,
            )
        raise RequestError(
            f"unknown parameter {name!r}: not a parameter {where} implements here (docs/protocol.md, "
            f'"Gateway", lists them)',
            param=name,
            code="unknown_parameter",
        )


def _logit_bias(body: dict, n_vocab: int | None) -> tuple:
    """``logit_bias`` checked: ``((token id, bias), ...)``, ids below ``n_vocab``, biases in [-100, 100]."""
    value = body.get("logit_bias")
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise RequestError(
            "logit_bias must be an object mapping token ids (strings) to a bias in [-100, 100]", param="logit_bias"
        )
    if len(value) > MAX_LOGIT_BIAS:
        raise RequestError(f"logit_bias has {len(value)} entries; at most {MAX_LOGIT_BIAS}", param="logit_bias")
    pairs = []
    for key, bias in value.items():
        if not (key.isascii() and key.isdigit()) or (n_vocab is not None and int(key) >= n_vocab):
            raise RequestError(f"logit_bias keys must be token ids in [0, {n_vocab}), got {key!r}", param="logit_bias")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -100 <= bias <= 100:
            raise RequestError(
                f"logit_bias values must be numbers in [-100, 100], got {bias!r} for token {key}", param="logit_bias"
            )
        pairs.append((int(key), float(bias)))
    return tuple(pairs)


def parse_params(
    body: dict,
    default_max_tokens: int,
    chat: bool = True,
    n_vocab: int | None = None,
    fim: bool = False,
    tools: ToolRequest | None = None,
    grammar_parses: Callable[[str], bool] | None = None,
) -> RequestOptions:
    """The checked options of an OpenAI request body for ``/v1/chat/completions`` (``chat``) or ``/v1/completions``.

    Omitted settings take llama.cpp server defaults (temperature 0.8, top_k 40, top_p 0.95, min_p 0.05,
    repeat_penalty 1, repeat_last_n 64). ``top_k``, ``min_p``, ``repeat_penalty``, ``repeat_last_n`` (-1: the
    whole context, as llama-server) and ``ignore_eos`` are accepted as llama-server extensions; ``n_vocab``
    bounds ``logit_bias``'s token ids; ``fim``: the model has fill-in-the-middle tokens (``suffix`` is still
    refused: not implemented); ``tools``: the request's checked tools (client.tools.tool_request, which checks
    ``tools`` / ``tool_choice`` / ``functions`` / ``function_call``): a forced call's grammar becomes
    ``params.grammar``; ``grammar`` (llama-server's extension, a GBNF string with a ``root`` rule, both endpoints)
    too, checked by ``grammar_parses`` (Tokenizer.grammar_parses) when given. ``n`` is 1..MAX_CHOICES. Raises
    RequestError (400, ``param`` naming the parameter) for a parameter that is unknown, of the wrong type, out of
    range, or not implemented (``best_of`` > 1, ``suffix``, a grammar that does not parse, ``grammar`` with
    ``response_format`` or with tools, a
    ``response_format`` schema constrained decoding cannot enforce (client.grammar), ``response_format`` other
    than text with tools offered, ``echo`` with ``logprobs``, a llama-server sampler other than the ones above).
    ``response_format`` json_object / json_schema become ``params.grammar``.
    """
    _check_known(body, chat)
    n = _number(body, "n", 1, 1, MAX_CHOICES, int)
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    max_tokens = _number({"max_tokens": max_tokens}, "max_tokens", default_max_tokens, 0, None, int)
    d = SamplingParams()
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise RequestError(f"seed must be an integer, got {seed!r}", param="seed")
    repeat_last_n = _number(body, "repeat_last_n", d.repeat_last_n, -1, INT32_MAX, int)
    params = SamplingParams(
        temperature=_number(body, "temperature", d.temperature, 0, 2),
        top_p=_number(body, "top_p", d.top_p, 0, 1),
        top_k=_number(body, "top_k", d.top_k, 0, None, int),
        min_p=_number(body, "min_p", d.min_p, 0, 1),
        repeat_penalty=_number(body, "repeat_penalty", d.repeat_penalty, 0, None),
        repeat_last_n=MAX_CONTEXT if repeat_last_n == -1 else repeat_last_n,  # llama-server: -1 = context size
        presence_penalty=_number(body, "presence_penalty", 0.0, -2, 2),
        frequency_penalty=_number(body, "frequency_penalty", 0.0, -2, 2),
        logit_bias=_logit_bias(body, n_vocab),
        seed=seed,
    )
    try:
        params = params.validate()
    except ValueError as exc:
        raise RequestError(str(exc)) from None
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    elif not (isinstance(stop, list) and all(isinstance(s, str) and s for s in stop) and len(stop) <= MAX_STOP_STRINGS):
        raise RequestError(
            f"stop must be a string or a list of up to {MAX_STOP_STRINGS} non-empty strings", param="stop"
        )
    stream = _flag(body, "stream")
    skip_special = body.get("skip_special_tokens") is None or _flag(body, "skip_special_tokens")
    opts = RequestOptions(
        params, max_tokens, stop, stream, ignore_eos=_flag(body, "ignore_eos"), special=not skip_special, n=n
    )
    opts.timings_per_token = _flag(body, "timings_per_token")
    grammar = _grammar(body, grammar_parses)
    if body.get("speculative.n_max") is not None:
        opts.draft_max = _number(body, "speculative.n_max", 0, 0, MAX_DRAFT, int)
    stream_options = body.get("stream_options")
    if stream_options is not None:
        if not stream:
            raise RequestError("stream_options is only allowed with stream: true", param="stream_options")
        if not isinstance(stream_options, dict):
            raise RequestError("stream_options must be an object", param="stream_options")
        for key in stream_options:
            if key not in ("include_usage", "include_obfuscation"):  # no obfuscation here: nothing to pad
                raise RequestError(
                    f"stream_options.{key} is not implemented (include_usage is)", param="stream_options"
                )
        if not isinstance(stream_options.get("include_usage", False), bool):
            raise RequestError(
                f"stream_options.include_usage must be true or false, got {stream_options['include_usage']!r}",
                param="stream_options",
            )
        opts.include_usage = stream_options.get("include_usage", False)
    if chat:
        opts.logprobs = _flag(body, "logprobs")
        if body.get("top_logprobs") is not None:
            opts.top_logprobs = _number(body, "top_logprobs", 0, 0, MAX_TOP_LOGPROBS_CHAT, int)
            if not opts.logprobs:
                raise RequestError("top_logprobs needs logprobs: true", param="top_logprobs")
        try:  # constrained decoding: the head's llama.cpp grammar sampler
            json_grammar = response_format_grammar(body.get("response_format"))
        except SchemaNotEnforceable as exc:
            raise RequestError(str(exc), param="response_format") from None
        if grammar and body.get("response_format") is not None:  # llama-server: json_schema and grammar refused
            raise RequestError(
                "grammar and response_format together: give one constraint (a GBNF grammar or a JSON format)",
                param="grammar",
            )
        if grammar and tools is not None:
            raise RequestError(
                "grammar together with tools is not supported: tool calls have their own grammar; drop one "
                '(or send tool_choice: "none")',
                param="grammar",
            )
        grammar = grammar or json_grammar
        if json_grammar and tools is not None:
            raise RequestError(
                "response_format (json_object / json_schema) together with tools is not supported: "
                "the answer would have to be a tool call and JSON at once; drop one (or send "
                'tool_choice: "none")',
                param="response_format",
            )
        if tools is not None and tools.grammar:  # tool_choice "required" / a named function: one forced call
            grammar = tools.grammar
    if grammar:
        opts.params = replace(opts.params, grammar=grammar)
    if not chat:
        if body.get("logprobs") is not None:
            opts.logprobs = True
            opts.top_logprobs = _number(body, "logprobs", 0, 0, MAX_TOP_LOGPROBS_COMPLETION, int)
        opts.echo = _flag(body, "echo")
        if opts.echo and opts.logprobs:
            raise RequestError(
                "echo with logprobs is not supported: the head computes logprobs for generated "
                "tokens only, not for the prompt",
                param="echo",
            )
        if _number(body, "best_of", 1, 1, None, int) != 1:
            raise RequestError("only best_of = 1 is supported", param="best_of")
        suffix = body.get("suffix")
        if suffix is not None and not isinstance(suffix, str):
            raise RequestError("suffix must be a string", param="suffix")
        if suffix:
            why = (
                "fill-in-the-middle is not implemented by this gateway"
                if fim
                else "this model has no fill-in-the-middle tokens"
            )
            raise RequestError(f"suffix is not supported: {why}", param="suffix")
    return opts


def _grammar(body: dict, parses: Callable[[str], bool] | None) -> str:
    """``grammar`` (llama-server's extension) checked: a GBNF string with a ``root`` rule that llama.cpp parses
    (``parses``); "" when absent, null or empty."""
    grammar = body.get("grammar")
    if grammar is None or grammar == "":
        return ""
    if not isinstance(grammar, str) or len(grammar) > MAX_GRAMMAR_CHARS:
        raise RequestError(f"grammar must be a GBNF string of at most {MAX_GRAMMAR_CHARS} characters", param="grammar")
    if parses is not None and not parses(grammar):
        raise RequestError(
            "grammar does not parse: llama.cpp's GBNF parser refused it (it needs a rule named root, and every rule "
            "it uses defined)",
            param="grammar",
        )
    return grammar
