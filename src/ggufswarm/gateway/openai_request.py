"""The request bodies of ``POST /v1/chat/completions`` and ``POST /v1/completions`` as typed pydantic models: every
parameter the gateway takes, with its type, range and default, those accepted with no effect and those refused
(docs/protocol.md, "Gateway"). ``parse_request`` turns a body into one, or a RequestError naming the ``param``;
params.parse_params adds what a schema cannot say (cross-field rules, the vocabulary, grammars)."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal, get_args

import annotated_types as at
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SkipValidation,
    StrictInt,
    StringConstraints,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from ..client.speculative import MAX_DRAFT
from ..runtime.sampling import MAX_GRAMMAR_CHARS, SamplingParams
from .errors import RequestError

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
MAX_STOP_STRINGS = 16  # entries of one request's ``stop``
MAX_TOP_LOGPROBS_CHAT = 20  # OpenAI's bounds of top_logprobs (chat) and logprobs (completions)
MAX_TOP_LOGPROBS_COMPLETION = 5
INT32_MAX = 2**31 - 1
MAX_CHOICES = 8  # n: choices of one request, each its own route session (KV on every node)
MAX_LOGIT_BIAS = 1024  # entries of one request's logit_bias
SEED_SPACE = 2**63  # SamplingParams.seed's range
_D = SamplingParams()  # llama.cpp server's sampling defaults
NOT_IMPLEMENTED = "(a llama-server sampler setting) is not implemented by this gateway"
NO_EFFECT = "accepted, no effect"


class _Strict(BaseModel):
    """No coercion ("1" is not 1) and no unknown field; ``null`` is the field's default (as OpenAI reads it)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, value):
        return {k: v for k, v in value.items() if v is not None} if isinstance(value, dict) else value


def _off(value: float, why: str = NOT_IMPLEMENTED):
    """A setting taken only at ``value`` (the one that turns it off); any other is refused with ``why``."""
    return Field(None, ge=value, le=value, description=why)


def _no_effect(**kw):
    return Field(None, description=NO_EFFECT, **kw)


# -- what the schema documents of fields checked elsewhere (SkipValidation: their checker is the one source) --

Role = Literal["system", "developer", "user", "assistant", "tool"]
CHAT_ROLES = get_args(Role)


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class CalledFunction(BaseModel):
    name: str
    arguments: str | dict[str, Any] = ""


class ToolCall(BaseModel):
    id: str | None = None
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(BaseModel):
    """A chat message, checked by messages.chat_turns (each error names ``messages[i].field``): ``content`` may
    be omitted only by an assistant message with ``tool_calls``; a ``tool`` message's ``tool_call_id`` is
    optional (the chat template decides, as llama-server)."""

    role: Role
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None


class FunctionSpec(BaseModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolSpec(BaseModel):
    """A function tool (checked by client.tools.tool_request)."""

    type: Literal["function"]
    function: FunctionSpec


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: NamedFunction


# -- checked here --


class ChatStreamOptions(_Strict):
    include_usage: bool | None = Field(False, description="a final chunk with usage and empty choices")
    include_obfuscation: bool | None = _no_effect()


class ChatJSONSchema(_Strict):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ChatFormatText(_Strict):
    type: Literal["text"]


class ChatFormatJSONObject(_Strict):
    """Any JSON object; with ``schema`` (llama-server's shorthand), one following it."""

    type: Literal["json_object"]
    schema_: dict[str, Any] | None = Field(None, alias="schema")


class ChatFormatJSONSchema(_Strict):
    """JSON following ``json_schema.schema`` (or ``schema``, llama-server's shorthand; neither: any object)."""

    type: Literal["json_schema"]
    json_schema: ChatJSONSchema | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")


ResponseFormat = Annotated[ChatFormatText | ChatFormatJSONObject | ChatFormatJSONSchema, Field(discriminator="type")]
TokenId = Annotated[str, StringConstraints(pattern=r"^[0-9]+$")]
Bias = Annotated[float, Field(ge=-100, le=100)]
StopString = Annotated[str, Field(min_length=1)]


class _Common(_Strict):
    """The parameters both endpoints take. Omitted (or null) sampling settings take llama.cpp server's defaults."""

    model: str | None = None
    max_tokens: int | None = Field(None, ge=0, description="default: the gateway's --max-tokens")
    max_completion_tokens: int | None = Field(None, ge=0, description="OpenAI's newer max_tokens (wins)")
    n: int | None = Field(1, ge=1, le=MAX_CHOICES, description="choices, each its own route session")
    stream: bool | None = False
    stream_options: ChatStreamOptions | None = Field(None, description="only with stream: true")
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = None
    temperature: float | None = Field(_D.temperature, ge=0, le=2)
    top_p: float | None = Field(_D.top_p, gt=0, le=1)
    top_k: int | None = Field(_D.top_k, ge=0, le=INT32_MAX, description="llama-server's extension (0: off)")
    min_p: float | None = Field(_D.min_p, ge=0, le=1, description="llama-server's extension")
    repeat_penalty: float | None = Field(_D.repeat_penalty, gt=0, description="llama-server's extension")
    repeat_last_n: int | None = Field(
        _D.repeat_last_n, ge=-1, le=INT32_MAX, description="llama-server's extension (-1: the whole context)"
    )
    presence_penalty: float | None = Field(0.0, ge=-2, le=2)
    frequency_penalty: float | None = Field(0.0, ge=-2, le=2)
    seed: int | None = Field(None, ge=0, lt=SEED_SPACE, description="choice i draws with seed + i")
    logit_bias: dict[TokenId, Bias] | None = Field(
        None, max_length=MAX_LOGIT_BIAS, description="token id (a string, below the vocabulary size) -> bias"
    )
    ignore_eos: bool | None = Field(False, description="llama-server's extension: never end of generation")
    skip_special_tokens: bool | None = Field(True, description="vLLM's extension: false renders control tokens")
    speculative_n_max: int | None = Field(
        None, alias="speculative.n_max", ge=0, le=MAX_DRAFT, description="llama-server's: drafts per step"
    )
    grammar: str | None = Field(
        "", max_length=MAX_GRAMMAR_CHARS, description="llama-server's extension: GBNF with a root rule"
    )
    timings_per_token: bool | None = Field(False, description="llama-server's extension: timings in every chunk")
    # OpenAI and llama-server parameters that change nothing in what one locally served model generates
    user: str | None = _no_effect()
    store: bool | None = _no_effect()
    metadata: dict[str, str] | None = _no_effect()
    service_tier: str | None = _no_effect()
    safety_identifier: str | None = _no_effect()
    prompt_cache_key: str | None = _no_effect()
    cache_prompt: bool | None = _no_effect()
    parallel_tool_calls: bool | None = Field(None, description="chat with tools: false reports the first call only")
    # llama-server samplers not implemented here: taken only at the value that turns them off ...
    typical_p: float | None = _off(1.0)
    mirostat: int | None = _off(0)
    dry_multiplier: float | None = _off(0.0)
    xtc_probability: float | None = _off(0.0)
    top_n_sigma: float | None = _off(-1.0)
    dynatemp_range: float | None = _off(0.0)
    n_probs: int | None = _off(0)
    min_keep: int | None = _off(0)
    # ... and their sub-settings, which do nothing while the setting above is off
    mirostat_tau: float | None = _no_effect()
    mirostat_eta: float | None = _no_effect()
    dry_base: float | None = _no_effect()
    dry_allowed_length: int | None = _no_effect()
    dry_penalty_last_n: int | None = _no_effect()
    dry_sequence_breakers: list[str] | None = _no_effect()
    xtc_threshold: float | None = _no_effect()
    dynatemp_exponent: float | None = _no_effect()


class ChatCompletionRequest(_Common):
    """The body of ``POST /v1/chat/completions``. ``messages``, ``tools`` and ``tool_choice`` are checked by
    messages.chat_turns and client.tools.tool_request (their errors name the exact field)."""

    messages: SkipValidation[list[ChatMessage]]
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS_CHAT, description="needs logprobs: true")
    response_format: ResponseFormat | None = Field(None, description="constrained decoding; not with tools")
    tools: SkipValidation[list[ToolSpec]] | None = None
    tool_choice: SkipValidation[Literal["none", "auto", "required"] | NamedToolChoice] | None = None
    functions: SkipValidation[list[dict[str, Any]]] | None = Field(
        None, description="refused: deprecated function calling (send tools)"
    )
    function_call: SkipValidation[str | dict[str, Any]] | None = Field(
        None, description="refused: deprecated function calling (send tool_choice)"
    )


class CompletionRequest(_Common):
    """The body of ``POST /v1/completions``: ``prompt`` a string or token ids (or a list holding one of them)."""

    prompt: (
        str
        | Annotated[list[str], Field(min_length=1, max_length=1)]
        | Annotated[list[StrictInt], Field(min_length=1)]
        | Annotated[list[Annotated[list[StrictInt], Field(min_length=1)]], Field(min_length=1, max_length=1)]
    )

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, value):
        """One prompt: a string, token ids, or a list holding one of them (OpenAI's batch of several is refused)."""
        inner = value[0] if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str | list) else value
        ids = isinstance(inner, list) and inner and all(type(t) is int for t in inner)
        if not (isinstance(inner, str) or ids):
            raise PydanticCustomError(
                "one_prompt",
                "must be a string or token ids (a list of integers), or a list holding one of them; this gateway "
                "takes one prompt a request (send several requests, or n for several choices)",
            )
        return value

    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS_COMPLETION, description="top alternatives per token")
    echo: bool | None = Field(False, description="the text starts with the prompt; not with logprobs")
    suffix: str | None = Field(None, description="refused unless empty: fill-in-the-middle is not implemented")
    best_of: int | None = _off(1, "> 1 is not implemented by this gateway (each choice is sampled once)")


OpenAIRequest = ChatCompletionRequest | CompletionRequest
_TYPES = {
    "int_type": "an integer",
    "float_type": "a number",
    "bool_type": "true or false",
    "string_type": "a string",
    "list_type": "a list",
    "dict_type": "an object",
    "model_type": "an object",
    "model_attributes_type": "an object",
    "literal_error": "one of {expected}",
}


def parse_request(body: dict, chat: bool) -> OpenAIRequest:
    """``body`` as a ChatCompletionRequest (``chat``) or CompletionRequest; RequestError (400) naming the
    top-level parameter at fault (the message the full path): unknown (``unknown_parameter``), missing, of the
    wrong type, out of range, or a llama-server sampler not at its off value."""
    kind = ChatCompletionRequest if chat else CompletionRequest
    try:
        return kind.model_validate(body)
    except ValidationError as exc:
        raise request_error(exc, body, kind) from None


def request_error(exc: ValidationError, body: dict, kind: type[BaseModel]) -> RequestError:
    """The RequestError of the first parameter ``exc`` finds at fault; of a union's errors the one of the branch
    the value's type matches (a type error of every branch: "must be a string or a list")."""
    errors = exc.errors(include_url=False)
    first = errors[0]["loc"][:1]
    mine = [e for e in errors if e["loc"][:1] == first]
    name = str(first[0]) if first else None
    field = next((f for n, f in kind.model_fields.items() if (f.alias or n) == name), None)
    lo, _, hi, _ = _bounds(field.metadata if field is not None else ())
    if lo is not None and lo == hi:  # a setting taken only at its off value
        return RequestError(f"{name} {field.description}; omit it or leave it at {json.dumps(lo)}", param=name)
    if mine[0]["type"] == "extra_forbidden" and len(mine[0]["loc"]) == 1:
        path = CHAT_PATH if kind is ChatCompletionRequest else COMPLETIONS_PATH
        return RequestError(
            f"unknown parameter {name!r}: not a parameter {path} implements here (docs/protocol.md, "
            f'"Gateway", lists them)',
            param=name,
            code="unknown_parameter",
        )
    if len(mine) > 1 and all(e["type"] in _TYPES for e in mine):
        wants = " or ".join(dict.fromkeys(_TYPES[e["type"]] for e in mine))
        return RequestError(f"{name} must be {wants}, got {_show(mine[0]['input'])}", param=name)
    err = max([e for e in mine if e["type"] not in _TYPES] or mine, key=lambda e: len(e["loc"]))
    return RequestError(_message(err, _path(err, body), field), param=name)


def _message(err: dict, path: str, field) -> str:
    kind, got, ctx = err["type"], err.get("input"), err.get("ctx", {})
    if kind in _TYPES:
        return f"{path} must be {_TYPES[kind].format(**ctx)}, got {_show(got)}"
    if kind in ("greater_than", "greater_than_equal", "less_than", "less_than_equal"):
        nested = field is None or len(err["loc"]) > 1
        lo, lo_open, hi, hi_open = _bounds([at.Interval(**ctx)] if nested else field.metadata)
        if lo is not None and hi is not None:
            bound = f"in {'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}"
        else:
            bound = f"{'>' if lo_open else '>='} {lo}" if lo is not None else f"{'<' if hi_open else '<='} {hi}"
        return f"{path} must be {bound}, got {_show(got)}"
    if kind == "missing":
        return f"{path} is required"
    if kind == "extra_forbidden":
        return f"{path} is not implemented here (not a field this gateway knows)"
    if kind in ("too_long", "too_short"):
        return f"{path} has {ctx['actual_length']} entries; it takes {ctx.get('max_length', ctx.get('min_length'))}"
    if kind == "string_too_short":
        return f"{path} must not be empty"
    if kind == "string_too_long":
        return f"{path} must be at most {ctx['max_length']} characters"
    if kind == "string_pattern_mismatch" and "[key]" in err["loc"]:
        return f"{err['loc'][0]} keys must be token ids (strings of digits), got {_show(got)}"
    if kind == "union_tag_invalid":
        return f"{path}: type {ctx['tag']!r} is not supported ({ctx['expected_tags']})"
    if kind == "union_tag_not_found":
        return f'{path} must be an object with a "type"'
    return f"{path}: {err['msg']}"


def _bounds(metadata) -> tuple:
    """(low, low open, high, high open) of a field's annotated_types constraints."""
    lo = lo_open = hi = hi_open = None
    for m in metadata:
        for name in ("ge", "gt", "le", "lt"):
            value = getattr(m, name, None)
            if value is not None and name in ("ge", "gt"):
                lo, lo_open = value, name == "gt"
            elif value is not None:
                hi, hi_open = value, name == "lt"
    return lo, lo_open, hi, hi_open


def _path(err: dict, body) -> str:
    """An error's location as a path (``stream_options.include_usage``, ``logit_bias["12"]``), without the union
    labels pydantic puts in it (a branch's type, a tag)."""
    loc, path, value, tag = err["loc"], "", body, False
    for k, part in enumerate(loc):
        last = k + 1 == len(loc)
        if isinstance(part, int):
            path += f"[{part}]"
            value = value[part] if isinstance(value, list) and part < len(value) else None
        elif isinstance(value, dict) and (part in value or (last and err["type"] == "missing")):
            if not tag and not last and part == value.get("type"):  # a discriminated union's tag
                tag = True
                continue
            path += (f".{part}" if path else part) if part.isidentifier() or not path else f"[{json.dumps(part)}]"
            value = value.get(part)
        tag = False
    return path or "body"


def _show(value) -> str:
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."
