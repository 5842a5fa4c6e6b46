"""Anthropic's Messages API on the gateway: ``POST /v1/messages`` (whole or as Anthropic's SSE events) and
``POST /v1/messages/count_tokens``, over the same route sessions as chat completions (the request converted by
anthropic_request.to_chat), and the errors of these paths in Anthropic's shape (``errors_middleware``)."""

from __future__ import annotations

import asyncio
import json
import secrets

from aiohttp import web

from ..client.generate import GenerationStats
from ..client.tools import ToolCallStream, ToolError, ToolRequest, parse_tool_calls, tool_request
from ..net.http import json_errors_middleware
from ..protocol.errors import ProtocolError
from .anthropic_request import CountTokensRequest, MessagesRequest, parse_request, renamed, to_chat
from .errors import CLIENT_GONE, JSON, RequestError, say_failed
from .generation import Delta, Done, Failed, Generation
from .intake import answer, gateway_for, next_while_connected, read_body
from .messages import converted_turns
from .params import RequestOptions, parse_params
from .render import SSE_HEADERS
from .state import Gateway

MESSAGES_PATH = "/v1/messages"
COUNT_TOKENS_PATH = "/v1/messages/count_tokens"
ERROR_TYPES = {  # HTTP status -> Anthropic's error type (other 4xx: invalid_request_error, other 5xx: api_error)
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def error_body(err: ProtocolError) -> dict:
    """Anthropic's error object of ``err``: ``{"type": "error", "error": {"type", "message"}}``, plus the
    gateway's ``telemetry`` when the route session had opened."""
    kind = ERROR_TYPES.get(err.status, "invalid_request_error" if err.status < 500 else "api_error")
    body = {"type": "error", "error": {"type": kind, "message": err.message}}
    if getattr(err, "telemetry", None):
        body["telemetry"] = err.telemetry
    return body


def error_response(err: ProtocolError, headers: dict | None = None) -> web.Response:
    """The error answer of ``err`` in Anthropic's shape, with its HTTP status."""
    return web.Response(
        body=json.dumps(error_body(err)).encode(), status=err.status, content_type=JSON, headers=headers
    )


def _say_failed(request: web.Request, err: ProtocolError) -> None:
    say_failed("request failed", err.status, err.code, err.message)


def errors_middleware():
    """Middleware answering every error under ``/v1/messages`` (a handler's, the API key check's, the router's
    404 / 405) in Anthropic's shape (net.http.json_errors_middleware with error_response); other paths pass."""
    inner = json_errors_middleware(on_error=_say_failed, render=error_response)

    @web.middleware
    async def anthropic_errors(request: web.Request, handler):
        if request.path == MESSAGES_PATH or request.path.startswith(MESSAGES_PATH + "/"):
            return await inner(request, handler)
        return await handler(request)

    return anthropic_errors


async def _prepare(request: web.Request, kind: type[CountTokensRequest]):
    """The request checked: (gateway, chat body, prompt token ids, ToolRequest or None). RequestError (400)
    for a bad body, 404 for a model not served here."""
    req = parse_request(await read_body(request), kind)
    chat = to_chat(req)
    gw = await gateway_for(request, chat)
    template = gw.tokenizer.chat_template
    turns = converted_turns(chat["messages"], template)
    try:
        tools = tool_request(chat, template)
    except ToolError as exc:
        raise renamed(RequestError(str(exc), param=exc.param)) from None
    try:  # off the event loop, as for chat
        ids = await asyncio.get_running_loop().run_in_executor(
            gw.pool, gw.tokenizer.encode_chat, turns, True, tools.tools if tools else None
        )
    except ValueError as exc:
        raise RequestError(str(exc), param="messages") from None
    return gw, chat, ids, tools


async def count_tokens(request: web.Request) -> web.Response:
    """``POST /v1/messages/count_tokens``: ``{"input_tokens": N}``, the prompt tokens a Messages request with
    this body would take (its messages, system and tools rendered by the chat template, as generation does)."""
    _, _, ids, _ = await _prepare(request, CountTokensRequest)
    return web.json_response({"input_tokens": len(ids)})


async def messages(request: web.Request) -> web.StreamResponse:
    """``POST /v1/messages``: the answer as one ``message`` object, or with ``stream`` as Anthropic's SSE events.
    RequestError for a bad body; the route's failure before the answer starts is an error answer, after it an
    ``error`` event; a client that goes away stops the generation (its session closes on every node)."""
    gw, chat, ids, tools = await _prepare(request, MessagesRequest)
    try:
        opts = parse_params(chat, gw.config.default_max_tokens, True, gw.tokenizer.n_vocab, False, tools)
    except RequestError as exc:
        raise renamed(exc) from None
    reply = MessageReply(gw, opts, len(ids), tools)
    generation = Generation(gw, ids, opts, "messages", reply.id)

    async def streamed() -> web.StreamResponse:
        resp = web.StreamResponse(headers=SSE_HEADERS)
        try:
            await reply.stream(resp, request, generation)
        except ConnectionResetError:
            pass  # the client left; answer() stops the generation
        return resp

    return await answer(request, generation, opts.stream, streamed, lambda: reply.whole(request, generation))


def event(name: str, data: dict) -> bytes:
    """One server-sent event in Anthropic's framing: ``event: NAME`` and its ``data`` (compact JSON)."""
    return f"event: {name}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


class MessageReply:
    """The answer objects of one Messages request: one ``msg_…`` id, stop reasons, content blocks, usage."""

    def __init__(self, gw: Gateway, opts: RequestOptions, input_tokens: int, tools: ToolRequest | None):
        self.gw, self.opts, self.input_tokens, self.tools = gw, opts, input_tokens, tools
        self.id = "msg_" + secrets.token_hex(12)

    def message(self, content: list, stop_reason=None, stop_sequence=None, output_tokens: int = 0) -> dict:
        """A ``message`` object (the answer, or the stream's ``message_start`` one with no content yet)."""
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.gw.model_name,
            "content": content,
            "stop_reason": stop_reason,
            "stop_sequence": stop_sequence,
            "usage": {"input_tokens": self.input_tokens, "output_tokens": output_tokens},
        }

    def stop(self, text: str, stats: GenerationStats) -> tuple[str, str | None]:
        """``(stop_reason, stop_sequence)`` of a generation whose whole text was ``text``: ``max_tokens`` (or
        ``model_context_window_exceeded`` when the session's context ended it first), ``end_turn`` (an
        end-of-generation token), ``stop_sequence`` and the stop string its last tokens completed."""
        if stats.finish_reason == "length":
            full = stats.completion_tokens >= self.opts.max_tokens
            return ("max_tokens" if full else "model_context_window_exceeded"), None
        if not stats.tokens or stats.tokens[-1] in self.gw.tokenizer.eog_ids:
            return "end_turn", None
        rest = self.gw.tokenizer.decode(stats.tokens, self.opts.special)[len(text) :]
        matched = next((s for s in self.opts.stop if rest.startswith(s)), None)
        return ("stop_sequence", matched) if matched is not None else ("end_turn", None)

    @staticmethod
    def tool_uses(calls: list[dict]) -> list[dict] | None:
        """``tool_use`` blocks of parsed calls (client.tools.parse_tool_calls), each with a new ``toolu_`` id;
        None when a call's arguments are not a JSON object (the answer is then text, as a malformed call is)."""
        out = []
        for call in calls:
            try:
                args = json.loads(call["function"]["arguments"])
            except ValueError:
                return None
            if not isinstance(args, dict):
                return None
            name, call_id = call["function"]["name"], "toolu_" + secrets.token_hex(12)
            out.append({"type": "tool_use", "id": call_id, "name": name, "input": args})
        return out

    def content(self, text: str) -> tuple[list[dict], bool]:
        """The content blocks of a whole answer ``text`` (calls parsed out when tools were offered; no empty text
        block) and whether it made calls."""
        uses: list[dict] = []
        if self.tools is not None:
            rest, made = parse_tool_calls(text)
            found = self.tools.calls(made) and self.tool_uses(self.tools.calls(made))
            if found:
                text, uses = rest or "", found
        return ([{"type": "text", "text": text}] if text else []) + uses, bool(uses)

    async def whole(self, request: web.Request, generation: Generation) -> web.Response:
        """The non-streamed answer once the generation is done (``telemetry`` added at the top level); its
        failure raised (an error answer)."""
        parts = []
        while True:
            try:
                ev = await next_while_connected(request, generation)
            except ConnectionResetError:
                return web.Response(status=CLIENT_GONE)  # nobody reads it; the handler stops the generation
            if isinstance(ev, Failed):
                raise ev.error
            if isinstance(ev, Done):
                text = "".join(parts)
                blocks, called = self.content(text)
                reason, sequence = ("tool_use", None) if called else self.stop(text, ev.stats)
                body = self.message(blocks, reason, sequence, ev.stats.completion_tokens)
                body["telemetry"] = ev.telemetry
                return web.Response(body=json.dumps(body).encode(), content_type=JSON)
            parts.append(ev.text)

    async def stream(self, resp: web.StreamResponse, request: web.Request, generation: Generation) -> None:
        """Anthropic's SSE events: ``message_start``, ``ping``, a text block (``content_block_start``, its
        ``text_delta``s, ``content_block_stop``), one ``tool_use`` block per call (its ``input`` as one
        ``input_json_delta``), ``message_delta`` (stop reason, ``usage.output_tokens``, ``telemetry``),
        ``message_stop``; a failure as an ``error`` event. With tools, text that may be a call is held back
        (client.tools.ToolCallStream). ConnectionResetError when the client went away."""
        await resp.prepare(request)
        await resp.write(event("message_start", {"type": "message_start", "message": self.message([])}))
        await resp.write(event("ping", {"type": "ping"}))
        calls = ToolCallStream() if self.tools is not None else None
        parts, sent, index, text_open = [], 0, 0, False

        async def send_text(text: str) -> None:
            nonlocal text_open, sent
            if not text:
                return
            if not text_open:
                block = {"type": "text", "text": ""}
                await resp.write(
                    event(
                        "content_block_start", {"type": "content_block_start", "index": index, "content_block": block}
                    )
                )
                text_open = True
            delta = {"type": "text_delta", "text": text}
            await resp.write(
                event("content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta})
            )
            sent += len(text)

        while True:
            ev = await next_while_connected(request, generation)
            if isinstance(ev, Failed):
                await resp.write(event("error", error_body(ev.error)))
                say_failed(f"stream failed after {ev.tokens} tokens", ev.error.status, ev.error.code, ev.error.message)
                break
            if isinstance(ev, Delta):
                parts.append(ev.text)
                await send_text(calls.push(ev.text) if calls is not None else ev.text)
                continue
            text, uses = "".join(parts), []
            if calls is not None:
                rest, made = calls.finish()
                uses = (made and self.tool_uses(self.tools.calls(made))) or []
                await send_text((rest or "") if uses else text[sent:])
            if text_open:
                await resp.write(event("content_block_stop", {"type": "content_block_stop", "index": index}))
                index += 1
            for use in uses:
                start = {"type": "content_block_start", "index": index, "content_block": {**use, "input": {}}}
                await resp.write(event("content_block_start", start))
                delta = {"type": "input_json_delta", "partial_json": json.dumps(use["input"])}
                await resp.write(
                    event("content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta})
                )
                await resp.write(event("content_block_stop", {"type": "content_block_stop", "index": index}))
                index += 1
            reason, sequence = ("tool_use", None) if uses else self.stop(text, ev.stats)
            usage = {"input_tokens": self.input_tokens, "output_tokens": ev.stats.completion_tokens}
            delta = {
                "type": "message_delta",
                "delta": {"stop_reason": reason, "stop_sequence": sequence},
                "usage": usage,
            }
            await resp.write(event("message_delta", delta | {"telemetry": ev.telemetry}))
            await resp.write(event("message_stop", {"type": "message_stop"}))
            break
        await resp.write_eof()
