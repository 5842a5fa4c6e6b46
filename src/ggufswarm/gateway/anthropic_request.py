"""Anthropic Messages API request bodies (``POST /v1/messages``, ``POST /v1/messages/count_tokens``) as typed
pydantic models, and their conversion to the OpenAI chat body the chat path implements (messages.chat_turns,
client.tools.tool_request, params.parse_params), so both endpoints render, tokenize and sample alike."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, model_validator

from .errors import RequestError
from .params import MAX_STOP_STRINGS

TEXT_JOIN = "\n\n"  # between the text blocks of one turn (and of ``system``), and merged consecutive turns
# known Messages API fields this gateway refuses (a 400 naming them): what each would need
REFUSED = {
    "container": "code execution containers are not implemented",
    "mcp_servers": "MCP connectors are not implemented",
}


class _Strict(BaseModel):
    """No coercion ("1" is not 1) and no unknown field, as the chat endpoint's checks."""

    model_config = ConfigDict(extra="forbid", strict=True)


class CacheControl(_Strict):
    """A prompt-cache breakpoint: accepted, no effect (prompt prefixes are reused from the snapshot cache anyway)."""

    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class TextBlock(_Strict):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None
    citations: list[dict] | None = None  # accepted, no effect


class MediaBlock(BaseModel):
    """An image or a document: parsed only to be refused (``to_chat``), since the served models have no vision."""

    model_config = ConfigDict(extra="allow")
    type: Literal["image", "document", "search_result", "container_upload"]


class ToolUseBlock(_Strict):
    """A call the assistant made (in the history): becomes an OpenAI ``tool_calls`` entry."""

    type: Literal["tool_use"]
    id: str = Field(min_length=1)
    name: str
    input: dict[str, Any]
    cache_control: CacheControl | None = None


def _blocks(value):
    """A string content is one text block (Anthropic's shorthand; the JSON Schema says both forms)."""
    if isinstance(value, str):
        return [{"type": "text", "text": value}]
    if not isinstance(value, list):
        raise ValueError("must be a string or a list of content blocks")
    return value


ResultContent = Annotated[TextBlock | MediaBlock, Field(discriminator="type")]


class ToolResultBlock(_Strict):
    """A tool's answer to a ``tool_use``: becomes an OpenAI ``tool`` message. ``is_error``: no effect (chat
    templates have no place for it)."""

    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1)
    content: Annotated[list[ResultContent], BeforeValidator(_blocks, str | list[ResultContent])] = []
    is_error: bool | None = None
    cache_control: CacheControl | None = None


class ThinkingBlock(_Strict):
    """Extended thinking from an earlier answer (a client sends it back): dropped, no effect."""

    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(_Strict):
    type: Literal["redacted_thinking"]
    data: str


ContentBlock = Annotated[
    TextBlock | MediaBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock,
    Field(discriminator="type"),
]


class Message(_Strict):
    """A turn: ``user``, ``assistant``, or ``system`` (a system message mid-conversation, text only)."""

    role: Literal["user", "assistant", "system"]
    content: Annotated[list[ContentBlock], BeforeValidator(_blocks, str | list[ContentBlock])]


class Tool(_Strict):
    """A client tool: ``name``, ``description``, ``input_schema`` (the call's ``input`` JSON Schema)."""

    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,128}$")
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    cache_control: CacheControl | None = None
    strict: bool | None = None  # accepted, no effect (a forced call follows the schema anyway)

    @model_validator(mode="before")
    @classmethod
    def _server_tool(cls, value):
        if isinstance(value, dict) and value.get("type") not in (None, "custom"):
            raise ValueError(
                f"server tools (type {value['type']!r}) are not implemented; give client tools: "
                '{"name", "description", "input_schema"}'
            )
        return value


class ToolChoiceAuto(_Strict):
    type: Literal["auto"]
    disable_parallel_tool_use: bool | None = None


class ToolChoiceAny(_Strict):
    type: Literal["any"]
    disable_parallel_tool_use: bool | None = None


class ToolChoiceTool(_Strict):
    type: Literal["tool"]
    name: str
    disable_parallel_tool_use: bool | None = None


class ToolChoiceNone(_Strict):
    type: Literal["none"]


ToolChoice = Annotated[ToolChoiceAuto | ToolChoiceAny | ToolChoiceTool | ToolChoiceNone, Field(discriminator="type")]


class ThinkingEnabled(_Strict):
    type: Literal["enabled"]
    budget_tokens: int = Field(ge=0)
    display: Literal["summarized", "omitted"] | None = None


class ThinkingAdaptive(_Strict):
    type: Literal["adaptive"]
    display: Literal["summarized", "omitted"] | None = None


class ThinkingDisabled(_Strict):
    type: Literal["disabled"]


Thinking = Annotated[ThinkingEnabled | ThinkingAdaptive | ThinkingDisabled, Field(discriminator="type")]


class OutputFormat(_Strict):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Strict):
    """``format``: a JSON Schema the answer follows (constrained decoding, as chat's ``response_format``);
    ``effort``: no effect."""

    format: OutputFormat | None = None
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None


class ClearThinking(BaseModel):
    """A context edit that clears earlier thinking blocks: nothing to do (they are dropped anyway)."""

    model_config = ConfigDict(extra="allow")
    type: Literal["clear_thinking_20251015"]


class ContextManagement(_Strict):
    """Server-side context editing: only clearing thinking is accepted (no effect); an edit that would change
    the prompt (clearing tool uses) is refused."""

    edits: list[ClearThinking] = []


class Metadata(_Strict):
    user_id: str | None = None


class CountTokensRequest(_Strict):
    """The body of ``POST /v1/messages/count_tokens`` (and the part of a Messages body that makes the prompt).

    Honoured: ``model``, ``messages``, ``system``, ``tools``, ``tool_choice``, ``output_config.format``. Accepted
    with no effect: ``cache_control`` (anywhere), ``thinking`` (the model does not think aloud: no thinking
    blocks), ``context_management`` that only clears thinking, ``output_config.effort``, ``speed``,
    ``inference_geo``, text ``citations``, ``is_error``, thinking blocks in the history."""

    model: str
    messages: list[Message] = Field(min_length=1)
    system: Annotated[list[TextBlock], BeforeValidator(_blocks, str | list[TextBlock])] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    cache_control: CacheControl | None = None
    speed: Literal["standard", "fast"] | None = None
    inference_geo: str | None = None
    context_management: ContextManagement | None = None


class MessagesRequest(CountTokensRequest):
    """The body of ``POST /v1/messages``: the prompt's fields, and ``max_tokens`` (required), ``stop_sequences``
    (at most MAX_STOP_STRINGS), ``temperature`` (0..1), ``top_p``, ``top_k``, ``stream``. Accepted with no effect:
    ``metadata``, ``service_tier``. Omitted sampling settings take the chat endpoint's (llama.cpp's) defaults."""

    max_tokens: int = Field(ge=1)
    stop_sequences: list[Annotated[str, Field(min_length=1)]] | None = Field(None, max_length=MAX_STOP_STRINGS)
    stream: bool = False
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, ge=0, le=1)
    top_k: int | None = Field(None, ge=0)
    metadata: Metadata | None = None
    service_tier: Literal["auto", "standard_only"] | None = None


def _where(loc: tuple, body: dict) -> str:
    """A pydantic error location as a path (``messages[0].content[1].text``), without the union tags pydantic
    puts in it (the block's ``type``)."""
    path, at = "", body
    for k, part in enumerate(loc):
        if isinstance(part, int):
            path += f"[{part}]"
            at = at[part] if isinstance(at, list) and part < len(at) else None
        elif isinstance(at, dict) and part == at.get("type") and k + 1 < len(loc):
            continue  # a discriminated union's tag (always followed by the member's field)
        else:
            path += f".{part}" if path else str(part)
            at = at.get(part) if isinstance(at, dict) else None
    return path


def parse_request(body: dict, kind: type[CountTokensRequest]) -> CountTokensRequest:
    """``body`` checked as ``kind`` (MessagesRequest or CountTokensRequest). RequestError (400, ``param`` the
    top-level field at fault, the message naming the full path): a missing or mistyped field, a value out of
    range, a field this endpoint does not know (``unknown_parameter``) or refuses (REFUSED)."""
    for name in body:
        if name in REFUSED:
            raise RequestError(f"{name} is not supported: {REFUSED[name]}", param=name)
    try:
        return kind.model_validate(body)
    except ValidationError as exc:
        err = exc.errors(include_url=False)[0]
        where, param = _where(err["loc"], body), str(err["loc"][0]) if err["loc"] else None
        if err["type"] == "extra_forbidden" and len(err["loc"]) == 1:
            raise RequestError(
                f"unknown parameter {param!r}: not a parameter this endpoint implements here (docs/protocol.md, "
                f'"Messages API", lists them)',
                param=param,
                code="unknown_parameter",
            ) from None
        message = "unknown field" if err["type"] == "extra_forbidden" else err["msg"].removeprefix("Value error, ")
        raise RequestError(f"{where}: {message}" if where else message, param=param) from None


def _text(blocks: list, where: str, start: int = 0) -> str:
    """The text of ``blocks`` (text blocks joined by TEXT_JOIN; ``start``: the first one's index in ``where``);
    RequestError for an image or a document."""
    parts = []
    for j, block in enumerate(blocks, start):
        if isinstance(block, MediaBlock):
            raise RequestError(
                f"{where}[{j}]: {block.type} blocks are not supported: the served model reads text only",
                param=where.split("[")[0],
            )
        if isinstance(block, TextBlock):
            parts.append(block.text)
    return TEXT_JOIN.join(parts)


def _chat_messages(req: CountTokensRequest) -> list[dict]:
    """OpenAI chat ``messages`` of the request: ``system`` first, each ``tool_use`` an assistant's
    ``tool_calls`` entry, each ``tool_result`` a ``tool`` message, consecutive turns of one role merged (as
    Anthropic combines them). RequestError for an image / document block, or a last turn from the assistant
    (prefill: the chat template would close it)."""
    out: list[dict] = []

    def add(msg: dict) -> None:
        prev = out[-1] if out else None
        if prev is not None and prev["role"] == msg["role"] and msg["role"] in ("user", "assistant"):
            prev["content"] = TEXT_JOIN.join(t for t in (prev["content"], msg["content"]) if t) or None
            prev["tool_calls"] = prev.get("tool_calls", []) + msg.get("tool_calls", [])
            if not prev["tool_calls"]:
                del prev["tool_calls"]
        else:
            out.append(msg)

    if req.system:
        out.append({"role": "system", "content": _text(req.system, "system")})
    for i, m in enumerate(req.messages):
        where, text = f"messages[{i}].content", []
        if m.role == "system":
            if any(not isinstance(b, (TextBlock, MediaBlock)) for b in m.content):
                raise RequestError(f"{where}: a system message holds text blocks only", param="messages")
            add({"role": "system", "content": _text(m.content, where)})
            continue
        if m.role == "assistant":
            calls = [
                {"id": b.id, "type": "function", "function": {"name": b.name, "arguments": json.dumps(b.input)}}
                for b in m.content
                if isinstance(b, ToolUseBlock)
            ]
            msg = {"role": "assistant", "content": _text(m.content, where) or None}
            if calls:
                msg["tool_calls"] = calls
            if msg["content"] is not None or calls:
                add(msg)
            continue
        for j, b in enumerate(m.content):
            if isinstance(b, ToolResultBlock):
                if text:
                    add({"role": "user", "content": TEXT_JOIN.join(text)})
                    text = []
                add({"role": "tool", "tool_call_id": b.tool_use_id, "content": _text(b.content, f"{where}[{j}]")})
            elif isinstance(b, ToolUseBlock):
                raise RequestError(f"{where}[{j}]: tool_use blocks belong in assistant messages", param="messages")
            else:
                text.append(_text([b], where, j))
        if text:
            add({"role": "user", "content": TEXT_JOIN.join(t for t in text if t)})
    if out and out[-1]["role"] == "assistant":
        raise RequestError(
            "the last message is the assistant's: continuing a partial answer (prefill) is not supported; "
            "end with a user message",
            param="messages",
        )
    return out


def to_chat(req: CountTokensRequest) -> dict:
    """The OpenAI chat body equivalent to ``req``: ``messages``, ``tools`` (``{"type": "function", "function":
    {"name", "description", "parameters": input_schema}}``), ``tool_choice`` (auto → ``"auto"``, any →
    ``"required"``, tool → the named function, none → ``"none"``; ``disable_parallel_tool_use`` →
    ``parallel_tool_calls: false``), ``response_format`` from ``output_config.format``, and for a
    MessagesRequest ``max_tokens``, ``stop``, ``stream``, ``temperature``, ``top_p``, ``top_k``. RequestError as
    _chat_messages."""
    body: dict = {"model": req.model, "messages": _chat_messages(req)}
    if req.tools:
        # in OpenAI's order (name, description, parameters): a template renders the tools as JSON in key order, so
        # the prompt is the one the same tools sent to chat completions make
        body["tools"] = [
            {
                "type": "function",
                "function": {"name": t.name}
                | ({"description": t.description} if t.description is not None else {})
                | {"parameters": t.input_schema},
            }
            for t in req.tools
        ]
    choice = req.tool_choice
    if choice is not None:
        body["tool_choice"] = {
            "auto": "auto",
            "any": "required",
            "none": "none",
            "tool": {"type": "function", "function": {"name": getattr(choice, "name", "")}},
        }[choice.type]
        if getattr(choice, "disable_parallel_tool_use", None) and req.tools:
            body["parallel_tool_calls"] = False
    if req.output_config is not None and req.output_config.format is not None:
        schema = req.output_config.format.schema_
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": schema}}
    if isinstance(req, MessagesRequest):
        body |= {"max_tokens": req.max_tokens, "stream": req.stream, "stop": req.stop_sequences or []}
        for name in ("temperature", "top_p", "top_k"):
            if getattr(req, name) is not None:
                body[name] = getattr(req, name)
    return body


# the OpenAI parameter a chat-path check names -> the Messages field it came from
MESSAGES_PARAM = {
    "stop": "stop_sequences",
    "response_format": "output_config",
    "parallel_tool_calls": "tool_choice",
}


def renamed(err: RequestError) -> RequestError:
    """``err`` (raised by the chat path's checks on a converted body) naming the Messages field, not the OpenAI
    parameter it became."""
    err.param = MESSAGES_PARAM.get(err.param, err.param)
    return err
