"""Fault suite: SIGKILL a random node of a live 3-node route at a random decode step; the route is repaired.

Six Gemma nodes (two per span 0:6, 6:12, 12:18) fetched from the swarm, a tracker (3 s TTL), a
snapshot cache and a gateway. Each trial streams one greedy completion, kills one node of its route
after a random number of streamed tokens, and checks the completion equals an uninterrupted run, and
that the repair restored a snapshot (replaying fewer tokens than the whole history). The killed node
is restarted before the next trial. ``make faults`` runs this file alone and prints the table
(``GGUFSWARM_FAULT_TRIALS`` sets the trial count, default 20).
"""

from __future__ import annotations

import http.client
import json
import os
import random
import sys
import time
from urllib.parse import urlsplit

import pytest
from apphost import AppThread
from route_fixtures import health, one_thread, reference
from route_fixtures import http as http_json

from ggufswarm.cache.app import CacheConfig
from ggufswarm.cache.app import make_app as make_cache_app
from ggufswarm.client.generate import generate
from ggufswarm.client.ring import GRANT_AHEAD
from ggufswarm.client.session import AsyncRouteSession
from ggufswarm.directory.trackers import TrackerClient
from ggufswarm.gateway import GatewayConfig, make_app
from ggufswarm.net.http import ServerThread
from ggufswarm.net.link import FrameLink
from ggufswarm.node.launch import start_nodes, stop_nodes
from ggufswarm.protocol import decode_frame
from ggufswarm.runtime.sampling import SamplingParams
from ggufswarm.runtime.shard import even_split
from ggufswarm.swarm.publish import publish
from ggufswarm.swarm.torrent import Swarm, save_path_for
from ggufswarm.tracker.app import TrackerConfig
from ggufswarm.tracker.app import make_app as make_tracker_app

TRIALS = int(os.environ.get("GGUFSWARM_FAULT_TRIALS", "20"))
PROMPT = (
    "The old lighthouse keeper climbed the spiral stairs every evening at dusk, carrying a lantern and a "
    "notebook in which he wrote down the ships he saw. One stormy night in October,"
)
MAX_TOKENS = 24
# the streams that see a node die: the head may have sent up to GRANT_AHEAD steps past the gateway's (ring decode)
# when a node is killed, so every kill leaves more tokens to go than that, and a margin for the client's lag
KILL_TOKENS = 24 + GRANT_AHEAD
TTL_S = 6.0  # (heartbeats every 2 s: a node of a busy machine's starved loop still beats in time)


def stream(base: str, prompt: str, on_delta, **sampling) -> tuple[str, dict]:
    """Stream a completion (greedy unless ``sampling`` says otherwise); ``on_delta(i)`` after the i-th text
    delta. (text, telemetry)."""
    parts = urlsplit(base)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=300)
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True, **sampling}
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200, resp.read()
    text, telemetry, n = [], None, 0
    for raw in resp:
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        event = json.loads(line[6:])
        assert "error" not in event, (
            f"{event['error']['code']}: {event['error']['message']} telemetry={json.dumps(event.get('telemetry'))}"
        )
        delta = event["choices"][0]["text"]
        if delta:
            text.append(delta)
            n += 1
            on_delta(n)
        telemetry = event.get("telemetry") or telemetry
    conn.close()
    return "".join(text), telemetry


@pytest.fixture
def swarm(whole_swarm):
    """The module's swarm with every node up: a node an earlier test killed is replaced by a fresh process (once
    the tracker has forgotten the dead one), so the tests pass in any order."""
    nodes, tracker = whole_swarm["nodes"], whole_swarm["tracker"]
    for i, node in enumerate(nodes):
        if node.proc.poll() is None:
            continue
        wait_for(lambda: node.url not in listed(tracker), 3 * TTL_S)
        nodes[i] = whole_swarm["launch"](i)
    wait_for(lambda: {n.url for n in nodes} <= listed(tracker), 30)
    return whole_swarm


def listed(tracker: str) -> set[str]:
    """URLs of the nodes the tracker lists for the model."""
    return {a["url"] for a in TrackerClient(tracker).nodes("gemma")}


@pytest.fixture(scope="module")
def whole_swarm(gemma_path, tmp_path_factory):
    """Tracker, seeder, cache, six nodes (two per span) and a gateway routing through the tracker."""
    work = tmp_path_factory.mktemp("faults")
    specs = even_split(18, 3) * 2
    with (
        AppThread(lambda: make_tracker_app(TrackerConfig(db=":memory:", ttl_s=TTL_S))) as tracker,
        AppThread(lambda: make_cache_app(CacheConfig(dir=str(work / "cache"), max_bytes=2**30))) as cache,
    ):
        published = publish(gemma_path, tracker, "gemma", work / "publisher")
        seeder = Swarm()
        seeder.seed(published.torrent, save_path_for([gemma_path]))
        extra = ["--tracker", tracker, "--cache", cache, "--snapshot-every", "16", "--hop-timeout", "10"]

        def launch(i):
            return start_nodes(
                [specs[i]],
                "gemma",
                threads=1,
                timeout=600,
                extra=extra,
                per_node=lambda _: ["--data-dir", str(work / f"node{i}")],
            )[0]

        nodes = start_nodes(
            specs,
            "gemma",
            threads=1,
            timeout=600,
            extra=extra,
            per_node=lambda i: ["--data-dir", str(work / f"node{i}")],
        )
        gateway = None
        try:
            wait_for(lambda: len(TrackerClient(tracker).nodes("gemma")) == len(nodes), 30)
            gateway = ServerThread(
                make_app(
                    GatewayConfig([], model="gemma", tracker=tracker, hop_timeout_s=10, data_dir=str(work / "gateway"))
                )
            )
            yield {
                "tracker": tracker,
                "cache": cache,
                "gateway": gateway.start(),
                "nodes": nodes,
                "launch": launch,
                "gateway_app": gateway.app,
            }
        finally:
            if gateway is not None:
                gateway.stop()
            stop_nodes(nodes)
            seeder.close()


@pytest.fixture
def repair_log(monkeypatch):
    """What each route repair in this process (the gateway runs in it) started from, measured outside the repair
    code: the session's history (tokens it had stepped) and its step boundaries; then the tokens it sent again
    as "do not sample" frames while that repair's replay ran, counted at the wire."""
    log = []
    replaying = {}  # session id -> the entry of the repair whose replay is running
    repair, send = AsyncRouteSession.repair, FrameLink.send

    async def spy_repair(self, exc):
        entry = {"history": len(self.tokens), "boundaries": set(self.boundaries), "replayed": 0}
        replaying[self.id] = entry
        log.append(entry)
        return await repair(self, exc)

    async def spy_send(self, frame, waiter, timeout=None):
        header = decode_frame(frame)
        entry = replaying.get(header.session_id)
        if entry is not None:
            if header.sample:
                del replaying[header.session_id]  # the failed step again: the replay is over
            else:  # counted once answered (a frame sent again on a fresh connection counts once)

                def answered(done, n=header.n_tokens):
                    if not done.cancelled() and done.exception() is None and done.result()[0] == 200:
                        entry["replayed"] += n

                waiter.add_done_callback(answered)
        return await send(self, frame, waiter, timeout)

    monkeypatch.setattr(AsyncRouteSession, "repair", spy_repair)
    monkeypatch.setattr(FrameLink, "send", spy_send)
    return log


def check_repair(repair: dict, seen: dict, prompt_tokens: int) -> None:
    """A repair's telemetry against what the session did: it restored a snapshot of more than the prompt, cut at
    one of the session's own step boundaries (llama.cpp nodes: docs/protocol.md "Snapshots and route repair"),
    and replayed exactly the history after it."""
    restored, replayed = repair["restored_tokens"], repair["tokens_replayed"]
    assert restored in seen["boundaries"] and prompt_tokens <= restored <= seen["history"], (repair, seen)
    assert replayed == seen["history"] - restored == seen["replayed"], (repair, seen)


def wait_for(predicate, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.1)


def test_fault_suite_kill_random_node_of_route(swarm, gemma, repair_log, capfd):
    ref_text, _ = reference(gemma, PROMPT, KILL_TOKENS)
    prompt_tokens = len(gemma.prompt_ids(PROMPT))
    base, nodes, tracker = swarm["gateway"], swarm["nodes"], swarm["tracker"]
    text, telemetry = stream(base, PROMPT, lambda i: None, max_tokens=KILL_TOKENS)  # uninterrupted
    assert text == ref_text and telemetry["repairs"] == []
    rng = random.Random(20261129)
    rows = []
    for trial in range(TRIALS):
        kill_at = rng.randrange(2, KILL_TOKENS - GRANT_AHEAD - 6)
        victim = {}

        def on_delta(i):
            if i == kill_at:  # one route session is open: the nodes holding it form the route
                route = sorted(
                    (n for n in nodes if n.proc.poll() is None and health(n.url)["sessions"] > 0),
                    key=lambda n: n.spec.start,
                )
                assert len(route) == 3
                victim["node"] = rng.choice(route)
                victim["node"].kill()

        t0 = time.monotonic()
        repair_log.clear()
        text, telemetry = stream(base, PROMPT, on_delta, max_tokens=KILL_TOKENS)
        killed = victim["node"]
        repairs = telemetry["repairs"]
        rows.append(
            (
                trial + 1,
                kill_at,
                f"{killed.spec.start}:{killed.spec.end}",
                len(repairs),
                repairs[0]["cause"] if repairs else "-",
                repairs[0]["restored_tokens"] if repairs else 0,
                repairs[0]["tokens_replayed"] if repairs else 0,
                repairs[0]["ms"] if repairs else 0.0,
                text == ref_text,
                round(time.monotonic() - t0, 1),
            )
        )
        assert text == ref_text, f"trial {trial + 1} ({rows[-1]}, {repairs}): {text!r} != {ref_text!r}"
        assert telemetry["ring_steps"] > 0  # the head sent decode steps itself (ring decode), around the kill too
        assert [r["hop"] for r in repairs] == [killed.url], repairs
        assert len(repair_log) == 1
        check_repair(repairs[0], repair_log[0], prompt_tokens)
        assert killed.url not in {h["node"] for h in telemetry["route"]}
        # bring the slot back (a fresh process, on a new port) while the tracker forgets the dead one; the next
        # trial starts once both happened
        i = nodes.index(killed)
        nodes[i] = swarm["launch"](i)
        wait_for(lambda: killed.url not in listed(tracker) and nodes[i].url in listed(tracker), 3 * TTL_S + 30)
    print("\ntrial kill_at span repairs cause restored replayed repair_ms identical seconds")
    for row in rows:
        print("  ".join(str(x) for x in row))
    assert len(rows) == TRIALS and all(r[8] for r in rows)
    # seeded sampling survives a repair too: draws are keyed by (seed, position), not a running RNG
    seeded = {"temperature": 0.9, "seed": 11}
    want, _ = stream(base, PROMPT, lambda i: None, max_tokens=KILL_TOKENS, **seeded)
    head = {}

    def kill_head(i):
        if i == 5:
            head["node"] = next(
                n for n in nodes if n.spec.head and n.proc.poll() is None and health(n.url)["sessions"] > 0
            )
            head["node"].kill()

    repair_log.clear()
    sys.stdout.write(capfd.readouterr().out)  # (the table above, when run with -s)
    got, telemetry = stream(base, PROMPT, kill_head, max_tokens=KILL_TOKENS, **seeded)
    assert [r["hop"] for r in telemetry["repairs"]] == [head["node"].url] and got == want
    said = [ln for ln in capfd.readouterr().err.splitlines() if "repaired a route" in ln]
    spare = telemetry["repairs"][0]["replacement"][0]
    assert said == [
        f"ggufswarm gateway: repaired a route: node {head['node'].url} (layers 12:18) failed "
        f"({telemetry['repairs'][0]['cause']}); continued on {spare} "
        f"({telemetry['repairs'][0]['restored_tokens']} tokens restored, "
        f"{telemetry['repairs'][0]['tokens_replayed']} replayed)"
    ], said
    assert len(repair_log) == 1
    check_repair(telemetry["repairs"][0], repair_log[0], prompt_tokens)
    i = nodes.index(head["node"])
    wait_for(lambda: head["node"].url not in listed(tracker), 3 * TTL_S)
    nodes[i] = swarm["launch"](i)


def _two_prompts(model, reference_text) -> list[str]:
    ids = model.tokenizer.encode(reference_text)
    shared = model.tokenizer.decode(ids[1:601])  # 600 tokens after BOS
    return [shared + " In short, the first point is", shared + " Summarizing the second section:"]


def test_llama_cpp_prefix_reuse_continues_a_conversation(swarm, gemma):
    """llama.cpp nodes: a follow-up request whose prompt is the first request's prompt, its answer and more
    restores the first request's KV from the snapshots (every node of its route) up to a step boundary, and
    computes only the rest. The answer equals llama.cpp running the same steps: the first prompt in one step,
    the answer's tokens one by one (as they were decoded), then the rest of the follow-up in one step — what
    llama-server's prompt cache does with a conversation in one slot."""
    nodes = swarm["nodes"]

    def written():
        # taken and handed to the cache: stored, or kept there already (the first blob for a key stays)
        return sum(
            health(n.url)["snapshots"]["written"] + health(n.url)["snapshots"]["kept"]
            for n in nodes
            if n.proc.poll() is None
        )

    first_ids = gemma.prompt_ids(PROMPT)
    before = written()
    answer, first = stream(swarm["gateway"], PROMPT, lambda i: None)
    assert answer == reference(gemma, PROMPT, MAX_TOKENS)[0]
    # per hop: the snapshot after the prefill and one at each multiple of 16 passed while decoding
    fed = len(first_ids) + MAX_TOKENS - 1
    wait_for(lambda: written() >= before + 3 * (1 + fed // 16 - len(first_ids) // 16), 30)
    follow_up = PROMPT + answer + " Then the keeper"
    text, second = stream(swarm["gateway"], follow_up, lambda i: None)
    ids = gemma.prompt_ids(follow_up)
    restored = second["prefix_tokens_restored"]
    # the first request's snapshots: after its prompt step, and at each multiple of 16 it fed while decoding. Its
    # steps ended at the prompt's end and at every token after, so the longest one is restorable as far as the
    # follow-up's prompt (minus its last token, which is computed) shares it
    history = first_ids + reference(gemma, PROMPT, MAX_TOKENS)[1][: MAX_TOKENS - 1]
    assert len(history) == fed
    longest = max([len(first_ids)] + [m for m in range(16, fed + 1, 16)])
    shared = next((i for i, (a, b) in enumerate(zip(ids[:-1], history)) if a != b), min(len(ids) - 1, fed))
    assert ids[: len(first_ids)] == first_ids and shared >= len(first_ids)
    assert restored == min(longest, shared), (restored, longest, shared, len(first_ids), fed)
    with one_thread():
        local = gemma.session(len(ids) + MAX_TOKENS + 8, SamplingParams(temperature=0))
        local.logits(ids[: len(first_ids)])
        for token in ids[len(first_ids) : restored]:
            local.logits([token])
        local.history[:] = ids[:restored]
        want = "".join(generate(local, gemma.tokenizer, ids[restored:], MAX_TOKENS))
    assert text == want
    print(
        f"\nprefix reuse (llama.cpp): TTFT {first['ttft_ms']:.0f} ms → {second['ttft_ms']:.0f} ms "
        f"({restored} of {second['prompt_tokens']} prompt tokens restored)"
    )


@pytest.fixture(scope="module")
def torch_route(gemma_path, tmp_path_factory):
    """Three torch-backend nodes with a snapshot cache, and a gateway over them (no tracker)."""
    work = tmp_path_factory.mktemp("torch-route")
    with AppThread(lambda: make_cache_app(CacheConfig(dir=str(work / "cache"), max_bytes=2**30))) as cache:
        nodes = start_nodes(
            even_split(18, 3),
            str(gemma_path),
            threads=1,
            extra=["--backend", "torch", "--cache", cache, "--hop-timeout", "30"],
        )
        gateway = ServerThread(make_app(GatewayConfig([n.url for n in nodes], model=str(gemma_path), hop_timeout_s=30)))
        try:
            yield {"gateway": gateway.start(), "nodes": nodes}
        finally:
            gateway.stop()
            stop_nodes(nodes)


@pytest.mark.slow
def test_prefix_reuse_restores_a_shared_600_token_prefix(torch_route, gemma_torch, reference_text):
    """torch backend (batch-invariant): a second request sharing a 600-token prefix restores it from the
    snapshots of the first (every node of its route), computes only the rest, and completes exactly as
    without the cache."""
    prompts = _two_prompts(gemma_torch, reference_text)
    nodes = torch_route["nodes"]

    def written():
        return sum(health(n.url)["snapshots"]["written"] + health(n.url)["snapshots"]["kept"] for n in nodes)

    before = written()
    first_text, first = stream(torch_route["gateway"], prompts[0], lambda i: None)
    wait_for(lambda: written() >= before + 3, 30)
    second_text, second = stream(torch_route["gateway"], prompts[1], lambda i: None)
    assert first["prefix_tokens_restored"] == 0  # a cold cache (this module's torch route has its own)
    restored = second["prefix_tokens_restored"]
    # the snapshot of the first prompt is found by whole 16-token blocks and restored on to every token the
    # second prompt (minus its last token, which is computed) shares with it: a torch shard's KV does not depend
    # on how the tokens were grouped into steps
    first_ids, second_ids = gemma_torch.prompt_ids(prompts[0]), gemma_torch.prompt_ids(prompts[1])
    shared = next(i for i, (a, b) in enumerate(zip(first_ids, second_ids[:-1])) if a != b)
    assert shared >= 600 and restored == shared, (restored, shared)
    assert first_text == reference(gemma_torch, prompts[0], MAX_TOKENS)[0]
    # the exact reference computes the restored prefix as the first request did (in its prompt step), then the
    # rest: even PyTorch's CPU matmuls round differently for different batch shapes
    assert first_ids[:restored] == second_ids[:restored]
    with one_thread():
        local = gemma_torch.session(len(first_ids) + MAX_TOKENS + 8, SamplingParams(temperature=0))
        local.logits(first_ids)
        local.truncate(restored)
        local.history[:] = second_ids[:restored]
        want = "".join(generate(local, gemma_torch.tokenizer, second_ids[restored:], MAX_TOKENS))
    assert second_text == want
    print(
        f"\nprefix reuse (torch): TTFT {first['ttft_ms']:.0f} ms → {second['ttft_ms']:.0f} ms "
        f"({second['prefix_tokens_restored']} of {second['prompt_tokens']} prompt tokens restored)"
    )


def test_next_hop_must_be_a_registered_node(swarm):
    """With a tracker, a node takes as next_hop only a node the tracker lists for its model: a session that
    names any other URL (an SSRF attempt: the node would post to it with the swarm token) is refused at open
    and at relink, and nothing reaches that URL."""
    seen = []

    def listener():
        from aiohttp import web

        async def record(request):
            seen.append(request.path)
            return web.Response(text="ok")

        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", record)
        return app

    first = next(n for n in swarm["nodes"] if n.spec.start == 0 and n.proc.poll() is None)
    second = next(n for n in swarm["nodes"] if n.spec.start == 6 and n.proc.poll() is None)
    with AppThread(listener) as url:
        status, body = http_json("POST", first.url + "/v1/sessions", {"max_length": 64, "next_hop": url})
        assert status == 403 and body["error"]["code"] == "next_hop_unknown", body
        status, opened = http_json("POST", first.url + "/v1/sessions", {"max_length": 64, "next_hop": second.url})
        assert status == 201, opened
        sid = opened["session_id"]
        status, body = http_json("POST", f"{first.url}/v1/sessions/{sid}/truncate", {"length": 0, "next_hop": url})
        assert status == 403 and body["error"]["code"] == "next_hop_unknown"
        http_json("DELETE", f"{first.url}/v1/sessions/{sid}")
    assert seen == []


def test_new_requests_plan_around_a_dead_node_the_tracker_still_lists(swarm, caplog, monkeypatch):
    """A node killed while idle stays on the tracker's list until its TTL: a new request whose plan picks it
    finds it does not answer (it proves its key before the token goes there, or fails to open there), plans
    again without it, and completes; the gateway reports the node, and the tracker, finding it down, drops it
    then, before its TTL (it logs that). On a loaded machine the request may outlast the TTL (3 s here): then
    the report finds the node already gone (404)."""
    from ggufswarm.directory.trackers import TrackerError
    from ggufswarm.gateway.app import GATEWAY

    answers = []  # (reported URL, the tracker's answer or its TrackerError)
    real_acall = TrackerClient.acall

    async def spy_acall(self, http, path, method="GET", body=None, **kw):
        try:
            got = await real_acall(self, http, path, method, body, **kw)
        except TrackerError as exc:
            got = exc
        if path == "nodes/report":
            answers.append((body["url"], got))
        if isinstance(got, TrackerError):
            raise got
        return got

    monkeypatch.setattr(TrackerClient, "acall", spy_acall)
    real_report = TrackerClient.report

    def spy_report(self, node_url, timeout_s=None):
        try:
            answers.append((node_url, real_report(self, node_url, timeout_s=timeout_s)))
        except TrackerError as exc:
            answers.append((node_url, exc))
            raise
        return answers[-1][1]

    monkeypatch.setattr(TrackerClient, "report", spy_report)
    nodes, tracker = swarm["nodes"], swarm["tracker"]
    victim, other = [n for n in nodes if n.spec.start == 0 and n.proc.poll() is None]
    # New routes avoid a suspect while another node can serve: this makes the next plan pick the victim.
    swarm["gateway_app"][GATEWAY].suspect(other.url)
    caplog.set_level("WARNING", logger="ggufswarm.tracker.app")
    victim.kill()
    text, telemetry = stream(swarm["gateway"], PROMPT, lambda i: None, max_tokens=2)
    assert text and other.url in {h["node"] for h in telemetry["route"]}
    wait_for(lambda: any(url == victim.url for url, _ in answers), 30)
    answer = next(a for url, a in answers if url == victim.url)
    if isinstance(answer, TrackerError):  # expired by its TTL before the report came
        assert answer.status == 404 and "no node advertises" in answer.reason, answer
    else:
        assert answer["alive"] is False and answer["removed"] >= 1, answer
        assert f"node {victim.url} reported failing" in caplog.text
    assert victim.url not in listed(tracker)
    i = nodes.index(victim)
    wait_for(lambda: victim.url not in listed(tracker), 3 * TTL_S)
    nodes[i] = swarm["launch"](i)
    wait_for(lambda: nodes[i].url in listed(tracker), 30)


def test_max_tokens_past_every_node_s_kv_is_served_up_to_the_route_s_length(swarm):
    """A max_tokens no node has KV for (10^6: every node's free KV is far less) is no 503 no_route: the answer
    streams, to end at the route's length with finish_reason "length" as llama-server's does (the test
    reads a few tokens and hangs up)."""
    parts = urlsplit(swarm["gateway"])
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=300)
    try:
        conn.request(
            "POST",
            "/v1/completions",
            json.dumps({"prompt": PROMPT, "max_tokens": 10**6, "temperature": 0, "stream": True}),
            {"Content-Type": "application/json"},
        )
        resp = conn.getresponse()
        assert resp.status == 200, resp.read()
        deltas = 0
        for raw in resp:
            line = raw.decode().strip()
            if line.startswith("data: "):
                event = json.loads(line[6:])
                assert "error" not in event, event
                deltas += bool(event["choices"][0]["text"])
                if deltas == 3:
                    break
        assert deltas == 3
    finally:
        conn.close()


def test_no_replacement_is_a_clear_error(swarm):
    """With both nodes of a span gone, the repair finds no replacement: the stream ends with a 503
    ``no_replacement`` error naming the failed node, and the gateway's /health turns 503 naming the layers no
    ready node serves (it was 200 while the swarm could serve the model)."""
    nodes, tracker = swarm["nodes"], swarm["tracker"]
    middle = [n for n in nodes if n.spec.start == 6 and n.proc.poll() is None]
    assert len(middle) == 2
    status, body = http_json("GET", swarm["gateway"] + "/health")
    assert status == 200 and body["status"] == "ok", body
    middle[0].kill()
    wait_for(lambda: middle[0].url not in listed(tracker), 3 * TTL_S)
    with pytest.raises(AssertionError, match="no_replacement") as err:
        stream(swarm["gateway"], PROMPT, lambda i: i == 3 and middle[1].kill(), max_tokens=KILL_TOKENS)
    assert middle[1].url in str(err.value) and "layers 6:12" in str(err.value)
    assert swarm["tracker"] not in str(err.value)  # the tracker's reason, never its address
    # the error event still reports the session, with the repair it could not make
    failed = json.loads(str(err.value).split("telemetry=", 1)[1].split("\n", 1)[0])
    [attempt] = failed["repairs"]
    assert attempt["hop"] == middle[1].url and attempt["replacement"] is None and "6:12" in attempt["error"]
    wait_for(lambda: http_json("GET", swarm["gateway"] + "/health")[0] == 503, 3 * TTL_S)  # the tracker drops it
    status, body = http_json("GET", swarm["gateway"] + "/health")
    assert body["status"] == "degraded" and body["tracker"] == {"ok": True}, body
    assert (
        body["reason"] == "the swarm cannot serve gemma end to end now: layers 6:12 are not served by any ready node"
        and tracker not in json.dumps(body)
    ), body
