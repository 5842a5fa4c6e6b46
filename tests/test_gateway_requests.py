"""Gateway request validation that happens before any node is contacted."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from ggufswarm.artifact.gguf_file import GGUFModelFile
from ggufswarm.gateway import GatewayConfig, make_app
from ggufswarm.gateway.errors import RequestError
from ggufswarm.gateway.messages import chat_turns
from ggufswarm.net.http import ServerThread


@pytest.fixture(scope="module")
def gateway(gemma_path):
    server = ServerThread(make_app(GatewayConfig(route=["http://127.0.0.1:9"], model=str(gemma_path))))
    yield server.start()
    server.stop()


def post(url, body):
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), method="POST", headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_unknown_model_is_404(gateway):
    status, body = post(f"{gateway}/v1/completions", {"model": "nope", "prompt": "hi"})
    assert status == 404 and body["error"]["code"] == "model_not_found"


def test_a_failed_request_leaves_one_line_on_stderr(gateway, capsys):
    """A 5xx answer (this module's route is a port nothing listens on: 502 hop_failed), streamed or not, leaves one
    line on the gateway's stderr (it runs in this process); a client's 4xx leaves none."""
    capsys.readouterr()
    assert post(f"{gateway}/v1/completions", {"prompt": "hi", "temperature": 9})[0] == 400
    assert post(f"{gateway}/v1/completions", {"model": "nope", "prompt": "hi"})[0] == 404
    assert "ggufswarm gateway" not in capsys.readouterr().err
    for stream in (False, True):  # the route fails before a stream starts: an error answer either way
        status, body = post(
            f"{gateway}/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "stream": stream},
        )
        assert status == 502 and body["error"]["code"] == "hop_failed", body
        lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("ggufswarm gateway")]
        assert lines == [f"ggufswarm gateway: request failed (502 hop_failed): {body['error']['message']}"]


def test_unknown_role_and_bad_numbers_are_400(gateway):
    status, body = post(f"{gateway}/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]})
    assert status == 400 and "role" in body["error"]["message"]
    status, body = post(f"{gateway}/v1/completions", {"prompt": "hi", "max_tokens": -5})
    assert status == 400 and body["error"]["message"] == "max_tokens must be >= 0, got -5"
    status, body = post(f"{gateway}/v1/completions", {"prompt": "hi", "seed": 2**70})
    assert status == 400 and "seed" in body["error"]["message"]


def test_unreachable_node_is_a_5xx_naming_it(gateway):
    status, body = post(f"{gateway}/v1/completions", {"prompt": "hi", "max_tokens": 2})
    assert 500 <= status < 600 and "127.0.0.1:9" in body["error"]["message"]


def test_api_keys(gemma_path):
    server = ServerThread(
        make_app(GatewayConfig(route=["http://127.0.0.1:9"], model=str(gemma_path), api_keys=("k1", "k2")))
    )
    url = server.start()
    try:

        def get(headers, path="/v1/models"):
            req = urllib.request.Request(url + path, headers=headers)
            try:
                with urllib.request.urlopen(req, timeout=30) as r:
                    return r.status, json.loads(r.read())
            except urllib.error.HTTPError as e:
                return e.code, json.loads(e.read())

        status, body = get({})
        assert status == 401 and body["error"]["code"] == "invalid_api_key"
        assert get({"Authorization": "Bearer nope"})[0] == 401
        assert get({"Authorization": "Bearer k2"})[0] == 200
        assert get({"Authorization": "bearer k2"})[0] == 200  # the scheme is case-insensitive (RFC 9110)
        assert get({"Authorization": "k2"})[0] == 401  # but it must be there
        # /health needs no key: it answers 503 "degraded" (the route's one node does not listen), not 401
        status, body = get({}, "/health")
        assert status == 503 and body["status"] == "degraded", body
        import openai

        client = openai.OpenAI(base_url=f"{url}/v1", api_key="k1")
        assert [m.id for m in client.models.list()] == [gemma_path.stem]
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{url}/v1", api_key="bad").models.list()
    finally:
        server.stop()


def test_unknown_paths_and_methods_are_json_errors(gateway):
    status, body = post(f"{gateway}/v1/embeddings", {"input": "hi"})
    assert status == 404 and body["error"]["code"] == "not_found"
    req = urllib.request.Request(f"{gateway}/v1/models", data=b"{}", method="POST")
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=30)
    assert err.value.code == 405 and json.loads(err.value.read())["error"]["code"] == "method_not_allowed"


def test_unreadable_bodies_are_4xx(gateway):
    for data, headers, status, code in (
        (b"[" * 100000, {"Content-Type": "application/json"}, 400, "bad_request"),
        (b"{}", {"Content-Type": "application/json; charset=bogus"}, 400, "bad_request"),
        (b"not gzip", {"Content-Type": "application/json", "Content-Encoding": "gzip"}, 400, "bad_request"),
        (b"x" * (17 * 2**20), {"Content-Type": "application/json"}, 413, "body_too_large"),
    ):
        req = urllib.request.Request(f"{gateway}/v1/completions", data=data, method="POST", headers=headers)
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(req, timeout=30)
        assert err.value.code == status and json.loads(err.value.read())["error"]["code"] == code, data[:20]


def test_lone_surrogates_and_empty_prompts_without_bos_are_400(gateway):
    raw = b'{"prompt": "hi \\ud800 there", "max_tokens": 2}'  # valid JSON; no text holds a lone surrogate
    req = urllib.request.Request(
        f"{gateway}/v1/completions", data=raw, method="POST", headers={"Content-Type": "application/json"}
    )
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=30)
    body = json.loads(err.value.read())
    assert err.value.code == 400 and "surrogate" in body["error"]["message"] and "d800" in body["error"]["message"]
    status, body = post(f"{gateway}/v1/chat/completions", {"messages": [{"role": "user", "content": "\ud800"}]})
    assert status == 400 and "surrogate" in body["error"]["message"]


def test_empty_prompt_on_a_model_without_bos():
    from ggufswarm.artifact.default_model import smollm2_path

    assert GGUFModelFile(smollm2_path()).metadata.get("tokenizer.ggml.add_bos_token") is not True
    server = ServerThread(make_app(GatewayConfig(route=["http://127.0.0.1:9"], model=str(smollm2_path()))))
    url = server.start()
    try:
        status, body = post(f"{url}/v1/completions", {"prompt": "", "max_tokens": 2})
        assert status == 400 and body["error"]["param"] == "prompt" and "BOS" in body["error"]["message"]
    finally:
        server.stop()
    # started by its alias, the model is named by it (as publish and a node started with --model smollm2 name it)
    server = ServerThread(make_app(GatewayConfig(route=["http://127.0.0.1:9"], model="smollm2")))
    url = server.start()
    try:
        listed = json.loads(urllib.request.urlopen(f"{url}/v1/models", timeout=30).read())
        assert [m["id"] for m in listed["data"]] == ["smollm2"]
    finally:
        server.stop()


def test_roles_developer_and_missing_content():
    """``developer`` becomes ``system`` for a template without that role; a message needs content (an assistant
    turn making tool calls excepted)."""
    msgs = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert chat_turns(msgs, "{% for m in messages %}{{ m.role }}{% endfor %}")[0]["role"] == "system"
    assert chat_turns(msgs, "{% if m.role == 'developer' %}{% endif %}")[0]["role"] == "developer"
    with pytest.raises(RequestError, match=r"messages\[1\] \(user\) has no content"):
        chat_turns([msgs[0], {"role": "user"}], None)
    call = {"id": "1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    assert chat_turns([{"role": "assistant", "content": None, "tool_calls": [call]}], None) == [
        {"role": "assistant", "content": "", "tool_calls": [{**call, "function": {"name": "f", "arguments": {"a": 1}}}]}
    ]
    with pytest.raises(RequestError, match=r"messages\[0\]\.tool_calls\[0\]"):
        chat_turns([{"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]}], None)


def test_developer_message_reaches_the_route(gateway):
    status, body = post(
        f"{gateway}/v1/chat/completions",
        {
            "messages": [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
            "max_tokens": 2,
        },
    )
    assert 500 <= status < 600 and "127.0.0.1:9" in body["error"]["message"]  # valid: it went on to the (dead) node
    status, body = post(f"{gateway}/v1/chat/completions", {"messages": [{"role": "user"}]})
    assert status == 400 and "no content" in body["error"]["message"]


def test_open_gateway_beyond_loopback_warns_and_waits_for_its_route(gemma_path):
    """Without --api-key on a non-loopback address the gateway says, at start, who can use it; with a route
    whose node does not answer (yet) it says so and waits (start order does not matter) instead of failing."""
    import subprocess
    import sys

    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "ggufswarm.cli",
            "gateway",
            "--route",
            "http://127.0.0.1:9",
            "--model",
            str(gemma_path),
            "--host",
            "0.0.0.0",
            "--port",
            "0",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        first, second = proc.stderr.readline(), proc.stderr.readline()
        assert "without --api-key" in first, first
        assert "waiting for the route: node http://127.0.0.1:9" in second and proc.poll() is None, second
    finally:
        proc.terminate()
        proc.communicate(timeout=30)


def test_a_huge_prompt_does_not_stall_the_gateway(gateway):
    """Tokenizing a 1 MB prompt runs off the event loop: /health answers meanwhile (503 "degraded" here: this
    module's route is a port nothing listens on, which /health finds at once)."""
    import threading
    import time

    done = threading.Event()
    took = {}

    def huge():
        t0 = time.monotonic()
        post(f"{gateway}/v1/chat/completions", {"messages": [{"role": "user", "content": "lorem ipsum " * 90000}]})
        took["s"] = time.monotonic() - t0
        done.set()

    threading.Thread(target=huge, daemon=True).start()
    slowest = 0.0
    while not done.is_set():
        t0 = time.monotonic()
        try:
            urllib.request.urlopen(f"{gateway}/health", timeout=30).close()
            raise AssertionError("/health answered 200 for a route whose node does not listen")
        except urllib.error.HTTPError as e:
            assert e.code == 503 and json.loads(e.read())["status"] == "degraded"
        slowest = max(slowest, time.monotonic() - t0)
        time.sleep(0.02)
    # on the event loop, tokenizing would hold /health for most of the huge request; a share of that request's own
    # time (at least 1 s), not a fixed 0.5 s, so that a loaded machine does not break the test
    assert slowest < max(1.0, took["s"] / 3), (slowest, took)


CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
MSGS = [{"role": "user", "content": "Hi"}]


@pytest.mark.parametrize(
    "path,extra,param",
    [
        (COMP, {"n": 9}, "n"),  # past MAX_CHOICES
        (CHAT, {"n": 0}, "n"),
        (COMP, {"best_of": 2}, "best_of"),
        (COMP, {"suffix": " world"}, "suffix"),  # Gemma 3 270M has no fill-in-the-middle tokens
        (COMP, {"echo": True, "logprobs": 2}, "echo"),
        (COMP, {"logprobs": 6}, "logprobs"),  # OpenAI: 0..5
        (COMP, {"logprobs": True}, "logprobs"),
        (COMP, {"top_logprobs": 2}, "top_logprobs"),  # a chat parameter
        (CHAT, {"top_logprobs": 3}, "top_logprobs"),  # needs logprobs: true
        (CHAT, {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        (CHAT, {"logprobs": 1}, "logprobs"),
        (CHAT, {"echo": True}, "echo"),  # a completions parameter
        (CHAT, {"logit_bias": {"262144": 5}}, "logit_bias"),  # past the vocabulary
        (CHAT, {"logit_bias": {"12": 101}}, "logit_bias"),
        (CHAT, {"logit_bias": {"x": 1}}, "logit_bias"),
        (CHAT, {"logit_bias": [[12, 1]]}, "logit_bias"),
        (CHAT, {"presence_penalty": 2.5}, "presence_penalty"),
        (CHAT, {"frequency_penalty": -3}, "frequency_penalty"),
        (CHAT, {"repeat_last_n": -2}, "repeat_last_n"),
        (CHAT, {"stream_options": {"include_usage": True}}, "stream_options"),  # without stream: true
        (CHAT, {"stream": True, "stream_options": {"include_usage": 1}}, "stream_options"),
        (CHAT, {"stream": True, "stream_options": {"chunk_size": 4}}, "stream_options"),
        (CHAT, {"response_format": {"type": "xml"}}, "response_format"),
        (
            CHAT,
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "n", "schema": {"type": "integer", "minimum": 3}},
                }
            },
            "response_format",
        ),  # the grammar would not enforce minimum
        (
            CHAT,
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "n", "schema": {"oneOf": [{"type": "string"}, {"type": "integer"}]}},
                }
            },
            "response_format",
        ),
        (
            CHAT,
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {
                        "name": "n",
                        "schema": {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["b"]},
                    },
                }
            },
            "response_format",
        ),
        (CHAT, {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        (CHAT, {"tool_choice": "auto"}, "tool_choice"),
        (CHAT, {"functions": [{"name": "f"}]}, "functions"),
        (CHAT, {"mirostat": 2}, "mirostat"),
        (CHAT, {"typical_p": 0.5}, "typical_p"),
        (CHAT, {"ignore_eos": 1}, "ignore_eos"),
        (CHAT, {"skip_special_tokens": "no"}, "skip_special_tokens"),
        (CHAT, {"min_keep": 2}, "min_keep"),
        (CHAT, {"audio": {"voice": "x"}}, "audio"),
        (CHAT, {"temprature": 0}, "temprature"),  # a typo is not silently ignored
    ],
)
def test_unimplemented_or_bad_parameters_are_400_naming_them(gateway, path, extra, param):
    base = {"messages": MSGS} if path == CHAT else {"prompt": "Hi"}
    status, body = post(gateway + path, {**base, "max_tokens": 2, **extra})
    assert status == 400, body
    assert body["error"]["type"] == "invalid_request_error" and body["error"]["message"]
    assert body["error"]["param"] == param


def test_tools_on_a_template_without_tool_support_say_so(gateway):
    status, body = post(gateway + CHAT, {"messages": MSGS, "tools": [{"type": "function", "function": {"name": "f"}}]})
    assert status == 400 and body["error"]["param"] == "tools"
    assert "chat template has no tool support" in body["error"]["message"]  # Gemma 3's template renders no tools


@pytest.mark.parametrize(
    "path,extra",
    [
        (COMP, {"best_of": 1, "echo": True, "suffix": None, "n": 1}),
        (COMP, {"suffix": "", "logprobs": 5}),
        (COMP, {"logprobs": 0, "logit_bias": {"0": -100, "262143": 100}}),
        (CHAT, {"logprobs": True, "top_logprobs": 20, "presence_penalty": -2, "frequency_penalty": 2}),
        (
            CHAT,
            {
                "stream": True,
                "stream_options": {"include_usage": False},
                "repeat_penalty": 1.1,
                "repeat_last_n": -1,
                "top_k": 5,
                "min_p": 0.1,
            },
        ),
        (CHAT, {"response_format": {"type": "json_object"}}),
        (
            CHAT,
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {
                        "name": "n",
                        "strict": True,
                        "schema": {
                            "type": "object",
                            "properties": {"a": {"type": "string", "maxLength": 3}, "b": {"$ref": "#/$defs/b"}},
                            "required": ["a"],
                            "additionalProperties": False,
                            "$defs": {"b": {"enum": [1, 2]}},
                        },
                    },
                }
            },
        ),
        (
            CHAT,
            {
                "response_format": {"type": "text"},
                "tool_choice": "none",
                "user": "u1",
                "store": False,
                "metadata": {"k": "v"},
                "mirostat": 0,
                "mirostat_tau": 5.0,
                "typical_p": 1,
                "cache_prompt": True,
            },
        ),
    ],
)
def test_implemented_and_neutral_parameters_pass_validation(gateway, path, extra):
    """Accepted bodies go on to the route (here a dead node: a 5xx naming it, not a 400)."""
    base = {"messages": MSGS} if path == CHAT else {"prompt": "Hi"}
    status, body = post(gateway + path, {**base, "max_tokens": 2, **extra})
    assert 500 <= status < 600 and "127.0.0.1:9" in body["error"]["message"], body


def test_a_model_can_be_retrieved_by_id(gateway):
    """``GET /v1/models/{id}`` (the openai client's ``models.retrieve``): the listed model, or 404."""
    import openai

    client = openai.OpenAI(base_url=gateway + "/v1", api_key="unused")
    [listed] = client.models.list().data
    assert client.models.retrieve(listed.id).id == listed.id
    with pytest.raises(openai.NotFoundError) as err:
        client.models.retrieve("no-such-model")
    assert err.value.body["code"] == "model_not_found"


CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}


@pytest.mark.parametrize(
    "messages,param",
    [
        ([], "messages"),
        ({"role": "user", "content": "Hi"}, "messages"),
        (["Hi"], "messages[0]"),
        ([{"content": "Hi"}], "messages[0].role"),
        ([*MSGS, {"role": "wizard", "content": "Hi"}], "messages[1].role"),
        ([*MSGS, {"role": 3, "content": "Hi"}], "messages[1].role"),
        ([{"role": "user"}], "messages[0].content"),
        ([{"role": "user", "content": 5}], "messages[0].content"),
        ([{"role": "user", "content": {"text": "Hi"}}], "messages[0].content"),
        ([{"role": "user", "content": [{"type": "text", "text": "a"}, {"text": "b"}]}], "messages[0].content[1]"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], "messages[0].content[0]"),
        ([*MSGS, {"role": "assistant"}], "messages[1].content"),
        ([*MSGS, {"role": "assistant", "content": None}], "messages[1].content"),
        ([*MSGS, {"role": "assistant", "content": None, "tool_calls": [{"id": "x"}]}], "messages[1].tool_calls[0]"),
        ([*MSGS, {"role": "tool", "tool_call_id": 7, "content": "1"}], "messages[1].tool_call_id"),
        ([{"role": "user", "content": "Hi", "name": 1}], "messages[0].name"),
    ],
)
def test_malformed_messages_are_400_naming_the_field(gateway, messages, param):
    status, body = post(gateway + CHAT, {"messages": messages, "max_tokens": 2})
    assert status == 400, body
    assert body["error"]["param"] == param and body["error"]["message"], body


@pytest.mark.parametrize(
    "messages",
    [
        [{"role": "user", "content": None}],  # llama-server takes a null content as empty text
        [*MSGS, {"role": "assistant", "tool_calls": [CALL]}, {"role": "tool", "tool_call_id": "c1", "content": "1"}],
        # no tool_call_id: llama-server takes it (the chat template decides what it needs)
        [*MSGS, {"role": "assistant", "tool_calls": [CALL]}, {"role": "tool", "content": "1"}],
        [*MSGS, {"role": "assistant", "content": "", "tool_calls": []}],
        [{"role": "system", "content": [{"type": "text", "text": "Be brief."}]}, *MSGS],
    ],
)
def test_messages_llama_server_takes_pass_validation(gateway, messages):
    status, body = post(gateway + CHAT, {"messages": messages, "max_tokens": 2})
    assert 500 <= status < 600 and "127.0.0.1:9" in body["error"]["message"], body


@pytest.mark.parametrize(
    "path,extra",
    [
        (CHAT, {"n": 8, "seed": 2**63 - 1, "timings_per_token": True}),
        (COMP, {"n": 2, "grammar": 'root ::= "a" | "b"'}),
        (CHAT, {"response_format": {"type": "json_object", "schema": {"type": "object"}}}),
        (CHAT, {"response_format": {"type": "json_schema", "schema": {"type": "string", "maxLength": 4}}}),
        (CHAT, {"response_format": {"type": "json_schema"}}),
        (CHAT, {"grammar": "", "response_format": {"type": "text"}}),
    ],
)
def test_new_parameters_pass_validation(gateway, path, extra):
    base = {"messages": MSGS} if path == CHAT else {"prompt": "Hi"}
    status, body = post(gateway + path, {**base, "max_tokens": 2, **extra})
    assert 500 <= status < 600 and "127.0.0.1:9" in body["error"]["message"], body


@pytest.mark.parametrize(
    "extra,param",
    [
        ({"grammar": "root ::= ("}, "grammar"),
        ({"grammar": ["root ::= x"]}, "grammar"),
        ({"grammar": 'root ::= "a"', "response_format": {"type": "json_object"}}, "grammar"),
        ({"timings_per_token": "yes"}, "timings_per_token"),
        ({"n": 1.5}, "n"),
        ({"response_format": {"type": "json_object", "schema": 3}}, "response_format"),
        ({"response_format": {"type": "text", "schema": {}}}, "response_format"),
        ({"response_format": {"type": "json_schema", "schema": {}, "json_schema": {"schema": {}}}}, "response_format"),
    ],
)
def test_new_parameters_refused_naming_them(gateway, extra, param):
    status, body = post(gateway + CHAT, {"messages": MSGS, "max_tokens": 2, **extra})
    assert status == 400 and body["error"]["param"] == param, body
