"""aiohttp app of the gateway: ``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``, ``/health``.

Each request gets its own route session (KV on every node), run in a worker thread by the same
``generate`` loop as ``ggufswarm generate``; text deltas cross to the event loop through a queue, so
concurrent requests proceed concurrently. The final stream chunk and the non-streamed body carry
``usage`` and a ``telemetry`` object (docs/protocol.md, "Generation telemetry"). A request that fails
with a 5xx (an error answer, or a stream's error event) leaves one line on stderr (``_say_failed``), and so
does each route repair that worked (``_say_repaired``).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import secrets
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

import aiohttp
from aiohttp import web

from ..artifact.default_model import model_name, resolve_model
from ..artifact.gguf_file import GGUFModelFile
from ..client.generate import GenerationStats, generate
from ..client.speculative import DEFAULT_DRAFT_MAX, MAX_DRAFT, METHODS, DraftModel, NgramDrafter, check_draft_max
from ..client.grammar import SchemaNotEnforceable, response_format_grammar
from ..client.remote import REPAIRABLE, Hop, RemoteRoute, RouteError, fetch_model_headers
from ..runtime.sampling import SamplingParams
from ..client.tokenizer import Tokenizer
from ..client.tools import ToolCallStream, ToolError, ToolRequest, new_call_id, parse_tool_calls, tool_request
from ..artifact.accounting import MAX_CONTEXT
from ..protocol.auth import auth_headers
from ..protocol.errors import ProtocolError
from ..protocol.http import json_errors_middleware, probe, probe_json, read_json, run_server

log = logging.getLogger(__name__)

JSON = "application/json"
GATEWAY = web.AppKey("gateway", object)
HEALTH_PROBE_S = 2.0  # GET /health: how long it waits for each node's (or the tracker's) answer, in seconds
# what a gateway without a tracker can and cannot do about a failed node (its error answers and its /health say it)
FIXED_ROUTE_HINT = ("this gateway serves a fixed --route and cannot replace a failed node: start that node again, "
                    "the gateway finds it on the next request; or run the gateway with --tracker and spare nodes, "
                    "and routes are repaired mid-request")


@dataclass
class GatewayConfig:
    """Gateway settings. ``route``: node URLs in order; ``hop_timeout_s``: seconds one hop may take (see RemoteRoute)."""

    route: list[str]
    model: str | None = None
    model_name: str | None = None
    host: str = "127.0.0.1"
    port: int = 0
    hop_timeout_s: float = 30.0
    wire_dtype: str = "f32"
    default_max_tokens: int = 512
    workers: int = 64
    api_keys: tuple[str, ...] = ()    # when set, /v1/* needs ``Authorization: Bearer KEY`` (OpenAI style)
    tracker: str | None = None        # plan a route per session from this tracker (``route`` unused)
    token: str | None = None          # swarm token, sent to the tracker and the nodes (None: an open swarm)
    data_dir: str = "ggufswarm-data"  # where the vocabulary (GGUF header) fetched from the swarm goes
    # /v1/completions: read control-token text in a raw prompt as control tokens (as llama-server does), or
    # as literal text (``--literal-prompts``). Chat messages are always literal (Tokenizer.encode_chat).
    prompt_special: bool = True
    session_lease_s: float = 30.0  # nodes drop a session idle this long: a gateway that dies frees its KV that soon
    chat_template: str | None = None  # jinja2 chat template used instead of the GGUF's (``--chat-template-file``)
    speculative: str = "none"  # "ngram": prompt-lookup drafts verified by the route (client.speculative), or "none"
    draft_max: int = DEFAULT_DRAFT_MAX  # most tokens drafted per verify step (a request's speculative.n_max lowers it)
    draft_model: str | None = None  # speculative "draft": a small GGUF of the served model's vocabulary, run here
    draft_threads: int = 1          # its llama.cpp threads
    draft_sessions: int = 4         # requests drafting at once (others decode without drafts)


class RequestError(ProtocolError):
    """A request the gateway refuses: HTTP ``status``, OpenAI error ``type``, ``code`` and ``param``."""

    def __init__(self, message: str, status: int = 400, code: str = "invalid_request", param: str | None = None,
                 type_: str = "invalid_request_error"):
        super().__init__(code, message, status)
        self.param, self.type = param, type_


class Cancelled(Exception):
    """The client went away; the worker stops at the next token."""


def _fixed_route_error(exc: RouteError) -> RouteError:
    """``exc`` (a node of the route failed) with what a gateway without a tracker can and cannot do about it."""
    out = RouteError(f"{exc} ({FIXED_ROUTE_HINT})", exc.status, exc.code, exc.hop)
    out.late = exc.late
    return out


def _one_line(text) -> str:
    """``text`` with its line breaks as spaces: one line of a log."""
    return " ".join(str(text).splitlines())


def _say_failed(what: str, status: int, code: str, message: str) -> None:
    """One line on stderr for a request that failed on the gateway's side (``status`` >= 500; a client's 4xx
    says nothing): ``ggufswarm gateway: WHAT (STATUS CODE): MESSAGE``, flushed at once."""
    if status >= 500:
        print(f"ggufswarm gateway: {what} ({status} {code}): {_one_line(message)}", file=sys.stderr, flush=True)


def _say_repaired(repairs: list[dict]) -> None:
    """One stderr line per route repair that worked (``telemetry.repairs``): ``ggufswarm gateway: repaired a
    route: node URL (layers a:b) failed (CAUSE); continued on URL, ... (N tokens restored, M replayed)``."""
    for r in repairs:
        if r.get("replacement") and "error" not in r:
            lo, hi = r["replaced_layers"]
            replanned = "" if [lo, hi] == r["layers"] else f"; layers {lo}:{hi} re-planned"
            print(f"ggufswarm gateway: repaired a route: node {r['hop']} (layers {r['layers'][0]}:{r['layers'][1]}) "
                  f"failed ({r['cause']}); continued on {', '.join(r['replacement'])}{replanned} "
                  f"({r['restored_tokens']} tokens restored, {r['tokens_replayed']} replayed)",
                  file=sys.stderr, flush=True)


def _error_response(exc: Exception, headers: dict | None = None, log: bool = False) -> web.Response:
    """OpenAI's error answer ``{"error": {message, type, param, code}}`` (plus ``telemetry`` when the exception
    carries it) for a RequestError, a RouteError, any other ProtocolError, or a bug (500). ``log``: a 5xx also
    leaves a "request failed" line on stderr (_say_failed)."""
    if isinstance(exc, RequestError):
        err = {"message": str(exc), "type": exc.type, "param": exc.param, "code": exc.code}
        status = exc.status
    elif isinstance(exc, ProtocolError):
        kind = "invalid_request_error" if exc.status < 500 else "server_error"
        err = {"message": exc.message, "type": kind, "param": None, "code": exc.code}
        status = exc.status
    elif isinstance(exc, RouteError):
        err = {"message": str(exc), "type": "route_error", "param": None, "code": exc.code}
        status = exc.status
    else:
        err = {"message": f"{type(exc).__name__}: {exc}", "type": "server_error", "param": None, "code": "internal"}
        status = 500
    body = {"error": err}
    if getattr(exc, "telemetry", None):
        body["telemetry"] = exc.telemetry
    if log:
        _say_failed("request failed", status, err["code"], err["message"])
    return web.Response(body=json.dumps(body).encode(), status=status, content_type=JSON, headers=headers)


def _number(body: dict, name: str, default, lo=None, hi=None, kind=float):
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and not isinstance(value, int)):
        raise RequestError(f"{name} must be {'an integer' if kind is int else 'a number'}, got {value!r}", param=name)
    if value != value or (lo is not None and value < lo) or (hi is not None and value > hi):
        bound = f"in [{lo}, {hi}]" if lo is not None and hi is not None else (f">= {lo}" if lo is not None else f"<= {hi}")
        raise RequestError(f"{name} must be {bound}, got {value!r}", param=name)
    return kind(value)


# OpenAI parameters that change nothing in what one locally served model generates: accepted and ignored.
IGNORED_PARAMS = frozenset({"user", "store", "metadata", "service_tier", "safety_identifier", "prompt_cache_key",
                            "parallel_tool_calls", "cache_prompt"})
# llama-server sampler settings this gateway does not implement: accepted only at the value that turns them off.
NEUTRAL_EXTRAS = {"typical_p": 1.0, "mirostat": 0, "dry_multiplier": 0.0, "xtc_probability": 0.0,
                  "top_n_sigma": -1.0, "dynatemp_range": 0.0, "n_probs": 0, "min_keep": 0}
EOG_BIAS = -1e30  # ignore_eos: llama-server biases end-of-generation tokens by -inf; a finite "never" here
# ... and their sub-settings, which do nothing while the setting above is off: accepted and ignored.
DEPENDENT_EXTRAS = frozenset({"mirostat_tau", "mirostat_eta", "dry_base", "dry_allowed_length", "dry_penalty_last_n",
                              "dry_sequence_breakers", "xtc_threshold", "dynatemp_exponent"})
_COMMON_PARAMS = frozenset({"model", "max_tokens", "max_completion_tokens", "temperature", "top_p", "n", "stream",
                            "stream_options", "stop", "seed", "presence_penalty", "frequency_penalty", "logit_bias",
                            "logprobs", "top_k", "min_p", "repeat_penalty", "repeat_last_n", "ignore_eos",
                            "speculative.n_max", "skip_special_tokens"})
CHAT_PARAMS = _COMMON_PARAMS | {"messages", "top_logprobs", "response_format", "tools", "tool_choice", "functions",
                                "function_call"}
COMPLETION_PARAMS = _COMMON_PARAMS | {"prompt", "echo", "suffix", "best_of"}
MAX_LOGIT_BIAS = 1024  # entries of one request's logit_bias


@dataclass
class RequestOptions:
    """What an OpenAI request body asks for, checked (see ``parse_params``).

    ``logprobs``: report the sampled tokens' logprobs; ``top_logprobs``: that many most likely alternatives per
    token (chat 0..20, completions 0..5); ``include_usage``: a final stream chunk with empty ``choices`` and
    ``usage``; ``echo``: the completion's text starts with the prompt; ``ignore_eos``: end-of-generation tokens
    are never drawn (llama-server's extension; ``Gateway.run`` adds their logit bias).
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


def _flag(body: dict, name: str) -> bool:
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise RequestError(f"{name} must be true or false, got {value!r}", param=name)
    return value


def _check_known(body: dict, chat: bool) -> None:
    """RequestError naming the first parameter that is not implemented (or not neutral) for this endpoint."""
    known = CHAT_PARAMS if chat else COMPLETION_PARAMS
    where = "/v1/chat/completions" if chat else "/v1/completions"
    for name, value in body.items():
        if name in known or name in IGNORED_PARAMS or name in DEPENDENT_EXTRAS:
            continue
        if name in NEUTRAL_EXTRAS:
            neutral = NEUTRAL_EXTRAS[name]
            same_kind = isinstance(value, (bool, int, float)) and isinstance(value, bool) == isinstance(neutral, bool)
            if value is None or (same_kind and value == neutral):
                continue
            raise RequestError(f"{name} (a llama-server sampler setting) is not implemented by this gateway; omit it "
                               f"or leave it at {json.dumps(neutral)}", param=name)
        raise RequestError(f"unknown parameter {name!r}: not a parameter {where} implements here (docs/protocol.md, "
                           f"\"Gateway\", lists them)", param=name, code="unknown_parameter")


def _logit_bias(body: dict, n_vocab: int | None) -> tuple:
    value = body.get("logit_bias")
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise RequestError("logit_bias must be an object mapping token ids (strings) to a bias in [-100, 100]",
                           param="logit_bias")
    if len(value) > MAX_LOGIT_BIAS:
        raise RequestError(f"logit_bias has {len(value)} entries; at most {MAX_LOGIT_BIAS}", param="logit_bias")
    pairs = []
    for key, bias in value.items():
        if not (key.isascii() and key.isdigit()) or (n_vocab is not None and int(key) >= n_vocab):
            raise RequestError(f"logit_bias keys must be token ids in [0, {n_vocab}), got {key!r}", param="logit_bias")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -100 <= bias <= 100:
            raise RequestError(f"logit_bias values must be numbers in [-100, 100], got {bias!r} for token {key}",
                               param="logit_bias")
        pairs.append((int(key), float(bias)))
    return tuple(pairs)


def parse_params(body: dict, default_max_tokens: int, chat: bool = True, n_vocab: int | None = None,
                 fim: bool = False, tools: ToolRequest | None = None) -> RequestOptions:
    """The checked options of an OpenAI request body for ``/v1/chat/completions`` (``chat``) or ``/v1/completions``.

    Omitted settings take llama.cpp server defaults (temperature 0.8, top_k 40, top_p 0.95, min_p 0.05,
    repeat_penalty 1, repeat_last_n 64). ``top_k``, ``min_p``, ``repeat_penalty``, ``repeat_last_n`` (-1: the
    whole context, as llama-server) and ``ignore_eos`` are accepted as llama-server extensions; ``n_vocab``
    bounds ``logit_bias``'s token ids; ``fim``: the model has fill-in-the-middle tokens (``suffix`` is still
    refused: not implemented); ``tools``: the request's checked tools (client.tools.tool_request, which checks
    ``tools`` / ``tool_choice`` / ``functions`` / ``function_call``): a forced call's grammar becomes
    ``params.grammar``. Raises RequestError (400, ``param`` naming the parameter) for a parameter that is
    unknown, of the wrong type, out of range, or not implemented (``n``/``best_of`` > 1, ``suffix``, a
    ``response_format`` schema constrained decoding cannot enforce (client.grammar), ``response_format`` other
    than text with tools offered, ``echo`` with ``logprobs``, a llama-server sampler other than the ones above).
    ``response_format`` json_object / json_schema become ``params.grammar``.
    """
    _check_known(body, chat)
    if _number(body, "n", 1, 1, None, int) != 1:
        raise RequestError("only n = 1 is supported", param="n")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    max_tokens = _number({"max_tokens": max_tokens}, "max_tokens", default_max_tokens, 0, None, int)
    d = SamplingParams()
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise RequestError(f"seed must be an integer, got {seed!r}", param="seed")
    repeat_last_n = _number(body, "repeat_last_n", d.repeat_last_n, -1, 2 ** 31 - 1, int)
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
        seed=seed)
    try:
        params = params.validate()
    except ValueError as exc:
        raise RequestError(str(exc)) from None
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    elif not (isinstance(stop, list) and all(isinstance(s, str) and s for s in stop) and len(stop) <= 16):
        raise RequestError("stop must be a string or a list of up to 16 non-empty strings", param="stop")
    stream = _flag(body, "stream")
    skip_special = body.get("skip_special_tokens") is None or _flag(body, "skip_special_tokens")
    opts = RequestOptions(params, max_tokens, stop, stream, ignore_eos=_flag(body, "ignore_eos"),
                          special=not skip_special)
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
                raise RequestError(f"stream_options.{key} is not implemented (include_usage is)",
                                   param="stream_options")
        if not isinstance(stream_options.get("include_usage", False), bool):
            raise RequestError(f"stream_options.include_usage must be true or false, got "
                               f"{stream_options['include_usage']!r}", param="stream_options")
        opts.include_usage = stream_options.get("include_usage", False)
    if chat:
        opts.logprobs = _flag(body, "logprobs")
        if body.get("top_logprobs") is not None:
            opts.top_logprobs = _number(body, "top_logprobs", 0, 0, 20, int)
            if not opts.logprobs:
                raise RequestError("top_logprobs needs logprobs: true", param="top_logprobs")
        try:  # constrained decoding: the head's llama.cpp grammar sampler
            grammar = response_format_grammar(body.get("response_format"))
        except SchemaNotEnforceable as exc:
            raise RequestError(str(exc), param="response_format") from None
        if grammar and tools is not None:
            raise RequestError("response_format (json_object / json_schema) together with tools is not supported: "
                               "the answer would have to be a tool call and JSON at once; drop one (or send "
                               "tool_choice: \"none\")", param="response_format")
        if tools is not None and tools.grammar:  # tool_choice "required" / a named function: one forced call
            grammar = tools.grammar
        if grammar:
            opts.params = replace(opts.params, grammar=grammar)
    else:
        if body.get("logprobs") is not None:
            opts.logprobs = True
            opts.top_logprobs = _number(body, "logprobs", 0, 0, 5, int)
        opts.echo = _flag(body, "echo")
        if opts.echo and opts.logprobs:
            raise RequestError("echo with logprobs is not supported: the head computes logprobs for generated "
                               "tokens only, not for the prompt", param="echo")
        if _number(body, "best_of", 1, 1, None, int) != 1:
            raise RequestError("only best_of = 1 is supported", param="best_of")
        suffix = body.get("suffix")
        if suffix is not None and not isinstance(suffix, str):
            raise RequestError("suffix must be a string", param="suffix")
        if suffix:
            why = ("fill-in-the-middle is not implemented by this gateway" if fim else
                   "this model has no fill-in-the-middle tokens")
            raise RequestError(f"suffix is not supported: {why}", param="suffix")
    return opts


def _message_text(content) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise RequestError("message content parts must be {\"type\": \"text\", \"text\": ...}", param="messages")
            parts.append(part["text"])
        return "".join(parts)
    if content is None:
        return ""
    raise RequestError("message content must be a string or a list of text parts", param="messages")


class _Guarded:
    """Wraps a RouteSession so a disconnected client stops the generation at the next step. With ``logprobs``
    it keeps ``(token, logprob, [(id, logprob), ...])`` of each sample (but end-of-generation tokens, in
    ``skip``) until ``drain``."""

    def __init__(self, session, cancelled: threading.Event, logprobs: bool = False, skip=frozenset()):
        self.session, self.cancelled = session, cancelled
        self.logprobs, self.skip = logprobs, skip
        self.entries: list[tuple[int, float, list]] = []

    def step(self, token_ids):
        if self.cancelled.is_set():
            raise Cancelled()
        token = self.session.step(token_ids)
        if self.logprobs and token is not None and token not in self.skip:
            self.entries.append((token, self.session.last_token_logprob, self.session.last_logprobs or []))
        return token

    @property
    def max_length(self) -> int:
        return self.session.max_length

    @property
    def max_verify_tokens(self) -> int:
        return self.session.max_verify_tokens

    def verify(self, token_ids):
        """The session's verify step (speculative decoding; never with logprobs: Gateway._drafter)."""
        if self.cancelled.is_set():
            raise Cancelled()
        return self.session.verify(token_ids)

    def drop(self, n):
        self.session.drop(n)

    def drain(self) -> list[tuple[int, float, list]]:
        """The samples kept since the last drain."""
        out, self.entries = self.entries, []
        return out

    def close(self):
        self.session.close()


class Gateway:
    """State shared by the handlers: tokenizer, route (described lazily from the nodes' /health), workers."""

    def __init__(self, config: GatewayConfig, parent: "Gateway | None" = None):
        if config.speculative not in METHODS:
            raise ValueError(f"speculative must be one of {', '.join(METHODS)}, got {config.speculative!r}")
        check_draft_max(config.draft_max)
        if (config.speculative == "draft") != bool(config.draft_model):
            raise ValueError("speculative draft needs a draft model (--draft-model PATH), and a draft model needs "
                             "--speculative draft")
        if config.speculative == "draft" and config.tracker and not config.model:
            raise ValueError("speculative draft needs the served model named (--model): a draft model drafts for one "
                             "vocabulary")
        self.config = config
        self.draft: DraftModel | None = None  # loaded with the vocabulary (load)
        self.tokenizer: Tokenizer | None = None
        self.model_name = config.model_name
        self.fingerprint: str | None = None  # the model's GGUF header fingerprint (load)
        self._route: RemoteRoute | None = None
        if parent is None:
            self.pool = ThreadPoolExecutor(max_workers=config.workers, thread_name_prefix="route")
            self._route_lock = threading.Lock()
            self._suspects: dict[str, float] = {}  # node URL -> until when new routes avoid it (monotonic s)
            self.created = int(time.time())
        else:  # one model of a gateway serving every model: the workers and what failed lately are shared
            self.pool, self._route_lock, self._suspects = parent.pool, parent._route_lock, parent._suspects
            self.created = parent.created
        self._models: dict[str, Gateway] = {}
        self._models_lock = threading.Lock()

    @property
    def every_model(self) -> bool:
        """Whether this gateway serves every model of its tracker's swarm (``--tracker`` without ``--model``):
        each request's ``model`` picks one, loaded on first use (``for_model``)."""
        return bool(self.config.tracker) and self.config.model is None and self.config.model_name is None

    def for_model(self, name) -> "Gateway":
        """The gateway of model ``name`` (blocking: fetches its header from the swarm the first time). Only on
        a gateway serving every model. RequestError 400 without a name, 404 ``model_not_found`` for a model
        the swarm has not published; TrackerError when the tracker cannot be reached."""
        from ..swarm.publish import TrackerError

        if not isinstance(name, str) or not name:
            raise RequestError("model is required: this gateway serves every model of its swarm (GET /v1/models "
                               "lists them)", param="model")
        with self._models_lock:
            found = self._models.get(name)
        if found is not None:
            return found
        child = Gateway(replace(self.config, model=name), parent=self)
        try:
            child.load()
        except TrackerError as exc:
            if exc.status == 404:
                raise RequestError(f"model {name!r} is not published in this swarm (GET /v1/models lists the "
                                   f"models it can serve)", 404, "model_not_found", "model") from None
            raise
        with self._models_lock:
            return self._models.setdefault(name, child)

    SUSPECT_S = 30.0  # how long new routes avoid a node that failed (the tracker forgets it after its TTL)
    OPEN_ATTEMPTS = 3  # plans tried for one session when opening it fails on a node

    def suspect(self, url: str) -> None:
        """Avoid ``url`` in new routes for SUSPECT_S seconds (it failed an open or a step). With a tracker, a
        newly suspected node is also reported to it (``POST /nodes/report``, in the background): the tracker
        checks the node and, when it is down, stops routing anyone to it before its TTL runs out."""
        now = time.monotonic()
        with self._route_lock:
            new = self._suspects.get(url, 0.0) <= now
            self._suspects[url] = now + self.SUSPECT_S
        if new and self.config.tracker:
            threading.Thread(target=self._report, args=(url,), name="report-node", daemon=True).start()

    def _report(self, url: str) -> None:
        from ..swarm.publish import TrackerError, tracker_call
        try:
            tracker_call(f"{self.config.tracker.rstrip('/')}/nodes/report", "POST", {"url": url}, timeout=10.0,
                         token=self.config.token)
        except TrackerError as exc:  # best effort: the node's TTL still runs out
            log.info("reporting node %s to the tracker failed: %s", url, exc.reason)

    def suspects(self) -> set[str]:
        """Node URLs new routes avoid now."""
        now = time.monotonic()
        with self._route_lock:
            self._suspects = {u: t for u, t in self._suspects.items() if t > now}
            return set(self._suspects)

    def load(self) -> None:
        """Read the GGUF header and vocabulary (blocking): from ``--model``; with a tracker, fetched from the
        swarm (header only); with ``--route`` and no ``--model``, fetched from the route's first node (its
        headers: the model is whatever the route serves). ``fingerprint`` is then the model's identity, which
        every node of every route must share. Raises GGUFError / OSError / TrackerError / RouteError."""
        if self.every_model:
            return  # each model is loaded on first use (for_model)
        if self.config.tracker:
            from ..swarm.shard_fetch import fetch_header
            self.model_name = self.config.model or self.config.model_name
            path, self._swarm = fetch_header(self.config.tracker, self.model_name, Path(self.config.data_dir),
                                             token=self.config.token)
        elif self.config.model is None and self.config.route:
            path, info = fetch_model_headers(self.config.route[0], Path(self.config.data_dir),
                                             min(self.config.hop_timeout_s, 30.0), token=self.config.token)
            self.model_name = self.model_name or info["name"]
        else:
            path = resolve_model(self.config.model)
        file = GGUFModelFile(path)
        self.tokenizer = Tokenizer(str(file.path), file.metadata)
        if self.config.chat_template:  # --chat-template-file: used instead of the GGUF's
            self.tokenizer.chat_template = self.config.chat_template
        self.fingerprint = file.fingerprint
        self.model_name = self.model_name or model_name(self.config.model, file.path)
        if self.config.speculative == "draft" and self.draft is None:  # ValueError: another vocabulary
            self.draft = DraftModel(self.config.draft_model, file.metadata, sessions=self.config.draft_sessions,
                                    threads=self.config.draft_threads)

    def route(self, max_length: int = 1, exclude=(), span: tuple[int, int] | None = None) -> RemoteRoute:
        """The route, asking each node's /health the first time (blocking). Raises RouteError / ValueError.

        With a tracker, a new route is planned for every session (sticky for that session), so new
        sessions see nodes that came and went; ``max_length`` (tokens) must fit every node's free KV.
        ``exclude`` (node URLs) and ``span`` (layers ``(start, end)``) plan a replacement for a failed hop.
        Nodes that failed lately (``suspects``) are avoided too, unless no route exists without them.
        """
        if self.config.tracker:
            from urllib.parse import urlencode

            from ..swarm.publish import TrackerError, tracker_call
            plans = [set(exclude) | self.suspects(), set(exclude)]  # then the suspects too: perhaps one is back
            for avoid in plans[:1] if plans[0] == plans[1] else plans:
                query = {"model": self.model_name, "max_length": max_length}
                if avoid:
                    query["exclude"] = ",".join(sorted(avoid))
                if span:
                    query["start"], query["end"] = span
                try:
                    planned = tracker_call(f"{self.config.tracker.rstrip('/')}/route?{urlencode(query)}",
                                           token=self.config.token)
                    hops = [Hop.from_advertisement(ad) for ad in planned["route"]]
                    if all(hops):  # described by their advertisements: no /health round trip per node (TTFT)
                        return RemoteRoute.of_hops(hops, self.config.hop_timeout_s, part=span is not None,
                                                   model=self.fingerprint, token=self.config.token)
                    return RemoteRoute([hop["url"] for hop in planned["route"]], self.config.hop_timeout_s,
                                       part=span is not None, model=self.fingerprint, token=self.config.token)
                except TrackerError as exc:
                    # the tracker's reason, not its URL: API clients need not learn the swarm's addresses
                    refused = RouteError(f"no route for {max_length} tokens: {exc.reason}", 503, "no_route")
                except ValueError as exc:
                    raise RouteError(f"bad route from the tracker: {exc} (this gateway's model: {self.model_name})",
                                     502, "bad_route") from None
            raise refused
        with self._route_lock:
            if self._route is None:
                try:
                    self._route = RemoteRoute(self.config.route, self.config.hop_timeout_s, model=self.fingerprint,
                                              token=self.config.token)
                except ValueError as exc:
                    raise RouteError(f"bad route: {exc} (this gateway's model: {self.model_name})", 502,
                                     "bad_route") from None
            return self._route

    def run(self, ids: list[int], opts: RequestOptions, emit, cancelled: threading.Event,
            prompt_param: str = "prompt") -> None:
        """Worker thread: open a route session, generate, emit ("open", session), ("delta", text, logprob entries
        of the tokens behind it (see _Guarded)), ("done", stats, telemetry) or ("error", exc, tokens generated
        before it) events."""
        session, stats = None, GenerationStats()
        params, max_tokens, stop = opts.params, opts.max_tokens, opts.stop
        try:
            if params.seed is None:  # a seed of our own: a repaired route draws the same tokens (see Sampler)
                params = replace(params, seed=secrets.randbits(62))
            # presence / frequency penalties count generated tokens only (OpenAI): from the prompt's end on
            params = replace(params, penalize_from=len(ids))
            if opts.ignore_eos:  # as llama-server: end-of-generation tokens biased to never (over any logit_bias)
                bias = dict(params.logit_bias) | {t: EOG_BIAS for t in self.tokenizer.eog_ids}
                params = replace(params, logit_bias=tuple(sorted(bias.items())))
            for attempt in range(self.OPEN_ATTEMPTS):
                try:
                    session, max_length = self._open(ids, params, max_tokens, prompt_param, opts)
                    break
                except RouteError as exc:  # a node of the plan is gone (the tracker still lists it): plan again
                    if not self.config.tracker or exc.code not in REPAIRABLE or not exc.hop \
                            or attempt + 1 == self.OPEN_ATTEMPTS:
                        raise
                    self.suspect(exc.hop)
            emit(("open", session))
            # a session holds max_length tokens: the prompt, then every sampled token but the last is fed back
            budget = min(max_tokens, max_length - len(ids) + 1)  # past it the answer ends with "length"
            guarded = _Guarded(session, cancelled, opts.logprobs, self.tokenizer.eog_ids)
            drafter = self._drafter(session, opts)
            try:
                for delta in generate(guarded, self.tokenizer, ids, budget, stop, stats, drafter, opts.special):
                    emit(("delta", delta, guarded.drain()))
            finally:
                if hasattr(drafter, "close"):
                    drafter.close()
            rest = guarded.drain()  # tokens whose text was held back (a stop string) or empty
            if rest:
                emit(("delta", "", rest))
            _say_repaired(session.telemetry.repairs)  # before the answer ends: its reader may look for the line
            emit(("done", stats, self.telemetry(session, stats)))
        except Cancelled:
            if session is not None:
                _say_repaired(session.telemetry.repairs)
            emit(("error", RequestError("client went away", 499, "cancelled"), stats.completion_tokens))
        except Exception as exc:  # noqa: BLE001 - handed to the event loop
            if isinstance(exc, RouteError) and exc.code in REPAIRABLE and not self.config.tracker:
                exc = _fixed_route_error(exc)
            if session is not None:  # what the session did before it failed (repairs attempted, route)
                exc.telemetry = {"route": session.route.describe(), "session": str(session.id),
                                 "repairs": list(session.telemetry.repairs)}
                _say_repaired(session.telemetry.repairs)
            emit(("error", exc, stats.completion_tokens))
        finally:
            if session is not None:
                session.close()

    def _open(self, ids: list[int], params: SamplingParams, max_tokens: int, prompt_param: str,
              opts: RequestOptions):
        """Plan a route and open a session on it: (RemoteSession, its max_length). RouteError, RequestError."""
        want = min(len(ids) + max(max_tokens, 1), MAX_CONTEXT)
        try:
            route = self.route(want)
        except RouteError as exc:
            if exc.code != "no_route":
                raise
            try:
                if want <= len(ids) + 1:
                    raise
                # No route has KV for the whole of max_tokens: take one that holds the prompt; the answer ends at
                # its length with finish_reason "length", as llama-server's does at its context.
                route = self.route(len(ids) + 1)
            except RouteError as held:
                if held.code != "no_route":
                    raise
                # Nothing holds the prompt now. When no node could ever (its sessions are shorter) that is the
                # request's fault, a 400 (not a 503 a client would retry); otherwise the nodes are busy: the 503.
                try:
                    longest = self.route(1).max_length
                except RouteError:
                    raise held from None
                if len(ids) >= longest:
                    raise RequestError(f"prompt is {len(ids)} tokens; the longest session this swarm's nodes hold "
                                       f"is {longest} tokens", code="context_length_exceeded",
                                       param=prompt_param) from None
                raise held from None
        limit = route.max_length
        if len(ids) >= limit:
            raise RequestError(f"prompt is {len(ids)} tokens; this route holds at most {limit}",
                               code="context_length_exceeded", param=prompt_param)
        max_length = min(limit, len(ids) + max(max_tokens, 1))
        def replan(exclude, span):  # repair: a replacement for a failed hop's span, from the tracker
            for url in exclude:  # nodes this session saw fail: new sessions avoid them too
                self.suspect(url)
            return self.route(max_length, exclude, span)
        return route.open(max_length, params, self.config.wire_dtype, top_logprobs=opts.top_logprobs,
                          replan=replan if self.config.tracker else None,
                          lease_s=self.config.session_lease_s, logprobs=opts.logprobs), max_length

    def _drafter(self, session, opts: RequestOptions):
        """The request's drafter with ``--speculative ngram`` or ``draft`` (close it after the generation): None when
        speculation is off (also per request: ``speculative.n_max`` 0), for requests with logprobs (a verify step
        reports none), on a route whose head cannot verify (an older node), or when the draft model has no free
        session that long: the request is decoded plainly."""
        k = self.config.draft_max if opts.draft_max is None else min(opts.draft_max, self.config.draft_max)
        if self.config.speculative == "none" or k < 1 or opts.logprobs or session.max_verify_tokens < 2:
            return None
        k = min(k, session.max_verify_tokens - 1)
        if self.config.speculative == "draft":
            return self.draft.drafter(k, session.max_length) if self.draft is not None else None
        return NgramDrafter(k)

    def telemetry(self, session, stats: GenerationStats) -> dict:
        """The ``telemetry`` object of a finished generation (ms, tok/s, bytes, tokens; the route as it
        ended, after any repairs, each listed in ``repairs``)."""
        per_hop = session.telemetry.summary(session.route)
        return {"route": session.route.describe(), "session": str(session.id), "wire_dtype": self.config.wire_dtype,
                "prompt_tokens": stats.prompt_tokens, "completion_tokens": stats.completion_tokens,
                "ttft_ms": round(stats.ttft_ms, 2), "prefill_tok_s": round(stats.prefill_tok_s, 2),
                "decode_tok_s": round(stats.decode_tok_s, 2), **per_hop,
                "speculative": stats.speculative_summary()}


def _sse(obj) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


async def _stream(resp: web.StreamResponse, request: web.Request, queue: asyncio.Queue, chunk, usage,
                  chat: bool, opts: RequestOptions, echo: str | None, calls: ToolCallStream | None = None,
                  tools: ToolRequest | None = None) -> None:
    """Write SSE chunks from the worker's events until done (final chunk, the usage chunk when asked for,
    [DONE]) or an error event (a 5xx one also leaves a "stream failed after N tokens" line on stderr). With
    ``calls`` (tools offered), text that may be a tool call is held back and sent at the end as one
    ``delta.tool_calls`` chunk (finish_reason ``tool_calls``), or as content when it was none."""
    await resp.prepare(request)
    if chat:
        await resp.write(_sse(chunk(None, first=True)))
    if echo:
        await resp.write(_sse(chunk(echo)))
    while True:
        event = await queue.get()
        if event[0] == "delta":
            text = calls.push(event[1]) if calls is not None else event[1]
            if calls is None or text or event[2]:
                await resp.write(_sse(chunk(text, entries=event[2])))
        elif event[0] == "done":
            stats, telemetry = event[1], event[2]
            finish = stats.finish_reason
            if calls is not None:
                content, made = calls.finish()
                if content:
                    await resp.write(_sse(chunk(content)))
                if made:
                    await resp.write(_sse(chunk(None, tool_calls=tools.calls(made))))
                    finish = "tool_calls"
            last = chunk(None, finish)
            if opts.include_usage:  # OpenAI: one more chunk, with no choices, carries the usage
                await resp.write(_sse(last))
                last = {**chunk(None), "choices": [], "usage": usage(stats)}
            last["telemetry"] = telemetry
            await resp.write(_sse(last))
            await resp.write(b"data: [DONE]\n\n")
            break
        else:
            exc = event[1]
            err = {"message": str(exc), "type": "route_error" if isinstance(exc, RouteError) else
                   "server_error", "code": getattr(exc, "code", "internal"),
                   "status": getattr(exc, "status", 500)}
            _say_failed(f"stream failed after {event[2]} tokens", err["status"], err["code"], err["message"])
            event = {"error": err}
            if getattr(exc, "telemetry", None):
                event["telemetry"] = exc.telemetry
            await resp.write(_sse(event))
            break
    await resp.write_eof()


class _Logprobs:
    """Renders the head's samples ``(token, logprob, [(id, logprob), ...])`` in OpenAI's logprobs shapes."""

    def __init__(self, tokenizer: Tokenizer, offset: int = 0):
        self.tokenizer = tokenizer
        self.offset = offset  # completions' text_offset of the next token (characters)

    def _piece(self, token: int) -> tuple[str, bytes]:
        raw = self.tokenizer.token_bytes(token)
        return raw.decode("utf-8", errors="replace"), raw

    def chat(self, entries) -> dict:
        """``{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}],
        "refusal": None}`` (chat.completion and chat.completion.chunk)."""
        content = []
        for token, logprob, top in entries:
            text, raw = self._piece(token)
            alts = []
            for tid, lp in top:
                t, b = self._piece(tid)
                alts.append({"token": t, "logprob": lp, "bytes": list(b)})
            content.append({"token": text, "logprob": logprob, "bytes": list(raw), "top_logprobs": alts})
        return {"content": content, "refusal": None}

    def completion(self, entries) -> dict:
        """``{"tokens", "token_logprobs", "top_logprobs": [{text: logprob}], "text_offset"}``: each dict holds the
        most likely tokens and the sampled one (OpenAI: "up to logprobs + 1 elements")."""
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token, logprob, top in entries:
            text, _ = self._piece(token)
            alts = {self._piece(tid)[0]: lp for tid, lp in top}
            alts.setdefault(text, logprob)
            out["tokens"].append(text)
            out["token_logprobs"].append(logprob)
            out["top_logprobs"].append(alts)
            out["text_offset"].append(self.offset)
            self.offset += len(text)
        return out


async def _complete(request: web.Request, ids: list[int], body: dict, chat: bool,
                    prompt: str | None = None, gw: "Gateway | None" = None,
                    tools: ToolRequest | None = None) -> web.StreamResponse:
    gw = gw or request.app[GATEWAY]
    opts = parse_params(body, gw.config.default_max_tokens, chat, gw.tokenizer.n_vocab, gw.tokenizer.has_fim, tools)
    echo = prompt if opts.echo else None
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    cancelled = threading.Event()

    def emit(event):
        loop.call_soon_threadsafe(queue.put_nowait, event)

    work = loop.run_in_executor(gw.pool, gw.run, ids, opts, emit, cancelled, "messages" if chat else "prompt")
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
    created = int(time.time())
    obj = "chat.completion" if chat else "text_completion"
    render = _Logprobs(gw.tokenizer, len(echo) if echo else 0)

    def logprobs(entries) -> dict | None:
        if not opts.logprobs:
            return None
        return render.chat(entries) if chat else render.completion(entries)

    async def next_event():
        # aiohttp does not cancel a handler whose client hung up: look for that while waiting, so a non-streamed
        # request whose client left stops its generation (and frees its KV on every node) within a second
        while True:
            if request.transport is None or request.transport.is_closing():
                raise ConnectionResetError("the client went away")
            try:
                return await asyncio.wait_for(queue.get(), 0.5)
            except asyncio.TimeoutError:
                pass

    try:
        try:
            event = await next_event()
        except ConnectionResetError:
            return web.Response(status=499)
        if event[0] == "error":
            return _error_response(event[1], log=True)

        def chunk(text: str | None, finish: str | None = None, first: bool = False, entries=None,
                  tool_calls=None) -> dict:
            lp = logprobs(entries) if entries else None
            if chat:
                delta = {"role": "assistant", "content": ""} if first else ({"content": text} if text else {})
                if tool_calls:  # OpenAI's streamed shape: each call whole, with its index
                    delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(tool_calls)]
                choice = {"index": 0, "delta": delta, "logprobs": lp, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": text or "", "logprobs": lp, "finish_reason": finish}
            out = {"id": rid, "object": obj + ".chunk" if chat else obj, "created": created,
                   "model": gw.model_name, "choices": [choice]}
            if opts.include_usage:  # OpenAI: every chunk but the last has "usage": null
                out["usage"] = None
            return out

        def usage(stats: GenerationStats) -> dict:
            return {"prompt_tokens": stats.prompt_tokens, "completion_tokens": stats.completion_tokens,
                    "total_tokens": stats.prompt_tokens + stats.completion_tokens}

        if opts.stream:
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
            try:
                await _stream(resp, request, queue, chunk, usage, chat, opts, echo,
                              ToolCallStream() if tools is not None else None, tools)
            except ConnectionResetError:
                pass  # the client left; `finally` below stops the worker
            return resp
        parts, entries = [echo or ""], []
        while True:
            try:
                event = await next_event()
            except ConnectionResetError:
                return web.Response(status=499)  # nobody reads it; `finally` below stops the worker
            if event[0] == "delta":
                parts.append(event[1])
                entries += event[2]
            elif event[0] == "done":
                stats, telemetry = event[1], event[2]
                break
            else:
                return _error_response(event[1], log=True)
        text = "".join(parts)
        if chat:
            message, finish = {"role": "assistant", "content": text}, stats.finish_reason
            if tools is not None:
                message["content"], made = parse_tool_calls(text)
                if made:
                    message["tool_calls"], finish = tools.calls(made), "tool_calls"
            choice = {"index": 0, "message": message, "logprobs": logprobs(entries), "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text, "logprobs": logprobs(entries), "finish_reason": stats.finish_reason}
        return web.Response(body=json.dumps({"id": rid, "object": obj, "created": created, "model": gw.model_name,
                                             "choices": [choice], "usage": usage(stats),
                                             "telemetry": telemetry}).encode(), content_type=JSON)
    finally:
        cancelled.set()  # no-op when finished; stops the worker when the client left mid-stream
        if not work.done():
            work.add_done_callback(lambda f: f.exception())


async def _read_body(request: web.Request) -> dict:
    """The request's JSON object (protocol/http.py read_json: size, depth, charset limits); RequestError (400,
    413) otherwise, also for a lone UTF-16 surrogate in a string."""
    try:
        body = await read_json(request)
    except ProtocolError as exc:
        raise RequestError(exc.message, exc.status, exc.code) from None
    try:  # JSON may escape a lone UTF-16 surrogate ("\\ud800"): no text can hold it, no tokenizer can take it
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as exc:
        raise RequestError(f"body holds a lone UTF-16 surrogate (\\u{ord(exc.object[exc.start]):04x}), which is not "
                           f"text; send valid Unicode") from None
    return body


CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


def _tool_calls(calls, i: int) -> list[dict]:
    """An assistant message's OpenAI ``tool_calls`` in the shape Hugging Face chat templates read: ``{"id",
    "type": "function", "function": {"name", "arguments"}}`` with ``arguments`` a JSON object when the string
    holds one (Qwen 2.5 / Hermes and Llama 3.1 templates write ``arguments | tojson``), else the string.
    RequestError (param ``messages``) for a malformed one."""
    if not isinstance(calls, list) or not calls:
        raise RequestError(f"messages[{i}].tool_calls must be a non-empty list", param="messages")
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or call.get("type", "function") != "function" \
                or not isinstance(fn.get("name"), str) or not isinstance(fn.get("arguments", ""), (str, dict)) \
                or not isinstance(call.get("id", ""), str):
            raise RequestError(f'messages[{i}].tool_calls[{j}] must be {{"id", "type": "function", "function": '
                               f'{{"name", "arguments": JSON string}}}}', param="messages")
        args = fn.get("arguments", "")
        try:
            parsed = json.loads(args) if isinstance(args, str) else args  # (an object, as some clients send)
            if isinstance(parsed, dict):
                args = parsed
        except ValueError:
            pass  # not JSON (a model's malformed call sent back): the template gets the string
        out.append({"id": call.get("id") or new_call_id(), "type": "function",
                    "function": {"name": fn["name"], "arguments": args}})
    return out


def chat_turns(messages, template: str | None) -> list[dict]:
    """The turns the chat template renders, from OpenAI ``messages``: ``{"role", "content"}``, plus ``tool_calls``
    on an assistant turn that made calls (see _tool_calls) and ``tool_call_id`` / ``name`` (the called
    function's, found from the id when not given) on a ``tool`` turn.

    ``developer`` (what current OpenAI clients send instead of ``system``) becomes ``system`` when the
    template has no ``developer`` role. RequestError (400, param ``messages``) for a message that is not an
    object, has an unknown role, or has no content (only an assistant turn that makes tool calls may omit it),
    or malformed ``tool_calls``.
    """
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list", param="messages")
    turns, called = [], {}
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise RequestError(f"messages[{i}] needs a role and content", param="messages")
        role = m["role"]
        if role not in CHAT_ROLES:
            raise RequestError(f"message role must be one of {', '.join(CHAT_ROLES)}, got {role!r}", param="messages")
        if m.get("content") is None and not (role == "assistant" and m.get("tool_calls")):
            raise RequestError(f"messages[{i}] ({role}) has no content", param="messages")
        if role == "developer" and "developer" not in (template or ""):
            role = "system"
        turn = {"role": role, "content": _message_text(m.get("content"))}
        if role == "assistant" and m.get("tool_calls"):
            turn["tool_calls"] = _tool_calls(m["tool_calls"], i)
            called.update((c["id"], c["function"]["name"]) for c in turn["tool_calls"])
        if role == "tool":
            call_id, name = m.get("tool_call_id"), m.get("name")
            if not isinstance(call_id, (str, type(None))) or not isinstance(name, (str, type(None))):
                raise RequestError(f"messages[{i}].tool_call_id and name must be strings", param="messages")
            if call_id is not None:
                turn["tool_call_id"] = call_id
            if name or called.get(call_id):
                turn["name"] = name or called[call_id]
        elif isinstance(m.get("name"), str):
            turn["name"] = m["name"]
        turns.append(turn)
    return turns


async def _gateway_for(request: web.Request, body: dict) -> "Gateway":
    """The gateway of the model ``body`` asks for: a gateway serving every model loads it on first use
    (Gateway.for_model); one serving one model refuses any other name with 404 ``model_not_found`` (as OpenAI)."""
    gw: Gateway = request.app[GATEWAY]
    name = body.get("model")
    if gw.every_model:
        return await asyncio.get_running_loop().run_in_executor(gw.pool, gw.for_model, name)
    if name is not None and name != gw.model_name:
        raise RequestError(f"model {name!r} is not served here; this gateway serves {gw.model_name!r}",
                           404, "model_not_found", "model")
    return gw


async def chat_completions(request: web.Request) -> web.StreamResponse:
    """``POST /v1/chat/completions`` (OpenAI): messages rendered with the GGUF chat template."""
    try:
        body = await _read_body(request)
        gw = await _gateway_for(request, body)
        turns = chat_turns(body.get("messages"), gw.tokenizer.chat_template)
        try:
            tools = tool_request(body, gw.tokenizer.chat_template)
        except ToolError as exc:
            raise RequestError(str(exc), param=exc.param) from None
        try:
            # off the event loop: a 1 MB prompt takes ~1 s to render and tokenize, other requests go on meanwhile
            ids = await asyncio.get_running_loop().run_in_executor(
                gw.pool, gw.tokenizer.encode_chat, turns, True, tools.tools if tools else None)
        except ValueError as exc:
            raise RequestError(str(exc), param="messages") from None
        return await _complete(request, ids, body, chat=True, gw=gw, tools=tools)
    except Exception as exc:  # noqa: BLE001
        return _error_response(exc, log=True)


async def completions(request: web.Request) -> web.StreamResponse:
    """``POST /v1/completions`` (OpenAI): a plain ``prompt`` string (or a list holding one)."""
    try:
        body = await _read_body(request)
        gw = await _gateway_for(request, body)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str):
            raise RequestError("prompt must be a string", param="prompt")
        ids = await asyncio.get_running_loop().run_in_executor(  # off the event loop, as for chat
            gw.pool, lambda: gw.tokenizer.encode(prompt, special=gw.config.prompt_special))
        if not ids:  # a model without BOS has nothing to start from
            raise RequestError("prompt is empty and this model adds no BOS token: give at least one token of text",
                               param="prompt")
        return await _complete(request, ids, body, chat=False, prompt=prompt, gw=gw)
    except Exception as exc:  # noqa: BLE001
        return _error_response(exc, log=True)


async def models(request: web.Request) -> web.Response:
    """``GET /v1/models``: the model this gateway serves (with a tracker: if the swarm can serve it end to end);
    a gateway serving every model lists every model the swarm can serve end to end now."""
    gw: Gateway = request.app[GATEWAY]
    names = [gw.model_name]
    if gw.config.tracker:
        from ..swarm.publish import TrackerError, tracker_call
        try:
            servable = await asyncio.get_running_loop().run_in_executor(
                None, lambda: tracker_call(gw.config.tracker.rstrip("/") + "/models", token=gw.config.token))
            names = list(servable["models"]) if gw.every_model else [n for n in names if n in servable["models"]]
        except TrackerError:
            names = []
    return web.json_response({"object": "list", "data": [
        {"id": n, "object": "model", "created": gw.created, "owned_by": "ggufswarm"} for n in names]})


async def model(request: web.Request) -> web.Response:
    """``GET /v1/models/{model}`` (OpenAI's retrieve): the model object when ``/v1/models`` lists it, else 404
    ``model_not_found``."""
    listed = json.loads((await models(request)).body)["data"]
    found = next((m for m in listed if m["id"] == request.match_info["model"]), None)
    if found is None:
        return _error_response(RequestError(f"model {request.match_info['model']!r} is not served here (GET "
                                            f"/v1/models lists what is)", 404, "model_not_found", "model"))
    return web.json_response(found)


async def health(request: web.Request) -> web.Response:
    """``GET /health``: whether this gateway can serve now. With a fixed ``--route``, every node's ``GET /health``
    is asked at once (the swarm token sent, HEALTH_PROBE_S = 2 s each); with ``--tracker``, the tracker's
    ``GET /models`` (what the swarm can serve end to end now). ``200 {"status": "ok", "model", "route", "nodes":
    [{"url", "ok"}]}`` (a tracker gateway: ``"tracker": {"ok"}`` instead of ``route`` and ``nodes``; its address
    is not shown) when all answer 200 and (tracker) the model has a complete chain of ready nodes (a gateway of
    every model: some model has); else ``503 {"status": "degraded", ..., "reason"}``, each failed probe with its
    ``error`` (protocol.http.probe: connection refused, timeout, HTTP status) and ``reason`` one line naming
    what failed (for a fixed route: that the gateway cannot replace a node, and what to do). Answers within
    about 2 s; needs no API key."""
    gw: Gateway = request.app[GATEWAY]
    config, headers = gw.config, auth_headers(gw.config.token)
    body = {"status": "ok", "model": gw.model_name}

    def entry(error: str | None) -> dict:
        return {"ok": True} if error is None else {"ok": False, "error": error}

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=HEALTH_PROBE_S)) as http:
        if config.tracker:
            answer, error = await probe_json(http, config.tracker.rstrip("/") + "/models", headers)
            body["tracker"] = entry(error)
            if error is not None:
                body["reason"] = f"the tracker does not answer: {error}"
            elif gw.every_model:
                if not answer.get("models"):
                    body["reason"] = "no model of this swarm can be served end to end now (no chain of ready nodes)"
            elif gw.model_name not in (answer.get("models") or []):
                why = (answer.get("unservable") or {}).get(gw.model_name)
                body["reason"] = f"the swarm cannot serve {gw.model_name} end to end now" + (f": {why}" if why else "")
        else:
            errors = await asyncio.gather(*(probe(http, url.rstrip("/") + "/health", headers)
                                            for url in config.route))
            body["route"] = config.route
            body["nodes"] = [{"url": url, **entry(e)} for url, e in zip(config.route, errors)]
            failed = [f"{url} ({e})" for url, e in zip(config.route, errors) if e is not None]
            if failed:
                which = "nodes" if len(failed) > 1 else "node"
                body["reason"] = f"{which} {', '.join(failed)} of the route failed; {FIXED_ROUTE_HINT}"
    if "reason" in body:
        body["status"] = "degraded"
        return web.json_response(body, status=503)
    return web.json_response(body)


def api_key_middleware(keys: tuple[str, ...]):
    """With API keys configured, ``/v1/*`` answers 401 (OpenAI's ``invalid_api_key``) without a valid
    ``Authorization: Bearer KEY``; ``/health`` stays open."""

    @web.middleware
    async def check(request: web.Request, handler):
        if keys and request.path.startswith("/v1/"):
            scheme, _, given = request.headers.get("Authorization", "").strip().partition(" ")
            given = given.strip().encode() if scheme.lower() == "bearer" else b""
            if not any(hmac.compare_digest(given, k.encode()) for k in keys):
                return _error_response(RequestError("missing or invalid API key", 401, "invalid_api_key"))
        return await handler(request)

    return check


def make_app(config: GatewayConfig) -> web.Application:
    """The gateway's aiohttp app; the vocabulary is loaded at startup, the route on first use."""
    gw = Gateway(config)
    app = web.Application(client_max_size=16 * 2 ** 20, middlewares=[api_key_middleware(tuple(config.api_keys)),
                                                                        json_errors_middleware(render=_error_response)])
    app[GATEWAY] = gw
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/v1/models/{model}", model)
    app.router.add_get("/health", health)

    async def lifecycle(app):
        await asyncio.get_running_loop().run_in_executor(gw.pool, gw.load)
        yield
        gw.pool.shutdown(wait=False, cancel_futures=True)

    app.cleanup_ctx.append(lifecycle)
    return app


def _loopback(host: str) -> bool:
    """Whether ``host`` (an address or name to listen on) is only reachable from this machine."""
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_route(config: GatewayConfig, every_s: float = 2.0) -> RemoteRoute:
    """``gateway --route``, before serving: the route's nodes answer, carry the swarm token, chain from the
    embedding to the head, and serve one model (``--model``'s, when given). A node that does not answer yet
    is waited for (one line on stderr per new reason, then a retry every ``every_s`` s: start order does not
    matter); a route that cannot work (bad chain, other model, wrong token) raises ValueError saying why."""
    model = GGUFModelFile(resolve_model(config.model)) if config.model else None
    said = None
    while True:
        try:
            return RemoteRoute(config.route, min(config.hop_timeout_s, 10.0), model=model and model.fingerprint,
                               token=config.token)
        except ValueError as exc:
            mine = f" (--model {model.path.name}: fingerprint {model.fingerprint[:12]})" if model else ""
            raise ValueError(f"bad route: {exc}{mine}") from None
        except RouteError as exc:
            if exc.status in (401, 403):
                raise ValueError(f"bad route: {exc} (give the nodes' --token)") from None
            if str(exc) != said:
                print(f"ggufswarm gateway: waiting for the route: {exc}; retrying every {every_s:g} s",
                      file=sys.stderr, flush=True)
                said = str(exc)
        time.sleep(every_s)


def run_gateway(config: GatewayConfig) -> int:
    """``ggufswarm gateway``: check the route (``--route``; see check_route), then serve until SIGINT/SIGTERM,
    printing one ready line to stdout."""
    if not config.api_keys and not _loopback(config.host):
        print(f"ggufswarm gateway: WARNING: listening on {config.host} without --api-key: anyone who can reach "
              f"this port can generate (and hold KV cache on every node of the swarm); set --api-key",
              file=sys.stderr, flush=True)
    if config.route and not config.tracker:
        check_route(config)
    if config.tracker:  # start order does not matter: wait for the tracker (and the model, when one is named)
        from ..node.server import wait_for_model
        wait_for_model(config.tracker, config.model, who="gateway", token=config.token)
    app = make_app(config)

    def ready(url: str) -> None:
        where = f"tracker {config.tracker}" if config.tracker else f"route {','.join(config.route)}"
        print(f"ggufswarm gateway ready: {url}/v1 {where}", flush=True)

    run_server(app, config.host, config.port, ready)
    print("ggufswarm gateway: stopped", file=sys.stderr, flush=True)
    return 0
