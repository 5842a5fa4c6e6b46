"""``GET /openapi.json``: the OpenAPI 3.1 document of the gateway's five generation endpoints, built from the typed
request models that also check their bodies (openai_request, responses_request, anthropic_request), so the
document and the checks cannot disagree (docs/protocol.md, "Gateway")."""

from __future__ import annotations

from functools import cache
from importlib.metadata import PackageNotFoundError, version

from aiohttp import web
from pydantic.json_schema import models_json_schema

from . import anthropic_api
from .anthropic_request import CountTokensRequest, MessagesRequest
from .openai_request import CHAT_PATH, COMPLETIONS_PATH, ChatCompletionRequest, CompletionRequest
from .responses_request import RESPONSES_PATH, ResponseRequest

OPENAPI_PATH = "/openapi.json"
# path -> (request model, summary, whether errors come in Anthropic's shape)
ENDPOINTS = {
    CHAT_PATH: (ChatCompletionRequest, "OpenAI Chat Completions", False),
    COMPLETIONS_PATH: (CompletionRequest, "OpenAI Completions", False),
    RESPONSES_PATH: (ResponseRequest, "OpenAI Responses", False),
    anthropic_api.MESSAGES_PATH: (MessagesRequest, "Anthropic Messages", True),
    anthropic_api.COUNT_TOKENS_PATH: (CountTokensRequest, "Anthropic Messages: count tokens", True),
}
_TEXT = {"type": "string"}
ERROR_SCHEMAS = {
    "Error": {
        "type": "object",
        "description": "An error answer in OpenAI's shape; param names the request field at fault",
        "properties": {
            "error": {
                "type": "object",
                "properties": {
                    "message": _TEXT,
                    "type": _TEXT,
                    "param": {"type": ["string", "null"]},
                    "code": {"type": ["string", "null"]},
                },
                "required": ["message", "type", "param", "code"],
            }
        },
        "required": ["error"],
    },
    "AnthropicError": {
        "type": "object",
        "description": "An error answer in Anthropic's shape",
        "properties": {
            "type": {"const": "error"},
            "error": {
                "type": "object",
                "properties": {"type": _TEXT, "message": _TEXT},
                "required": ["type", "message"],
            },
        },
        "required": ["type", "error"],
    },
}


def _version() -> str:
    try:
        return version("ggufswarm")
    except PackageNotFoundError:  # a source tree that was never installed
        return "0+unknown"


def _error(ref: str, description: str) -> dict:
    return {"description": description, "content": {"application/json": {"schema": {"$ref": ref}}}}


@cache
def document() -> dict:
    """The OpenAPI 3.1 document: each endpoint's requestBody a ``$ref`` to its model's schema under
    ``#/components/schemas``; responses a generic 200 (JSON, or SSE with ``stream``) and the error shapes."""
    models = [(model, "validation") for model, _, _ in ENDPOINTS.values()]
    refs, defs = models_json_schema(models, ref_template="#/components/schemas/{model}")
    paths = {}
    for path, (model, summary, anthropic) in ENDPOINTS.items():
        err = "#/components/schemas/" + ("AnthropicError" if anthropic else "Error")
        ok = {"application/json": {"schema": {"type": "object"}}}
        if path != anthropic_api.COUNT_TOKENS_PATH:
            ok["text/event-stream"] = {"schema": {"type": "string"}}
        paths[path] = {
            "post": {
                "summary": summary,
                "operationId": path.strip("/").replace("/", "_"),
                "requestBody": {
                    "required": True,
                    "content": {"application/json": {"schema": refs[(model, "validation")]}},
                },
                "responses": {
                    "200": {"description": "the answer (with stream: server-sent events)", "content": ok},
                    "400": _error(err, "a bad request; param names the field at fault"),
                    "401": _error(err, "missing or invalid API key"),
                    "404": _error(err, "the model is not served here"),
                    "5XX": _error(err, "the route failed"),
                },
            }
        }
    return {
        "openapi": "3.1.0",
        "info": {"title": "ggufswarm gateway", "version": _version()},
        "paths": paths,
        "components": {
            "schemas": defs.get("$defs", {}) | ERROR_SCHEMAS,
            "securitySchemes": {
                "bearer": {"type": "http", "scheme": "bearer"},
                "x-api-key": {"type": "apiKey", "in": "header", "name": "x-api-key"},
            },
        },
        "security": [{"bearer": []}, {"x-api-key": []}, {}],
    }


async def openapi_json(request: web.Request) -> web.Response:
    """``GET /openapi.json``: the document, open without the API key (as vLLM serves it: it describes the API,
    it reveals nothing of what the gateway serves)."""
    return web.json_response(document())
