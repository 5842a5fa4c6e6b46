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
from .generation import Delta, Done, Event, Failed, LogprobEntry
from .params import RequestOptions
from .timings import combined

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


def total_usage(dones: list[Done]) -> dict:
    """``usage`` of a request's choices: the prompt counted once, the completion tokens of every choice summed."""
    out = usage(dones[0].stats)
    out["completion_tokens"] = sum(d.stats.completion_tokens for d in dones)
    out["total_tokens"] = out["prompt_tokens"] + out["completion_tokens"]
    return out


def total_telemetry(dones: list[Done]) -> dict:
    """``telemetry`` of a request's choices: choice 0's; with n > 1 also ``choices``, every choice's own."""
    if len(dones) == 1:
        return dones[0].telemetry
    return {**dones[0].telemetry, "choices": [d.telemetry for d in dones]}


class Reply:
    """The response objects of one request to ``/v1/chat/completions`` (``chat``) or ``/v1/completions``: one
    ``id`` and ``created`` for all of them, ``opts.n`` choices. ``echo``: the prompt, when each completion
    starts with it."""

    def __init__(
        self, model_name: str, tokenizer: Tokenizer, chat: bool, opts: RequestOptions, echo: str | None = None
    ):
        self.model_name, self.chat, self.opts, self.echo = model_name, chat, opts, echo
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:ID_HEX]
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"
        self._logprobs = [LogprobsRenderer(tokenizer, len(echo) if echo else 0) for _ in range(opts.n)]

    def logprobs(self, entries: list[LogprobEntry], index: int = 0) -> dict | None:
        """The ``logprobs`` of choice ``index`` (None when the request did not ask for them)."""
        if not self.opts.logprobs:
            return None
        renderer = self._logprobs[index]
        return renderer.chat(entries) if self.chat else renderer.completion(entries)

    def chunk(
        self,
        text: str | None,
        finish: str | None = None,
        first: bool = False,
        entries=None,
        tool_calls=None,
        index: int = 0,
        timings: dict | None = None,
    ) -> dict:
        """One stream chunk of choice ``index``: ``text`` (chat: the first chunk's delta is ``{"role":
        "assistant", "content": null}``, as llama-server and OpenAI), its logprob ``entries``, the ``finish``
        reason of the last, a chat's ``tool_calls``, llama-server's ``timings`` object when given."""
        lp = self.logprobs(entries, index) if entries else None
        if self.chat:
            delta = {"role": "assistant", "content": None} if first else ({"content": text} if text else {})
            if tool_calls:  # OpenAI's streamed shape: each call whole, with its index
                delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(tool_calls)]
            choice = {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish}
        else:
            choice = {"index": index, "text": text or "", "logprobs": lp, "finish_reason": finish}
        out = {
            "id": self.id,
            "object": self.object + ".chunk" if self.chat else self.object,
            "created": self.created,
            "model": self.model_name,
            "choices": [choice],
        }
        if self.opts.include_usage:  # OpenAI: every chunk but the last has "usage": null
            out["usage"] = None
        if timings is not None:
            out["timings"] = timings
        return out

    def choice(self, index: int, text: str, entries: list[LogprobEntry], done: Done, tools: ToolRequest | None):
        """Choice ``index`` of the non-streamed answer: the whole ``text`` (chat: tool calls parsed out of it when
        ``tools`` were offered) and its logprobs."""
        finish, lp = done.stats.finish_reason, self.logprobs(entries, index)
        if not self.chat:
            return {"index": index, "text": text, "logprobs": lp, "finish_reason": finish}
        message = {"role": "assistant", "content": text}
        if tools is not None:
            message["content"], made = parse_tool_calls(text)
            if made:
                message["tool_calls"], finish = tools.calls(made), "tool_calls"
        return {"index": index, "message": message, "logprobs": lp, "finish_reason": finish}

    def body(self, choices: list[dict], dones: list[Done]) -> dict:
        """The non-streamed answer: its ``choices`` (Reply.choice, by index), ``usage`` (total_usage),
        ``telemetry`` (total_telemetry) and llama-server's ``timings`` (timings.combined)."""
        return {
            "id": self.id,
            "object": self.object,
            "created": self.created,
            "model": self.model_name,
            "choices": choices,
            "usage": total_usage(dones),
            "telemetry": total_telemetry(dones),
            "timings": combined([d.timings for d in dones]),
        }

    def last_chunks(self, index: int, done: Done, calls: ToolCallStream | None, tools: ToolRequest | None):
        """The chunks that end choice ``index``'s stream: held-back text and tool calls (``calls``), then its
        final chunk with its finish reason and ``timings``."""
        out, finish = [], done.stats.finish_reason
        if calls is not None:
            content, made = calls.finish()
            if content:
                out.append(self.chunk(content, index=index))
            if made:
                out.append(self.chunk(None, tool_calls=tools.calls(made), index=index))
                finish = "tool_calls"
        out.append(self.chunk(None, finish, index=index, timings=done.timings))
        return out

    def end_chunks(self, dones: list[Done]) -> list[dict]:
        """What follows the last choice's final chunk: the usage chunk (no choices; ``usage`` and ``timings``)
        when asked for."""
        if not self.opts.include_usage:  # OpenAI: one more chunk, with no choices, carries the usage
            return []
        return [
            {
                **self.chunk(None),
                "choices": [],
                "usage": total_usage(dones),
                "timings": combined([d.timings for d in dones]),
            }
        ]


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
    next_event: Callable[[], Awaitable[tuple[int, Event]]],
    reply: Reply,
    tools: ToolRequest | None = None,
) -> None:
    """Write SSE chunks from the choices' events (``next_event``: ``(index, event)``, choices.Choices.next) until
    every choice is Done (each choice's last_chunks as it ends; end_chunks, ``telemetry`` on the very last chunk,
    ``[DONE]``) or one Failed (error_event). With ``tools`` offered, each choice's text that may be a tool call is
    held back and sent at its end as one ``delta.tool_calls`` chunk (finish_reason ``tool_calls``), or as content
    when it was none. Every chunk carries ``timings`` with ``opts.timings_per_token``. ConnectionResetError when
    the client went away."""
    await resp.prepare(request)
    n, per_token = reply.opts.n, reply.opts.timings_per_token
    calls = [ToolCallStream() if tools is not None else None for _ in range(n)]
    dones: dict[int, Done] = {}
    started: set[int] = set()
    while True:
        index, event = await next_event()
        if isinstance(event, (Delta, Done)) and index not in started:  # as llama-server: with the first token
            started.add(index)
            timings = event.timings if per_token else None
            if reply.chat:
                await resp.write(sse(reply.chunk(None, first=True, index=index, timings=timings)))
            if reply.echo:
                await resp.write(sse(reply.chunk(reply.echo, index=index, timings=timings)))
        if isinstance(event, Delta):
            held = calls[index]
            text = held.push(event.text) if held is not None else event.text
            if held is None or text or event.entries:
                timings = event.timings if per_token else None
                await resp.write(sse(reply.chunk(text, entries=event.entries, index=index, timings=timings)))
        elif isinstance(event, Done):
            dones[index] = event
            chunks = reply.last_chunks(index, event, calls[index], tools)
            if len(dones) == n:
                ordered = [dones[i] for i in range(n)]
                chunks += reply.end_chunks(ordered)
                chunks[-1]["telemetry"] = total_telemetry(ordered)
            for chunk in chunks:
                await resp.write(sse(chunk))
            if len(dones) == n:
                await resp.write(SSE_DONE)
                break
        elif isinstance(event, Failed):
            await resp.write(sse(error_event(event.error, event.tokens)))
            break
    await resp.write_eof()
