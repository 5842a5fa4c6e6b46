"""Speculative decoding across the route (--speculative ngram): same tokens as plain decoding, KV rolled back.

One 3-node Gemma cluster (route_fixtures.cluster) and one 3-node SmolLM2 cluster for the module; each has one
gateway started with ``--speculative ngram``, and the plain reference is the same gateway with the request's
``speculative.n_max: 0`` (decoded one token per step), so both go through the same nodes.
"""

from __future__ import annotations

import json
import subprocess
import urllib.request

import pytest
from route_fixtures import HOP_TIMEOUT, cluster, http  # noqa: F401  (cluster: a module fixture)

from ggufswarm.client import loop
from ggufswarm.client.generate import GenerationStats, generate
from ggufswarm.client.route import RemoteRoute
from ggufswarm.client.speculative import NgramDrafter, speculate
from ggufswarm.gateway import GatewayConfig, make_app
from ggufswarm.net.http import ServerThread
from ggufswarm.node.launch import start_nodes, stop_nodes
from ggufswarm.runtime.sampling import SamplingParams
from ggufswarm.runtime.shard import even_split

CODE = (
    "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef mul(a, b):\n"
    "    return a * b\n\n\ndef div(a, b):"
)
REPETITIVE = "Monday, Tuesday, Wednesday, Thursday, Friday. Monday, Tuesday, Wednesday,"
LIST = "apple banana cherry\napple banana cherry\napple banana"
PROSE = "The capital of France is"


@pytest.fixture(scope="module")
def spec_gateway(cluster, gemma_path):
    server = ServerThread(
        make_app(
            GatewayConfig(
                [n.url for n in cluster],
                model=str(gemma_path),
                hop_timeout_s=HOP_TIMEOUT,
                speculative="ngram",
                draft_max=2,
            )
        )
    )
    url = server.start()
    yield url
    server.stop()


@pytest.fixture(scope="module")
def smollm2_nodes():
    from ggufswarm.artifact.default_model import smollm2_path

    nodes = start_nodes(even_split(30, 3), str(smollm2_path()), threads=1, extra=["--hop-timeout", str(HOP_TIMEOUT)])
    yield nodes
    stop_nodes(nodes)


def _smollm2_gateway(nodes, **speculative):
    from ggufswarm.artifact.default_model import smollm2_path

    server = ServerThread(
        make_app(
            GatewayConfig([n.url for n in nodes], model=str(smollm2_path()), hop_timeout_s=HOP_TIMEOUT, **speculative)
        )
    )
    return server, server.start()


@pytest.fixture(scope="module")
def smollm2_gateway(smollm2_nodes):
    server, url = _smollm2_gateway(smollm2_nodes, speculative="ngram", draft_max=4)
    yield url
    server.stop()


@pytest.fixture(scope="module")
def smollm2_draft_gateway(smollm2_nodes):
    """--speculative draft with SmolLM2 itself as the draft model (the mechanics; a real draft model is smaller)."""
    server, url = _smollm2_gateway(
        smollm2_nodes, speculative="draft", draft_max=4, draft_model="smollm2", draft_sessions=1
    )
    yield url
    server.stop()


def stream(url: str, path: str, body: dict) -> tuple[str, dict]:
    """POST a streamed request for the served model: (the text of every delta joined, the last chunk's telemetry)."""
    body = {**body, "model": http("GET", url + "/v1/models")[1]["data"][0]["id"], "stream": True}
    req = urllib.request.Request(
        url + path, data=json.dumps(body).encode(), method="POST", headers={"Content-Type": "application/json"}
    )
    text, telemetry = [], None
    with urllib.request.urlopen(req, timeout=300) as resp:
        for line in resp:
            line = line.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            event = json.loads(line[6:])
            assert "error" not in event, event
            choice = event["choices"][0] if event.get("choices") else {}
            text.append(choice.get("text") or (choice.get("delta") or {}).get("content") or "")
            telemetry = event.get("telemetry", telemetry)
    return "".join(text), telemetry


@pytest.mark.parametrize("prompt", [CODE, REPETITIVE, LIST, PROSE])
def test_speculative_greedy_equals_plain_gemma(spec_gateway, prompt):
    body = {"model": "x", "prompt": prompt, "max_tokens": 40, "temperature": 0}
    plain, plain_tel = stream(spec_gateway, "/v1/completions", {**body, "speculative.n_max": 0})
    spec, tel = stream(spec_gateway, "/v1/completions", body)
    assert plain_tel["speculative"]["drafted"] == 0
    assert spec == plain
    s = tel["speculative"]
    assert s["method"] == "ngram" and s["verify_steps"] > 0 and 0 <= s["accepted"] <= s["drafted"]
    if prompt in (CODE, REPETITIVE, LIST):  # text that repeats itself: most drafts are confirmed
        assert s["accepted"] >= 10, s  # each accepted draft is one trip through the route saved


def test_speculative_sampling_equals_plain(spec_gateway):
    """Draws are keyed by (seed, position): a verify step draws exactly what one-token steps draw."""
    body = {"model": "x", "prompt": REPETITIVE, "max_tokens": 40, "temperature": 0.7, "seed": 7}
    plain, _ = stream(spec_gateway, "/v1/completions", {**body, "speculative.n_max": 0})
    spec, tel = stream(spec_gateway, "/v1/completions", body)
    assert spec == plain and tel["speculative"]["verify_steps"] > 0


def test_speculative_chat_smollm2(smollm2_gateway):
    for content in [
        "Write a Python function that returns the squares of a list of numbers.",
        "Repeat after me three times: the quick brown fox jumps over the lazy dog.",
    ]:
        body = {"model": "x", "messages": [{"role": "user", "content": content}], "max_tokens": 48, "temperature": 0}
        plain, _ = stream(smollm2_gateway, "/v1/chat/completions", {**body, "speculative.n_max": 0})
        spec, tel = stream(smollm2_gateway, "/v1/chat/completions", body)
        assert spec == plain
        assert tel["speculative"]["verify_steps"] > 0 and tel["speculative"]["accepted"] > 0


def test_speculative_draft_model_smollm2(smollm2_draft_gateway):
    body = {
        "messages": [{"role": "user", "content": "Name three colors and describe each in one sentence."}],
        "max_tokens": 40,
        "temperature": 0,
    }
    plain, _ = stream(smollm2_draft_gateway, "/v1/chat/completions", {**body, "speculative.n_max": 0})
    spec, tel = stream(smollm2_draft_gateway, "/v1/chat/completions", body)
    assert spec == plain
    s = tel["speculative"]
    # the draft model is the served one: its greedy drafts are the head's greedy tokens
    assert s["method"] == "draft" and s["verify_steps"] > 0 and s["accepted"] == s["drafted"] > 10, s


def test_draft_model_needs_the_same_vocabulary(gemma_path):
    from ggufswarm.gateway.state import Gateway

    gw = Gateway(
        GatewayConfig(["http://127.0.0.1:1"], model=str(gemma_path), speculative="draft", draft_model="smollm2")
    )
    with pytest.raises(ValueError, match="vocabulary"):
        gw.load()
    for bad in ({"speculative": "draft"}, {"speculative": "ngram", "draft_model": "smollm2"}):
        with pytest.raises(ValueError, match="draft model"):
            Gateway(GatewayConfig(["http://127.0.0.1:1"], model=str(gemma_path), **bad))


class Recording:
    """A RemoteSession whose steps are recorded as (start position, n_tokens)."""

    def __init__(self, session):
        self.session, self.sent = session, []

    def __getattr__(self, name):
        return getattr(self.session, name)

    def step(self, ids):
        self.sent.append((self.session.position, len(ids)))
        return self.session.step(ids)

    def verify(self, ids):
        self.sent.append((self.session.position, len(ids)))
        return self.session.verify(ids)


def test_every_node_holds_the_accepted_position(cluster, gemma):
    """After each step every node's KV length (kv_tokens of its hop in the reply) is the accepted position the
    step started at plus its tokens: rejected drafts were dropped on every node. Also the route's tokens equal
    the in-process plain greedy run's."""
    route = RemoteRoute([n.url for n in cluster], HOP_TIMEOUT)
    ids = gemma.tokenizer.encode(CODE)
    session = route.open(len(ids) + 48, SamplingParams(temperature=0), reuse_prefix=False)
    rec = Recording(session)
    stats = GenerationStats()
    try:
        list(generate(rec, gemma.tokenizer, ids, 48, None, stats, NgramDrafter(2)))
        steps = session.telemetry.steps
    finally:
        session.close()
    ref = GenerationStats()
    local = gemma.session(len(ids) + 48, SamplingParams(temperature=0))
    try:
        list(generate(local, gemma.tokenizer, ids, 48, None, ref))
    finally:
        local.close()
    assert [(s.start, s.n_tokens) for s in steps] == rec.sent
    for s in steps:
        assert s.kv_tokens == [s.start + s.n_tokens] * 3, (s.start, s.n_tokens, s.kv_tokens)
    # some verify step had a draft rejected, and the next step started before the end of it (a rewind)
    assert any(b[0] < a[0] + a[1] for a, b in zip(rec.sent, rec.sent[1:]))
    assert stats.accepted > 0 and stats.accepted < stats.drafted
    assert stats.tokens == ref.tokens


def test_bad_draft_max(spec_gateway, ggufswarm_cli, gemma_path):
    model = http("GET", spec_gateway + "/v1/models")[1]["data"][0]["id"]
    for bad in (16, -1, 1.5, "2"):
        status, body = http(
            "POST",
            spec_gateway + "/v1/completions",
            {"model": model, "prompt": "Hi", "max_tokens": 2, "speculative.n_max": bad},
        )
        assert status == 400 and body["error"]["param"] == "speculative.n_max", body
    with pytest.raises(ValueError, match="draft_max"):
        make_app(GatewayConfig(["http://127.0.0.1:1"], model=str(gemma_path), speculative="ngram", draft_max=0))
    with pytest.raises(ValueError, match="speculative"):
        make_app(GatewayConfig(["http://127.0.0.1:1"], model=str(gemma_path), speculative="eagle"))
    for args in (["--draft-max", "0"], ["--draft-max", "16"], ["--speculative", "maybe"]):
        proc = subprocess.run(ggufswarm_cli + ["generate", "x", *args], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2 and ("--draft-max" in proc.stderr or "--speculative" in proc.stderr), proc.stderr
    for command in (["generate", "x"], ["gateway", "--route", "http://127.0.0.1:1"]):  # drafts without speculation
        proc = subprocess.run(
            ggufswarm_cli + [*command, "--draft-max", "4"], capture_output=True, text=True, timeout=60
        )
        assert proc.returncode == 1 and "--draft-max" in proc.stderr and "--speculative" in proc.stderr, proc.stderr


def test_verify_step_limits(cluster, gemma):
    """Too many tokens for one verify step: a ValueError before anything is sent; the session goes on."""
    route = RemoteRoute([n.url for n in cluster], HOP_TIMEOUT)
    assert route.hops[-1].max_verify_tokens == 16
    session = route.open(64, SamplingParams(temperature=0), reuse_prefix=False)
    try:
        t = session.step(gemma.tokenizer.encode(PROSE))
        with pytest.raises(ValueError, match="verify step takes 1..16"):
            session.verify([t] * 17)
        out = loop.run(speculate(session.session, t, [t, t]))  # the blocking session's async one, on its loop
        assert 1 <= len(out) <= 3 and session.position == len(gemma.tokenizer.encode(PROSE)) + len(out)
    finally:
        session.close()


def test_model_drafter_follows_the_history():
    """A draft session keeps the common prefix of what it was fed and the new history, drops the rest, and
    feeds what is new: its KV holds exactly the history and the drafts fed after it."""
    from ggufswarm.artifact.default_model import smollm2_path
    from ggufswarm.artifact.gguf_file import GGUFModelFile
    from ggufswarm.client.draft_model import DraftModel

    draft = DraftModel("smollm2", GGUFModelFile(smollm2_path()).metadata, max_length=256, sessions=2)
    tok = draft.model.tokenizer
    d, other = draft.drafter(3, 128), draft.drafter(3, 128)
    assert draft.drafter(3, 128) is None and draft.drafter(3, 250) is None  # both sessions taken; too long
    other.close()
    try:
        h1 = tok.encode("The quick brown fox jumps over the")
        out1 = d.draft(h1)
        assert len(out1) == 3 and d.fed == h1 + out1[:2] and d.session.history == d.fed
        h2 = h1[:-2] + tok.encode(" a lazy", add_bos=False)  # diverges two tokens before the end
        out2 = d.draft(h2, cap=2)
        assert len(out2) == 2 and d.fed == h2 + out2[:1] and d.session.history == d.fed
        assert d.session.kvs[0].length == len(d.fed)
        fresh = draft.model.session(128, SamplingParams(temperature=0))
        try:
            assert out2[0] == fresh.step(h2)  # the first draft is the model's greedy token after h2
        finally:
            fresh.close()
    finally:
        d.close()
