"""OpenAI chat ``messages`` to the turns a chat template renders: roles, text content parts, an assistant's
``tool_calls`` and a tool's reply (RequestError, param ``messages``, for anything malformed)."""

from __future__ import annotations

import json

from ..client.tools import new_call_id
from .errors import RequestError

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


def message_text(content) -> str:
    """A message's ``content`` as text: a string, or the concatenation of a list of text parts (None: empty)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise RequestError('message content parts must be {"type": "text", "text": ...}', param="messages")
            parts.append(part["text"])
        return "".join(parts)
    if content is None:
        return ""
    raise RequestError("message content must be a string or a list of text parts", param="messages")


def tool_calls(calls, i: int) -> list[dict]:
    """An assistant message's OpenAI ``tool_calls`` in the shape Hugging Face chat templates read: ``{"id",
    "type": "function", "function": {"name", "arguments"}}`` with ``arguments`` a JSON object when the string
    holds one (Qwen 2.5 / Hermes and Llama 3.1 templates write ``arguments | tojson``), else the string.
    RequestError (param ``messages``) for a malformed one."""
    if not isinstance(calls, list) or not calls:
        raise RequestError(f"messages[{i}].tool_calls must be a non-empty list", param="messages")
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
                param="messages",
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
    template has no ``developer`` role. RequestError (400, param ``messages``) for a message that is not an
    object, has an unknown role, or has no content (only an assistant turn that makes tool calls may omit it),
    or malformed ``tool_calls``.
    """
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list", param="messages")
    turns, called = [], {}
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise RequestError(f"messages[{i}] needs a role and content", param="messages")
        role = m["role"]
        if role not in CHAT_ROLES:
            raise RequestError(f"message role must be one of {', '.join(CHAT_ROLES)}, got {role!r}", param="messages")
        if m.get("content") is None and not (role == "assistant" and m.get("tool_calls")):
            raise RequestError(f"messages[{i}] ({role}) has no content", param="messages")
        if role == "developer" and "developer" not in (template or ""):
            role = "system"
        turn = {"role": role, "content": message_text(m.get("content"))}
        if role == "assistant" and m.get("tool_calls"):
            turn["tool_calls"] = tool_calls(m["tool_calls"], i)
            called.update((c["id"], c["function"]["name"]) for c in turn["tool_calls"])
        if role == "tool":
            call_id, name = m.get("tool_call_id"), m.get("name")
            if not isinstance(call_id, (str, type(None))) or not isinstance(name, (str, type(None))):
                raise RequestError(f"messages[{i}].tool_call_id and name must be strings", param="messages")
            if call_id is not None:
                turn["tool_call_id"] = call_id
            if name or called.get(call_id):
                turn["name"] = name or called[call_id]
        elif isinstance(m.get("name"), str):
            turn["name"] = m["name"]
        turns.append(turn)
    return turns
