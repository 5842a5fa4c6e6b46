"""``/v1/responses`` (OpenAI's Responses API) over the route sessions chat completions uses: the input items are
rendered with the chat template, function tools and ``text.format`` go through the chat path's checks, and the
answer is a ``response`` object (or its SSE events). Stored responses (responses_store.py) are continued by
``previous_response_id`` and read or deleted by id."""

from __future__ import annotations

import asyncio
import json
import secrets
import time

from aiohttp import web

from ..client.tools import ToolCallStream, ToolError, ToolRequest, parse_tool_calls
from ..client.tools import tool_request as checked_tools
from .errors import CLIENT_GONE, JSON, RequestError
from .generation import Delta, Done, Failed, Generation
from .intake import API_KEY, GATEWAY, answer, gateway_for, next_while_connected, read_body
from .messages import converted_turns
from .params import parse_params
from .render import SSE_HEADERS, error_event
from .responses_request import ResponseRequest, chat_error, chat_messages, parse_request
from .responses_store import StoredResponse, owner_key
from .state import Gateway

ID_HEX = 24  # hex digits after an id's prefix (resp_, msg_, fc_)
MAX_LIST_LIMIT = 100  # GET /v1/responses/{id}/input_items: ``limit`` 1..100 (default 20), as OpenAI


def _new_id(prefix: str) -> str:
    return prefix + secrets.token_hex(ID_HEX // 2)


def _owner(request: web.Request, gw: Gateway) -> str:
    """The store's owner of ``request``: the API key app.api_key_middleware let it in with (either header) when
    keys are set."""
    return owner_key(request.get(API_KEY) if gw.config.api_keys else None)


def _not_found(response_id: str, param: str | None = None) -> RequestError:
    return RequestError(f"no response with id {response_id!r} is stored here", 404, "not_found", param)


def message_item(text: str, status: str = "completed", item_id: str | None = None) -> dict:
    """An output ``message`` item holding one ``output_text`` part."""
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {
        "type": "message",
        "id": item_id or _new_id("msg_"),
        "status": status,
        "role": "assistant",
        "content": [part],
    }


def call_item(
    call: dict, status: str = "completed", arguments: str | None = None, namespace: str | None = None
) -> dict:
    """An output ``function_call`` item of a parsed call (client.tools.parse_tool_calls's shape); ``namespace``:
    that of the called function, when it came in a namespace tool."""
    fn = call["function"]
    item = {
        "type": "function_call",
        "id": "fc_" + call["id"].removeprefix("call_"),
        "call_id": call["id"],
        "name": fn["name"],
        "arguments": fn["arguments"] if arguments is None else arguments,
        "status": status,
    }
    if namespace is not None:
        item["namespace"] = namespace
    return item


class ResponseReply:
    """The ``response`` objects of one request: one ``id`` and ``created_at``, the request's settings echoed."""

    def __init__(self, model_name: str, req: ResponseRequest, opts, tools: ToolRequest | None):
        self.id, self.created_at = _new_id("resp_"), int(time.time())
        self.req, self.opts, self.tools = req, opts, tools
        self.model_name = model_name
        self.namespaces = req.namespaces()

    def call_item(self, call: dict, status: str = "completed", arguments: str | None = None) -> dict:
        return call_item(call, status, arguments, self.namespaces.get(call["function"]["name"]))

    def object(self, status: str, output: list[dict], done: Done | None = None, error: dict | None = None) -> dict:
        """The response object: ``status`` ``in_progress`` / ``completed`` / ``incomplete`` / ``failed``;
        ``usage`` (tokens) and ``telemetry`` once ``done``; ``error`` ``{"code", "message"}`` when failed."""
        req = self.req
        text = req.text.model_dump(by_alias=True, exclude_none=True) if req.text is not None else {}
        text.setdefault("format", {"type": "text"})
        tool_choice = req.tool_choice or "auto"
        if not isinstance(tool_choice, str):
            tool_choice = tool_choice.model_dump()
        out = {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "max_tool_calls": req.max_tool_calls,
            "model": self.model_name,
            "output": output,
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id,
            "reasoning": {"effort": None, "summary": None},
            "store": req.store is not False,
            "temperature": self.opts.params.temperature,
            "text": text,
            "tool_choice": tool_choice,
            "tools": [t.model_dump() for t in req.tools or []],
            "top_p": self.opts.params.top_p,
            "truncation": "disabled",
            "usage": None,
            "user": req.user,
            "metadata": req.metadata or {},
            "background": False,
            "service_tier": "default",
        }
        if done is not None:
            p, c = done.stats.prompt_tokens, done.stats.completion_tokens
            out["usage"] = {
                "input_tokens": p,
                "input_tokens_details": {"cached_tokens": done.telemetry.get("prefix_tokens_restored", 0)},
                "output_tokens": c,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": p + c,
            }
            out["telemetry"] = done.telemetry
        return out

    def calls(self, made: list[dict]) -> list[dict]:
        """The parsed calls reported: ``parallel_tool_calls`` false keeps the first, ``max_tool_calls`` caps them."""
        if self.tools is None:
            return []
        made = self.tools.calls(made)
        return made[: self.req.max_tool_calls] if self.req.max_tool_calls else made

    def status(self, done: Done) -> str:
        return "incomplete" if done.stats.finish_reason == "length" else "completed"


async def create_response(request: web.Request) -> web.StreamResponse:
    """``POST /v1/responses``: the input items (after a stored ``previous_response_id``'s conversation) rendered
    with the chat template and generated on a route session; a ``response`` object, or its SSE events with
    ``stream``. RequestError 400 naming the param (responses_request.parse_request and the chat path's checks),
    404 ``not_found`` for a ``previous_response_id`` not stored for this API key; the route's failure as chat's."""
    body = await read_body(request)
    req = parse_request(body)
    gw = await gateway_for(request, body)
    root = request.app[GATEWAY]
    owner = _owner(request, root)
    previous = None
    if req.previous_response_id is not None:
        previous = root.responses.get(owner, req.previous_response_id)
        if previous is None:
            raise _not_found(req.previous_response_id, "previous_response_id")
    input_items = req.items()
    conversation = (previous.conversation if previous else []) + input_items
    template = gw.tokenizer.chat_template
    chat = req.chat_body()
    try:
        turns = converted_turns(chat_messages(req.instructions, conversation), template)
        tools = checked_tools(chat, template)
    except RequestError as exc:
        raise chat_error(exc) from None
    except ToolError as exc:
        raise chat_error(RequestError(str(exc), param=exc.param)) from None
    try:  # off the event loop, as chat
        ids = await asyncio.get_running_loop().run_in_executor(
            gw.pool, gw.tokenizer.encode_chat, turns, True, tools.tools if tools else None
        )
    except ValueError as exc:
        raise RequestError(str(exc), param="input") from None
    try:
        opts = parse_params(
            {**chat, "messages": turns},
            gw.config.default_max_tokens,
            True,
            gw.tokenizer.n_vocab,
            gw.tokenizer.has_fim,
            tools,
        )
    except RequestError as exc:
        raise chat_error(exc) from None
    reply = ResponseReply(gw.model_name, req, opts, tools)

    def keep(response: dict, done: Done) -> None:
        if req.store is not False:
            own = [{**item, "id": item.get("id") or _new_id("msg_")} for item in input_items]
            root.responses.put(owner, response, own, conversation + response["output"], ids + list(done.stats.tokens))

    generation = Generation(gw, ids, opts, "input", reply.id)
    return await answer(
        request,
        generation,
        opts.stream,
        lambda: _stream(request, generation, reply, keep),
        lambda: _whole(request, generation, reply, keep),
    )


def _output(reply: ResponseReply, text: str, done: Done) -> list[dict]:
    """The output items of a finished answer: its text as a message (none when it is only calls), then its calls."""
    content, made = parse_tool_calls(text) if reply.tools is not None else (text, [])
    made = reply.calls(made)
    status = reply.status(done)
    out = [message_item(content or "", status)] if content or not made else []
    return out + [reply.call_item(c) for c in made]


async def _whole(request: web.Request, generation: Generation, reply: ResponseReply, keep) -> web.Response:
    parts = []
    while True:
        try:
            event = await next_while_connected(request, generation)
        except ConnectionResetError:
            return web.Response(status=CLIENT_GONE)
        if isinstance(event, Failed):
            raise event.error
        if isinstance(event, Done):
            response = reply.object(reply.status(event), _output(reply, "".join(parts), event), event)
            keep(response, event)
            return web.Response(body=json.dumps(response).encode(), content_type=JSON)
        if isinstance(event, Delta):
            parts.append(event.text)


class _Events:
    """The SSE events of one streamed response: ``event: TYPE`` and ``data: {"type", "sequence_number", ...}``."""

    def __init__(self, resp: web.StreamResponse):
        self.resp, self.seq = resp, 0

    async def send(self, kind: str, **fields) -> None:
        data = json.dumps({"type": kind, "sequence_number": self.seq, **fields}, separators=(",", ":"))
        self.seq += 1
        await self.resp.write(f"event: {kind}\ndata: {data}\n\n".encode())


class _StreamedMessage:
    """The message item of a stream, opened on its first text (output index ``index``)."""

    def __init__(self, events: _Events, index: int):
        self.events, self.index, self.item, self.text = events, index, None, ""

    async def add(self, text: str) -> None:
        if self.item is None:
            self.item = message_item("", "in_progress")
            self.item["content"] = []
            await self.events.send("response.output_item.added", output_index=self.index, item=self.item)
            await self.events.send(
                "response.content_part.added",
                item_id=self.item["id"],
                output_index=self.index,
                content_index=0,
                part={"type": "output_text", "text": "", "annotations": [], "logprobs": []},
            )
        if text:
            self.text += text
            await self.events.send(
                "response.output_text.delta",
                item_id=self.item["id"],
                output_index=self.index,
                content_index=0,
                delta=text,
                logprobs=[],
            )

    async def done(self, status: str) -> dict:
        item = message_item(self.text, status, self.item["id"])
        where = {"item_id": item["id"], "output_index": self.index, "content_index": 0}
        await self.events.send("response.output_text.done", **where, text=self.text, logprobs=[])
        await self.events.send("response.content_part.done", **where, part=item["content"][0])
        await self.events.send("response.output_item.done", output_index=self.index, item=item)
        return item


async def _stream(request: web.Request, generation: Generation, reply: ResponseReply, keep) -> web.StreamResponse:
    """The SSE answer: created, in_progress, the message's item / part / text deltas as text comes (with tools:
    text that may be a call held back, client.tools.ToolCallStream), each call's item and arguments at the end,
    then ``response.completed`` (``response.incomplete`` when cut by max_output_tokens) with the whole object;
    ``response.failed`` when the route fails. A client that goes away ends it quietly."""
    resp = web.StreamResponse(headers=SSE_HEADERS)
    events = _Events(resp)
    held = ToolCallStream() if reply.tools is not None else None
    message = _StreamedMessage(events, 0)
    try:
        await resp.prepare(request)
        start = reply.object("in_progress", [])
        await events.send("response.created", response=start)
        await events.send("response.in_progress", response=start)
        while True:
            event = await generation.next()
            if isinstance(event, Delta):
                text = held.push(event.text) if held is not None else event.text
                if text:
                    await message.add(text)
            elif isinstance(event, Done):
                await _finish(events, reply, message, held, event, keep)
                break
            elif isinstance(event, Failed):
                err = error_event(event.error, event.tokens)["error"]  # (its stderr line for a 5xx)
                output = [message_item(message.text, "incomplete", message.item["id"])] if message.item else []
                failed = reply.object("failed", output, error={"code": err["code"], "message": err["message"]})
                if event.error.telemetry:
                    failed["telemetry"] = event.error.telemetry
                await events.send("response.failed", response=failed)
                break
        await resp.write_eof()
    except ConnectionResetError:
        pass  # the client left; create_response stops the generation
    return resp


async def _finish(events: _Events, reply: ResponseReply, message, held, done: Done, keep) -> None:
    content, made = held.finish() if held is not None else (None, [])
    made = reply.calls(made)
    status = reply.status(done)
    if content or (message.item is None and not made):
        await message.add(content or "")
    output = [await message.done(status)] if message.item is not None else []
    for call in made:
        index = len(output)
        item = reply.call_item(call, "in_progress", "")
        await events.send("response.output_item.added", output_index=index, item=item)
        where = {"item_id": item["id"], "output_index": index}
        args = call["function"]["arguments"]
        await events.send("response.function_call_arguments.delta", **where, delta=args)
        await events.send("response.function_call_arguments.done", **where, name=item["name"], arguments=args)
        output.append(reply.call_item(call))
        await events.send("response.output_item.done", output_index=index, item=output[-1])
    response = reply.object(status, output, done)
    keep(response, done)
    await events.send("response.completed" if status == "completed" else "response.incomplete", response=response)


def _stored(request: web.Request) -> StoredResponse:
    root = request.app[GATEWAY]
    response_id = request.match_info["response_id"]
    found = root.responses.get(_owner(request, root), response_id)
    if found is None:
        raise _not_found(response_id)
    return found


async def get_response(request: web.Request) -> web.Response:
    """``GET /v1/responses/{id}``: the stored response object; 404 ``not_found`` when it is not stored for this
    API key (never stored, ``store: false``, deleted, evicted, or another key's)."""
    return web.json_response(_stored(request).response)


async def delete_response(request: web.Request) -> web.Response:
    """``DELETE /v1/responses/{id}``: ``{"id", "object": "response", "deleted": true}``; 404 as GET."""
    root = request.app[GATEWAY]
    response_id = request.match_info["response_id"]
    if not root.responses.delete(_owner(request, root), response_id):
        raise _not_found(response_id)
    return web.json_response({"id": response_id, "object": "response", "deleted": True})


async def list_input_items(request: web.Request) -> web.Response:
    """``GET /v1/responses/{id}/input_items`` (``limit`` 1..100, default 20; ``order`` ``desc`` (default) or
    ``asc``; ``after`` an item id): ``{"object": "list", "data", "first_id", "last_id", "has_more"}``, the
    response's own input items; 404 as GET, 400 naming a bad query parameter."""
    items = list(_stored(request).input_items)
    query = request.query
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise RequestError(f"order must be asc or desc, got {order!r}", param="order")
    limit = query.get("limit", "20")
    if not (limit.isdigit() and 1 <= int(limit) <= MAX_LIST_LIMIT):
        raise RequestError(f"limit must be an integer in [1, {MAX_LIST_LIMIT}], got {limit!r}", param="limit")
    if order == "desc":
        items.reverse()
    after = query.get("after")
    if after is not None:
        at = next((i for i, item in enumerate(items) if item["id"] == after), None)
        if at is None:
            raise RequestError(f"after: no input item {after!r} in this response", param="after")
        items = items[at + 1 :]
    page = items[: int(limit)]
    return web.json_response(
        {
            "object": "list",
            "data": page,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
            "has_more": len(items) > len(page),
        }
    )
