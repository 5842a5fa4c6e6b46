"""Function calling: OpenAI ``tools`` / ``tool_choice`` checked, a tool-call grammar, tool calls parsed back.

Sources: the OpenAI API reference (Chat Completions: ``tools``, ``tool_choice``, ``message.tool_calls``, the
streamed ``delta.tool_calls``) and the Hermes function-calling format of Qwen 2.5 / Hermes chat templates
(https://github.com/NousResearch/Hermes-Function-Calling), the one format taken. The constrained grammar comes from
llama-cpp-python's JSON-schema converter (``llama_cpp.llama_grammar.SchemaConverter``, as client.grammar). Which
templates are refused, and how calls stream: docs/protocol.md, "Parameters"."""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field

from .grammar import MAX_SCHEMA_BYTES, SchemaNotEnforceable, _check

HERMES = "hermes"
OPEN, CLOSE = "<tool_call>", "</tool_call>"
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI: a-z, A-Z, 0-9, underscores and dashes, at most 64
_CALL = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.DOTALL)
MAX_TOOLS = 128  # OpenAI's limit on tools per request


class ToolError(ValueError):
    """A ``tools`` / ``tool_choice`` request the gateway refuses; ``param`` names the parameter (HTTP 400)."""

    def __init__(self, message: str, param: str = "tools"):
        super().__init__(message)
        self.param = param


def template_tool_format(template: str | None) -> str | None:
    """The tool-call format a chat template teaches: ``"hermes"`` when it mentions ``<tool_call>``; ``""`` when
    it renders ``tools`` in another format (not parsed here); None when it renders no tools at all."""
    if not template or not re.search(r"\btools\b", template):
        return None
    return HERMES if OPEN in template else ""


@dataclass
class ToolRequest:
    """What a chat request asks of function calling, checked.

    ``tools``: OpenAI's tool list as given (the template's ``tools`` variable); ``choice``: ``"auto"``,
    ``"required"`` or ``"function"`` (then ``name`` is the function to call); ``grammar``: GBNF forcing one
    call (``"required"`` / ``"function"``), else ""; ``format``: the template's format (``"hermes"``);
    ``parallel``: OpenAI's ``parallel_tool_calls`` (default true); false keeps only the first call parsed.
    """

    tools: list[dict]
    choice: str = "auto"
    name: str | None = None
    grammar: str = ""
    format: str = HERMES
    schemas: dict[str, dict] = field(default_factory=dict)  # function name -> its parameters schema
    parallel: bool = True

    def calls(self, made: list[dict]) -> list[dict]:
        """The parsed calls the answer reports: all of them, or the first without ``parallel``."""
        return made if self.parallel else made[:1]


def _functions(tools) -> dict[str, dict]:
    """``{name: parameters schema}`` of a ``tools`` list; ToolError (param ``tools``) for a malformed one."""
    if not isinstance(tools, list) or not tools:
        raise ToolError('tools must be a non-empty list of {"type": "function", "function": {...}}')
    if len(tools) > MAX_TOOLS:
        raise ToolError(f"tools has {len(tools)} entries; at most {MAX_TOOLS}")
    out = {}
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise ToolError(
                f'{where} must be {{"type": "function", "function": {{"name", "description", "parameters"}}}}'
            )
        unknown = set(tool) - {"type", "function"}
        if unknown:
            raise ToolError(f"{where}: unexpected {', '.join(sorted(unknown))}")
        fn = tool["function"]
        unknown = set(fn) - {"name", "description", "parameters", "strict"}
        if unknown:
            raise ToolError(f"{where}.function: unexpected {', '.join(sorted(unknown))}")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise ToolError(f"{where}.function.name must be 1-64 letters, digits, _ or -, got {name!r}")
        if name in out:
            raise ToolError(f"{where}.function.name {name!r} is given twice")
        if not isinstance(fn.get("description", ""), str):
            raise ToolError(f"{where}.function.description must be a string")
        if fn.get("strict") is not None and not isinstance(fn["strict"], bool):
            raise ToolError(f"{where}.function.strict must be true or false")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise ToolError(f"{where}.function.parameters must be a JSON Schema object")
        if len(json.dumps(params)) > MAX_SCHEMA_BYTES:
            raise ToolError(f"{where}.function.parameters is over {MAX_SCHEMA_BYTES} bytes")
        out[name] = params
    return out


def tool_request(body: dict, template: str | None) -> ToolRequest | None:
    """The checked function-calling part of a chat request body (OpenAI's ``tools`` / ``tool_choice``, and the
    deprecated ``functions`` / ``function_call``, which are refused: use tools). None when no tools are offered:
    no ``tools``, or ``tool_choice: "none"`` (the template then renders no tools and nothing is parsed).

    Raises ToolError naming the parameter: malformed tools, a ``tool_choice`` other than ``"none"``, ``"auto"``,
    ``"required"`` or ``{"type": "function", "function": {"name"}}`` of an offered tool, ``tool_choice`` without
    tools, a template without tool support or in a format not parsed here, and (for ``"required"`` / a named
    function) a ``parameters`` schema that constrained decoding cannot enforce (client.grammar).
    """
    for name in ("functions", "function_call"):
        if body.get(name) is not None:
            raise ToolError(
                f"{name} (deprecated function calling) is not implemented: send tools / tool_choice", param=name
            )
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools is None or tools == []:
        if choice not in (None, "none"):
            raise ToolError("tool_choice needs tools", param="tool_choice")
        return None
    schemas = _functions(tools)
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise ToolError(
            f"parallel_tool_calls must be true or false, got {json.dumps(parallel)}", param="parallel_tool_calls"
        )
    if choice is None or choice == "auto":
        kind, name = "auto", None
    elif choice == "none":
        return None
    elif choice == "required":
        kind, name = "required", None
    elif (
        isinstance(choice, dict)
        and choice.get("type") == "function"
        and isinstance(choice.get("function"), dict)
        and set(choice) == {"type", "function"}
        and set(choice["function"]) == {"name"}
    ):
        kind, name = "function", choice["function"]["name"]
        if name not in schemas:
            raise ToolError(f"tool_choice names function {name!r}, which is not among the tools", param="tool_choice")
    else:
        raise ToolError(
            'tool_choice must be "none", "auto", "required" or {"type": "function", "function": '
            f'{{"name": ...}}}}, got {json.dumps(choice)}',
            param="tool_choice",
        )
    fmt = template_tool_format(template)
    if fmt is None:
        raise ToolError(
            "tools (function calling) are not supported: this model's chat template has no tool "
            "support (give a template that renders tools with gateway --chat-template-file)"
        )
    if fmt != HERMES:
        raise ToolError(
            "tools (function calling) are not supported for this chat template: it renders tools in a "
            "format this gateway does not parse (it parses the Hermes / Qwen <tool_call> format)"
        )
    request = ToolRequest(tools, kind, name, format=fmt, schemas=schemas, parallel=parallel is not False)
    if kind != "auto":
        request.grammar = tool_call_grammar({n: s for n, s in schemas.items() if name is None or n == name})
    return request


def tool_call_grammar(schemas: dict[str, dict]) -> str:
    """GBNF (root rule ``root``) of exactly one Hermes call ``<tool_call>\\n{"name": NAME, "arguments": ARGS}
    \\n</tool_call>`` to one of ``schemas`` (``{function name: parameters JSON Schema}``), ARGS following that
    function's schema. ToolError (param ``tool_choice``) for a schema constrained decoding cannot enforce."""
    from llama_cpp.llama_grammar import SchemaConverter

    alternatives = []
    for name, params in schemas.items():
        try:
            _check(params, f"tools[{name}].function.parameters#", params)
        except SchemaNotEnforceable as exc:
            raise ToolError(
                f"tool_choice {name!r} needs constrained decoding, which cannot enforce the tool's parameters: {exc}",
                param="tool_choice",
            ) from None
        alternatives.append(
            {
                "type": "object",
                "properties": {"name": {"const": name}, "arguments": params},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
        )
    schema = alternatives[0] if len(alternatives) == 1 else {"anyOf": alternatives}
    converter = SchemaConverter(
        prop_order={"name": 0, "arguments": 1}, allow_fetch=False, dotall=False, raw_pattern=False
    )
    try:
        converter.visit(converter.resolve_refs(json.loads(json.dumps(schema)), "tools"), "")
        rules = converter.format_grammar()
    except (AssertionError, ValueError, KeyError, TypeError, RecursionError) as exc:
        raise ToolError(
            f"tool parameters cannot be turned into a grammar: {exc or type(exc).__name__}", param="tool_choice"
        ) from None
    # the converter's root rule is the call's JSON; the grammar's root wraps it in the template's tags
    rules = re.sub(r"^root ::=", "tool-call-json ::=", rules, count=1, flags=re.MULTILINE)
    return f'root ::= "{OPEN}\\n" tool-call-json "\\n{CLOSE}"\n{rules}\n'


def new_call_id() -> str:
    """An OpenAI-style tool call id: ``call_`` and 24 random letters and digits."""
    return "call_" + secrets.token_hex(12)


def parse_tool_calls(text: str) -> tuple[str | None, list[dict]]:
    """(content, tool calls) of a generated answer in the Hermes format.

    Each ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` becomes ``{"id": "call_...", "type":
    "function", "function": {"name", "arguments": JSON text}}`` (``arguments`` given as a JSON string is kept
    as that string); ``content`` is the text outside the calls (stripped; None when empty). An answer whose
    calls do not all parse (malformed JSON, no name, an unclosed ``<tool_call>``) is plain content: ``(text,
    [])``. Never raises.
    """
    if OPEN not in text:
        return text, []
    calls, outside, last = [], [], 0
    for m in _CALL.finditer(text):
        outside.append(text[last : m.start()])
        last = m.end()
        try:
            call = json.loads(m.group(1), strict=False)  # a raw newline in a string: still what was meant
        except ValueError:
            return text, []
        if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not call["name"]:
            return text, []
        args = call.get("arguments", {})
        if not isinstance(args, str):
            args = json.dumps(args, ensure_ascii=False)
        calls.append({"id": new_call_id(), "type": "function", "function": {"name": call["name"], "arguments": args}})
    outside.append(text[last:])
    rest = "".join(outside)
    if not calls or OPEN in rest:  # an unclosed or stray <tool_call>: not a call
        return text, []
    return rest.strip() or None, calls


class ToolCallStream:
    """Streamed answers with tools: passes content through but holds back text from the first ``<tool_call>``
    (or what may still become one) on, so a call never leaks as content; ``finish`` parses what was held.

    ``push(text)`` returns the content to send now; ``finish()`` returns ``(content, calls)``: the held text as
    content when it was no call after all (parse_tool_calls), else the text around the calls and the calls.
    """

    def __init__(self):
        self._held = ""
        self._calling = False

    def push(self, text: str) -> str:
        if self._calling:
            self._held += text
            return ""
        self._held += text
        at = self._held.find(OPEN)
        if at >= 0:
            self._calling = True
            out, self._held = self._held[:at], self._held[at:]
        else:  # hold a tail that may be the start of <tool_call>
            keep = max((n for n in range(1, len(OPEN)) if self._held.endswith(OPEN[:n])), default=0)
            out, self._held = self._held[: len(self._held) - keep], self._held[len(self._held) - keep :]
        return out

    def finish(self) -> tuple[str | None, list[dict]]:
        held, self._held = self._held, ""
        if not self._calling:
            return held or None, []
        content, calls = parse_tool_calls(held)
        if not calls:
            return held, []
        return content, calls


__all__ = [
    "HERMES",
    "ToolCallStream",
    "ToolError",
    "ToolRequest",
    "new_call_id",
    "parse_tool_calls",
    "template_tool_format",
    "tool_call_grammar",
    "tool_request",
]
