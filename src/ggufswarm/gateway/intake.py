"""What every API handler of the gateway shares: the request's JSON body, the gateway of the model it names, and
waiting on a generation while its client is still there."""

from __future__ import annotations

import asyncio
import json

from aiohttp import web

from ..net.http import read_json
from .errors import CLIENT_GONE, RequestError
from .generation import Event, Failed, Generation
from .state import Gateway

GATEWAY = web.AppKey("gateway", Gateway)
API_KEY = web.RequestKey("api_key", str)  # the API key a request was let in with (app.api_key_middleware)
DISCONNECT_POLL_S = 0.5  # a non-streamed request looks this often whether its client is still there


async def read_body(request: web.Request) -> dict:
    """The request's JSON object (net/http.py read_json: size, depth, charset limits; ProtocolError 400 / 413
    otherwise); RequestError (400) for a lone UTF-16 surrogate in a string."""
    body = await read_json(request)
    try:  # JSON may escape a lone UTF-16 surrogate ("\\ud800"): no text can hold it, no tokenizer can take it
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as exc:
        raise RequestError(
            f"body holds a lone UTF-16 surrogate (\\u{ord(exc.object[exc.start]):04x}), which is not "
            f"text; send valid Unicode"
        ) from None
    return body


async def gateway_for(request: web.Request, body: dict) -> Gateway:
    """The gateway of the model ``body`` asks for: a gateway serving every model loads it on first use
    (Gateway.for_model); one serving one model refuses any other name with 404 ``model_not_found`` (as OpenAI)."""
    gw = request.app[GATEWAY]
    name = body.get("model")
    if gw.every_model:
        return await asyncio.get_running_loop().run_in_executor(gw.pool, gw.for_model, name)
    if name is not None and name != gw.model_name:
        raise RequestError(
            f"model {name!r} is not served here; this gateway serves {gw.model_name!r}", 404, "model_not_found", "model"
        )
    return gw


async def next_while_connected(request: web.Request, generation: Generation) -> Event:
    """The generation's next event; ConnectionResetError when the client hangs up first. (aiohttp does not cancel
    a handler whose client hung up: this looks for it while waiting, so a non-streamed request whose client left
    stops its generation, freeing its KV on every node, within DISCONNECT_POLL_S.)"""
    while True:
        if request.transport is None or request.transport.is_closing():
            raise ConnectionResetError("the client went away")
        try:
            return await asyncio.wait_for(generation.next(), DISCONNECT_POLL_S)
        except TimeoutError:
            pass


async def answer(request: web.Request, generation: Generation, stream: bool, streamed, whole) -> web.StreamResponse:
    """Run ``generation`` for ``request`` and answer it: ``streamed()`` (SSE) when ``stream``, else ``whole()``, each
    a coroutine function returning the response, called once the first event came. The route's failure before the
    answer starts is raised (an error answer); a client gone first gets no answer (CLIENT_GONE); the generation is
    cancelled on the way out (a no-op when it finished; it stops one whose client left mid-stream)."""
    try:
        try:
            first = await next_while_connected(request, generation)
        except ConnectionResetError:
            return web.Response(status=CLIENT_GONE)
        if isinstance(first, Failed):
            raise first.error
        return await (streamed() if stream else whole())
    finally:
        generation.cancel()


__all__ = ["API_KEY", "DISCONNECT_POLL_S", "GATEWAY", "answer", "gateway_for", "next_while_connected", "read_body"]
