"""The request body of ``POST /v1/responses`` (OpenAI's Responses API) as typed pydantic models, and what the chat
path makes of it: input items to chat ``messages``, the sampling and tool fields to a chat completions body.
``parse_request`` turns a body into a ResponseRequest or a RequestError naming the ``param`` at fault."""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, ValidationError, field_validator

from .errors import RequestError

RESPONSES_PATH = "/v1/responses"
MAX_METADATA_KEYS = 16  # OpenAI's bounds of ``metadata``: keys, key length, value length (characters)
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512
# Fields of a chat completions error that are named otherwise here.
CHAT_PARAM_NAMES = {"messages": "input", "max_tokens": "max_output_tokens", "response_format": "text.format"}


class _Strict(BaseModel):
    """No unknown field, no coercion ("1" is not 1): a field this gateway does not know is refused, not dropped."""

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)


def _type_of(default: str | None = None):
    """The discriminator of a union of typed objects: the ``type`` field (``default`` when it is absent)."""

    def pick(value: Any) -> str | None:
        if isinstance(value, dict):
            return value.get("type", default)
        return getattr(value, "type", default)

    return pick


def _tagged(*members: tuple[type, str], default: str | None = None):
    return Annotated[
        Union[tuple(Annotated[cls, Tag(tag)] for cls, tag in members)],  # noqa: UP007 - a tuple of members
        Discriminator(_type_of(default), custom_error_type="unsupported_type", custom_error_message="unsupported"),
    ]


class InputText(_Strict):
    type: Literal["input_text"]
    text: str


class OutputText(_Strict):
    """An earlier answer's text (a stored response's output sent back as input)."""

    type: Literal["output_text"]
    text: str
    annotations: list[Any] = []
    logprobs: list[Any] | None = None


class Refusal(_Strict):
    type: Literal["refusal"]
    refusal: str


ContentPart = _tagged((InputText, "input_text"), (OutputText, "output_text"), (Refusal, "refusal"))


class MessageItem(_Strict):
    """``{"type": "message", "role", "content"}``: ``content`` a string or text parts (``input_text``,
    ``output_text``, ``refusal``); ``id``, ``status`` and ``phase`` are what a stored output item carries."""

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[ContentPart]
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None
    phase: Literal["commentary", "final_answer"] | None = None

    def text(self) -> str:
        """The message's text: the string, or its parts' text joined."""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.refusal if isinstance(p, Refusal) else p.text for p in self.content)


class FunctionCallItem(_Strict):
    """A call the model made (an earlier output item): ``arguments`` a JSON string."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    namespace: str | None = None
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class FunctionCallOutputItem(_Strict):
    """The result of call ``call_id``: ``output`` a string or text parts."""

    type: Literal["function_call_output"]
    call_id: str
    output: str | list[ContentPart]
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    def text(self) -> str:
        if isinstance(self.output, str):
            return self.output
        return "".join(p.refusal if isinstance(p, Refusal) else p.text for p in self.output)


InputItem = _tagged(
    (MessageItem, "message"),
    (FunctionCallItem, "function_call"),
    (FunctionCallOutputItem, "function_call_output"),
    default="message",
)


class FunctionTool(_Strict):
    """``{"type": "function", "name", "description", "parameters", "strict"}`` (the Responses API's flat shape)."""

    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamespaceTool(_Strict):
    """Function tools grouped under ``name``: offered to the model as plain function tools (their names unique
    across the request); a call to one reports its ``namespace``."""

    type: Literal["namespace"]
    name: str
    description: str | None = None
    tools: list[_tagged((FunctionTool, "function"))]


class WebSearchTool(BaseModel):
    """A hosted tool OpenAI runs (``web_search``, ``web_search_preview``): accepted, never offered to the model
    (this gateway runs no hosted tool), so never called."""

    model_config = ConfigDict(extra="allow")
    type: Literal["web_search", "web_search_preview"]


Tool = _tagged(
    (FunctionTool, "function"),
    (NamespaceTool, "namespace"),
    (WebSearchTool, "web_search"),
    (WebSearchTool, "web_search_preview"),
)


class ToolChoiceFunction(_Strict):
    type: Literal["function"]
    name: str


class FormatText(_Strict):
    type: Literal["text"]


class FormatJSONObject(_Strict):
    type: Literal["json_object"]


class FormatJSONSchema(_Strict):
    type: Literal["json_schema"]
    name: str
    schema_: dict[str, Any] = Field(alias="schema")
    description: str | None = None
    strict: bool | None = None


TextFormat = _tagged((FormatText, "text"), (FormatJSONObject, "json_object"), (FormatJSONSchema, "json_schema"))


class TextConfig(_Strict):
    """``text``: ``format`` (constrained decoding, as chat's ``response_format``); ``verbosity`` has no effect."""

    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class Reasoning(_Strict):
    """``reasoning``: accepted, no effect (the served model reports no separate reasoning)."""

    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class StreamOptions(_Strict):
    include_obfuscation: bool | None = None  # nothing to pad here: no effect


class ResponseRequest(_Strict):
    """The body of ``POST /v1/responses``. Honoured: ``model``, ``input``, ``instructions`` (a system message
    before the input; not carried over by ``previous_response_id``, as OpenAI), ``max_output_tokens``,
    ``temperature``, ``top_p``, ``tools`` (function tools, and ``namespace`` tools' functions), ``tool_choice``,
    ``parallel_tool_calls``, ``max_tool_calls``, ``text.format``, ``stream``, ``store``, ``previous_response_id``,
    ``metadata``. Accepted, no effect: ``web_search`` tools (never offered: no hosted tool runs here),
    ``client_metadata`` (Codex CLI's), ``user``, ``safety_identifier``, ``prompt_cache_key``, ``service_tier``,
    ``reasoning``, ``text.verbosity``, ``stream_options.include_obfuscation``, ``include`` of
    ``reasoning.encrypted_content``, ``truncation: "disabled"``, ``top_logprobs: 0``, ``background: false``.
    Anything else is refused (400)."""

    model: str | None = None
    input: str | list[InputItem] | None = None
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, ge=0, le=1)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ToolChoiceFunction | None = None
    parallel_tool_calls: bool | None = None
    max_tool_calls: int | None = Field(None, ge=1)
    text: TextConfig | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    store: bool | None = None
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    client_metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    reasoning: Reasoning | None = None
    include: list[Literal["reasoning.encrypted_content"]] | None = None
    truncation: Literal["disabled"] | None = None
    top_logprobs: Literal[0] | None = None
    background: Literal[False] | None = None

    @field_validator("metadata")
    @classmethod
    def _bounded(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        if value is not None:
            if len(value) > MAX_METADATA_KEYS:
                raise ValueError(f"at most {MAX_METADATA_KEYS} keys")
            for k, v in value.items():
                if len(k) > MAX_METADATA_KEY_CHARS or len(v) > MAX_METADATA_VALUE_CHARS:
                    raise ValueError(
                        f"keys of at most {MAX_METADATA_KEY_CHARS} characters, values of at most "
                        f"{MAX_METADATA_VALUE_CHARS}"
                    )
        return value

    def items(self) -> list[dict]:
        """The input as a list of items (a string input is one user message), each a dict with its ``type``."""
        if self.input is None:
            return []
        if isinstance(self.input, str):
            return [{"type": "message", "role": "user", "content": self.input}]
        return [item.model_dump(by_alias=True, exclude_none=True) for item in self.input]

    def functions(self) -> list[FunctionTool]:
        """The function tools offered to the model: ``tools``' functions, those of each namespace after them."""
        tools = self.tools or []
        return [t for t in tools if isinstance(t, FunctionTool)] + [
            f for t in tools if isinstance(t, NamespaceTool) for f in t.tools
        ]

    def namespaces(self) -> dict[str, str]:
        """{function name: its namespace} of the namespaced functions."""
        return {f.name: t.name for t in self.tools or [] if isinstance(t, NamespaceTool) for f in t.tools}

    def chat_body(self) -> dict:
        """The chat completions body of the same sampling, tools and output format (params.parse_params and
        client.tools.tool_request check it), without ``messages``."""
        body: dict = {
            "max_tokens": self.max_output_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "stream": self.stream,
            "parallel_tool_calls": self.parallel_tool_calls,
        }
        functions = self.functions()
        if functions:
            body["tools"] = [
                {"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)} for t in functions
            ]
        if isinstance(self.tool_choice, ToolChoiceFunction):
            body["tool_choice"] = {"type": "function", "function": {"name": self.tool_choice.name}}
        elif functions or self.tool_choice not in ("auto", "none"):  # no function: "auto" / "none" mean nothing
            body["tool_choice"] = self.tool_choice
        fmt = self.text.format if self.text is not None else None
        if isinstance(fmt, FormatJSONSchema):
            spec = fmt.model_dump(by_alias=True, exclude={"type"}, exclude_none=True)
            body["response_format"] = {"type": "json_schema", "json_schema": spec}
        elif fmt is not None:
            body["response_format"] = {"type": fmt.type}
        return {k: v for k, v in body.items() if v is not None}


def chat_messages(instructions: str | None, items: list[dict]) -> list[dict]:
    """OpenAI chat ``messages`` of a conversation's items (dicts as ResponseRequest.items gives them):
    ``instructions`` as a first system message; a ``function_call`` joins the assistant message before it (one
    answer's text and calls), else starts one with no content; a ``function_call_output`` is a ``tool`` message."""
    messages = [{"role": "system", "content": instructions}] if instructions else []
    for item in items:
        kind = item.get("type", "message")
        if kind == "message":
            messages.append({"role": item["role"], "content": MessageItem.model_validate(item).text()})
        elif kind == "function_call":
            call = {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]},
            }
            if messages and messages[-1]["role"] == "assistant":
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            text = FunctionCallOutputItem.model_validate(item).text()
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": text})
    return messages


def _param(loc: tuple) -> str:
    """OpenAI's ``param`` of a pydantic error location: ``input[0].content[1].type`` (union branch labels out)."""
    out, prev = "", None
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif (
            not (part.isidentifier() and not part[:1].isupper())
            or (isinstance(prev, int) or prev in ("format", "input", "content", "output", "tool_choice"))
            and part in _LABELS
        ):
            pass  # a union branch ("str", "list[...]", a tag)
        else:
            out += ("." if out else "") + part
        prev = part
    return out or "body"


_LABELS = {
    "str",
    "message",
    "function_call",
    "function_call_output",
    "input_text",
    "output_text",
    "refusal",
    "function",
    "namespace",
    "web_search",
    "web_search_preview",
    "text",
    "json_object",
    "json_schema",
}


def _at(body, loc: tuple):
    """The value at ``loc`` in ``body`` (union labels skipped), or None."""
    value = body
    for part in loc:
        if isinstance(value, list) and isinstance(part, int) and part < len(value):
            value = value[part]
        elif isinstance(value, dict) and part in value:
            value = value[part]
    return value


def parse_request(body: dict) -> ResponseRequest:
    """``body`` as a ResponseRequest. RequestError (400) naming the param: an unknown field
    (``unknown_parameter``), a wrong type or value, an input part or item or tool of a type not served here
    (``input_image`` / ``input_file`` parts: the model reads text only; only function tools), a missing
    ``input``."""
    try:
        request = ResponseRequest.model_validate(body)
    except ValidationError as exc:
        # the most specific error: a union reports one per branch, the deepest says what is wrong
        err = max(exc.errors(), key=lambda e: len(e["loc"]))
        param = _param(err["loc"])
        if err["type"] == "extra_forbidden" and len(err["loc"]) == 1:
            raise RequestError(
                f"unknown parameter {param!r}: not a parameter {RESPONSES_PATH} implements here (docs/protocol.md, "
                f'"Responses", lists them)',
                param=param,
                code="unknown_parameter",
            ) from None
        if err["type"] == "unsupported_type":
            raise RequestError(_unsupported(param, _at(body, err["loc"])), param=param) from None
        msg = err["msg"].removeprefix("Value error, ")
        raise RequestError(f"{param}: {msg}", param=param) from None
    if request.input is None:
        raise RequestError("input is required (a string or a list of input items)", param="input")
    return request


def _unsupported(param: str, value) -> str:
    kind = value.get("type") if isinstance(value, dict) else None
    if kind in ("input_image", "input_file", "input_audio"):
        return f"{param}: {kind} parts are not supported: the served model reads text only (send input_text)"
    if param.startswith("tools"):
        return f"{param}: tools of type {kind!r} are not supported: only function tools ({{'type': 'function'}})"
    if param.startswith("input") and param.count("[") == 1:
        return (
            f"{param}: input items of type {kind!r} are not supported (message, function_call, "
            f"function_call_output are)"
        )
    return f"{param}: type {kind!r} is not supported here"


def chat_error(err: RequestError) -> RequestError:
    """A chat path's RequestError (params.parse_params, messages.chat_turns, client.tools) with its ``param``
    named as the Responses API names it (``max_tokens`` → ``max_output_tokens``, ``response_format`` →
    ``text.format``, ``messages`` → ``input``)."""
    name = CHAT_PARAM_NAMES.get(err.param, err.param)
    message = err.message
    for old, new in CHAT_PARAM_NAMES.items():
        message = message.replace(old, new)
    return RequestError(message, err.status, err.code, name, err.type)
