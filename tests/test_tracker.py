"""Tracker: registry with TTL and restarts, manifests, BitTorrent announce for libtorrent peers, routes, status page."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.request

import pytest
from apphost import AppThread
from identities import ad_of, deregister_path, identity, key, signed_ad
from tinymodels import write_tiny_model

from ggufswarm.artifact.manifest import Manifest
from ggufswarm.directory.routing import Advertisement
from ggufswarm.swarm.torrent import Swarm, make_torrent
from ggufswarm.tracker.app import TrackerConfig, make_app
from ggufswarm.tracker.registry import Registry


def call(url, method="GET", body=None):
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def beat(url, node, layers, n=4, sign=True, **kw):
    body = ad_of(node, None, layers, n, **kw)
    return call(f"{url}/nodes/heartbeat", "POST", signed_ad(body) if sign else body)


def test_registry_survives_restart_and_expires_stale_nodes(tmp_path):
    db = tmp_path / "t.sqlite"
    reg = Registry(db, ttl_s=10)
    reg.heartbeat(Advertisement("a", "http://a", "m", (0, 4), True, True, "ready", 100, 1.0), now=1000.0)
    reg.heartbeat(Advertisement("b", "http://b", "m", (0, 4), True, True, "ready", 100, 1.0), now=1008.0)
    reg.put_manifest("m", "{}", b"torrent", "ab" * 20)
    reg.close()
    reg = Registry(db, ttl_s=10)
    assert [a.node_id for a in reg.nodes(now=1009.0)] == ["a", "b"]
    assert reg.manifest("m") == ("{}", b"torrent")
    assert [a.node_id for a in reg.nodes(now=1015.0)] == ["b"]  # a's TTL ran out


@pytest.fixture(scope="module")
def tiny_artifact(tiny_dir):
    path = write_tiny_model(tiny_dir / "tracker-tiny.gguf", "llama", n_layers=4)
    return path, Manifest.from_gguf(path, name="tiny")


def test_routes_follow_heartbeats(tmp_path, tiny_artifact):
    path, manifest = tiny_artifact
    with AppThread(lambda: make_app(TrackerConfig(db=str(tmp_path / "t.sqlite"), ttl_s=1.5))) as url:
        status, _ = call(
            f"{url}/manifests/tiny",
            "PUT",
            {"manifest": json.loads(manifest.to_json()), "torrent_hex": make_torrent([path]).hex()},
        )
        assert status == 200
        status, body = call(f"{url}/route?model=tiny&max_length=64")
        assert (
            status == 503
            and body["error"]["code"] == "no_route"
            and "layers 0:4 are not served" in body["error"]["message"]
        )
        beat(url, "a", (0, 2))
        status, body = call(f"{url}/route?model=tiny&max_length=64")
        assert status == 503 and "layers 2:4 are not served" in body["error"]["message"]
        sent_b = time.time()  # the registry's clock; b's heartbeat arrives no earlier
        beat(url, "b", (2, 4))
        status, body = call(f"{url}/route?model=tiny&max_length=64")
        assert status == 200 and [h["node_id"] for h in body["route"]] == [key("a"), key("b")]
        assert call(f"{url}/models")[1]["models"] == ["tiny"]
        assert call(f"{url}/nodes/heartbeat", "POST", signed_ad({"node_id": "x"}))[0] == 400  # signed, no fields
        assert call(f"{url}/route?model=nope")[0] == 404
        # no heartbeats: both expire, and not before the TTL (1.5 s) since their last heartbeat. Polled; the
        # deadline only bounds a tracker that never expires them
        deadline = time.monotonic() + 30
        while call(f"{url}/nodes?model=tiny")[1]["nodes"]:
            assert time.monotonic() < deadline, "the nodes never expired"
            time.sleep(0.05)
        assert time.time() - sent_b >= 1.5
        status, body = call(f"{url}/route?model=tiny&max_length=64")
        assert status == 503
        beat(url, "a", (0, 2))
        beat(url, "b", (2, 4))
        assert call(f"{url}{deregister_path('b')}", "DELETE")[0] == 200  # the node itself
        assert call(f"{url}/route?model=tiny&max_length=64")[0] == 503


def test_libtorrent_peers_find_each_other_through_the_tracker(tmp_path, gemma_path):
    with AppThread(lambda: make_app(TrackerConfig(db=":memory:"))) as url:
        torrent = make_torrent([gemma_path], trackers=[f"{url}/announce"])
        manifest = Manifest.from_gguf(gemma_path, hash_files=False)
        seed_dir = tmp_path / "seed"
        seed_dir.mkdir()
        shutil.copy(gemma_path, seed_dir / gemma_path.name)
        seeder, leech = Swarm(), Swarm()
        try:
            seeder.seed(torrent, seed_dir)
            # as `node --layers auto` does: the header first, then a block, in one torrent; the second fetch keeps
            # the seeder it found (libtorrent would not dial a dropped tracker peer again for 60 s: a few MiB within
            # 45 s is then out of reach, however idle the machine); then the head, as before
            leech.fetch(torrent, tmp_path, manifest.byte_ranges(0, 0), timeout=120, progress=False)
            leech.fetch(torrent, tmp_path, manifest.byte_ranges(17, 18), timeout=45, progress=False)
            stats = leech.fetch(torrent, tmp_path, manifest.byte_ranges(17, 18, head=True), timeout=120, progress=False)
            assert stats.bytes_downloaded > 0 and seeder.uploaded(torrent) > 0
        finally:
            seeder.close()
            leech.close()


@pytest.mark.parametrize("token", [None, "page-t0ken"], ids=["open", "private"])
def test_status_page_renders_in_headless_chromium(tmp_path, tiny_artifact, token):
    """The live page in a real browser; in a private swarm it is opened as ``/?token=…`` and its
    requests for /status.json carry the token too."""
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.fail("chromium is not installed (.ci/run installs it with apt-get)")
    path, manifest = tiny_artifact
    query = f"?token={token}" if token else ""
    with AppThread(lambda: make_app(TrackerConfig(db=":memory:", token=token))) as base:
        call(
            f"{base}/manifests/tiny{query}",
            "PUT",
            {"manifest": json.loads(manifest.to_json()), "torrent_hex": make_torrent([path]).hex()},
        )
        call(
            f"{base}/nodes/heartbeat{query}",
            "POST",
            signed_ad(ad_of("node-a", layers=(0, 2))),
        )
        call(
            f"{base}/nodes/heartbeat{query}",
            "POST",
            signed_ad(ad_of("node-b", layers=(2, 4), state="loading")),
        )
        out = subprocess.run(
            [
                chromium,
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-quic",
                "--no-first-run",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                f"--user-data-dir={tmp_path / 'profile'}",
                "--virtual-time-budget=3000",
                "--dump-dom",
                f"{base}/{query}",
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        dom = out.stdout
        assert "tiny" in dom and "http://node-a" in dom and "http://node-b" in dom, out.stderr[-2000:]
        assert "loading" in dom and "2:4" in dom


def test_status_command_draws_coverage(tiny_artifact, ggufswarm_cli):
    path, manifest = tiny_artifact
    with AppThread(lambda: make_app(TrackerConfig(db=":memory:"))) as url:
        call(
            f"{url}/manifests/tiny",
            "PUT",
            {"manifest": json.loads(manifest.to_json()), "torrent_hex": make_torrent([path]).hex()},
        )
        beat(url, "node-a", (0, 2))
        out = subprocess.run([*ggufswarm_cli, "status", "--tracker", url], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert (
            "tiny  (4 layers, 1 node)" in out.stdout and "█" in out.stdout and "not servable: layers 2:4" in out.stdout
        )
        beat(url, "node-b", (2, 4), head=False)  # every layer covered, but no route can end without a head
        out = subprocess.run([*ggufswarm_cli, "status", "--tracker", url], capture_output=True, text=True, timeout=60)
        assert "not servable" in out.stdout and "needs it" in out.stdout and "servable end to end" not in out.stdout
        beat(url, "node-c", (2, 4))
        out = subprocess.run([*ggufswarm_cli, "status", "--tracker", url], capture_output=True, text=True, timeout=60)
        assert "servable end to end" in out.stdout, out.stdout
        dead = subprocess.run(
            [*ggufswarm_cli, "status", "--tracker", "http://127.0.0.1:9"], capture_output=True, text=True, timeout=60
        )
        assert dead.returncode == 1 and "cannot reach tracker" in dead.stderr and "Traceback" not in dead.stderr


def test_heartbeat_with_bad_numbers_is_400():
    with AppThread(lambda: make_app(TrackerConfig(db=":memory:"))) as url:
        for extra in ({"decode_ms": float("nan")}, {"free_kv_tokens": 10**30}, {"decode_ms": -1}):
            # NaN cannot be signed (canonical JSON has none): the fields are checked before the signature
            nan = extra.get("decode_ms") != extra.get("decode_ms")
            status, body = beat(url, "a", (0, 2), sign=not nan, **extra)
            assert status == 400 and body["error"]["code"] == "bad_advertisement", extra
        assert beat(url, "a", (0, 2))[0] == 200


def test_a_reported_node_is_dropped_only_when_the_tracker_finds_it_down():
    """POST /nodes/report: the tracker asks the node at the reported URL to sign a challenge (GET
    /v1/reach/probe?challenge=, without the swarm token) and drops it at once when it does not: a dead node, and
    something else listening where a node was advertised, are the same to it; a node that signs stays. An unknown
    URL is 404 and nothing is dialled; the swarm token is never sent."""
    import socket

    from aiohttp import web

    from ggufswarm.net.reach import add_probe_route

    seen = []

    @web.middleware
    async def record(request, handler):
        seen.append(request.headers.get("X-Ggufswarm-Token"))
        return await handler(request)

    def node(ident):
        app = web.Application(middlewares=[record])
        add_probe_route(app, ident)
        return app

    with socket.socket() as s:  # a port nothing listens on: a dead node
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    headers = {"Content-Type": "application/json", "X-Ggufswarm-Token": "sekret"}

    def tcall(url, method="GET", body=None):
        req = urllib.request.Request(
            url, json.dumps(body).encode() if body is not None else None, headers, method=method
        )
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    with (
        AppThread(lambda: node(identity("live"))) as live,
        AppThread(lambda: node(None)) as other,  # answers the probe, but holds no key: not the advertised node
        AppThread(lambda: make_app(TrackerConfig(db=":memory:", token="sekret"))) as url,
    ):
        for name, node_url in (("live", live), ("dead", dead), ("impostor", other)):
            body = {"node_id": name, "url": node_url, "model": "tiny", "layers": [0, 4], "embed": True, "head": True}
            assert tcall(f"{url}/nodes/heartbeat", "POST", signed_ad(body))[0] == 200
        assert tcall(f"{url}/nodes/report", "POST", {"url": live}) == (200, {"url": live, "alive": True, "removed": 0})
        for gone in (dead, other):
            report = tcall(f"{url}/nodes/report", "POST", {"url": gone + "/"})
            assert report == (200, {"url": gone, "alive": False, "removed": 1}), report
        assert [n["node_id"] for n in tcall(f"{url}/nodes")[1]["nodes"]] == [key("live")]
        status, body = tcall(f"{url}/nodes/report", "POST", {"url": "http://127.0.0.1:9"})
        assert status == 404 and body["error"]["code"] == "unknown_node"
        assert call(f"{url}/nodes/report", "POST", {"url": live})[0] == 401  # no token: refused, nothing probed
        assert len(seen) == 2 and set(seen) == {None}  # dialled twice, never with the token


def test_a_tracker_gateway_s_health_asks_its_tracker(tmp_path, tiny_artifact):
    """A --tracker gateway's /health is 200 "ok" while its tracker answers it (with the swarm token) and the swarm
    can serve a model end to end; 503 "degraded" when no model has a complete chain of ready nodes, and naming
    the tracker when the tracker refuses its token or is gone."""
    from ggufswarm.gateway import GatewayConfig
    from ggufswarm.gateway import make_app as make_gateway_app
    from ggufswarm.net.http import ServerThread

    tracker_server = ServerThread(make_app(TrackerConfig(db=":memory:", token="sekret")))
    tracker = tracker_server.start()
    # serving every model of the swarm (no --model), a gateway starts without any node; one without the token
    gateways = {
        token: ServerThread(
            make_gateway_app(GatewayConfig([], tracker=tracker, token=token, data_dir=str(tmp_path / "gw")))
        )
        for token in ("sekret", None)
    }
    try:
        urls = {token: g.start() for token, g in gateways.items()}
        status, body = call(urls["sekret"] + "/health")  # nothing published, no node
        assert status == 503 and body["status"] == "degraded" and body["tracker"] == {"ok": True}, body
        assert body["reason"] == "no model of this swarm can be served end to end now (no chain of ready nodes)"
        path, manifest = tiny_artifact
        headers = {"Content-Type": "application/json", "X-Ggufswarm-Token": "sekret"}
        for method, where, sent in (
            (
                "PUT",
                "/manifests/tiny",
                {"manifest": json.loads(manifest.to_json()), "torrent_hex": make_torrent([path]).hex()},
            ),
            (
                "POST",
                "/nodes/heartbeat",
                signed_ad(ad_of("a", layers=(0, 2))),
            ),
        ):
            req = urllib.request.Request(tracker + where, json.dumps(sent).encode(), headers, method=method)
            with urllib.request.urlopen(req, timeout=10) as r:
                assert r.status == 200
            status, body = call(urls["sekret"] + "/health")  # published; then layers 2:4 served by no one
            assert status == 503 and body["reason"].startswith("no model of this swarm"), body
        req = urllib.request.Request(tracker + "/models", headers=headers)
        with urllib.request.urlopen(req, timeout=10) as r:
            assert json.loads(r.read())["unservable"] == {"tiny": "layers 2:4 are not served by any ready node"}
        req = urllib.request.Request(
            tracker + "/nodes/heartbeat",
            json.dumps(
                signed_ad(
                    {
                        "node_id": "b",
                        "url": "http://b",
                        "model": "tiny",
                        "layers": [2, 4],
                        "embed": False,
                        "head": True,
                        "state": "ready",
                        "free_kv_tokens": 4096,
                    }
                )
            ).encode(),
            headers,
            method="POST",
        )
        with urllib.request.urlopen(req, timeout=10) as r:
            assert r.status == 200
        status, body = call(urls["sekret"] + "/health")
        assert status == 200 and body["status"] == "ok" and body["tracker"] == {"ok": True}, body
        status, body = call(urls[None] + "/health")
        assert status == 503 and body["status"] == "degraded" and body["tracker"]["ok"] is False, body
        assert body["reason"].startswith("the tracker does not answer: HTTP 401"), body
        tracker_server.stop()  # the tracker is gone
        tracker_server = None
        status, body = call(urls["sekret"] + "/health")
        assert status == 503 and body["status"] == "degraded", body
        assert body["reason"] == "the tracker does not answer: connection refused" and tracker not in str(body), body
    finally:
        for g in gateways.values():
            g.stop()
        if tracker_server is not None:
            tracker_server.stop()


def test_free_kv_reaches_the_tracker_when_sessions_close(tmp_path, tiny_artifact):
    """A node re-advertises within a fraction of a second of sessions opening or closing, not only at its next
    heartbeat (60 s here): a swarm a burst of requests has just freed is routable again at once (it used to be
    refused as full, 503 no_route, until the next beat)."""
    import uuid

    from ggufswarm.node.app import make_app as make_node_app
    from ggufswarm.node.state import NODE, NodeConfig

    path, manifest = tiny_artifact
    with AppThread(lambda: make_app(TrackerConfig(db=str(tmp_path / "t.sqlite")))) as tracker:
        assert (
            call(
                f"{tracker}/manifests/tiny",
                "PUT",
                {"manifest": json.loads(manifest.to_json()), "torrent_hex": make_torrent([path]).hex()},
            )[0]
            == 200
        )
        config = NodeConfig(
            layers="0:4",
            embed=True,
            head=True,
            model=str(path),
            tracker=tracker,
            swarm_name="tiny",
            heartbeat_s=60.0,
            ctx_size=256,
            max_sessions=1,
            data_dir=str(tmp_path / "node"),
        )
        app = make_node_app(config)
        with AppThread(lambda: app) as node:
            app[NODE].url = node  # what run_node sets from its listening socket: the advertised address

            def route_status(deadline_s: float, want: int) -> float:
                t0 = time.monotonic()
                while call(f"{tracker}/route?model=tiny&max_length=200")[0] != want:
                    assert time.monotonic() - t0 < deadline_s, f"the tracker did not answer {want} in {deadline_s} s"
                    time.sleep(0.05)
                return time.monotonic() - t0

            route_status(10.0, 200)  # the first advertisement
            sid = str(uuid.uuid4())
            assert call(f"{node}/v1/sessions", "POST", {"session_id": sid, "max_length": 200})[0] == 201
            assert route_status(3.0, 503) < 3.0  # the node's one session slot is taken: no route
            assert call(f"{node}/v1/sessions/{sid}", "DELETE")[0] == 200
            assert route_status(3.0, 200) < 3.0  # freed: routable again long before the 60 s heartbeat
