"""aiohttp app of the gateway: ``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``, ``/health``, the
verifier's ``/v1/verify`` and ``/metrics`` (gateway/verify.py), Anthropic's ``/v1/messages`` (anthropic_api.py) and
``/openapi.json`` (openapi.py: the document of the typed request models that check the bodies).

Each choice of a request (``n``) gets its own route session (KV on every node), run by ``generation.Generation``
(``choices.Choices``: all at once); concurrent requests proceed concurrently. The final stream chunk and the
non-streamed body carry ``usage``, llama-server's ``timings`` and a ``telemetry`` object (docs/protocol.md,
"Generation telemetry"). Handlers raise typed errors (errors.RequestError, GatewayError); one
middleware answers them in OpenAI's shape, and a request that fails with a 5xx (an error answer, or a stream's
error event) leaves one line on stderr (errors.say_failed), as does each route repair that worked.
"""

from __future__ import annotations

import asyncio
import hmac
import json

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from ..client.tools import ToolError, ToolRequest, tool_request
from ..directory.trackers import TrackerError
from ..net.auth import auth_headers
from ..net.http import json_errors_middleware, probe, probe_json
from ..protocol.errors import ProtocolError
from . import anthropic_api
from .choices import Choices
from .config import GatewayConfig
from .errors import CLIENT_GONE, FIXED_ROUTE_HINT, JSON, RequestError, error_response, say_failed
from .generation import Delta, Done, Failed
from .intake import API_KEY, GATEWAY, gateway_for, next_while_connected, read_body
from .messages import chat_turns
from .openai_request import CHAT_PATH, COMPLETIONS_PATH, ChatCompletionRequest, OpenAIRequest, parse_request
from .openapi import OPENAPI_PATH, openapi_json
from .params import parse_params
from .render import SSE_HEADERS, Reply, write_stream
from .responses import create_response, delete_response, get_response, list_input_items
from .responses_request import RESPONSES_PATH
from .state import Gateway

HEALTH_PROBE_S = 2.0  # GET /health: how long it waits for each node's (or the tracker's) answer, in seconds
MAX_BODY_BYTES = 16 * 2**20  # largest request body taken (a long prompt)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    """``POST /v1/chat/completions`` (OpenAI): messages rendered with the GGUF chat template."""
    body = await read_body(request)
    gw = await gateway_for(request, body)
    req = parse_request(body, chat=True)
    turns = chat_turns(req.messages, gw.tokenizer.chat_template)
    try:
        tools = tool_request(body, gw.tokenizer.chat_template)
    except ToolError as exc:
        raise RequestError(str(exc), param=exc.param) from None
    try:  # off the event loop: a long prompt takes a while to render and tokenize, other requests go on meanwhile
        ids = await asyncio.get_running_loop().run_in_executor(
            gw.pool, gw.tokenizer.encode_chat, turns, True, tools.tools if tools else None
        )
    except ValueError as exc:
        raise RequestError(str(exc), param="messages") from None
    return await complete(request, gw, ids, req, tools=tools)


async def completions(request: web.Request) -> web.StreamResponse:
    """``POST /v1/completions`` (OpenAI): a plain ``prompt`` string or token ids (or a list holding one of them)."""
    body = await read_body(request)
    gw = await gateway_for(request, body)
    req = parse_request(body, chat=False)
    prompt = req.prompt[0] if isinstance(req.prompt, list) and isinstance(req.prompt[0], str | list) else req.prompt
    if isinstance(prompt, list):  # token ids, as given
        ids = prompt
        bad = next((t for t in ids if not 0 <= t < gw.tokenizer.n_vocab), None)
        if bad is not None:
            raise RequestError(
                f"prompt token id {bad} is outside the vocabulary (0 to {gw.tokenizer.n_vocab - 1})", param="prompt"
            )
        prompt = gw.tokenizer.decode(ids)  # (echo)
    else:
        ids = await asyncio.get_running_loop().run_in_executor(  # off the event loop, as for chat
            gw.pool, lambda: gw.tokenizer.encode(prompt, special=gw.config.prompt_special)
        )
    if not ids:  # a model without BOS has nothing to start from
        raise RequestError(
            "prompt is empty and this model adds no BOS token: give at least one token of text", param="prompt"
        )
    return await complete(request, gw, ids, req, prompt=prompt)


async def complete(
    request: web.Request,
    gw: Gateway,
    ids: list[int],
    req: OpenAIRequest,
    prompt: str | None = None,
    tools: ToolRequest | None = None,
) -> web.StreamResponse:
    """Generate the ``n`` completions of prompt ``ids`` (choices.Choices: at once, each its own route session) and
    answer them, streamed (SSE) or whole. RequestError for a bad parameter; a route's failure before the answer
    starts is raised (an error answer), after it an SSE error event; a client that goes away stops every choice
    (its session closes on every node)."""
    chat = isinstance(req, ChatCompletionRequest)
    opts = parse_params(
        req,
        gw.config.default_max_tokens,
        chat,
        gw.tokenizer.n_vocab,
        gw.tokenizer.has_fim,
        tools,
        grammar_parses=gw.tokenizer.grammar_parses,
    )
    reply = Reply(gw.model_name, gw.tokenizer, chat, opts, prompt if opts.echo else None)
    choices = Choices(gw, ids, opts, "messages" if chat else "prompt", reply.id)
    try:
        try:
            failed = await choices.opened(lambda source: next_while_connected(request, source))
        except ConnectionResetError:
            return web.Response(status=CLIENT_GONE)
        if failed is not None:
            raise failed.error
        if opts.stream:
            return await stream_answer(request, choices, reply, tools)
        return await whole_answer(request, choices, reply, tools)
    finally:
        choices.cancel()  # no-op when finished; stops the generations when the client left mid-stream


async def stream_answer(
    request: web.Request, choices: Choices, reply: Reply, tools: ToolRequest | None
) -> web.StreamResponse:
    """The SSE answer (render.write_stream); a client that went away ends it quietly."""
    resp = web.StreamResponse(headers=SSE_HEADERS)
    try:
        await write_stream(resp, request, choices.next, reply, tools)
    except ConnectionResetError:
        pass  # the client left; complete() stops the generations
    return resp


async def whole_answer(request: web.Request, choices: Choices, reply: Reply, tools: ToolRequest | None) -> web.Response:
    """The non-streamed answer (Reply.body) once every choice is done; a failure raised (an error answer)."""
    parts = [[reply.echo or ""] for _ in range(choices.n)]
    entries: list[list] = [[] for _ in range(choices.n)]
    dones: dict[int, Done] = {}
    while len(dones) < choices.n:
        try:
            index, event = await next_while_connected(request, choices)
        except ConnectionResetError:
            return web.Response(status=CLIENT_GONE)  # nobody reads it; complete() stops the generations
        if isinstance(event, Failed):
            raise event.error
        if isinstance(event, Done):
            dones[index] = event
        elif isinstance(event, Delta):
            parts[index].append(event.text)
            entries[index] += event.entries
    ordered = [dones[i] for i in range(choices.n)]
    made = [reply.choice(i, "".join(parts[i]), entries[i], ordered[i], tools) for i in range(choices.n)]
    return web.Response(body=json.dumps(reply.body(made, ordered)).encode(), content_type=JSON)


async def models(request: web.Request) -> web.Response:
    """``GET /v1/models``: the model this gateway serves (with a tracker: if the swarm can serve it end to end);
    a gateway serving every model lists every model the swarm can serve end to end now."""
    return web.json_response({"object": "list", "data": await listed_models(request.app[GATEWAY])})


async def listed_models(gw: Gateway) -> list[dict]:
    """The model objects ``/v1/models`` lists (none when the tracker cannot be asked)."""
    names = [gw.model_name]
    if gw.config.tracker:
        try:
            servable = await asyncio.get_running_loop().run_in_executor(None, gw.planner.tracker.models)
            names = list(servable) if gw.every_model else [n for n in names if n in servable]
        except TrackerError:
            names = [gw.model_name] if await _dht_servable(gw) is None else []
    return [{"id": n, "object": "model", "created": gw.created, "owned_by": "ggufswarm"} for n in names]


async def model(request: web.Request) -> web.Response:
    """``GET /v1/models/{model}`` (OpenAI's retrieve): the model object when ``/v1/models`` lists it, else 404
    ``model_not_found``."""
    name = request.match_info["model"]
    found = next((m for m in await listed_models(request.app[GATEWAY]) if m["id"] == name), None)
    if found is None:
        raise RequestError(
            f"model {name!r} is not served here (GET /v1/models lists what is)", 404, "model_not_found", "model"
        )
    return web.json_response(found)


async def health(request: web.Request) -> web.Response:
    """``GET /health``: whether this gateway can serve now. With a fixed ``--route``, every node's ``GET /health``
    is asked at once (the swarm token sent, HEALTH_PROBE_S each); with ``--tracker``, the tracker's
    ``GET /models`` (what the swarm can serve end to end now). ``200 {"status": "ok", "model", "route", "nodes":
    [{"url", "ok"}]}`` (a tracker gateway: ``"tracker": {"ok"}`` instead of ``route`` and ``nodes``; its address
    is not shown) when all answer 200 and (tracker) the model has a complete chain of ready nodes (a gateway of
    every model: some model has); else ``503 {"status": "degraded", ..., "reason"}``, each failed probe with its
    ``error`` (net.http.probe: connection refused, timeout, HTTP status) and ``reason`` one line naming
    what failed (for a fixed route: that the gateway cannot replace a node, and what to do). Both carry ``verify``
    (``Verifier.health``: audit rate, audits by result, banned node keys). Answers within about HEALTH_PROBE_S;
    needs no API key."""
    gw = request.app[GATEWAY]
    body = {"status": "ok", "model": gw.model_name, "verify": gw.verifier.health()}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=HEALTH_PROBE_S)) as http:
        if gw.config.tracker:
            reason = await _tracker_health(gw, http, body)
        else:
            reason = await _route_health(gw, http, body)
    if reason is not None:
        body["status"], body["reason"] = "degraded", reason
        return web.json_response(body, status=503)
    return web.json_response(body)


def _probe_entry(error: str | None) -> dict:
    return {"ok": True} if error is None else {"ok": False, "error": error}


async def _dht_servable(gw: Gateway) -> str | None:
    """With ``--join`` (the DHT): None when a route of this model can be planned from the DHT now, else why not
    (also why not without a DHT)."""
    if gw.discovery is None or gw.every_model:
        return "no DHT (a gateway started without --join)"
    try:
        await gw.planner.directory.route(gw.http, {"max_length": 1}, count=False)
    except TrackerError as exc:
        return exc.reason or str(exc)
    return None


async def _tracker_health(gw: Gateway, http: aiohttp.ClientSession, body: dict) -> str | None:
    """``health`` of a tracker gateway: fills ``body["tracker"]`` (and ``body["dht"]`` when the tracker does not
    answer and the gateway joined with a link: routes are then planned from the DHT); why it cannot serve now, or
    None."""
    answer, error = await probe_json(http, gw.planner.tracker.url_for("models"), auth_headers(gw.config.token))
    body["tracker"] = _probe_entry(error)
    if error is not None and gw.discovery is not None:
        why = await _dht_servable(gw)
        body["dht"] = _probe_entry(why)
        return None if why is None else f"the tracker does not answer ({error}) and the DHT has no route: {why}"
    if error is not None:
        return f"the tracker does not answer: {error}"
    if gw.every_model:
        if not answer.get("models"):
            return "no model of this swarm can be served end to end now (no chain of ready nodes)"
    elif gw.model_name not in (answer.get("models") or []):
        why = (answer.get("unservable") or {}).get(gw.model_name)
        return f"the swarm cannot serve {gw.model_name} end to end now" + (f": {why}" if why else "")
    return None


async def _route_health(gw: Gateway, http: aiohttp.ClientSession, body: dict) -> str | None:
    """``health`` of a fixed-route gateway: fills ``body["route"]`` and ``["nodes"]``; why it cannot serve now,
    or None."""
    route, headers = gw.config.route, auth_headers(gw.config.token)
    errors = await asyncio.gather(*(probe(http, url.rstrip("/") + "/health", headers) for url in route))
    body["route"] = route
    body["nodes"] = [{"url": url, **_probe_entry(e)} for url, e in zip(route, errors)]
    failed = [f"{url} ({e})" for url, e in zip(route, errors) if e is not None]
    if failed:
        which = "nodes" if len(failed) > 1 else "node"
        return f"{which} {', '.join(failed)} of the route failed; {FIXED_ROUTE_HINT}"
    return None


async def verify(request: web.Request) -> web.Response:
    """``GET /v1/verify``: the verifier's state (gateway/verify.py, ``Verifier.view``): rate, audits by result, every
    ban with its signed evidence and the ids of the answers that went through the banned node (``tainted``), and the
    most recent audits. Behind the API key, as every ``/v1/*``."""
    return web.json_response(request.app[GATEWAY].verifier.view())


async def metrics(request: web.Request) -> web.Response:
    """``GET /metrics`` (Prometheus text): ``ggufswarm_gateway_audits_total{result}``."""
    data = generate_latest(request.app[GATEWAY].verifier.registry)
    return web.Response(body=data, headers={"Content-Type": CONTENT_TYPE_LATEST})


def api_key_middleware(keys: tuple[str, ...]):
    """With API keys configured, ``/v1/*`` answers 401 (OpenAI's ``invalid_api_key``) without a valid
    ``Authorization: Bearer KEY`` or ``x-api-key: KEY`` (Anthropic's header); ``/health`` stays open."""

    @web.middleware
    async def check(request: web.Request, handler):
        if keys and request.path.startswith("/v1/"):
            scheme, _, bearer = request.headers.get("Authorization", "").strip().partition(" ")
            given = [bearer.strip().encode() if scheme.lower() == "bearer" else b""]
            given.append(request.headers.get("x-api-key", "").strip().encode())
            matched = [k for g in given if g for k in keys if hmac.compare_digest(g, k.encode())]
            if not matched:
                raise RequestError("missing or invalid API key", 401, "invalid_api_key")
            request[API_KEY] = matched[0]  # whose stored responses it may read (responses.py)
        return await handler(request)

    return check


def _say_failed(request: web.Request, err: ProtocolError) -> None:
    say_failed("request failed", err.status, err.code, err.message)


def make_app(config: GatewayConfig) -> web.Application:
    """The gateway's aiohttp app; the vocabulary is loaded at startup, the route on first use."""
    gw = Gateway(config)
    errors = json_errors_middleware(on_error=_say_failed, render=error_response)  # outermost: sees every error
    keys = api_key_middleware(tuple(config.api_keys))
    anthropic_errors = anthropic_api.errors_middleware()  # /v1/messages*: Anthropic's error shape
    app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[errors, anthropic_errors, keys])
    app[GATEWAY] = gw
    app.router.add_post(CHAT_PATH, chat_completions)
    app.router.add_post(COMPLETIONS_PATH, completions)
    app.router.add_post(anthropic_api.MESSAGES_PATH, anthropic_api.messages)
    app.router.add_post(anthropic_api.COUNT_TOKENS_PATH, anthropic_api.count_tokens)
    app.router.add_post(RESPONSES_PATH, create_response)
    app.router.add_get(RESPONSES_PATH + "/{response_id}", get_response)
    app.router.add_delete(RESPONSES_PATH + "/{response_id}", delete_response)
    app.router.add_get(RESPONSES_PATH + "/{response_id}/input_items", list_input_items)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/v1/models/{model}", model)
    app.router.add_get("/health", health)
    app.router.add_get("/v1/verify", verify)
    app.router.add_get("/metrics", metrics)
    app.router.add_get(OPENAPI_PATH, openapi_json)

    async def lifecycle(app):
        await gw.start()
        yield
        await gw.stop()

    app.cleanup_ctx.append(lifecycle)
    return app
