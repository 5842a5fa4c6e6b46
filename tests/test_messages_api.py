"""Anthropic's Messages API on the gateway (``/v1/messages``, ``/v1/messages/count_tokens``) through the official
``anthropic`` SDK, over the shared 3-node Gemma route: every expected value is computed in the same test by the
reference path, the gateway's own ``/v1/chat/completions`` with the equivalent request. Tools use a second
in-process gateway over the same nodes with Qwen 2.5's tool template (as test_tools.py: Hermes ``<tool_call>``)."""

from __future__ import annotations

import json
import time
from http.client import HTTPConnection
from pathlib import Path

import anthropic
import pytest
from route_fixtures import HOP_TIMEOUT, cluster, gateway, health, http  # noqa: F401 - fixtures

from ggufswarm.gateway import GatewayConfig, make_app
from ggufswarm.net.http import ServerThread

TEMPLATE = (Path(__file__).parent / "data" / "qwen2.5-tools.jinja").read_text(encoding="utf-8")
SYSTEM = ["You are terse.", "Answer in English."]
QUESTION = "Name three colors."
GREEDY = {"temperature": 0}  # (this SDK's create() has no temperature argument: sent as an extra body field)
CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "Tokyo"]}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOL = {"name": "get_weather", "description": "Current weather in a city", "input_schema": CITY}
CHAT_TOOL = {
    "type": "function",
    "function": {"name": TOOL["name"], "description": TOOL["description"], "parameters": CITY},
}


@pytest.fixture(scope="module")
def client(gateway):
    return anthropic.Anthropic(base_url=gateway, api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tool_gateway(cluster, gemma_path):
    """A second gateway over the same nodes whose chat template renders tools (no new nodes)."""
    config = GatewayConfig(
        [n.url for n in cluster], model=str(gemma_path), chat_template=TEMPLATE, hop_timeout_s=HOP_TIMEOUT
    )
    server = ServerThread(make_app(config))
    yield server.start()
    server.stop()


def chat(url: str, **body) -> dict:
    """The reference: the same request through ``/v1/chat/completions`` (greedy)."""
    status, out = http("POST", url + "/v1/chat/completions", {**GREEDY, **body}, timeout=300)
    assert status == 200, out
    return out


def texts(msg) -> str:
    """The text of a message's text blocks."""
    return "".join(b.text for b in msg.content if b.type == "text")


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def test_create_and_stream_equal_chat_completions(client, gateway):
    """Greedy ``messages.create`` and ``messages.stream``: the text, stop reason and usage of the equivalent chat
    completion (``system`` text blocks are joined by a blank line); the gateway's telemetry rides along."""
    ref = chat(gateway, messages=[{"role": "system", "content": "\n\n".join(SYSTEM)}] + user(QUESTION), max_tokens=10)
    want, finish = ref["choices"][0]["message"]["content"], ref["choices"][0]["finish_reason"]
    system = [{"type": "text", "text": t} for t in SYSTEM]
    kw = dict(model="gemma", system=system, messages=user(QUESTION), max_tokens=10, extra_body=GREEDY)
    with pytest.raises(anthropic.NotFoundError):  # (any name but the served one: 404)
        client.messages.create(**kw)
    kw["model"] = ref["model"]
    msg = client.messages.create(**kw)
    assert msg.id.startswith("msg_") and msg.role == "assistant" and msg.model == ref["model"]
    assert [b.type for b in msg.content] == ["text"] and msg.content[0].text == want
    assert msg.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[finish] and msg.stop_sequence is None
    assert (msg.usage.input_tokens, msg.usage.output_tokens) == (
        ref["usage"]["prompt_tokens"],
        ref["usage"]["completion_tokens"],
    )
    assert msg.model_extra["telemetry"]["completion_tokens"] == msg.usage.output_tokens
    with client.messages.stream(**kw) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == want and final.content[0].text == want
    assert (final.stop_reason, final.usage.input_tokens, final.usage.output_tokens) == (
        msg.stop_reason,
        msg.usage.input_tokens,
        msg.usage.output_tokens,
    )


def test_stream_events_in_anthropics_order(gateway):
    """The raw SSE: message_start (empty content, input_tokens), ping, one text block, message_delta (stop reason,
    output_tokens, telemetry), message_stop; each ``event:`` name is its data's ``type``."""
    body = {"model": health(gateway)["model"], "messages": user(QUESTION), "max_tokens": 4, "stream": True, **GREEDY}
    conn = HTTPConnection("127.0.0.1", int(gateway.rsplit(":", 1)[1]), timeout=120)
    conn.request("POST", "/v1/messages", json.dumps(body))
    resp = conn.getresponse()
    assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/event-stream")
    frames = [f for f in resp.read().decode().split("\n\n") if f.strip()]
    conn.close()
    events = []
    for frame in frames:
        name, data = frame.split("\n")
        events.append(json.loads(data.removeprefix("data: ")))
        assert name == "event: " + events[-1]["type"]
    kinds = [e["type"] for e in events]
    assert kinds[:3] == ["message_start", "ping", "content_block_start"] and kinds[-2:] == [
        "message_delta",
        "message_stop",
    ]
    assert set(kinds[3:-3]) == {"content_block_delta"} and kinds[-3] == "content_block_stop"
    start, delta = events[0]["message"], events[-2]
    assert start["content"] == [] and start["stop_reason"] is None and start["usage"]["input_tokens"] > 0
    assert delta["delta"]["stop_reason"] == "max_tokens" and delta["usage"]["output_tokens"] == 4
    assert delta["telemetry"]["completion_tokens"] == 4


def test_stop_sequences_cut_as_chat_stop(client, gateway):
    ref = chat(gateway, messages=user(QUESTION), max_tokens=12)
    text = ref["choices"][0]["message"]["content"]
    # three characters from the text, where they first occur, past its start: the answer is cut there
    stop = next(text[k : k + 3] for k in range(3, len(text) - 3) if text.index(text[k : k + 3]) == k)
    cut = chat(gateway, messages=user(QUESTION), max_tokens=12, stop=[stop])
    assert cut["choices"][0]["finish_reason"] == "stop" and cut["choices"][0]["message"]["content"], (text, stop)
    want = cut["choices"][0]["message"]["content"]
    kw = dict(
        model=ref["model"], messages=user(QUESTION), max_tokens=12, stop_sequences=["zzz", stop], extra_body=GREEDY
    )
    msg = client.messages.create(**kw)
    assert texts(msg) == want == text[: text.index(stop)], (text, stop)
    assert (msg.stop_reason, msg.stop_sequence) == ("stop_sequence", stop)
    assert msg.usage.output_tokens == cut["usage"]["completion_tokens"]
    with client.messages.stream(**kw) as stream:
        final = stream.get_final_message()
    assert (texts(final), final.stop_reason, final.stop_sequence) == (want, "stop_sequence", stop)


def tool_history(call_id: str, args: dict) -> tuple[list[dict], list[dict]]:
    """The tool call and its result sent back: (Anthropic messages, OpenAI chat messages)."""
    result = json.dumps({"temperature": 21, "sky": "sunny"})
    ask = user("What is the weather like in Paris today?")
    ours = ask + [
        {"role": "assistant", "content": [{"type": "tool_use", "id": call_id, "name": TOOL["name"], "input": args}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call_id, "content": result}]},
    ]
    call = {"id": call_id, "type": "function", "function": {"name": TOOL["name"], "arguments": json.dumps(args)}}
    theirs = ask + [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call_id, "content": result},
    ]
    return ours, theirs


def test_tool_use_round_trip(tool_gateway):
    """A forced call (``tool_choice`` tool) is the call greedy chat completions make with the same tools, as a
    ``tool_use`` block (``stop_reason: tool_use``), streamed or not; its ``tool_result`` sent back gives chat's
    answer to the same history; count_tokens counts the tools as the prompt does."""
    client = anthropic.Anthropic(base_url=tool_gateway, api_key="none", max_retries=0, timeout=120)
    ask = user("What is the weather like in Paris today?")
    ref = chat(
        tool_gateway,
        messages=ask,
        tools=[CHAT_TOOL],
        tool_choice={"type": "function", "function": {"name": TOOL["name"]}},
        max_tokens=40,
    )
    (want,) = ref["choices"][0]["message"]["tool_calls"]
    kw = dict(model=ref["model"], messages=ask, tools=[TOOL], max_tokens=40, extra_body=GREEDY)
    kw["tool_choice"] = {"type": "tool", "name": TOOL["name"]}
    msg = client.messages.create(**kw)
    with client.messages.stream(**kw) as stream:
        final = stream.get_final_message()
    for m in (msg, final):
        assert m.stop_reason == "tool_use" and [b.type for b in m.content] == ["tool_use"], m
        (use,) = m.content
        assert use.id.startswith("toolu_") and use.name == want["function"]["name"]
        assert use.input == json.loads(want["function"]["arguments"])
        assert m.usage.input_tokens == ref["usage"]["prompt_tokens"]
    assert (
        client.messages.count_tokens(**{k: kw[k] for k in ("model", "messages", "tools", "tool_choice")}).input_tokens
        == ref["usage"]["prompt_tokens"]
    )
    ours, theirs = tool_history(use.id, use.input)
    ref = chat(tool_gateway, messages=theirs, tools=[CHAT_TOOL], max_tokens=6)
    msg = client.messages.create(model=ref["model"], messages=ours, tools=[TOOL], max_tokens=6, extra_body=GREEDY)
    text = "".join(b.text for b in msg.content if b.type == "text")
    assert text == (ref["choices"][0]["message"]["content"] or "")
    assert msg.usage.input_tokens == ref["usage"]["prompt_tokens"]


def test_count_tokens_is_the_chat_prompt(client, gateway):
    system = [{"type": "text", "text": t} for t in SYSTEM]
    history = user(QUESTION) + [{"role": "assistant", "content": "Red."}] + user("Two more.")
    ref = chat(gateway, messages=[{"role": "system", "content": "\n\n".join(SYSTEM)}] + history, max_tokens=1)
    counted = client.messages.count_tokens(model=ref["model"], system=system, messages=history)
    assert counted.input_tokens == ref["usage"]["prompt_tokens"]


def test_what_claude_code_sends_is_taken(tool_gateway):
    """Claude Code's request shapes (seen from its 2.1 CLI): a system message mid-conversation, thinking and
    context_management that clears thinking (no effect), cache_control on blocks, thinking blocks sent back,
    tool_result content as text blocks: counted as the equivalent chat prompt."""
    client = anthropic.Anthropic(base_url=tool_gateway, api_key="none", max_retries=0, timeout=120)
    model = health(tool_gateway)["model"]
    call = {"type": "tool_use", "id": "toolu_1", "name": TOOL["name"], "input": {"city": "Paris"}}
    ours = [
        {"role": "user", "content": [{"type": "text", "text": "Weather?", "cache_control": {"type": "ephemeral"}}]},
        {"role": "system", "content": "Be brief."},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": "s"}, call]},
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "sunny"}]}
            ],
        },
    ]
    counted = client.messages.count_tokens(
        model=model,
        messages=ours,
        tools=[TOOL],
        thinking={"type": "adaptive"},
        output_config={"effort": "high"},
        extra_body={"context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]}},
    )
    args = json.dumps(call["input"])
    theirs = [
        {"role": "user", "content": "Weather?"},
        {"role": "system", "content": "Be brief."},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "toolu_1", "type": "function", "function": {"name": TOOL["name"], "arguments": args}}
            ],
        },
        {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"},
    ]
    ref = chat(tool_gateway, messages=theirs, tools=[CHAT_TOOL], max_tokens=1)
    assert counted.input_tokens == ref["usage"]["prompt_tokens"]
    edits = {"edits": [{"type": "clear_tool_uses_20250919"}]}  # would change the prompt: refused
    status, out = http(
        "POST",
        tool_gateway + "/v1/messages/count_tokens",
        {"model": model, "messages": ours, "context_management": edits},
    )
    assert status == 400 and "context_management" in out["error"]["message"], out


def test_errors_in_anthropics_shape(client, gateway, gemma_path):
    """Missing max_tokens, an image block, an unknown parameter, an unknown model, a bad API key: Anthropic's
    ``{"type": "error", "error": {"type", "message"}}`` with the matching status. Chat keeps OpenAI's shape."""
    model = gemma_path.stem
    cases = [
        ({"model": model, "messages": user("hi")}, 400, "invalid_request_error", "max_tokens"),
        (
            {
                "model": model,
                "max_tokens": 2,
                "messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "base64"}}]}],
            },
            400,
            "invalid_request_error",
            "image",
        ),
        (
            {"model": model, "max_tokens": 2, "messages": user("hi"), "frequency": 1},
            400,
            "invalid_request_error",
            "frequency",
        ),
        (
            {"model": model, "max_tokens": 2, "messages": user("hi"), "temperature": 3},
            400,
            "invalid_request_error",
            "temperature",
        ),
        ({"model": "nope", "max_tokens": 2, "messages": user("hi")}, 404, "not_found_error", "nope"),
    ]
    for body, status, kind, named in cases:
        got, out = http("POST", gateway + "/v1/messages", body)
        assert (got, out["type"], out["error"]["type"]) == (status, "error", kind), out
        assert named in out["error"]["message"], out
    with pytest.raises(anthropic.BadRequestError) as err:
        client.messages.create(model=model, max_tokens=2, messages=[{"role": "assistant", "content": "Hi"}])
    assert err.value.body["error"]["type"] == "invalid_request_error"
    got, out = http("GET", gateway + "/v1/messages")
    assert got == 405 and out["type"] == "error", out
    got, out = http("POST", gateway + "/v1/chat/completions", {"model": "nope", "messages": user("hi")})
    assert got == 404 and out["error"]["code"] == "model_not_found"  # OpenAI's shape, unchanged
    server = ServerThread(
        make_app(GatewayConfig(route=["http://127.0.0.1:9"], model=str(gemma_path), api_keys=("k1",)))
    )
    url = server.start()
    try:
        body = {"model": model, "messages": user("hi")}
        with pytest.raises(anthropic.AuthenticationError) as err:
            anthropic.Anthropic(base_url=url, api_key="bad", max_retries=0).messages.count_tokens(**body)
        assert err.value.status_code == 401 and err.value.body["error"]["type"] == "authentication_error"
        ours = anthropic.Anthropic(base_url=url, api_key="k1", max_retries=0).messages.count_tokens(**body)
        bearer = anthropic.Anthropic(base_url=url, auth_token="k1", max_retries=0).messages.count_tokens(**body)
        assert ours.input_tokens == bearer.input_tokens > 0  # x-api-key and Authorization: Bearer both taken
    finally:
        server.stop()


def test_client_leaving_a_stream_frees_every_node(gateway, cluster):
    """A client that disconnects mid-stream stops the generation: its session closes on every node long before
    its 400 tokens could be decoded (counted in the head's decode steps)."""
    steps0 = health(cluster[-1].url)["decode_steps"]
    conn = HTTPConnection("127.0.0.1", int(gateway.rsplit(":", 1)[1]), timeout=60)
    body = {"model": health(gateway)["model"], "messages": user("Once upon a time"), "max_tokens": 400, "stream": True}
    conn.request("POST", "/v1/messages", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.readline() == b"event: message_start\n"
    conn.close()
    deadline = time.monotonic() + 120
    while any(health(n.url)["sessions"] or health(n.url)["kv_tokens_held"] for n in cluster):
        assert time.monotonic() < deadline, "route session left open after the client disconnected"
        time.sleep(0.05)
    assert health(cluster[-1].url)["decode_steps"] - steps0 < 399 // 2
