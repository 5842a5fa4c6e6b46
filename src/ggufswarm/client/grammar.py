"""JSON output constraints: an OpenAI ``response_format`` as a GBNF grammar for llama.cpp's grammar sampler.

The JSON-schema → GBNF conversion is llama-cpp-python's (``llama_cpp.llama_grammar.json_schema_to_gbnf``, a port
of llama.cpp's ``json_schema_to_grammar``). It enforces part of JSON Schema and silently drops the rest (e.g.
``minimum``); so that an answer that follows the grammar always validates against the schema, a schema using a
keyword the grammar would not enforce is refused here (``SchemaNotEnforceable``) instead of being loosened.
"""

from __future__ import annotations

import json

# Keywords that only annotate: no effect on what validates.
_ANNOTATIONS = frozenset(
    {
        "title",
        "description",
        "default",
        "examples",
        "$schema",
        "$id",
        "$comment",
        "deprecated",
        "readOnly",
        "writeOnly",
        "$defs",
        "definitions",
    }
)
# What the converter turns into grammar rules, by the keyword that selects its branch (``SchemaConverter.visit``).
_STRING_FORMATS = frozenset({"date", "time", "date-time", "uuid", "uuid1", "uuid2", "uuid3", "uuid4", "uuid5"})
_TYPES = frozenset({"object", "array", "string", "number", "integer", "boolean", "null"})
MAX_SCHEMA_BYTES = 64 * 1024


class SchemaNotEnforceable(ValueError):
    """A ``response_format`` that constrained decoding cannot guarantee; the message says which part and why."""


def _check(schema, where: str, defs: dict) -> None:
    """SchemaNotEnforceable when ``schema`` (at JSON pointer ``where``) uses a keyword, or a combination, that the
    grammar would not enforce."""
    if schema is True or schema == {}:
        return
    if not isinstance(schema, dict):
        raise SchemaNotEnforceable(f"{where}: a schema must be an object")
    keys = set(schema) - _ANNOTATIONS
    for name in ("$defs", "definitions"):
        for key, sub in (schema.get(name) or {}).items():
            _check(sub, f"{where}/{name}/{key}", defs)

    def only(*allowed: str) -> None:
        extra = keys - set(allowed)
        if extra:
            raise SchemaNotEnforceable(
                f"{where}: {', '.join(sorted(extra))} cannot be enforced together with "
                f"{', '.join(a for a in allowed if a in keys)} by constrained decoding"
            )

    if "$ref" in keys:
        ref = schema["$ref"]
        if not (isinstance(ref, str) and ref.startswith("#/")):
            raise SchemaNotEnforceable(f"{where}: only local $ref (#/...) is supported, got {ref!r}")
        only("$ref")
        return
    if "anyOf" in keys:
        only("anyOf")
        if not isinstance(schema["anyOf"], list) or not schema["anyOf"]:
            raise SchemaNotEnforceable(f"{where}/anyOf: must be a non-empty list")
        for i, sub in enumerate(schema["anyOf"]):
            _check(sub, f"{where}/anyOf/{i}", defs)
        return
    kind = schema.get("type")
    kinds = kind if isinstance(kind, list) else [kind]
    if any(k is not None and k not in _TYPES for k in kinds):
        raise SchemaNotEnforceable(f"{where}/type: unknown type {kind!r}")
    if isinstance(kind, list):
        only("type")
        return
    if "const" in keys:
        only("const", "type")
        return
    if "enum" in keys:
        only("enum", "type")
        if not isinstance(schema["enum"], list) or not schema["enum"]:
            raise SchemaNotEnforceable(f"{where}/enum: must be a non-empty list")
        return
    if kind in (None, "object") and ("properties" in keys or "additionalProperties" in keys):
        only("type", "properties", "required", "additionalProperties")
        props = schema.get("properties") or {}
        if not isinstance(props, dict):
            raise SchemaNotEnforceable(f"{where}/properties: must be an object")
        required = schema.get("required") or []
        missing = [r for r in required if r not in props]
        if missing:
            raise SchemaNotEnforceable(f"{where}/required: {missing[0]!r} is required but not in properties")
        for key, sub in props.items():
            _check(sub, f"{where}/properties/{key}", defs)
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            _check(extra, f"{where}/additionalProperties", defs)
        return
    if kind in (None, "array") and ("items" in keys or "prefixItems" in keys):
        items = schema.get("items") if "items" in keys else schema["prefixItems"]
        if isinstance(items, list):  # a tuple: exactly these items
            only("type", "items" if "items" in keys else "prefixItems")
            for i, sub in enumerate(items):
                _check(sub, f"{where}/items/{i}", defs)
        else:
            only("type", "items", "minItems", "maxItems")
            _check(items, f"{where}/items", defs)
        return
    if kind in (None, "string") and "pattern" in keys:
        only("type", "pattern")
        pattern = schema["pattern"]
        if not (isinstance(pattern, str) and pattern.startswith("^") and pattern.endswith("$")):
            raise SchemaNotEnforceable(f"{where}/pattern: must be anchored (^...$) to be enforced")
        return
    if kind in (None, "string") and "format" in keys:
        only("type", "format")
        if schema["format"] not in _STRING_FORMATS:
            raise SchemaNotEnforceable(
                f"{where}/format: {schema['format']!r} cannot be enforced (supported: "
                f"{', '.join(sorted(_STRING_FORMATS))})"
            )
        return
    if kind == "string":
        only("type", "minLength", "maxLength")
        return
    if kind is None and keys:
        raise SchemaNotEnforceable(f"{where}: {', '.join(sorted(keys))} cannot be enforced by constrained decoding")
    only("type")


def response_format_grammar(response_format) -> str:
    """The GBNF grammar (root rule ``root``) of an OpenAI ``response_format``, in every form llama-server takes:
    "" for ``{"type": "text"}`` or None; any JSON object for ``{"type": "json_object"}``; the schema's grammar
    for ``{"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}`` and for
    llama-server's shorthands ``{"type": "json_object", "schema": {...}}`` and ``{"type": "json_schema",
    "schema": {...}}`` (a ``json_schema`` type with no schema at all: any JSON object, as llama-server). Raises
    SchemaNotEnforceable (a ValueError) for anything else, a schema over MAX_SCHEMA_BYTES, or one using keywords
    the grammar would not enforce (``minimum``, ``oneOf``, ``uniqueItems``, ...)."""
    from llama_cpp.llama_grammar import JSON_GBNF

    if response_format is None:
        return ""
    if not isinstance(response_format, dict) or not isinstance(response_format.get("type"), str):
        raise SchemaNotEnforceable('response_format must be an object with a "type"')
    kind = response_format["type"]
    allowed = {"text": {"type"}, "json_object": {"type", "schema"}, "json_schema": {"type", "json_schema", "schema"}}
    if kind not in allowed:
        raise SchemaNotEnforceable(f"response_format type {kind!r} is not supported (text, json_object, json_schema)")
    extra = set(response_format) - allowed[kind]
    if extra:
        raise SchemaNotEnforceable(f"response_format: unexpected {', '.join(sorted(extra))} for type {kind!r}")
    if kind == "text":
        return ""
    if "schema" in response_format:  # llama-server's shorthand: the schema beside the type
        if "json_schema" in response_format:
            raise SchemaNotEnforceable("response_format: give the schema once (json_schema.schema or schema)")
        return _schema_grammar(response_format["schema"], "response_format.schema")
    if kind == "json_object" or response_format.get("json_schema") is None:
        return JSON_GBNF
    spec = response_format["json_schema"]
    if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
        raise SchemaNotEnforceable('response_format.json_schema must be {"name": ..., "schema": {...}}')
    unknown = set(spec) - {"name", "schema", "strict", "description"}
    if unknown:
        raise SchemaNotEnforceable(f"response_format.json_schema: unexpected {', '.join(sorted(unknown))}")
    return _schema_grammar(spec.get("schema", {}), "response_format.json_schema.schema")


def _schema_grammar(schema, where: str) -> str:
    """The grammar of JSON schema ``schema`` (named ``where`` in errors); SchemaNotEnforceable as above."""
    from llama_cpp.llama_grammar import json_schema_to_gbnf

    if not isinstance(schema, dict):
        raise SchemaNotEnforceable(f"{where} must be an object (a JSON schema)")
    text = json.dumps(schema)
    if len(text) > MAX_SCHEMA_BYTES:
        raise SchemaNotEnforceable(f"{where} is over {MAX_SCHEMA_BYTES} bytes")
    _check(schema, "#", schema)
    try:
        return json_schema_to_gbnf(text)
    except (AssertionError, ValueError, KeyError, TypeError, RecursionError) as exc:
        raise SchemaNotEnforceable(f"{where} cannot be turned into a grammar: {exc or type(exc).__name__}") from None


__all__ = ["MAX_SCHEMA_BYTES", "SchemaNotEnforceable", "response_format_grammar"]
