"""The relay (net/relay.py) carries HTTP and websockets to a node that accepts no inbound connection, and the
dial-back check (net/reach.py) tells a node whether it is reachable: loopback only."""

from __future__ import annotations

import asyncio
import os
import socket

import aiohttp
import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry

from ggufswarm.net.auth import auth_headers, token_middleware
from ggufswarm.net.http import json_errors_middleware
from ggufswarm.net.reach import (
    PROBE_PATH,
    ReachError,
    add_dialback_route,
    add_probe_route,
    check_reachable,
    skip_public_paths,
)
from ggufswarm.net.relay import RelayError, add_relay_routes
from ggufswarm.net.relay_client import RelayClient

TOKEN = "relay-test-token"
BIG = os.urandom(32 * 2**20)
pytestmark = pytest.mark.timeout(60)


def run(coro, timeout: float = 20.0):
    return asyncio.run(asyncio.wait_for(coro, timeout))


def echo_app() -> web.Application:
    """The 'node' behind NAT: plain HTTP and a websocket echo."""

    async def hello(_req):
        return web.json_response({"hello": "world"})

    async def echo(req):
        return web.Response(body=await req.read(), content_type="application/octet-stream")

    async def ws_echo(req):
        ws = web.WebSocketResponse()
        await ws.prepare(req)
        async for msg in ws:
            if msg.type == aiohttp.WSMsgType.BINARY:
                await ws.send_bytes(msg.data)
            elif msg.type == aiohttp.WSMsgType.TEXT:
                await ws.send_str(msg.data)
        return ws

    async def big(_req):
        return web.Response(body=BIG)

    app = web.Application(client_max_size=8 * 2**20)
    app.router.add_get("/big", big)
    app.router.add_get("/hello", hello)
    app.router.add_get("/health", hello)
    app.router.add_post("/echo", echo)
    app.router.add_get("/ws", ws_echo)
    add_probe_route(app)
    return app


def relay_app(rate_per_min: int = 10, registry=None):
    app = web.Application(middlewares=[skip_public_paths(token_middleware(TOKEN)), json_errors_middleware()])
    relay = add_relay_routes(app, "127.0.0.1", "127.0.0.1", registry=registry)
    add_dialback_route(app, timeout_s=1.0, rate_per_min=rate_per_min)
    add_probe_route(app)
    return app, relay


async def serve(app: web.Application, port: int = 0) -> tuple[web.AppRunner, int]:
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, runner.addresses[0][1]


async def until(cond, timeout: float = 5.0):
    for _ in range(int(timeout / 0.02)):
        if cond():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("condition not reached")


def refused(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


class Setup:
    """A node app, a relay app and a relay client attached, on one loop."""

    async def __aenter__(self):
        self.node, self.node_port = await serve(echo_app())
        self.registry = CollectorRegistry()
        app, self.relay = relay_app(registry=self.registry)
        self.relay_runner, self.relay_port = await serve(app)
        self.relay_url = f"http://127.0.0.1:{self.relay_port}"
        self.http = aiohttp.ClientSession()
        self.client = RelayClient(self.relay_url, self.node_port, TOKEN, min_backoff_s=0.05)
        host, port = await self.client.start(self.http)
        self.url = f"http://{host}:{port}"
        return self

    async def __aexit__(self, *exc):
        await self.client.close()
        await self.http.close()
        await self.relay_runner.cleanup()
        await self.node.cleanup()


def test_http_and_websockets_through_the_relay_equal_direct():
    async def main():
        async with Setup() as s:
            direct = f"http://127.0.0.1:{s.node_port}"
            assert s.url != direct
            for base in (direct, s.url):
                async with s.http.get(base + "/hello") as r:
                    assert r.status == 200 and await r.json() == {"hello": "world"}
            body = os.urandom(2**20)
            async with s.http.post(s.url + "/echo", data=body) as r:
                assert r.status == 200 and await r.read() == body
            async with s.http.ws_connect(s.url + "/ws") as ws:
                for size in (1, 1000, 300_000):
                    blob = os.urandom(size)
                    await ws.send_bytes(blob)
                    assert (await ws.receive(timeout=5)).data == blob
                await ws.send_str("text too")
                assert (await ws.receive(timeout=5)).data == "text too"

            async def one(i):
                data = os.urandom(1000 + i * 5000)
                async with aiohttp.ClientSession() as fresh:  # one connection, so one stream, each
                    async with fresh.post(s.url + "/echo", data=data) as r:
                        return await r.read() == data

            assert all(await asyncio.gather(*(one(i) for i in range(20))))
            stats = s.relay.stats()
            assert len(stats["clients"]) == 1 and stats["clients"][0]["port"] == int(s.url.rsplit(":", 1)[1])
            assert stats["bytes_in"] >= 2**20 and stats["bytes_out"] >= 2**20
            assert s.client.bytes_in == stats["bytes_in"] and s.client.bytes_out == stats["bytes_out"]
            for direction in ("in", "out"):
                counted = s.registry.get_sample_value("ggufswarm_relay_bytes_total", {"direction": direction})
                assert counted == stats[f"bytes_{direction}"]

    run(main())


def test_a_stalled_reader_holds_back_only_its_own_stream():
    async def main():
        async with Setup() as s:
            host, port = s.client.address
            reader, writer = await asyncio.open_connection(host, port)
            writer.write(b"GET /big HTTP/1.1\r\nHost: x\r\n\r\n")  # 32 MiB answer, not read for now
            await until(lambda: s.relay.stats()["bytes_out"] > 2**20)
            await asyncio.sleep(0.2)
            stalled = s.relay.stats()["bytes_out"]
            assert stalled < 16 * 2**20  # the window (1 MiB) and the sockets' buffers bound what is in flight
            for _ in range(5):
                async with s.http.get(s.url + "/hello") as r:
                    assert r.status == 200
            head = await reader.readuntil(b"\r\n\r\n")
            assert b"200 OK" in head
            assert await reader.readexactly(len(BIG)) == BIG
            writer.close()

    run(main())


def test_a_detached_client_loses_its_port():
    async def main():
        async with Setup() as s:
            port = int(s.url.rsplit(":", 1)[1])
            async with s.http.get(s.url + "/hello") as r:
                assert r.status == 200
            assert not refused(port)
            await s.client.close()
            await until(lambda: not s.relay.stats()["clients"])
            assert refused(port)

    run(main())


def test_the_client_reattaches_after_the_relay_restarts():
    async def main():
        async with Setup() as s:
            moved = asyncio.Event()
            seen = []

            async def on_address(host, port):
                seen.append((host, port))
                moved.set()

            s.client.on_address = on_address
            old = s.client.address
            await s.relay_runner.cleanup()
            await until(lambda: not s.client.attached)
            app, s.relay = relay_app()
            s.relay_runner, _ = await serve(app, s.relay_port)
            await asyncio.wait_for(moved.wait(), 10)
            assert s.client.attached and seen == [s.client.address] and s.client.address != old
            async with s.http.get("http://{}:{}/hello".format(*s.client.address)) as r:
                assert r.status == 200 and await r.json() == {"hello": "world"}

    run(main())


def test_a_malformed_message_closes_only_its_attachment():
    async def main():
        async with Setup() as s:
            for bad in (b"\x00", b"\x00\x00\x00\x01\x09", b"\x00\x00\x00\x01\x01"):  # short, unknown op, OPEN
                ws = await s.http.ws_connect(s.relay_url + "/v1/relay/attach", headers=auth_headers(TOKEN))
                addr = await ws.receive_json(timeout=5)
                await until(lambda: len(s.relay.stats()["clients"]) == 2)
                await ws.send_bytes(bad)
                msg = await ws.receive(timeout=5)
                assert msg.type == aiohttp.WSMsgType.CLOSE and msg.data == aiohttp.WSCloseCode.PROTOCOL_ERROR
                await ws.close()
                await until(lambda: len(s.relay.stats()["clients"]) == 1)
                assert refused(addr["port"])
            async with s.http.get(s.url + "/hello") as r:
                assert r.status == 200 and s.client.attached

    run(main())


def test_attach_refusals_are_clear():
    async def main():
        async with Setup() as s:
            async with aiohttp.ClientSession() as http:
                with pytest.raises(RelayError, match="token"):
                    await RelayClient(s.relay_url, s.node_port, "wrong").start(http)
                s.relay.max_clients = 1
                with pytest.raises(RelayError, match="full"):
                    await RelayClient(s.relay_url, s.node_port, TOKEN).start(http)
                with pytest.raises(RelayError, match="no relay"):
                    await RelayClient(f"http://127.0.0.1:{s.node_port}", 1, TOKEN).start(http)
                with pytest.raises(RelayError, match="cannot reach"):
                    await RelayClient("http://127.0.0.1:1", 1, TOKEN).start(http, timeout=2)

    run(main())


def test_dialback():
    async def main():
        node, node_port = await serve(echo_app())
        app, _ = relay_app(rate_per_min=4)
        runner, helper_port = await serve(app)
        helper = f"http://127.0.0.1:{helper_port}"
        try:
            async with aiohttp.ClientSession() as http:
                ok = await check_reachable(http, helper, node_port, TOKEN)
                assert ok.reachable and ok.status == 200 and ok.observed_ip == "127.0.0.1" and ok.error is None
                with socket.socket() as sock:  # a port nobody listens on
                    sock.bind(("127.0.0.1", 0))
                    closed = sock.getsockname()[1]
                no = await check_reachable(http, helper, closed, TOKEN)
                assert not no.reachable and no.status is None and "refused" in no.error
                for body in ({"port": 0}, {"port": 70000}, {"port": "80"}, {"port": 80, "path": "/v1/sessions"}):
                    body["host"] = "127.0.0.1"
                    async with http.post(helper + "/v1/reach/dialback", json=body, headers=auth_headers(TOKEN)) as r:
                        assert r.status == 400 and (await r.json())["error"]["code"] == "bad_request"
                async with http.post(
                    helper + "/v1/reach/dialback", json={"port": 80, "host": "10.1.2.3"}, headers=auth_headers(TOKEN)
                ) as r:
                    assert r.status == 400
                await check_reachable(http, helper, node_port, TOKEN, path="/health")
                await check_reachable(http, helper, node_port, TOKEN)
                with pytest.raises(ReachError) as err:  # the 5th a minute
                    await check_reachable(http, helper, node_port, TOKEN)
                assert err.value.status == 429
                with pytest.raises(ReachError, match="cannot reach"):
                    await check_reachable(http, "http://127.0.0.1:1", node_port, TOKEN)
        finally:
            await runner.cleanup()
            await node.cleanup()

    run(main())


def test_only_the_probe_path_is_open_without_the_token():
    async def main():
        app, _ = relay_app()
        runner, port = await serve(app)
        base = f"http://127.0.0.1:{port}"
        try:
            async with aiohttp.ClientSession() as http:
                async with http.get(base + PROBE_PATH) as r:
                    assert r.status == 200 and await r.json() == {"ok": True}
                async with http.post(base + "/v1/reach/dialback", json={"port": 80}) as r:
                    assert r.status == 401
                async with http.get(base + "/v1/relay/attach") as r:
                    assert r.status == 401
                with pytest.raises(ReachError) as err:
                    await check_reachable(http, base, 80, None)
                assert err.value.status == 401
        finally:
            await runner.cleanup()

    run(main())
