"""``GET /openapi.json``: an OpenAPI 3.1 document built from the typed request models of the five generation
endpoints; request bodies the other tests send validate against it, bodies the gateway refuses do not."""

from __future__ import annotations

import asyncio

import jsonschema
import pytest
from aiohttp.test_utils import TestClient, TestServer

from ggufswarm.gateway import GatewayConfig, make_app

MSGS = [{"role": "user", "content": "Hi"}]
CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
# bodies other tests send (test_gateway_requests, test_messages_api, test_responses_api), each endpoint's
ACCEPTED = {
    "/v1/chat/completions": [
        {"messages": MSGS, "max_tokens": 2, "n": 8, "seed": 2**63 - 1, "timings_per_token": True},
        {"messages": [*MSGS, {"role": "assistant", "tool_calls": [CALL]}, {"role": "tool", "content": "1"}]},
        {
            "messages": MSGS,
            "stream": True,
            "stream_options": {"include_usage": False},
            "repeat_penalty": 1.1,
            "repeat_last_n": -1,
            "top_k": 5,
            "min_p": 0.1,
            "logit_bias": {"0": -100, "262143": 100},
        },
        {
            "messages": MSGS,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "n", "strict": True, "schema": {"type": "object"}},
            },
            "tool_choice": "none",
            "user": "u1",
            "metadata": {"k": "v"},
            "mirostat": 0,
            "mirostat_tau": 5.0,
            "typical_p": 1,
        },
    ],
    "/v1/completions": [
        {"prompt": "Hi", "best_of": 1, "echo": True, "suffix": None, "n": 1},
        {"prompt": ["Hi"], "logprobs": 5, "grammar": 'root ::= "a" | "b"', "speculative.n_max": 4},
    ],
    "/v1/responses": [
        {"model": "m", "input": "hi", "max_output_tokens": 8, "instructions": "Be brief."},
        {"input": [{"role": "user", "content": [{"type": "input_text", "text": "hi"}]}], "stream": True},
    ],
    "/v1/messages": [
        {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "stream": True},
        {
            "model": "m",
            "system": "Be brief.",
            "max_tokens": 4,
            "messages": [
                {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "sunny"}]},
            ],
        },
    ],
    "/v1/messages/count_tokens": [{"model": "m", "messages": [{"role": "user", "content": "Hi"}]}],
}
# bodies the gateway refuses with a 400 that the schema refuses too
REFUSED = {
    "/v1/chat/completions": [{"messages": MSGS, "temperature": 9}, {"messages": MSGS, "temprature": 0}],
    "/v1/completions": [{"prompt": "Hi", "best_of": 2}, {"prompt": "Hi", "logprobs": True}, {"max_tokens": 2}],
    "/v1/responses": [{"input": "hi", "truncation": "auto"}],
    "/v1/messages": [{"model": "m", "messages": MSGS}],
    "/v1/messages/count_tokens": [{"model": "m", "messages": MSGS, "container": "x"}],
}


@pytest.fixture(scope="module")
def fetched(gemma_path):
    """(status and document of /openapi.json without a key, status of /v1/models without one, the 400s of
    REFUSED) from an in-process gateway with an API key (aiohttp's test client; its route: a dead port)."""

    async def run():
        app = make_app(GatewayConfig(route=["http://127.0.0.1:9"], model=str(gemma_path), api_keys=("k1",)))
        async with TestClient(TestServer(app)) as client:
            resp = await client.get("/openapi.json")
            models = await client.get("/v1/models")
            auth = {"Authorization": "Bearer k1"}
            refused = {}
            for path, bodies in REFUSED.items():
                for i, body in enumerate(bodies):
                    refused[path, i] = (await client.post(path, json=body, headers=auth)).status
            return resp.status, await resp.json(), models.status, refused

    return asyncio.run(run())


def test_the_document_is_openapi_3_1_and_open_without_the_key(fetched):
    status, doc, models_status, _ = fetched
    assert status == 200 and models_status == 401  # the document is open, the API behind the key
    assert doc["openapi"].startswith("3.1.") and doc["info"]["title"] == "ggufswarm gateway"
    assert isinstance(doc["info"]["version"], str) and doc["info"]["version"]
    assert set(doc["paths"]) == set(ACCEPTED)
    schemas = doc["components"]["schemas"]
    for schema in schemas.values():  # each component is a valid JSON Schema of OpenAPI 3.1's dialect
        jsonschema.Draft202012Validator.check_schema(schema)
    for path, item in doc["paths"].items():
        op = item["post"]
        ref = op["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        assert ref.startswith("#/components/schemas/") and ref.rsplit("/", 1)[1] in schemas, path
        assert {"200", "400"} <= set(op["responses"]) and all("description" in r for r in op["responses"].values())
    refs = [s for s in _walk(doc) if isinstance(s, str) and s.startswith("#/")]
    assert all(r.removeprefix("#/components/schemas/") in schemas for r in refs), refs  # every $ref resolves


def _walk(node):
    if isinstance(node, dict):
        for key, value in node.items():
            yield from ([value] if key == "$ref" else _walk(value))
    elif isinstance(node, list):
        for value in node:
            yield from _walk(value)


def _validator(doc: dict, path: str) -> jsonschema.Draft202012Validator:
    ref = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    return jsonschema.Draft202012Validator({"$ref": ref, "components": doc["components"]})


@pytest.mark.parametrize("path", sorted(ACCEPTED))
def test_bodies_the_gateway_takes_validate_and_refused_ones_do_not(fetched, path):
    _, doc, _, refused = fetched
    validator = _validator(doc, path)
    for body in ACCEPTED[path]:
        errors = [e.message for e in validator.iter_errors(body)]
        assert not errors, (body, errors)
    for i, body in enumerate(REFUSED[path]):
        assert refused[path, i] == 400 and not validator.is_valid(body), body
