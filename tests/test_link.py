"""Hop links: nodes pass step frames to their next hop over one WebSocket (``GET /v1/link``), fall back to
``POST /v1/step`` for a next hop without links, and answer bad link messages with an error, still serving."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
import uuid

import aiohttp
import pytest
from aiohttp import web
from apphost import AppThread
from route_fixtures import http, open_greedy, tiny_split_route
from tinymodels import write_tiny_model

from ggufswarm.client.route import RemoteRoute
from ggufswarm.net.link import FrameLink
from ggufswarm.node.app import make_app as make_node_app
from ggufswarm.node.state import NodeConfig
from ggufswarm.protocol import decode_frame, encode_tokens
from ggufswarm.protocol.frame import HEADER_SIZE
from ggufswarm.protocol.link import NO_KEY, REPLY_HEAD, frame_key
from ggufswarm.runtime.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0)
PROMPT = [5 + (i * 11) % 300 for i in range(24)]


@pytest.fixture(scope="module")
def tiny_route(tiny_dir):
    """A tiny llama split over two in-process nodes ([0,1) + embedding, [1,2) + head), and the whole model."""
    model = str(write_tiny_model(tiny_dir / "link-llama.gguf", "llama", n_layers=2))
    with tiny_split_route(model, tiny_dir / "link") as route:
        yield route


def greedy(urls: list[str], n: int = 6, ring: bool = True) -> list[int]:
    session = RemoteRoute(urls).open(64, GREEDY, ring=ring)
    try:
        out = [session.step(PROMPT)]
        for _ in range(n - 1):
            out.append(session.step([out[-1]]))
        return out
    finally:
        session.close()


def links_in_drop_to(url: str, want: int, deadline_s: float = 5.0) -> dict:
    """Poll ``url``'s /health until its incoming link count is ``want`` (a closed link is noticed
    asynchronously); its ``links`` then."""
    end = time.monotonic() + deadline_s
    while True:
        links = http("GET", url + "/health")[1]["links"]
        if links["in"] == want or time.monotonic() > end:
            return links
        time.sleep(0.02)


def test_route_steps_travel_over_one_link(tiny_route):
    """Every step of every session from the first node to the head goes over one WebSocket, the client's
    steps reach the first node over a link of their own (closed with the session), and the route answers as
    the whole model on one node. (Without ring decode: its head would hold a link to the first node too.)"""
    linked = links_in_drop_to(tiny_route["first"], 0)["in"]  # 0, unless a test left a client's session open
    want = greedy([tiny_route["whole"]])
    assert greedy([tiny_route["first"], tiny_route["head"]], ring=False) == want
    assert greedy([tiny_route["first"], tiny_route["head"]], ring=False) == want
    links = links_in_drop_to(tiny_route["first"], linked)  # (http_only counts next hops other tests made it try)
    assert links["in"] == linked and links["out"] == 1
    assert http("GET", tiny_route["head"] + "/health")[1]["links"]["in"] == 1
    session = RemoteRoute([tiny_route["first"], tiny_route["head"]]).open(64, GREEDY, ring=False)
    try:
        assert session.step(PROMPT) == want[0]
        assert http("GET", tiny_route["first"] + "/health")[1]["links"]["in"] == linked + 1  # the client's link
    finally:
        session.close()
    assert links_in_drop_to(tiny_route["first"], linked)["in"] == linked


def test_head_replies_straight_to_the_client(tiny_route):
    """After the first step the client holds a reply link to the head: decode replies come from the head in one
    message (telemetry.direct_replies), the tokens are the whole model's, every step's per-hop numbers still
    arrive (the route's replies, read late), and the link closes with the session."""
    want = greedy([tiny_route["whole"]])
    session = RemoteRoute([tiny_route["first"], tiny_route["head"]]).open(64, GREEDY)
    try:
        got = [session.step(PROMPT)]
        while len(got) < len(want):
            got.append(session.step([got[-1]]))
        assert got == want
        deadline = time.monotonic() + 10  # the link opens in the background: a few more steps at most
        while session.telemetry.direct_replies == 0 and time.monotonic() < deadline:
            session.step([got[-1]])
        telemetry = session.telemetry
        assert telemetry.direct_replies >= 1
        assert len(telemetry.steps) == session.step_no  # every step's per-hop numbers, direct ones included
        assert all(len(s.compute_ms) == 2 for s in telemetry.steps)
        assert http("GET", tiny_route["head"] + "/health")[1]["links"]["replies"] >= 1
    finally:
        session.close()
    deadline = time.monotonic() + 10
    while http("GET", tiny_route["head"] + "/health")[1]["links"]["replies"] and time.monotonic() < deadline:
        time.sleep(0.02)
    assert http("GET", tiny_route["head"] + "/health")[1]["links"]["replies"] == 0


def test_a_generation_is_a_coroutine_and_cancelling_it_closes_the_session(tiny_route):
    """``agenerate`` over an AsyncRouteSession runs on the caller's loop with the blocking ``generate``'s tokens;
    cancelling the task iterating it (which closes the session in its ``finally``) releases the session on
    every node."""
    from ggufswarm.artifact.gguf_file import GGUFModelFile
    from ggufswarm.client.generate import GenerationStats, agenerate, generate
    from ggufswarm.client.tokenizer import Tokenizer

    urls = [tiny_route["first"], tiny_route["head"]]
    file = GGUFModelFile(tiny_route["model"])
    tokenizer = Tokenizer(str(file.path), file.metadata)
    want = GenerationStats()
    session = RemoteRoute(urls).open(64, GREEDY)
    try:
        list(generate(session, tokenizer, PROMPT, 8, stats=want))
    finally:
        session.close()
    before = [http("GET", u + "/health")[1]["sessions"] for u in urls]

    async def run() -> GenerationStats:
        route = await RemoteRoute.connect(urls)
        got = GenerationStats()
        async with await route.aopen(64, GREEDY) as session:
            async for _ in agenerate(session, tokenizer, PROMPT, 8, stats=got):
                pass
        assert got.tokens == want.tokens
        stats = GenerationStats()

        async def generation():
            session = await route.aopen(64, GREEDY)
            try:
                async for _ in agenerate(session, tokenizer, PROMPT, 30, stats=stats):
                    pass
            finally:
                await session.close()

        task = asyncio.create_task(generation())
        while len(stats.tokens) < 3:
            await asyncio.sleep(0.001)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return stats

    stats = asyncio.run(run())
    assert 3 <= len(stats.tokens) < 30
    assert [http("GET", u + "/health")[1]["sessions"] for u in urls] == before


def test_prompt_longer_than_llama_cpps_batch(tiny_route):
    """A prompt over llama.cpp's batch (n_batch 2048 tokens) goes through a route and in process: nodes advertise
    max_step_tokens capped by it (not --max-step-tokens' 4096, which llama.cpp refused past 2048) and clients
    send the prompt in chunks of it; split and whole, in process and over HTTP, sample the same token."""
    from ggufswarm.client.local import LocalModel

    assert http("GET", tiny_route["first"] + "/health")[1]["max_step_tokens"] == 2048
    prompt = [3 + (7 * i) % 200 for i in range(2100)]
    got = []
    for urls in ([tiny_route["first"], tiny_route["head"]], [tiny_route["whole"]]):
        session = RemoteRoute(urls).open(2200, GREEDY)
        try:
            got.append(session.step(prompt))
        finally:
            session.close()
    local = LocalModel.load(tiny_route["model"], split=[1], max_length=2200, max_sessions=1, threads=1)
    got.append(local.session(2200, GREEDY).step(prompt))
    assert got[0] == got[1] == got[2]


def test_reply_link_only_from_a_head_for_an_open_session(tiny_route):
    """``GET /v1/link?replies=`` is refused by a node without the head (400), for an unknown session (404) and
    for a malformed id (400), before the upgrade."""
    import websocket

    sid = open_greedy(tiny_route["head"])
    try:
        for url, replies, status in (
            (tiny_route["first"], sid, 400),
            (tiny_route["head"], uuid.uuid4(), 404),
            (tiny_route["head"], "nope", 400),
        ):
            with pytest.raises(websocket.WebSocketBadStatusException) as err:
                websocket.create_connection(url.replace("http", "ws") + f"/v1/link?replies={replies}", timeout=10)
            assert err.value.status_code == status, (url, replies)
        ws = websocket.create_connection(
            tiny_route["head"].replace("http", "ws") + f"/v1/link?replies={sid}", timeout=10
        )
        ws.close()
    finally:
        http("DELETE", f"{tiny_route['head']}/v1/sessions/{sid}")


def test_next_hop_without_links_gets_plain_posts(tiny_route):
    """A next hop that has no /v1/link (an older node) is reached by POST /v1/step: asked for a link once."""
    seen = {"link": 0, "step": 0}
    http_only = http("GET", tiny_route["first"] + "/health")[1]["links"]["http_only"]  # other tests' fakes

    async def step(request):
        seen["step"] += 1
        frame = decode_frame(await request.read())
        return web.json_response(
            {
                "token": 7 + frame.n_tokens,
                "hops": [{"compute_ms": 0.0, "bytes_in": 0, "kv_tokens": 0, "handle_ms": 0.0}],
            }
        )

    @web.middleware
    async def count(request, handler):
        seen["link"] += request.path == "/v1/link"
        return await handler(request)

    def fake_head():
        app = web.Application(middlewares=[count])
        app.router.add_post("/v1/step", step)
        return app

    with AppThread(fake_head) as fake:
        sid = uuid.uuid4()
        status, _ = http(
            "POST", tiny_route["first"] + "/v1/sessions", {"session_id": str(sid), "max_length": 64, "next_hop": fake}
        )
        assert status == 201
        for i, ids in enumerate((PROMPT, [3], [4])):
            status, reply = http(
                "POST",
                tiny_route["first"] + "/v1/step",
                encode_tokens(sid, i + 1, 0 if i == 0 else len(PROMPT) + i - 1, ids),
            )
            assert status == 200 and reply["token"] == 7 + len(ids) and len(reply["hops"]) == 2
        assert seen == {"link": 1, "step": 3}
        assert http("GET", tiny_route["first"] + "/health")[1]["links"]["http_only"] == http_only + 1
        http("DELETE", f"{tiny_route['first']}/v1/sessions/{sid}")

        # The client's own step link falls back the same way when the first node has no links.
        async def client_link() -> FrameLink:
            async with aiohttp.ClientSession() as client:
                link = FrameLink(client, fake, 5.0)
                try:
                    for i in range(2):
                        status, body = await link.step(encode_tokens(sid, i + 1, i, [3]))
                        assert status == 200 and json.loads(body)["token"] == 8
                finally:
                    await link.close()
                return link

        link = asyncio.run(client_link())
        assert link.http_only and seen == {"link": 2, "step": 5}


def test_bad_link_messages_get_errors_and_the_node_keeps_serving(tiny_route):
    """Text, a short message, a malformed frame and an unknown session each get an error reply (keyed to the
    frame when it has a header); a message over the frame size limit closes that link only."""
    head = tiny_route["head"]

    async def talk():
        async with aiohttp.ClientSession() as client:
            ws = await client.ws_connect(head + "/v1/link")

            async def ask(send) -> tuple[bytes, int, bytes]:
                await send
                msg = await ws.receive(timeout=30)
                assert msg.type == aiohttp.WSMsgType.BINARY
                data = msg.data
                return data[:24], int.from_bytes(data[24:REPLY_HEAD], "little"), data[REPLY_HEAD:]

            key, status, body = await ask(ws.send_str("hello"))
            assert key == NO_KEY and status == 400 and b"bad_frame" in body
            key, status, body = await ask(ws.send_bytes(b"GSWF"))
            assert key == NO_KEY and status == 400 and b"bad_frame" in body
            unknown = encode_tokens(uuid.uuid4(), 1, 0, [1, 2, 3])
            key, status, body = await ask(ws.send_bytes(unknown))
            assert status == 400 and b"bad_dtype" in body and key == frame_key(unknown)  # head takes hidden states
            bad = bytearray(unknown)
            bad[4] = 99  # protocol version
            key, status, body = await ask(ws.send_bytes(bytes(bad)))
            assert status == 400 and b"unsupported_version" in body and key == frame_key(unknown)
            try:  # over max_step_tokens rows: the node drops the link as soon as it reads the length
                await ws.send_bytes(b"\0" * (HEADER_SIZE + 4096 * (256 * 4 + 4) + 2048))
            except ConnectionError:
                pass
            msg = await ws.receive(timeout=30)
            assert msg.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED, aiohttp.WSMsgType.ERROR)
            assert ws.close_code in (None, aiohttp.WSCloseCode.MESSAGE_TOO_BIG, aiohttp.WSCloseCode.ABNORMAL_CLOSURE)
            await ws.close()

    asyncio.run(talk())
    status, body = http("GET", head + "/v1/link")  # no Upgrade header: a JSON error, as every endpoint answers
    assert status == 400 and body["error"]["code"] == "bad_request" and "WebSocket" in body["error"]["message"]
    assert http("GET", head + "/health")[0] == 200
    assert greedy([tiny_route["first"], head], 3) == greedy([tiny_route["whole"]], 3)


def test_next_hop_must_be_a_bare_node_url_and_its_body_is_never_echoed(tiny_route):
    """A next_hop with a path, query, user info or no port is refused at open; a next hop that is not a node
    (here a listener answering private text) gets hop_failed without any of its body in the error."""
    first = tiny_route["first"]
    for bad in (
        "http://127.0.0.1:9/admin",
        "http://user:pw@127.0.0.1:9",
        "http://127.0.0.1:9/?x=1",
        "http://127.0.0.1",
        "ftp://127.0.0.1:9",
        "http://127.0.0.1:99999",
        "http://127.0.0.1:9#f",
    ):
        status, body = http("POST", first + "/v1/sessions", {"max_length": 64, "next_hop": bad})
        assert status == 400 and body["error"]["code"] == "bad_request", (bad, body)

    async def private(request):
        return web.Response(text="secret-internal-data", status=200 if request.method == "GET" else 500)

    def listener():
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", private)
        return app

    with AppThread(listener) as url:
        sid = uuid.uuid4()
        assert (
            http("POST", first + "/v1/sessions", {"session_id": str(sid), "max_length": 64, "next_hop": url})[0] == 201
        )
        status, body = http("POST", first + "/v1/step", encode_tokens(sid, 1, 0, PROMPT))
        assert status == 502 and body["error"]["code"] == "hop_failed" and "secret" not in json.dumps(body)
    assert http("GET", first + "/health")[0] == 200


def test_a_client_that_dies_frees_its_sessions_within_its_lease(tiny_route):
    """A session opened with a lease is dropped by every node once idle that long (not only after the
    node's 300 s session TTL); one whose client renews it, or keeps stepping, stays."""
    import time

    urls = [tiny_route["first"], tiny_route["head"]]
    before = [http("GET", u + "/health")[1]["sessions"] for u in urls]  # other tests' sessions, if any
    route = RemoteRoute(urls)
    abandoned = route.open(64, GREEDY, lease_s=1.0)
    abandoned.step(PROMPT)  # then its client "dies": no more steps, no close
    kept = route.open(64, GREEDY, lease_s=1.0)
    token = kept.step(PROMPT)
    t0 = time.monotonic()
    # the kept one renews for 1.5 s (past its 1 s lease), then steps, until the abandoned one is gone: polled (the
    # deadline only bounds a lease that never runs out), and not before both phases ran
    while time.monotonic() - t0 < 1.5 or [
        http("GET", u + "/health")[1]["sessions"] - b for u, b in zip(urls, before)
    ] != [1, 1]:
        assert time.monotonic() - t0 < 30, "the abandoned session outlived its lease"
        kept.renew() if time.monotonic() - t0 < 1.5 else None
        token = kept.step([token]) if time.monotonic() - t0 >= 1.5 else token
        time.sleep(0.2)
    assert [http("GET", u + "/health")[1]["sessions"] - b for u, b in zip(urls, before)] == [1, 1]  # the live one
    kept.close()
    status, body = http("POST", f"{urls[0]}/v1/sessions/{abandoned.id}/renew", None)
    assert status == 404 and body["error"]["code"] == "unknown_session"
    assert http("POST", urls[0] + "/v1/sessions", {"max_length": 8, "next_hop": urls[1], "lease_s": -1})[0] == 400
    abandoned.close()  # its step link to the first node stays open until then (other tests count links)


@pytest.mark.slow
def test_a_gateway_killed_mid_request_has_its_sessions_freed_within_its_lease(tiny_route, tmp_path):
    """A gateway process killed (SIGKILL) while it streams closes nothing; every node drops its session once
    idle for the gateway's lease (``gateway --session-lease``, default 30 s; 5 s here), long before the nodes' 300 s
    session TTL."""
    import subprocess
    import sys
    from http.client import HTTPConnection

    from ggufswarm.gateway import GatewayConfig

    assert GatewayConfig([]).session_lease_s == 30
    lease = 5.0
    urls = [tiny_route["first"], tiny_route["head"]]
    assert all(http("GET", u + "/health")[1]["session_ttl_s"] >= 300 for u in urls)
    before = [http("GET", u + "/health")[1]["sessions"] for u in urls]  # other tests' sessions, if any
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "ggufswarm.cli",
            "gateway",
            "--route",
            ",".join(urls),
            "--port",
            "0",
            "--data-dir",
            str(tmp_path),
            "--session-lease",
            str(lease),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        stdin=subprocess.DEVNULL,
        text=True,
    )
    try:
        line = proc.stdout.readline()
        assert line.startswith("ggufswarm gateway ready: "), line
        base = line.split()[3].rsplit("/v1", 1)[0]
        host, port = base.split("//", 1)[1].rsplit(":", 1)
        conn = HTTPConnection(host, int(port), timeout=60)
        conn.request(
            "POST",
            "/v1/completions",
            json.dumps({"prompt": "a b c d", "max_tokens": 10**6, "temperature": 0, "stream": True}),
            {"Content-Type": "application/json"},
        )
        resp = conn.getresponse()
        assert resp.status == 200
        assert resp.readline().startswith(b"data: ")
        assert [http("GET", u + "/health")[1]["sessions"] - b for u, b in zip(urls, before)] == [1, 1]
        proc.kill()
        proc.wait(timeout=30)
        t0 = time.monotonic()
        # polled; the bound is the lease plus the reaper's round and a loaded machine's slack, far below the TTL
        while [http("GET", u + "/health")[1]["sessions"] for u in urls] != before:
            assert time.monotonic() - t0 < lease + 30, "the dead gateway's session outlived its lease"
            time.sleep(0.5)
        conn.close()
    finally:
        proc.kill()
        proc.wait(timeout=30)


def test_a_repair_that_fails_halfway_is_recorded(tiny_route):
    """Telemetry lists every repair attempt: one whose replacement fails while restoring (recorded with its
    error), then the one that finds no replacement left."""
    from dataclasses import replace

    from ggufswarm.protocol.errors import RouteError

    async def opened(request):
        return web.json_response({"session_id": (await request.json())["session_id"]}, status=201)

    async def broken(request):
        return web.json_response({"error": {"code": "internal", "message": "disk on fire"}}, status=500)

    async def closed(request):
        return web.json_response({"closed": True})

    def spare_app():
        app = web.Application()
        app.router.add_post("/v1/sessions", opened)
        app.router.add_post("/v1/sessions/{sid}/restore", broken)
        app.router.add_delete("/v1/sessions/{sid}", closed)
        return app

    with AppThread(spare_app) as fake:
        route = RemoteRoute([tiny_route["first"], tiny_route["head"]])
        spare = RemoteRoute.of_hops([replace(route.hops[1], url=fake)], 30.0, part=True)

        def replan(exclude, span):
            if fake in exclude:
                raise RouteError("no_route", f"no node serves layers {span[0]}:{span[1]} any more", 503)
            return spare

        # no ring decode: the node that loses the session below could otherwise have run the next step already
        session = route.open(64, GREEDY, replan=replan, ring=False)
        try:
            token = session.step(PROMPT)
            http("DELETE", f"{tiny_route['head']}/v1/sessions/{session.id}")  # the head lost the session
            with pytest.raises(RouteError) as err:
                session.step([token])
            assert err.value.code == "no_replacement"
            first, last = session.telemetry.repairs
            assert first["hop"] == tiny_route["head"] and first["replacement"] == [fake]
            assert "disk on fire" in first["error"] and first["tokens_replayed"] == 0
            assert last["hop"] == fake and last["replacement"] is None and "any more" in last["error"]
        finally:
            session.close()


def test_a_repair_whose_replay_fails_halfway_records_the_tokens_it_replayed(tiny_route):
    """A replacement head that opens and restores, answers the first replayed step (the prompt) and fails the
    next: that repair is listed with the tokens it actually replayed and the replay's error, and the next repair
    (back to the first head, healthy again) replays the whole history; the text is unchanged."""
    from dataclasses import replace

    from ggufswarm.protocol.errors import RouteError

    steps = []

    async def opened(request):
        return web.json_response({"session_id": (await request.json())["session_id"]}, status=201)

    async def restored(request):
        return web.json_response({"length": 0, "boundaries": [0]})

    async def truncated(request):
        return web.json_response({"length": 0})

    async def step(request):
        frame = decode_frame(await request.read())
        steps.append(frame.n_tokens)
        if len(steps) > 1:
            return web.json_response({"error": {"code": "internal", "message": "disk on fire"}}, status=500)
        return web.json_response(
            {"token": None, "hops": [{"compute_ms": 0.0, "bytes_in": 0, "kv_tokens": 0, "handle_ms": 0.0}]}
        )

    async def closed(request):
        return web.json_response({"closed": True})

    def flaky_head():
        app = web.Application(client_max_size=64 << 20)
        app.router.add_post("/v1/sessions", opened)
        app.router.add_post("/v1/sessions/{sid}/restore", restored)
        app.router.add_post("/v1/sessions/{sid}/truncate", truncated)
        app.router.add_delete("/v1/sessions/{sid}", closed)
        app.router.add_post("/v1/step", step)
        return app

    first, head = tiny_route["first"], tiny_route["head"]
    with AppThread(flaky_head) as fake:
        route = RemoteRoute([first, head])
        spare = RemoteRoute.of_hops([replace(route.hops[1], url=fake)], 30.0, part=True)

        def replan(exclude, span):
            if fake not in exclude:
                return spare
            if head not in exclude:
                return RemoteRoute([head], 30.0, part=True)
            raise RouteError("no_route", f"no node serves layers {span[0]}:{span[1]} but those excluded", 503)

        want = greedy([tiny_route["whole"]], n=4)
        # no ring decode: the head would have sent the 4th step itself before it lost the session
        session = route.open(64, GREEDY, replan=replan, ring=False)
        try:
            out = [session.step(PROMPT)]
            out.append(session.step([out[-1]]))
            out.append(session.step([out[-1]]))
            http("DELETE", f"{head}/v1/sessions/{session.id}")  # the head lost the session
            out.append(session.step([out[-1]]))
        finally:
            session.close()
        assert out == want
        assert steps == [len(PROMPT), 1]  # the fake got the prompt, then failed the first decode step's replay
        flaky, back = session.telemetry.repairs
        assert (flaky["hop"], flaky["replacement"], back["hop"], back["replacement"]) == (head, [fake], fake, [head])
        assert flaky["restored_tokens"] == 0 and flaky["tokens_replayed"] == len(PROMPT)
        assert "replay failed" in flaky["error"] and "disk on fire" in flaky["error"]
        assert back["restored_tokens"] == 0 and back["tokens_replayed"] == len(PROMPT) + 2 and "error" not in back


def test_a_node_excluded_by_one_repair_can_replace_a_later_failure(tiny_route, tiny_dir):
    """The head fails (the session moves to a second head), then the second head fails too: the session goes
    back to the first head, which serves again, instead of ending with no_replacement; the text is unchanged."""
    from ggufswarm.protocol.errors import RouteError

    first, head = tiny_route["first"], tiny_route["head"]
    with AppThread(
        lambda: make_node_app(
            NodeConfig(layers="1:2", head=True, model=tiny_route["model"], data_dir=str(tiny_dir / "n3"))
        )
    ) as head2:
        asked = []

        def replan(exclude, span):
            asked.append(set(exclude))
            for url in (head, head2):
                if url not in exclude:
                    return RemoteRoute([url], 30.0, part=True)
            raise RouteError("no_route", f"no node serves layers {span[0]}:{span[1]} but those excluded", 503)

        want = greedy([tiny_route["whole"]], n=4)
        # no ring decode: the node that loses the session below could otherwise have run the next step already
        session = RemoteRoute([first, head]).open(64, GREEDY, replan=replan, ring=False)
        try:
            out = [session.step(PROMPT)]
            for lost in (head, head2, None):
                if lost is not None:
                    http("DELETE", f"{lost}/v1/sessions/{session.id}")  # that node lost the session
                out.append(session.step([out[-1]]))
        finally:
            session.close()
        assert out == want
        assert [(r["hop"], r["replacement"]) for r in session.telemetry.repairs] == [(head, [head2]), (head2, [head])]
        assert asked == [{head}, {head, head2}, {head2}]


def test_with_no_spare_for_the_failed_span_the_whole_route_is_replanned(tiny_route):
    """No node serves the failed head's layers alone, but one serves the whole model: the repair re-plans the
    whole route onto it (replaced_layers: all of them), releases the session on the first node, which the new
    route leaves out, and the text is unchanged (f32 frames). With no plan for either, the error is the one for
    the failed layers."""
    from ggufswarm.protocol.errors import RouteError

    first, head, whole = tiny_route["first"], tiny_route["head"], tiny_route["whole"]
    asked = []

    def replan(exclude, span):
        asked.append((set(exclude), span))
        if span == (0, 2) and whole not in exclude:
            return RemoteRoute([whole], 30.0, part=True)
        raise RouteError("no_route", f"no node serves layers {span[0]}:{span[1]}", 503)

    want = greedy([whole], n=4)
    # no ring decode: the node that loses the session below could otherwise have run the next step already
    session = RemoteRoute([first, head]).open(64, GREEDY, replan=replan, ring=False)
    try:
        out = [session.step(PROMPT)]
        http("DELETE", f"{head}/v1/sessions/{session.id}")  # the head lost the session
        for _ in range(3):
            out.append(session.step([out[-1]]))
        assert [h.url for h in session.route.hops] == [whole]
        assert http("DELETE", f"{first}/v1/sessions/{session.id}")[0] == 404  # released by the repair
        [repair] = session.telemetry.repairs
        assert repair["layers"] == [1, 2] and repair["replaced_layers"] == [0, 2] and repair["replacement"] == [whole]
        assert asked == [({head}, (1, 2)), ({head}, (0, 2))]
        http("DELETE", f"{whole}/v1/sessions/{session.id}")  # now the whole-model node loses it: nothing is left
        with pytest.raises(RouteError, match="no node serves layers 0:2") as err:
            session.step([out[-1]])
        assert err.value.code == "no_replacement"
    finally:
        session.close()
    assert out == want


def test_a_repair_onto_a_node_of_other_numerics_continues_coherently(tiny_route, tiny_dir):
    """A head fails and its layers go to a node whose numerics differ: here the torch backend (f32 dequantized
    weights, its own kernels), standing for a llama.cpp node of another CPU kind (whose AVX2 / AVX-512 kernels round
    differently). The stream goes on without an error, nothing lost or repeated: the tokens before the failure are
    llama.cpp's, and every token after it is the one the new route gives for the same history fed in the same steps
    (checked by teacher forcing on a fresh session of that route): a coherent continuation, which from that point
    may differ from an uninterrupted run."""
    first, head, model = tiny_route["first"], tiny_route["head"], tiny_route["model"]
    with AppThread(
        lambda: make_node_app(
            NodeConfig(
                layers="1:2", head=True, model=model, backend="torch", data_dir=str(tiny_dir / "link-torch-head")
            )
        )
    ) as other:

        def replan(exclude, span):
            assert span == (1, 2) and head in exclude
            return RemoteRoute([other], 30.0, part=True)

        n = 6
        want = greedy([first, head], n=n)
        # no ring decode: the node that loses the session below could otherwise have run the next step already
        session = RemoteRoute([first, head]).open(64, GREEDY, replan=replan, ring=False)
        try:
            out = [session.step(PROMPT), session.step([want[0]])]
            http("DELETE", f"{head}/v1/sessions/{session.id}")  # the head lost the session
            while len(out) < n:
                out.append(session.step([out[-1]]))
            [repair] = session.telemetry.repairs
            assert repair["replacement"] == [other] and "error" not in repair, repair
        finally:
            session.close()
        assert out[:2] == want[:2]
        forced = RemoteRoute([first, other]).open(64, GREEDY)
        try:  # the same steps: the prompt, then one token at a time
            forced.step(PROMPT)
            after = [forced.step([t]) for t in out[:-1]]
        finally:
            forced.close()
        assert out[2:] == after[1:], (out, after)


def test_hop_timeouts_grow_with_the_frame(tiny_route):
    """A node waits ``hop_timeout_s`` for its next hop's answer to a decode step, and proportionally longer for a
    prefill chunk (x4 for 2048 tokens): a next hop that takes 2 s times out a 1-token step with a 1 s hop
    timeout, and answers a 2048-token one in time."""

    async def slow_step(request):
        frame = decode_frame(await request.read())
        await asyncio.sleep(2.0)
        return web.json_response(
            {"token": frame.n_tokens, "hops": [{"compute_ms": 0.0, "bytes_in": 0, "kv_tokens": 0, "handle_ms": 0.0}]}
        )

    def slow_head():
        app = web.Application(client_max_size=64 << 20)
        app.router.add_post("/v1/step", slow_step)
        return app

    with AppThread(slow_head) as slow:
        first = tiny_route["first"]
        sid = uuid.uuid4()
        assert (
            http(
                "POST",
                first + "/v1/sessions",
                {"session_id": str(sid), "max_length": 4096, "next_hop": slow, "hop_timeout_s": 1.0},
            )[0]
            == 201
        )
        try:
            status, body = http("POST", first + "/v1/step", encode_tokens(sid, 1, 0, [5]))
            assert status == 504 and body["error"]["code"] == "hop_timeout" and "1 s" in body["error"]["message"]
            http("POST", f"{first}/v1/sessions/{sid}/truncate", {"length": 0})
            status, body = http(
                "POST", first + "/v1/step", encode_tokens(sid, 2, 0, [5 + i % 300 for i in range(2048)])
            )
            assert status == 200 and body["token"] == 2048, body
        finally:
            http("DELETE", f"{first}/v1/sessions/{sid}")


def test_one_model_end_to_end(tiny_route, tiny_dir):
    """Every node says which model it serves (the GGUF header fingerprint, /health and GET /v1/model, with its
    headers to fetch); a route over nodes of two models is refused naming both; an open for another model
    gets 409 model_mismatch and the node keeps serving."""
    from ggufswarm.artifact.gguf_file import GGUFModelFile

    first, head = tiny_route["first"], tiny_route["head"]
    model = GGUFModelFile(tiny_route["model"])
    health = http("GET", first + "/health")[1]
    assert health["model_fingerprint"] == model.fingerprint and health["model_name"] == "link-llama"
    status, info = http("GET", first + "/v1/model")
    assert status == 200 and info["fingerprint"] == model.fingerprint and info["n_layers"] == 2
    [file] = info["files"]
    assert file["bytes"] == model.path.stat().st_size and file["header_bytes"] == model.header_sizes[0]
    with urllib.request.urlopen(first + "/v1/model/header/0", timeout=10) as r:
        assert r.read() == model.path.read_bytes()[: file["header_bytes"]]
    assert http("GET", first + "/v1/model/header/1")[0] == 404

    other = write_tiny_model(tiny_dir / "other-llama.gguf", "llama", n_layers=2, context_length=2048)
    assert GGUFModelFile(other).fingerprint != model.fingerprint
    with AppThread(
        lambda: make_node_app(NodeConfig(layers="1:2", head=True, model=str(other), data_dir=str(tiny_dir / "n4")))
    ) as stranger:
        with pytest.raises(ValueError, match=r"serves other-llama .* not link-llama"):
            RemoteRoute([first, stranger])
        status, body = http("POST", stranger + "/v1/sessions", {"max_length": 8, "model": model.fingerprint})
        assert status == 409 and body["error"]["code"] == "model_mismatch" and "other-llama" in body["error"]["message"]
    route = RemoteRoute([first, head], model=model.fingerprint)
    assert route.model == model.fingerprint and greedy([first, head]) == greedy([tiny_route["whole"]])
    with pytest.raises(ValueError, match="a route serves one model"):
        RemoteRoute([first, head], model="0" * 64)


def test_a_gateway_given_only_a_route_serves_the_route_s_model(tiny_route, tmp_path, gemma_path):
    """``gateway --route`` without ``--model`` takes the model (vocabulary, name) from the route's nodes; with a
    ``--model`` the nodes don't serve, the start-up check and every request say which models differ."""
    from ggufswarm.gateway import GatewayConfig, make_app
    from ggufswarm.gateway.serve import check_route
    from ggufswarm.net.http import ServerThread

    urls = [tiny_route["first"], tiny_route["head"]]
    assert check_route(GatewayConfig(route=urls)).model == http("GET", urls[0] + "/health")[1]["model_fingerprint"]
    with pytest.raises(ValueError, match=r"bad route: .*serves link-llama .*--model gemma-3-270m-q4_k_m\.gguf"):
        check_route(GatewayConfig(route=urls, model=str(gemma_path)))
    with pytest.raises(ValueError, match="bad route: route must start at layer 0"):
        check_route(GatewayConfig(route=urls[::-1]))
    with pytest.raises(ValueError, match="bad route: route must start at layer 0 .* and end at layer 2 with the head"):
        check_route(GatewayConfig(route=urls[:1]))  # coverage: layer 1 and the head missing
    # the token: a route of nodes that require one is refused at start, naming the fix, and checked with it
    with AppThread(
        lambda: make_node_app(
            NodeConfig(
                layers="0:2",
                embed=True,
                head=True,
                model=tiny_route["model"],
                token="route-t0ken",
                data_dir=str(tmp_path / "tok"),
            )
        )
    ) as locked:
        for token in (None, "wrong"):
            with pytest.raises(ValueError, match=r"bad route: .*give the nodes' --token"):
                check_route(GatewayConfig(route=[locked], token=token), every_s=0.01)
        assert check_route(GatewayConfig(route=[locked], token="route-t0ken")).hops[0].url == locked

    server = ServerThread(make_app(GatewayConfig(route=urls, data_dir=str(tmp_path))))
    base = server.start()
    try:
        assert [m["id"] for m in http("GET", base + "/v1/models")[1]["data"]] == ["link-llama"]
        status, body = http(
            "POST",
            base + "/v1/completions",
            {"model": "link-llama", "prompt": "a b c d", "max_tokens": 4, "temperature": 0},
        )
        assert status == 200 and body["usage"]["prompt_tokens"] > 0, body
        assert list((tmp_path / "models").iterdir())  # the headers fetched from the first node
    finally:
        server.stop()
    server = ServerThread(make_app(GatewayConfig(route=urls, model=str(gemma_path))))
    base = server.start()
    try:
        status, body = http("POST", base + "/v1/completions", {"prompt": "Hello", "max_tokens": 2})
        assert status == 502 and "link-llama" in body["error"]["message"] and "gemma" in body["error"]["message"]
    finally:
        server.stop()


def test_a_session_opens_every_node_at_once_and_waits_head_first_for_a_full_node(tiny_route, tiny_dir):
    """Opens go to all nodes at once; when the head has no free session slot the opened ones are released and
    the session waits for the slot head first (no node is held while waiting), then runs as usual."""
    import threading

    first = tiny_route["first"]
    with AppThread(
        lambda: make_node_app(
            NodeConfig(
                layers="1:2", head=True, model=tiny_route["model"], max_sessions=1, data_dir=str(tiny_dir / "n5")
            )
        )
    ) as head:
        want = greedy([tiny_route["whole"]], n=3)
        before = http("GET", first + "/health")[1]["sessions"]
        holder = RemoteRoute([first, head]).open(64, GREEDY)  # takes the head's only slot
        assert http("GET", first + "/health")[1]["sessions"] == before + 1
        refused = http("GET", head + "/health")[1]["errors"]
        result = {}
        waiter = threading.Thread(target=lambda: result.setdefault("out", greedy([first, head], n=3)))
        waiter.start()
        # once the head has refused it (kv_budget_full), the waiting session holds nothing on the first node
        deadline = time.monotonic() + 30
        while (
            http("GET", head + "/health")[1]["errors"] == refused
            or http("GET", first + "/health")[1]["sessions"] != before + 1
        ):
            assert time.monotonic() < deadline, "the waiting session was never refused, or kept the first node"
            time.sleep(0.05)
        assert waiter.is_alive() and http("GET", first + "/health")[1]["sessions"] == before + 1
        holder.close()
        waiter.join(30)
        assert result["out"] == want


def test_an_unread_body_ends_the_connection_in_words(tiny_route):
    """A request whose body the endpoint never reads (renew takes none), here an undecodable gzip body: the
    answer says ``Connection: close`` rather than the node dropping a keep-alive connection without a word;
    a request with a normal body keeps the connection."""
    import http.client
    from urllib.parse import urlsplit

    parts = urlsplit(tiny_route["first"])
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=10)
    try:
        conn.request(
            "POST",
            f"/v1/sessions/{uuid.uuid4()}/renew",
            body=b"\x00garbage" * 8,
            headers={"Content-Encoding": "gzip", "Content-Type": "application/json"},
        )
        resp = conn.getresponse()
        body = json.loads(resp.read())
        assert resp.status == 404 and body["error"]["code"] == "unknown_session"
        assert resp.getheader("Connection", "").lower() == "close"
    finally:
        conn.close()
    whole = urlsplit(tiny_route["whole"])
    conn = http.client.HTTPConnection(whole.hostname, whole.port, timeout=10)
    try:
        for _ in range(2):  # a body that is read: the same connection serves the next request
            conn.request(
                "POST", "/v1/sessions", body=json.dumps({"max_length": 8}), headers={"Content-Type": "application/json"}
            )
            resp = conn.getresponse()
            sid = json.loads(resp.read())["session_id"]
            assert resp.status == 201 and resp.getheader("Connection", "").lower() != "close"
            conn.request("DELETE", f"/v1/sessions/{sid}")
            resp = conn.getresponse()
            assert resp.status == 200 and resp.read()
    finally:
        conn.close()


def test_a_step_longer_than_the_lease_keeps_the_session_on_later_nodes(tiny_route, monkeypatch):
    """A gateway's sessions hold a short lease (nodes drop a session idle that long). A prefill that takes longer
    than the lease on the first node leaves the head idle meanwhile: the client's keeper renews the lease on every
    node while the step is in flight, so the head still holds the session when the step reaches it (it answered
    unknown_session before: prompts past ~1800 tokens failed on a loaded machine)."""
    from ggufswarm.runtime.llamacpp.backend import LlamaCppShard

    forward = LlamaCppShard.forward

    def slow_first_prefill(self, kv, inputs, logits="last"):
        if self.spec.start == 0 and not self.spec.head and inputs.shape[0] > 1:
            time.sleep(2.5)
        return forward(self, kv, inputs, logits)

    monkeypatch.setattr(LlamaCppShard, "forward", slow_first_prefill)
    route = RemoteRoute([tiny_route["first"], tiny_route["head"]])
    session = route.open(64, GREEDY, lease_s=0.9)
    try:
        first = session.step(PROMPT)
        assert [first] + [session.step([first])] == greedy([tiny_route["whole"]], 2)
    finally:
        session.close()
