"""OpenAI chat ``messages`` to the turns a chat template renders: roles, text content parts, an assistant's
``tool_calls`` and a tool's reply. Anything malformed is a RequestError whose ``param`` names the field at fault
(``messages[2].role``, ``messages[0].content[1]``, ...), where llama-server also answers 400."""

from __future__ import annotations

import json

from ..client.tools import new_call_id
from .errors import RequestError
from .openai_request import CHAT_ROLES


def message_text(content, where: str = "messages") -> str:
    """A message's ``content`` as text: a string, or the concatenation of a list of text parts (None: empty).
    RequestError naming ``where`` (the content's path, e.g. ``messages[1].content``) or the part at fault."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                kind = part.get("type") if isinstance(part, dict) else None
                why = (
                    f"type {kind!r} is not supported here" if isinstance(kind, str) and kind != "text" else "malformed"
                )
                raise RequestError(
                    f'{where}[{j}]: {why}; content parts must be {{"type": "text", "text": ...}}',
                    param=f"{where}[{j}]",
                )
            parts.append(part["text"])
        return "".join(parts)
    if content is None:
        return ""
    raise RequestError(f"{where} must be a string or a list of text parts, got {type(content).__name__}", param=where)


def tool_calls(calls, i: int) -> list[dict]:
    """An assistant message's OpenAI ``tool_calls`` in the shape Hugging Face chat templates read: ``{"id",
    "type": "function", "function": {"name", "arguments"}}`` with ``arguments`` a JSON object when the string
    holds one (Qwen 2.5 / Hermes and Llama 3.1 templates write ``arguments | tojson``), else the string.
    RequestError (param ``messages``) for a malformed one."""
    if not isinstance(calls, list) or not calls:
        raise RequestError(f"messages[{i}].tool_calls must be a non-empty list", param=f"messages[{i}].tool_calls")
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if (
            not isinstance(fn, dict)
            or call.get("type", "function") != "function"
            or not isinstance(fn.get("name"), str)
            or not isinstance(fn.get("arguments", ""), (str, dict))
            or not isinstance(call.get("id", ""), str)
        ):
            raise RequestError(
                f'messages[{i}].tool_calls[{j}] must be {{"id", "type": "function", "function": '
                f'{{"name", "arguments": JSON string}}}}',
                param=f"messages[{i}].tool_calls[{j}]",
            )
        args = fn.get("arguments", "")
        try:
            parsed = json.loads(args) if isinstance(args, str) else args  # (an object, as some clients send)
            if isinstance(parsed, dict):
                args = parsed
        except ValueError:
            pass  # not JSON (a model's malformed call sent back): the template gets the string
        out.append(
            {
                "id": call.get("id") or new_call_id(),
                "type": "function",
                "function": {"name": fn["name"], "arguments": args},
            }
        )
    return out


def chat_turns(messages, template: str | None) -> list[dict]:
    """The turns the chat template renders, from OpenAI ``messages``: ``{"role", "content"}``, plus ``tool_calls``
    on an assistant turn that made calls (see tool_calls) and ``tool_call_id`` / ``name`` (the called
    function's, found from the id when not given) on a ``tool`` turn.

    ``developer`` (what current OpenAI clients send instead of ``system``) becomes ``system`` when the
    template has no ``developer`` role. RequestError (400) with ``param`` naming the field at fault: ``messages``
    (not a non-empty list), ``messages[i]`` (not an object), ``messages[i].role`` (missing, or not one of
    CHAT_ROLES), ``messages[i].content`` (missing, as llama-server: only an assistant turn that makes tool calls
    may omit it; ``null`` is empty text; not a string or a list of text parts), ``messages[i].content[j]``,
    ``messages[i].tool_calls[j]``, ``messages[i].tool_call_id`` (not a string; a ``tool`` message may omit it, as
    llama-server: the chat template decides), ``messages[i].name`` (not a string).
    """
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list", param="messages")
    turns, called = [], {}
    for i, m in enumerate(messages):
        at = f"messages[{i}]"
        if not isinstance(m, dict):
            raise RequestError(f"{at} must be an object with a role and content", param=at)
        role = m.get("role")
        if role is None:
            raise RequestError(f"{at} has no role", param=f"{at}.role")
        if role not in CHAT_ROLES:
            raise RequestError(f"{at}.role must be one of {', '.join(CHAT_ROLES)}, got {role!r}", param=f"{at}.role")
        if "content" not in m and not (role == "assistant" and m.get("tool_calls") is not None):
            what = "content or tool_calls" if role == "assistant" else "content"
            raise RequestError(f"{at} ({role}) has no content: it needs {what}", param=f"{at}.content")
        if role == "assistant" and m.get("content") is None and not m.get("tool_calls"):
            raise RequestError(
                f"{at} (assistant) has no content and no tool_calls: it needs one", param=f"{at}.content"
            )
        for key in ("name", "tool_call_id"):
            if m.get(key) is not None and not isinstance(m[key], str):
                raise RequestError(f"{at}.{key} must be a string, got {m[key]!r}", param=f"{at}.{key}")
        if role == "developer" and "developer" not in (template or ""):
            role = "system"
        turn = {"role": role, "content": message_text(m.get("content"), f"{at}.content")}
        if role == "assistant" and m.get("tool_calls"):
            turn["tool_calls"] = tool_calls(m["tool_calls"], i)
            called.update((c["id"], c["function"]["name"]) for c in turn["tool_calls"])
        if role == "tool":
            call_id, name = m.get("tool_call_id"), m.get("name")
            if call_id:  # optional, as llama-server: the chat template decides what it needs
                turn["tool_call_id"] = call_id
            if name or called.get(call_id):
                turn["name"] = name or called[call_id]
        elif isinstance(m.get("name"), str):
            turn["name"] = m["name"]
        turns.append(turn)
    return turns


def converted_turns(messages, template: str | None) -> list[dict]:
    """chat_turns of messages converted from another API's body (Anthropic's Messages, OpenAI's Responses): their
    indexes are not the client's, so a RequestError names ``messages`` only (the caller renames it)."""
    try:
        return chat_turns(messages, template)
    except RequestError as exc:
        if exc.param and exc.param.startswith("messages["):
            exc.param = "messages"
        raise
