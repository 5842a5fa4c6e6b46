"""``/v1/responses`` (OpenAI's Responses API) through the official openai client, against chat completions on the
same route as the reference: greedy text, streaming events, function calls, ``text.format``, stored responses and
``previous_response_id``, refused fields, a client that leaves mid-stream.

Uses the session's 3-node Gemma cluster: its ``gateway``, and a second in-process gateway over the same route
(``keyed``) with two API keys and Qwen 2.5's tool template (Gemma's own renders no tools; a forced call's grammar
makes the tiny model call a tool)."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from http.client import HTTPConnection
from pathlib import Path

import jsonschema
import openai
import pytest
from route_fixtures import HOP_TIMEOUT, cluster, gateway, http, wait_until_idle  # noqa: F401 - fixtures

from ggufswarm.gateway import GatewayConfig, make_app
from ggufswarm.gateway.app import GATEWAY
from ggufswarm.gateway.responses_request import chat_messages, parse_request
from ggufswarm.gateway.responses_store import ResponseStore
from ggufswarm.net.http import ServerThread

TEMPLATE = (Path(__file__).parent / "data" / "qwen2.5-tools.jinja").read_text(encoding="utf-8")
KEYS = ("key-a", "key-b")
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 16},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOL = {"name": "get_weather", "description": "Current weather in a city", "parameters": WEATHER}
QUESTION = "What is the weather like in Paris today?"


@pytest.fixture(scope="module")
def client(gateway):
    return openai.OpenAI(base_url=gateway + "/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def keyed(cluster, gemma_path):
    """(app, base URL) of a second gateway over the same route: API keys ``KEYS``, the Qwen 2.5 tool template."""
    app = make_app(
        GatewayConfig(
            [n.url for n in cluster],
            model=str(gemma_path),
            hop_timeout_s=HOP_TIMEOUT,
            api_keys=KEYS,
            chat_template=TEMPLATE,
        )
    )
    server = ServerThread(app)
    url = server.start()
    yield app, url
    server.stop()


def keyed_client(keyed, key: str = KEYS[0]) -> openai.OpenAI:
    return openai.OpenAI(base_url=keyed[1] + "/v1", api_key=key, max_retries=0, timeout=120)


_MODELS: dict[str, str] = {}


def served(client) -> str:
    """The name of the model ``client``'s gateway serves."""
    key = str(client.base_url)
    if key not in _MODELS:
        _MODELS[key] = client.models.list().data[0].id
    return _MODELS[key]


def chat_reference(client, messages, max_tokens, **kw):
    """The greedy chat completion of ``messages`` on the same gateway: the reference."""
    return client.chat.completions.create(
        model=served(client), messages=messages, max_tokens=max_tokens, temperature=0, **kw
    )


def test_create_equals_chat_completions(client):
    instructions, question = "Answer in one short sentence.", "Name three colors."
    want = chat_reference(
        client, [{"role": "system", "content": instructions}, {"role": "user", "content": question}], 12
    )
    got = client.responses.create(
        model=served(client), instructions=instructions, input=question, max_output_tokens=12, temperature=0
    )
    assert got.id.startswith("resp_") and got.object == "response" and got.model
    assert got.output_text == want.choices[0].message.content
    assert got.status == ("incomplete" if want.choices[0].finish_reason == "length" else "completed")
    if got.status == "incomplete":
        assert got.incomplete_details.reason == "max_output_tokens"
    message = got.output[0]
    assert message.type == "message" and message.id.startswith("msg_") and message.role == "assistant"
    assert (got.usage.input_tokens, got.usage.output_tokens) == (
        want.usage.prompt_tokens,
        want.usage.completion_tokens,
    )
    assert got.usage.total_tokens == got.usage.input_tokens + got.usage.output_tokens
    assert got.temperature == 0 and got.instructions == instructions and got.store is True
    telemetry = got.model_extra["telemetry"]
    assert telemetry["prompt_tokens"] == got.usage.input_tokens and len(telemetry["route"]) == 3


SCHEMA = {
    "type": "object",
    "properties": {"color": {"type": "string", "maxLength": 12}, "count": {"type": "integer"}},
    "required": ["color", "count"],
    "additionalProperties": False,
}
JSON_QUESTION = [{"role": "user", "content": "Give a color and a number as JSON."}]


@pytest.mark.parametrize("constrained", [False, True], ids=["cut", "json"])
def test_stream_gives_the_same_text_and_a_final_response(client, constrained):
    """Streamed, the text deltas add up to the chat reference's text, and the last event holds the whole response:
    ``response.incomplete`` when max_output_tokens cut it (Gemma 3 270M rambles), ``response.completed`` when the
    answer ended (a JSON schema's grammar ends it), which the SDK's ``get_final_response`` returns."""
    kw, question, budget = {}, [{"role": "user", "content": "Say hello in French."}], 12
    if constrained:
        question, budget = JSON_QUESTION, 40
        kw = {"text": {"format": {"type": "json_schema", "name": "pick", "schema": SCHEMA, "strict": True}}}
        fmt = {"type": "json_schema", "json_schema": {"name": "pick", "schema": SCHEMA, "strict": True}}
        want = chat_reference(client, question, budget, response_format=fmt)
    else:
        want = chat_reference(client, question, budget)
    status = "completed" if want.choices[0].finish_reason == "stop" else "incomplete"
    assert status == ("completed" if constrained else "incomplete")
    kinds, deltas, seqs = [], [], []
    with client.responses.stream(
        model=served(client), input=question, max_output_tokens=budget, temperature=0, **kw
    ) as stream:
        for event in stream:
            kinds.append(event.type)
            seqs.append(event.sequence_number)
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
        final = stream.get_final_response() if constrained else event.response
    assert "".join(deltas) == final.output_text == want.choices[0].message.content
    assert seqs == list(range(len(seqs)))
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        f"response.{status}",
    ]
    assert final.status == status and final.usage.output_tokens == want.usage.completion_tokens
    assert final.usage.input_tokens == want.usage.prompt_tokens
    assert final.model_extra["telemetry"]["completion_tokens"] == final.usage.output_tokens
    if constrained:
        jsonschema.validate(json.loads(final.output_text), SCHEMA)
    else:
        assert final.incomplete_details.reason == "max_output_tokens"


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_function_call_round_trip(keyed, stream):
    """A forced call is the call greedy chat completions makes with the same tools; its ``function_call_output``
    sent back gives what chat gives with the ``tool`` message."""
    client = keyed_client(keyed)
    chat_tools = [{"type": "function", "function": TOOL}]
    question = [{"role": "user", "content": QUESTION}]
    choice = {"type": "function", "function": {"name": "get_weather"}}
    want = chat_reference(client, question, 48, tools=chat_tools, tool_choice=choice)
    want_call = want.choices[0].message.tool_calls[0]
    kw = dict(
        input=QUESTION,
        tools=[{"type": "function", **TOOL}],
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=48,
        temperature=0,
    )
    if stream:
        arguments = ""
        with client.responses.stream(model=served(client), **kw) as events:
            for event in events:
                if event.type == "response.function_call_arguments.delta":
                    arguments += event.delta
            got = events.get_final_response()
    else:
        got = client.responses.create(model=served(client), **kw)
    calls = [item for item in got.output if item.type == "function_call"]
    assert len(calls) == 1 and got.status == "completed" and got.output_text == ""
    call = calls[0]
    assert (call.name, call.arguments) == (want_call.function.name, want_call.function.arguments)
    assert call.call_id.startswith("call_") and call.id.startswith("fc_")
    assert stream is False or arguments == call.arguments
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    # the round trip: the call and its output go back as items; chat gets the same as messages
    result = json.dumps({"temperature": 21, "sky": "sunny"})
    history = question + [
        {"role": "assistant", "content": None, "tool_calls": [want_call.model_dump()]},
        {"role": "tool", "tool_call_id": want_call.id, "content": result},
    ]
    want = chat_reference(client, history, 8, tools=chat_tools)
    items = [
        {"role": "user", "content": QUESTION},
        call.model_dump(exclude_none=True),
        {"type": "function_call_output", "call_id": call.call_id, "output": result},
    ]
    got = client.responses.create(
        model=served(client), input=items, tools=kw["tools"], max_output_tokens=8, temperature=0
    )
    assert got.usage.input_tokens == want.usage.prompt_tokens
    assert got.output_text == (want.choices[0].message.content or "")
    want_calls = [c.function.model_dump() for c in want.choices[0].message.tool_calls or []]
    got_calls = [{"name": c.name, "arguments": c.arguments} for c in got.output if c.type == "function_call"]
    assert got_calls == want_calls


def test_text_format_json_schema(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "pick", "schema": SCHEMA, "strict": True}}
    want = chat_reference(client, JSON_QUESTION, 40, response_format=fmt)
    got = client.responses.create(
        model=served(client),
        input=JSON_QUESTION,
        text={"format": {"type": "json_schema", "name": "pick", "schema": SCHEMA, "strict": True}},
        max_output_tokens=40,
        temperature=0,
    )
    assert got.status == "completed" and got.output_text == want.choices[0].message.content
    jsonschema.validate(json.loads(got.output_text), SCHEMA)
    assert got.text.format.type == "json_schema"


def test_previous_response_id_continues_the_conversation(keyed):
    """Turn 2 by ``previous_response_id`` is turn 2 with the whole conversation resent; its rendered prompt starts
    with turn 1's prompt and generated tokens (what the prefix snapshot cache restores)."""
    client = keyed_client(keyed)
    first = client.responses.create(
        model=served(client), input="My name is Ada. Say hi to me.", max_output_tokens=10, temperature=0
    )
    second = client.responses.create(
        model=served(client),
        previous_response_id=first.id,
        input="What is my name?",
        max_output_tokens=10,
        temperature=0,
    )
    whole = [{"role": "user", "content": "My name is Ada. Say hi to me."}]
    whole += [item.model_dump(exclude_none=True) for item in first.output]
    whole += [{"role": "user", "content": "What is my name?"}]
    resent = client.responses.create(
        model=served(client), input=whole, max_output_tokens=10, temperature=0, store=False
    )
    assert second.output_text == resent.output_text
    assert second.usage.input_tokens == resent.usage.input_tokens > first.usage.total_tokens
    assert second.previous_response_id == first.id
    store = keyed[0][GATEWAY].responses
    owner = next(k for k, rid in store._entries if rid == first.id)
    turn1 = store.get(owner, first.id).token_ids
    turn2 = store.get(owner, second.id).token_ids
    assert len(turn1) == first.usage.total_tokens
    shared = next((i for i, (a, b) in enumerate(zip(turn1, turn2)) if a != b), len(turn1))
    assert shared >= first.usage.input_tokens  # the prompt of turn 1 at least; see docs/protocol.md
    print(f"turn 2 starts with {shared} of turn 1's {len(turn1)} tokens")


def test_get_delete_and_owners(keyed):
    a, b = keyed_client(keyed, KEYS[0]), keyed_client(keyed, KEYS[1])
    made = a.responses.create(model=served(a), input="Hi.", max_output_tokens=4, temperature=0, metadata={"k": "v"})
    got = a.responses.retrieve(made.id)
    assert got.model_dump() == made.model_dump() and got.metadata == {"k": "v"}
    items = a.responses.input_items.list(made.id)
    assert [(i.type, i.role, i.content) for i in items.data] == [("message", "user", "Hi.")]
    assert items.data[0].id.startswith("msg_")
    with pytest.raises(openai.NotFoundError):  # another API key's response: not found
        b.responses.retrieve(made.id)
    with pytest.raises(openai.NotFoundError):
        b.responses.delete(made.id)
    with pytest.raises(openai.NotFoundError) as err:
        b.responses.create(model=served(b), previous_response_id=made.id, input="Again.", max_output_tokens=2)
    assert err.value.body["param"] == "previous_response_id"
    status, body = http("DELETE", keyed[1] + f"/v1/responses/{made.id}")  # no key at all: 401
    assert status == 401
    for key, found in ((KEYS[0], 200), (KEYS[1], 404)):  # Anthropic's header names the same owner as Bearer
        req = urllib.request.Request(keyed[1] + f"/v1/responses/{made.id}", headers={"x-api-key": key})
        try:
            with urllib.request.urlopen(req, timeout=60) as resp:
                status = resp.status
        except urllib.error.HTTPError as exc:
            status = exc.code
        assert status == found, key
    deleted = a.responses.delete(made.id)  # (the SDK returns nothing; its body checked below on another)
    assert deleted is None
    with pytest.raises(openai.NotFoundError):
        a.responses.retrieve(made.id)
    unstored = a.responses.create(model=served(a), input="Hi.", max_output_tokens=2, temperature=0, store=False)
    with pytest.raises(openai.NotFoundError):
        a.responses.retrieve(unstored.id)


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/a.png"}]}]}, None),
        ({"input": "hi", "tools": [{"type": "file_search", "vector_store_ids": []}]}, "tools[0]"),
        ({"input": "hi", "truncation": "auto"}, "truncation"),
        ({"input": "hi", "temperature": 3}, "temperature"),
        ({"input": "hi", "max_output_tokens": "8"}, "max_output_tokens"),
        ({"input": "hi", "frequency_penalty": 1}, "frequency_penalty"),
        ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": {"minimum": 1}}}}, None),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0]"),
    ],
)
def test_refused_fields_are_400_naming_the_param(gateway, extra, param):
    status, body = http("POST", gateway + "/v1/responses", extra)
    assert status == 400, body
    if param is None:  # an image part / a schema the grammar cannot enforce
        param = "input[0].content[0]" if "input_image" in json.dumps(extra) else "text.format"
    assert body["error"]["param"] == param and body["error"]["type"] == "invalid_request_error", body
    if param == "input[0].content[0]":
        assert "input_image" in body["error"]["message"]


def test_delete_answers_and_unknown_ids_are_404(client, gateway):
    made = client.responses.create(model=served(client), input="Hi.", max_output_tokens=2, temperature=0)
    assert http("DELETE", gateway + f"/v1/responses/{made.id}") == (
        200,
        {"id": made.id, "object": "response", "deleted": True},
    )
    for call in (lambda: client.responses.retrieve("resp_nope"), lambda: client.responses.delete("resp_nope")):
        with pytest.raises(openai.NotFoundError) as err:
            call()
        assert err.value.body["code"] == "not_found"


def test_client_leaving_mid_stream_closes_the_session(gateway, cluster):
    wait_until_idle(cluster)  # the test before may still be closing its session
    conn = HTTPConnection("127.0.0.1", int(gateway.rsplit(":", 1)[1]), timeout=60)
    body = {"input": "Tell me a long story.", "max_output_tokens": 300, "stream": True}
    conn.request("POST", "/v1/responses", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.readline() == b"event: response.created\n"
    assert http("GET", cluster[0].url + "/health")[1]["sessions"] == 1
    conn.close()
    deadline = time.monotonic() + 120  # a bound, not a timing: a busy machine may be slow to notice
    while any(http("GET", n.url + "/health")[1]["sessions"] for n in cluster):
        assert time.monotonic() < deadline, "route session left open after the client disconnected"
        time.sleep(0.2)


def test_what_codex_sends_is_accepted():
    """Codex CLI's request shape (logged from codex exec 0.171): ``namespace`` tools (their functions offered as
    function tools), a ``web_search`` tool (accepted, never offered), ``client_metadata``, ``reasoning`` and
    ``include``; a ``function_call`` item of a namespaced function keeps its ``namespace``."""
    body = {
        "model": "m",
        "input": [
            {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Be brief."}]},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]},
            {
                "type": "function_call",
                "call_id": "call_1",
                "name": "close_agent",
                "namespace": "agents",
                "arguments": "{}",
            },
            {"type": "function_call_output", "call_id": "call_1", "output": "ok"},
        ],
        "tools": [
            {"type": "function", "name": "exec_command", "description": "Run", "strict": False, "parameters": {}},
            {
                "type": "namespace",
                "name": "agents",
                "description": "Sub-agents",
                "tools": [{"type": "function", "name": "close_agent", "strict": False, "parameters": {}}],
            },
            {"type": "web_search", "external_web_access": False},
        ],
        "tool_choice": "auto",
        "parallel_tool_calls": True,
        "reasoning": {"summary": "auto"},
        "store": False,
        "stream": True,
        "include": ["reasoning.encrypted_content"],
        "prompt_cache_key": "k",
        "client_metadata": {"session_id": "s"},
    }
    req = parse_request(body)
    chat = req.chat_body()
    assert [t["function"]["name"] for t in chat["tools"]] == ["exec_command", "close_agent"]
    assert req.namespaces() == {"close_agent": "agents"}
    messages = chat_messages(req.instructions, req.items())
    assert [m["role"] for m in messages] == ["developer", "user", "assistant", "tool"]
    only_search = parse_request({"input": "hi", "tools": [{"type": "web_search"}], "tool_choice": "auto"})
    assert "tools" not in only_search.chat_body() and "tool_choice" not in only_search.chat_body()


def test_the_store_is_bounded_and_private():
    now = [0.0]
    store = ResponseStore(max_count=2, max_bytes=4000, max_age_s=10, clock=lambda: now[0])

    def put(owner, rid, size=10):
        return store.put(owner, {"id": rid, "pad": "x" * size}, [], [], [1, 2, 3])

    assert put("a", "r1") and put("a", "r2") and store.get("b", "r1") is None
    assert store.get("a", "r1") is not None  # r1 used last: r2 goes first
    assert put("a", "r3") and store.get("a", "r2") is None and len(store) == 2
    assert not put("a", "big", 5000) and store.get("a", "big") is None  # over the whole budget: not stored
    assert put("a", "r4", 3940) and len(store) == 1 and store.nbytes <= 4000  # bytes: the others evicted
    now[0] = 11.0
    assert store.get("a", "r4") is None and store.nbytes == 0  # aged out
    assert put("a", "r5") and store.delete("a", "r5") and not store.delete("a", "r5")
