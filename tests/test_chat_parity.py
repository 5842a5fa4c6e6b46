"""Chat Completions at llama-server's level, through the session-scoped 3-node gateway: ``n`` > 1 (greedy,
seeded, streamed), ``grammar``, every ``response_format`` form, the first delta's shape, ``timings``."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest
from route_fixtures import cluster, gateway, http, sse  # noqa: F401 - fixtures

from ggufswarm.gateway.params import choice_seed

CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
ASK = [{"role": "user", "content": "Name a color."}]
OK_SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}},
    "required": ["ok"],
    "additionalProperties": False,
}


def post(url: str, path: str, body: dict) -> dict:
    status, out = http("POST", url + path, body, timeout=300)
    assert status == 200, out
    return out


def texts(out: dict) -> list[str]:
    """The choices' texts of a chat or completions body, by index (asserting indexes 0..n-1)."""
    assert [c["index"] for c in out["choices"]] == list(range(len(out["choices"])))
    return [c["message"]["content"] if "message" in c else c["text"] for c in out["choices"]]


def test_n_greedy_choices_equal_the_single_answer(gateway):
    body = {"messages": ASK, "max_tokens": 6, "temperature": 0}
    one = post(gateway, CHAT, body)
    many = post(gateway, CHAT, {**body, "n": 3})
    assert texts(many) == texts(one) * 3
    assert many["usage"]["prompt_tokens"] == one["usage"]["prompt_tokens"]
    assert many["usage"]["completion_tokens"] == 3 * one["usage"]["completion_tokens"]
    assert many["usage"]["total_tokens"] == many["usage"]["prompt_tokens"] + many["usage"]["completion_tokens"]
    assert len(many["telemetry"]["choices"]) == 3
    assert many["timings"]["predicted_n"] == many["usage"]["completion_tokens"]


def test_n_seeded_choices_equal_requests_with_the_derived_seeds(gateway):
    body = {"prompt": "Once upon a time", "max_tokens": 6, "temperature": 1.0, "seed": 2**63 - 2}  # wraps at 2
    many = texts(post(gateway, COMP, {**body, "n": 3}))
    alone = [texts(post(gateway, COMP, {**body, "seed": choice_seed(body["seed"], i)}))[0] for i in range(3)]
    assert many == alone
    assert len(set(many)) > 1  # distinct seeds: the choices differ
    # streamed: each chunk names its choice; the choices' texts are the same
    chunks, _ = sse(gateway, COMP, {**body, "n": 3, "stream_options": {"include_usage": True}})
    streamed = [
        "".join(c["choices"][0]["text"] for c in chunks if c["choices"] and c["choices"][0]["index"] == i)
        for i in range(3)
    ]
    assert streamed == many
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 18
    finals = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert sorted(f["index"] for f in finals) == [0, 1, 2]


def test_streamed_chat_n_and_the_first_delta(gateway):
    body = {"messages": ASK, "max_tokens": 5, "temperature": 0.8, "seed": 7, "n": 2}
    whole = texts(post(gateway, CHAT, body))
    chunks, _ = sse(gateway, CHAT, body)
    for i in range(2):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == i]
        assert mine[0]["delta"] == {"role": "assistant", "content": None}  # llama-server's first delta
        assert "".join(c["delta"].get("content") or "" for c in mine) == whole[i]
        assert mine[-1]["delta"] == {} and mine[-1]["finish_reason"] == "length"
        assert all(c["finish_reason"] is None for c in mine[:-1])
    # with logprobs, the first delta is the same (its logprobs null) and the official SDK parses every chunk
    client = openai.OpenAI(base_url=gateway + "/v1", api_key="none", max_retries=0, timeout=120)
    stream = client.chat.completions.create(
        model=client.models.list().data[0].id, messages=ASK, max_tokens=3, temperature=0, logprobs=True, stream=True
    )
    parsed = list(stream)
    assert parsed[0].choices[0].delta.role == "assistant" and parsed[0].choices[0].delta.content is None
    assert parsed[0].choices[0].logprobs is None
    assert sum(len(c.choices[0].logprobs.content) for c in parsed if c.choices[0].logprobs) == 3


def test_grammar_constrains_the_answer(gateway):
    grammar = 'root ::= ("yes" | "no") ", " [0-9] [0-9]? "."'
    pattern = re.compile(r"(yes|no), [0-9][0-9]?\.")
    for path, base in ((CHAT, {"messages": ASK}), (COMP, {"prompt": "Is the sky blue?"})):
        for extra in ({"temperature": 0}, {"temperature": 1.0, "seed": 3}):
            out = post(gateway, path, {**base, "max_tokens": 12, "grammar": grammar, **extra})
            assert pattern.fullmatch(texts(out)[0]), out
            assert out["choices"][0]["finish_reason"] == "stop"
    for extra in ({"grammar": "root ::= ("}, {"grammar": 'start ::= "a"'}, {"grammar": 5}):
        status, out = http("POST", gateway + CHAT, {"messages": ASK, "max_tokens": 2, **extra})
        assert status == 400 and out["error"]["param"] == "grammar", out
    status, out = http(
        "POST",
        gateway + CHAT,
        {"messages": ASK, "max_tokens": 2, "grammar": grammar, "response_format": {"type": "json_object"}},
    )
    assert status == 400 and out["error"]["param"] == "grammar", out


def test_every_response_format_form(gateway):
    """llama-server's forms: json_object (with or without schema), json_schema (wrapped, or the schema beside
    the type), text. A schema's forms answer alike (one grammar) and validate."""
    ask = [{"role": "user", "content": 'Reply with a JSON object with one key, "ok", set to true.'}]
    body = {"messages": ask, "max_tokens": 48, "temperature": 0}
    schema_forms = [
        {"type": "json_schema", "json_schema": {"name": "ok", "schema": OK_SCHEMA, "strict": True}},
        {"type": "json_schema", "schema": OK_SCHEMA},
        {"type": "json_object", "schema": OK_SCHEMA},
    ]
    answers = []
    for response_format in schema_forms:
        out = post(gateway, CHAT, {**body, "response_format": response_format})
        assert out["choices"][0]["finish_reason"] == "stop", out
        answers.append(texts(out)[0])
        jsonschema.validate(json.loads(answers[-1]), OK_SCHEMA)
    assert answers == [answers[0]] * 3
    for response_format in ({"type": "json_object"}, {"type": "json_schema"}):  # any JSON object
        out = post(gateway, CHAT, {**body, "response_format": response_format})
        assert out["choices"][0]["finish_reason"] == "stop", out
        jsonschema.validate(json.loads(texts(out)[0]), {"type": "object"})
    plain = post(gateway, CHAT, {**body, "max_tokens": 4})
    assert texts(post(gateway, CHAT, {**body, "max_tokens": 4, "response_format": {"type": "text"}})) == texts(plain)


@pytest.mark.parametrize("path", [CHAT, COMP])
def test_timings(gateway, path):
    base = {"messages": ASK} if path == CHAT else {"prompt": "Once upon a time"}
    body = {**base, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    chunks, _ = sse(gateway, path, {**body, "timings_per_token": True, "stream_options": {"include_usage": True}})
    keys = {
        "prompt_n",
        "prompt_ms",
        "prompt_per_token_ms",
        "prompt_per_second",
        "predicted_n",
        "predicted_ms",
        "predicted_per_token_ms",
        "predicted_per_second",
    }
    assert all(set(c["timings"]) == keys for c in chunks), [c for c in chunks if "timings" not in c]
    usage = chunks[-1]["usage"]
    counts = [c["timings"]["predicted_n"] for c in chunks]
    assert counts == sorted(counts) and counts[-1] == usage["completion_tokens"] == 6
    assert all(c["timings"]["prompt_n"] == usage["prompt_tokens"] for c in chunks)
    last = chunks[-1]["timings"]
    assert last["prompt_ms"] > 0 and last["predicted_ms"] > 0
    assert last["predicted_per_token_ms"] == pytest.approx(last["predicted_ms"] / 5)
    assert last["predicted_per_second"] == pytest.approx(5e3 / last["predicted_ms"])
    # without timings_per_token: only the final chunk carries timings (as llama-server); a body always does
    chunks, _ = sse(gateway, path, body)
    assert [i for i, c in enumerate(chunks) if "timings" in c] == [len(chunks) - 1]
    assert chunks[-1]["timings"]["predicted_n"] == 6
    out = post(gateway, path, body)
    assert out["timings"]["predicted_n"] == out["usage"]["completion_tokens"] == 6
    assert out["timings"]["prompt_n"] == out["usage"]["prompt_tokens"] and "telemetry" in out
