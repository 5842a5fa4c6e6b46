"""OpenAI's response shapes of one request: ``chat.completion`` / ``text_completion`` bodies, their SSE chunks
(``.chunk``, usage chunk, ``[DONE]``, error event), and logprobs (chat's ``content`` list, completions' columns)."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Awaitable, Callable

from aiohttp import web

from ..client.generate import GenerationStats
from ..client.tokenizer import Tokenizer
from ..client.tools import ToolCallStream, ToolRequest, parse_tool_calls
from .errors import error_object, say_failed
from .generation import Delta, Done, Event, LogprobEntry
from .params import RequestOptions

SSE_DONE = b"data: [DONE]\n\n"
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
ID_HEX = 24  # hex digits of a response id after its prefix (``chatcmpl-``, ``cmpl-``)


def sse(obj) -> bytes:
    """One server-sent event carrying ``obj`` as compact JSON."""
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


class LogprobsRenderer:
    """Renders the head's samples (generation.LogprobEntry) in OpenAI's logprobs shapes."""

    def __init__(self, tokenizer: Tokenizer, offset: int = 0):
        self.tokenizer = tokenizer
        self.offset = offset  # completions' text_offset of the next token (characters)

    def _piece(self, token: int) -> tuple[str, bytes]:
        raw = self.tokenizer.token_bytes(token)
        return raw.decode("utf-8", errors="replace"), raw

    def chat(self, entries: list[LogprobEntry]) -> dict:
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

    def completion(self, entries: list[LogprobEntry]) -> dict:
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


def usage(stats: GenerationStats) -> dict:
    """OpenAI's ``usage`` object of a finished generation."""
    return {
        "prompt_tokens": stats.prompt_tokens,
        "completion_tokens": stats.completion_tokens,
        "total_tokens": stats.prompt_tokens + stats.completion_tokens,
    }


class Reply:
    """The response objects of one request to ``/v1/chat/completions`` (``chat``) or ``/v1/completions``: one
    ``id`` and ``created`` for all of them. ``echo``: the prompt, when the completion starts with it."""

    def __init__(
        self, model_name: str, tokenizer: Tokenizer, chat: bool, opts: RequestOptions, echo: str | None = None
    ):
        self.model_name, self.chat, self.opts, self.echo = model_name, chat, opts, echo
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:ID_HEX]
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"
        self._logprobs = LogprobsRenderer(tokenizer, len(echo) if echo else 0)

    def logprobs(self, entries: list[LogprobEntry]) -> dict | None:
        """The ``logprobs`` of a choice (None when the request did not ask for them)."""
        if not self.opts.logprobs:
            return None
        return self._logprobs.chat(entries) if self.chat else self._logprobs.completion(entries)

    def chunk(
        self, text: str | None, finish: str | None = None, first: bool = False, entries=None, tool_calls=None
    ) -> dict:
        """One stream chunk: ``text`` (chat: the first chunk's delta is the assistant role), its logprob
        ``entries``, the ``finish`` reason of the last, a chat's ``tool_calls``."""
        lp = self.logprobs(entries) if entries else None
        if self.chat:
            delta = {"role": "assistant", "content": ""} if first else ({"content": text} if text else {})
            if tool_calls:  # OpenAI's streamed shape: each call whole, with its index
                delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(tool_calls)]
            choice = {"index": 0, "delta": delta, "logprobs": lp, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": lp, "finish_reason": finish}
        out = {
            "id": self.id,
            "object": self.object + ".chunk" if self.chat else self.object,
            "created": self.created,
            "model": self.model_name,
            "choices": [choice],
        }
        if self.opts.include_usage:  # OpenAI: every chunk but the last has "usage": null
            out["usage"] = None
        return out

    def body(self, text: str, entries: list[LogprobEntry], done: Done, tools: ToolRequest | None) -> dict:
        """The non-streamed answer: the whole ``text`` (chat: tool calls parsed out of it when ``tools`` were
        offered), its logprobs, ``usage`` and ``telemetry``."""
        finish = done.stats.finish_reason
        if self.chat:
            message = {"role": "assistant", "content": text}
            if tools is not None:
                message["content"], made = parse_tool_calls(text)
                if made:
                    message["tool_calls"], finish = tools.calls(made), "tool_calls"
            choice = {"index": 0, "message": message, "logprobs": self.logprobs(entries), "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text, "logprobs": self.logprobs(entries), "finish_reason": finish}
        return {
            "id": self.id,
            "object": self.object,
            "created": self.created,
            "model": self.model_name,
            "choices": [choice],
            "usage": usage(done.stats),
            "telemetry": done.telemetry,
        }

    def last_chunks(self, done: Done, calls: ToolCallStream | None, tools: ToolRequest | None) -> list[dict]:
        """The chunks that end a stream: held-back text and tool calls (``calls``), the final chunk with its
        finish reason, then the usage chunk when asked for; the last carries ``telemetry``."""
        out, finish = [], done.stats.finish_reason
        if calls is not None:
            content, made = calls.finish()
            if content:
                out.append(self.chunk(content))
            if made:
                out.append(self.chunk(None, tool_calls=tools.calls(made)))
                finish = "tool_calls"
        out.append(self.chunk(None, finish))
        if self.opts.include_usage:  # OpenAI: one more chunk, with no choices, carries the usage
            out.append({**self.chunk(None), "choices": [], "usage": usage(done.stats)})
        out[-1]["telemetry"] = done.telemetry
        return out


def error_event(err, tokens: int) -> dict:
    """The SSE event of a stream that failed after ``tokens`` tokens (a 5xx also leaves a "stream failed" line on
    stderr): ``{"error": {message, type, code, status}, "telemetry"?}``."""
    obj = error_object(err)
    out = {"message": obj["message"], "type": obj["type"], "code": obj["code"], "status": err.status}
    say_failed(f"stream failed after {tokens} tokens", err.status, err.code, err.message)
    event = {"error": out}
    if getattr(err, "telemetry", None):
        event["telemetry"] = err.telemetry
    return event


async def write_stream(
    resp: web.StreamResponse,
    request: web.Request,
    next_event: Callable[[], Awaitable[Event]],
    reply: Reply,
    calls: ToolCallStream | None = None,
    tools: ToolRequest | None = None,
) -> None:
    """Write SSE chunks from the generation's events until Done (last_chunks, ``[DONE]``) or Failed (error_event).
    With ``calls`` (tools offered), text that may be a tool call is held back and sent at the end as one
    ``delta.tool_calls`` chunk (finish_reason ``tool_calls``), or as content when it was none. ConnectionResetError
    when the client went away."""
    await resp.prepare(request)
    if reply.chat:
        await resp.write(sse(reply.chunk(None, first=True)))
    if reply.echo:
        await resp.write(sse(reply.chunk(reply.echo)))
    while True:
        event = await next_event()
        if isinstance(event, Delta):
            text = calls.push(event.text) if calls is not None else event.text
            if calls is None or text or event.entries:
                await resp.write(sse(reply.chunk(text, entries=event.entries)))
        elif isinstance(event, Done):
            for chunk in reply.last_chunks(event, calls, tools):
                await resp.write(sse(chunk))
            await resp.write(SSE_DONE)
            break
        else:
            await resp.write(sse(error_event(event.error, event.tokens)))
            break
    await resp.write_eof()
