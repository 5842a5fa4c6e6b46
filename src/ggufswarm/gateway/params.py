"""Checking an OpenAI request body's parameters: ``parse_params`` (a body, checked against its typed model in
openai_request.py, to RequestOptions), with the rules a schema cannot say: cross-field rules, the vocabulary's
bounds, grammars; a RequestError names the parameter at fault."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from ..artifact.accounting import MAX_CONTEXT
from ..client.grammar import SchemaNotEnforceable, response_format_grammar
from ..client.tools import ToolRequest
from ..runtime.sampling import SamplingParams
from .errors import RequestError
from .openai_request import (
    CHAT_PATH,
    COMPLETIONS_PATH,
    MAX_STOP_STRINGS,
    SEED_SPACE,
    ChatCompletionRequest,
    CompletionRequest,
    OpenAIRequest,
    parse_request,
)

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


def choice_seed(seed: int | None, index: int) -> int | None:
    """The seed of choice ``index`` of a request asking for ``seed``: ``(seed + index) mod 2^63`` (choice 0 keeps
    the request's seed, so n = 1 draws as before); None (each choice draws its own random seed) without one."""
    return None if seed is None else (seed + index) % SEED_SPACE


def _logit_bias(value: dict[str, float] | None, n_vocab: int | None) -> tuple:
    """``logit_bias`` (its shape checked by the model) as ``((token id, bias), ...)``, ids below ``n_vocab``."""
    pairs = tuple((int(key), bias) for key, bias in (value or {}).items())
    for token, _ in pairs:
        if n_vocab is not None and token >= n_vocab:
            raise RequestError(
                f"logit_bias keys must be token ids in [0, {n_vocab}), got '{token}'", param="logit_bias"
            )
    return pairs


def parse_params(
    body: dict | OpenAIRequest,
    default_max_tokens: int,
    chat: bool = True,
    n_vocab: int | None = None,
    fim: bool = False,
    tools: ToolRequest | None = None,
    grammar_parses: Callable[[str], bool] | None = None,
) -> RequestOptions:
    """The checked options of an OpenAI request body for ``/v1/chat/completions`` (``chat``) or ``/v1/completions``:
    ``body`` (or its model, already parsed) checked by openai_request.parse_request (types, ranges, defaults,
    unknown and refused parameters), then by the rules here. ``n_vocab`` bounds ``logit_bias``'s token ids;
    ``fim``: the model has fill-in-the-middle tokens (``suffix`` is still refused: not implemented); ``tools``: the
    request's checked tools (client.tools.tool_request): a forced call's grammar becomes ``params.grammar``;
    ``grammar`` (llama-server's GBNF) too, checked by ``grammar_parses`` (Tokenizer.grammar_parses) when given.
    Raises RequestError (400, ``param`` naming the parameter) as parse_request, and for ``stream_options``
    without ``stream``, ``top_logprobs`` without ``logprobs``, ``echo`` with ``logprobs``, a non-empty ``suffix``,
    a grammar that does not parse, ``grammar`` with ``response_format`` or with tools, a ``response_format``
    schema constrained decoding cannot enforce (client.grammar), ``response_format`` other than text with tools.
    ``response_format`` json_object / json_schema become ``params.grammar``.
    """
    req = parse_request(body, chat) if isinstance(body, dict) else body
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    params = SamplingParams(
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=req.top_k,
        min_p=req.min_p,
        repeat_penalty=req.repeat_penalty,
        repeat_last_n=MAX_CONTEXT if req.repeat_last_n == -1 else req.repeat_last_n,  # llama-server: -1 = context
        presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty,
        logit_bias=_logit_bias(req.logit_bias, n_vocab),
        seed=req.seed,
    )
    try:  # the runtime's own checks (what the model allows, they allow)
        params = params.validate()
    except ValueError as exc:
        raise RequestError(str(exc)) from None
    opts = RequestOptions(
        params,
        default_max_tokens if max_tokens is None else max_tokens,
        [req.stop] if isinstance(req.stop, str) else list(req.stop or []),
        req.stream,
        ignore_eos=req.ignore_eos,
        special=not req.skip_special_tokens,
        draft_max=req.speculative_n_max,
        n=req.n,
        timings_per_token=req.timings_per_token,
    )
    if req.stream_options is not None:
        if not req.stream:
            raise RequestError("stream_options is only allowed with stream: true", param="stream_options")
        opts.include_usage = req.stream_options.include_usage
    grammar = _grammar(req.grammar, grammar_parses)
    if isinstance(req, ChatCompletionRequest):
        grammar = _chat_grammar(req, opts, grammar, tools)
    else:
        _completion(req, opts, fim)
    if grammar:
        opts.params = replace(opts.params, grammar=grammar)
    return opts


def _chat_grammar(req: ChatCompletionRequest, opts: RequestOptions, grammar: str, tools: ToolRequest | None) -> str:
    """Chat's logprobs into ``opts``; the grammar of the request: ``grammar``, ``response_format``'s or a forced
    tool call's (one of them at most)."""
    opts.logprobs = req.logprobs
    if req.top_logprobs is not None:
        if not opts.logprobs:
            raise RequestError("top_logprobs needs logprobs: true", param="top_logprobs")
        opts.top_logprobs = req.top_logprobs
    response_format = (
        None if req.response_format is None else req.response_format.model_dump(by_alias=True, exclude_none=True)
    )
    try:  # constrained decoding: the head's llama.cpp grammar sampler
        json_grammar = response_format_grammar(response_format)
    except SchemaNotEnforceable as exc:
        raise RequestError(str(exc), param="response_format") from None
    if grammar and response_format is not None:  # llama-server: json_schema and grammar refused
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
    if json_grammar and tools is not None:
        raise RequestError(
            "response_format (json_object / json_schema) together with tools is not supported: "
            "the answer would have to be a tool call and JSON at once; drop one (or send "
            'tool_choice: "none")',
            param="response_format",
        )
    if tools is not None and tools.grammar:  # tool_choice "required" / a named function: one forced call
        return tools.grammar
    return grammar or json_grammar


def _completion(req: CompletionRequest, opts: RequestOptions, fim: bool) -> None:
    """Completions' logprobs and echo into ``opts``; RequestError for echo with logprobs or a ``suffix``."""
    if req.logprobs is not None:
        opts.logprobs, opts.top_logprobs = True, req.logprobs
    opts.echo = req.echo
    if opts.echo and opts.logprobs:
        raise RequestError(
            "echo with logprobs is not supported: the head computes logprobs for generated "
            "tokens only, not for the prompt",
            param="echo",
        )
    if req.suffix:
        why = (
            "fill-in-the-middle is not implemented by this gateway"
            if fim
            else "this model has no fill-in-the-middle tokens"
        )
        raise RequestError(f"suffix is not supported: {why}", param="suffix")


def _grammar(grammar: str, parses: Callable[[str], bool] | None) -> str:
    """``grammar`` (llama-server's extension, its type and length checked by the model): a GBNF string with a
    ``root`` rule that llama.cpp parses (``parses``); "" when absent, null or empty."""
    if grammar and parses is not None and not parses(grammar):
        raise RequestError(
            "grammar does not parse: llama.cpp's GBNF parser refused it (it needs a rule named root, and every rule "
            "it uses defined)",
            param="grammar",
        )
    return grammar


__all__ = ["CHAT_PATH", "COMPLETIONS_PATH", "MAX_STOP_STRINGS", "RequestOptions", "choice_seed", "parse_params"]
