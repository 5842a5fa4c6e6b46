"""Node identities (issue 26): ed25519 keys, signed advertisements, bans by key.

A node's id is its public key and every advertisement it makes is signed with it (net/identity.py). Trackers refuse
unsigned, forged and stale heartbeats (401 bad_signature) and banned keys (403 banned, at any address, across a
restart); directories drop what does not verify or is banned, wherever it came from; a node refuses such hellos.
In-process servers only: fake nodes answer ``GET /v1/advertisement``, no model is loaded.
"""

from __future__ import annotations

import asyncio
import gc
import json
import time
import urllib.request
from types import SimpleNamespace

import aiohttp
import identities
import pytest
from aiohttp import web
from apphost import AppThread
from identities import SERVES, key, proof, running, signed_ad
from route_fixtures import http
from tinymodels import write_tiny_model

from ggufswarm.artifact.manifest import Manifest
from ggufswarm.directory.lookup import Directory
from ggufswarm.directory.routing import check_signed
from ggufswarm.directory.trackers import TrackerClient, TrackerError
from ggufswarm.net.http import json_errors_middleware
from ggufswarm.net.identity import IdentityError, NodeIdentity, canonical, verify, verify_json
from ggufswarm.net.reach import add_probe_route
from ggufswarm.node.discovery import advertisement_route, hello_route
from ggufswarm.node.state import NODE
from ggufswarm.swarm.torrent import make_torrent
from ggufswarm.tracker.app import TrackerConfig, make_app


def call(url, method="GET", body=None):
    """(status, JSON body) of one request (route_fixtures.http with the URL first)."""
    return http(method, url, body, timeout=10)


def ad_of(name: str, url: str | None = None, layers=(0, 4), n=4, **kw) -> dict:
    """An unsigned advertisement of model ``tiny`` by test node ``name`` (signed_ad signs it), with its hop header
    and numerics id (identities.SERVES: what the ban proofs' context says its nodes compute)."""
    extra = {"hop": {"n_layers": n, **SERVES["hop"]}, "numerics": SERVES["numerics"]}
    return identities.ad_of(name, url, layers, n, **{"extra": extra, **kw})


@pytest.fixture(scope="module")
def tiny_artifact(tiny_dir):
    path = write_tiny_model(tiny_dir / "identity-tiny.gguf", "llama", n_layers=4)
    return path, Manifest.from_gguf(path, name="tiny")


def publish(url: str, tiny_artifact) -> None:
    path, manifest = tiny_artifact
    body = {"manifest": json.loads(manifest.to_json()), "torrent_hex": make_torrent([path]).hex()}
    assert call(f"{url}/manifests/tiny", "PUT", body)[0] == 200


# -- keys and signatures ---------------------------------------------------------------------------------------------


def test_sign_and_verify_round_trip_and_tampering_is_detected():
    me, other = NodeIdentity.generate(), NodeIdentity.generate()
    assert len(me.key_id) == 64 and me.key_id != other.key_id and me.key_id == me.key_id.lower()
    sig = me.sign(b"hello")
    assert len(sig) == 128
    verify(me.key_id, b"hello", sig)
    for k, data, s in ((me.key_id, b"hellO", sig), (other.key_id, b"hello", sig), (me.key_id, b"hello", "00" * 64)):
        with pytest.raises(IdentityError, match="does not verify"):
            verify(k, data, s)
    with pytest.raises(IdentityError, match="64 hex"):
        verify("zz" * 32, b"hello", sig)
    signed = me.sign_json({"b": 1, "a": [1, "é"], "nested": {"y": 2, "x": 1}})
    assert verify_json(signed, me.key_id) == {"b": 1, "a": [1, "é"], "nested": {"y": 2, "x": 1}}
    assert canonical({"b": 1, "a": 2}) == b'{"a":2,"b":1}'  # key order does not matter to the signature
    verify_json(json.loads(json.dumps(signed, indent=2, sort_keys=False)), me.key_id)  # nor does the JSON layout
    for tampered in ({**signed, "b": 2}, {**signed, "nested": {"y": 2, "x": 2}}, {**signed, "extra": 1}):
        with pytest.raises(IdentityError):
            verify_json(tampered, me.key_id)
    with pytest.raises(IdentityError, match="unsigned"):
        verify_json({"b": 1}, me.key_id)


def test_advertisement_checks_signature_key_spelling_and_clock():
    now = time.time()
    good = signed_ad(ad_of("a"))
    check_signed(good)
    with pytest.raises(IdentityError, match="unsigned"):
        check_signed({k: v for k, v in good.items() if k != "sig"})
    with pytest.raises(IdentityError, match="does not verify"):
        check_signed({**good, "url": "http://elsewhere"})
    with pytest.raises(IdentityError, match="lowercase"):
        check_signed({**good, "node_id": good["node_id"].upper()})
    for at in (now - 400, now + 400):
        with pytest.raises(IdentityError, match="stale or future-dated"):
            check_signed(signed_ad(ad_of("a"), signed_at=at))
    check_signed(signed_ad(ad_of("a"), signed_at=now - 200))  # within 300 s either way
    for at in ("yesterday", True, 10**400):  # signed, but not a time (infinity cannot even be signed)
        with pytest.raises(IdentityError, match="unix seconds"):
            check_signed(signed_ad(ad_of("a"), signed_at=at))


def test_claim_gives_one_key_per_running_node_and_the_same_key_after_a_restart(tmp_path):
    first = NodeIdentity.claim(tmp_path)
    second = NodeIdentity.claim(tmp_path)  # another node started in the same folder
    assert first.key_id != second.key_id
    assert (tmp_path / "identity.key").stat().st_mode & 0o777 == 0o600
    kept = first.key_id
    del first
    gc.collect()  # the first node is gone: its key's lock is released
    again = NodeIdentity.claim(tmp_path)
    assert again.key_id == kept and again.key_id != second.key_id
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "identity.key").write_bytes(b"short")
    with pytest.raises(IdentityError, match="32 bytes"):
        NodeIdentity.claim(tmp_path / "bad")


# -- the tracker -----------------------------------------------------------------------------------------------------


def test_tracker_refuses_unsigned_forged_and_stale_heartbeats(tiny_artifact):
    with AppThread(lambda: make_app(TrackerConfig(db=":memory:"))) as url:
        publish(url, tiny_artifact)
        good = signed_ad(ad_of("a"))
        forged = {**good, "free_kv_tokens": 10**6}  # one field changed after signing
        unsigned = {k: v for k, v in good.items() if k != "sig"}
        stale = signed_ad(ad_of("a"), signed_at=time.time() - 301)
        wrong_key = {**good, "node_id": key("b")}  # a's signature under b's name
        for sent, why in (
            (forged, "does not verify"),
            (unsigned, "unsigned"),
            (stale, "stale or future-dated"),
            (wrong_key, "does not verify"),
            ({**good, "node_id": "n1"}, "64 hex"),
        ):
            status, body = call(f"{url}/nodes/heartbeat", "POST", sent)
            assert status == 401 and body["error"]["code"] == "bad_signature", (why, body)
            assert why in body["error"]["message"], body
        assert call(f"{url}/nodes")[1]["nodes"] == []
        assert call(f"{url}/nodes/heartbeat", "POST", good) == (200, {"ok": True, "ttl_s": 15.0})
        listed = call(f"{url}/nodes?model=tiny")[1]["nodes"]
        assert listed == [good]  # exactly what the node signed: whoever lists it can check it again
        verify_json(listed[0], key("a"))
        route = call(f"{url}/route?model=tiny&max_length=64")[1]["route"]
        check_signed(route[0])


def test_a_ban_drops_the_node_and_holds_at_any_address_across_a_restart(tmp_path, tiny_artifact):
    db = str(tmp_path / "t.sqlite")
    honest = {key("honest"), key("w1"), key("w2")}  # w1, w2: the nodes whose commitments prove the liar lied
    with AppThread(lambda: make_app(TrackerConfig(db=db, witness_age_s=0))) as url, running("w1", "w2") as at:
        publish(url, tiny_artifact)
        for name in ("liar", "honest", "w1", "w2"):
            assert call(f"{url}/nodes/heartbeat", "POST", signed_ad(ad_of(name, url=at.get(name))))[0] == 200
        tracker = TrackerClient(url)
        assert {a["node_id"] for a in tracker.nodes("tiny")} == honest | {key("liar")}
        evidence = proof("liar")
        assert tracker.ban(key("liar"), "wrong logits at step 7", evidence) == {"banned": key("liar")}
        assert {a["node_id"] for a in tracker.nodes("tiny")} == honest  # at once, not after the TTL
        for _ in range(3):  # the planner never picks it, whatever the load spreading
            planned = tracker.route({"model": "tiny", "max_length": 64})["route"]
            assert [h["node_id"] for h in planned] != [key("liar")]
        bans = tracker.bans()
        assert [(b["key"], b["reason"]) for b in bans] == [(key("liar"), "wrong logits at step 7")]
        assert abs(bans[0]["at"] - time.time()) < 60 and bans[0]["evidence"] == evidence  # anyone can check it
        moved = signed_ad(ad_of("liar", url="http://10.0.0.9:9999"))  # back under another address and port
        status, body = call(f"{url}/nodes/heartbeat", "POST", moved)
        assert status == 403 and body["error"]["code"] == "banned", body
        for bad, code in (
            ({"key": "nope"}, "bad_request"),
            ({"key": key("x"), "reason": 5}, "bad_request"),
            ({}, "bad_request"),
            ({"key": key("x"), "evidence": [1]}, "bad_evidence"),
        ):
            status, body = call(f"{url}/v1/bans", "POST", bad)
            assert status == 400 and body["error"]["code"] == code, (bad, body)
    with AppThread(lambda: make_app(TrackerConfig(db=db))) as url:  # the same database, a new process
        assert [b["key"] for b in TrackerClient(url).bans()] == [key("liar")]
        status, body = call(f"{url}/nodes/heartbeat", "POST", signed_ad(ad_of("liar", url="http://10.0.0.10:1")))
        assert status == 403 and body["error"]["code"] == "banned", body
        assert call(f"{url}/nodes/heartbeat", "POST", signed_ad(ad_of("honest")))[0] == 200


def test_a_banned_node_says_so_and_stops_once_its_sessions_end(monkeypatch, tmp_path, capsys):
    """A tracker answering a node's heartbeat with 403 banned: the node prints why (its key file, and that nodes
    sharing a --data-dir take keys in start order) once, keeps serving the session it holds, and sends itself
    SIGTERM when that session has ended (run_node then exits 3)."""
    from ggufswarm.node import advertise

    ident = NodeIdentity.claim(tmp_path)
    kills = []
    monkeypatch.setattr(advertise, "advertisement", lambda state: {})
    monkeypatch.setattr(advertise, "BANNED_POLL_S", 0.01)
    monkeypatch.setattr(advertise.os, "kill", lambda pid, sig: kills.append(sig))

    class Banned:
        url = "http://tracker"

        async def aheartbeat(self, client, ad):
            raise TrackerError("tracker: 403 banned", 403, f"node key {ident.key_id[:16]}... is banned from this swarm")

    state = SimpleNamespace(
        config=SimpleNamespace(heartbeat_s=0.02),
        url="http://node",
        client=None,
        trackers=[Banned()],
        identity=ident,
        banned=None,
        path=SimpleNamespace(active_sessions=0),  # (the step path's count of sessions mid-step)
        store=SimpleNamespace(sessions={"one": object()}),
    )

    async def run():
        task = asyncio.create_task(advertise.heartbeats(state))
        await asyncio.sleep(0.2)
        assert state.banned and not kills  # still holding a session
        state.store.sessions.clear()
        await asyncio.sleep(0.2)
        task.cancel()

    asyncio.run(run())
    err = capsys.readouterr().err
    assert kills and err.count("this node's key is banned") == 1, err
    assert str(ident.path) in err and "own --data-dir" in err and "banned and idle; stopping" in err


def test_a_node_whose_advertisement_is_refused_says_so_and_stops(monkeypatch, tmp_path, capsys):
    """A tracker answering a node's heartbeat with 400 (its advertisement can never be listed: a loopback URL from
    another machine, a head short of the last layer): the node says so once, naming the tracker's reason, and stops
    (run_node exits 1) instead of serving unlisted."""
    from ggufswarm.node import advertise

    kills = []
    monkeypatch.setattr(advertise, "advertisement", lambda state: {})
    monkeypatch.setattr(advertise.os, "kill", lambda pid, sig: kills.append(sig))
    why = "bad advertisement: url 'http://127.0.0.1:1' is loopback-only, advertised from 10.0.0.9"

    class Refusing:
        url = "http://tracker"

        async def aheartbeat(self, client, ad):
            raise TrackerError(f"tracker: 400 {why}", 400, why)

    state = SimpleNamespace(
        config=SimpleNamespace(heartbeat_s=0.02), url="http://node", client=None, trackers=[Refusing()],
        banned=None, refused=None,
    )  # fmt: skip

    async def run():
        task = asyncio.create_task(advertise.heartbeats(state))
        await asyncio.sleep(0.2)
        task.cancel()

    asyncio.run(run())
    err = capsys.readouterr().err
    assert kills and state.refused and err.count("refuses this node's advertisement") == 1, err
    assert "loopback-only" in err and "stopping" in err


def test_bans_are_token_gated_and_async_client_calls_work():
    async def go(url, at):
        tracker = TrackerClient(url, "sekret")
        async with aiohttp.ClientSession() as http:
            for name in ("w1", "w2"):
                await tracker.aheartbeat(http, signed_ad(ad_of(name, url=at[name])))
            assert await tracker.aban(http, key("x"), "lied", proof("x")) == {"banned": key("x")}
            assert [b["key"] for b in await tracker.abans(http)] == [key("x")]
            with pytest.raises(TrackerError) as err:
                await TrackerClient(url).abans(http)
            assert err.value.status == 401

    with (
        AppThread(lambda: make_app(TrackerConfig(db=":memory:", token="sekret", witness_age_s=0))) as url,
        running("w1", "w2") as at,
    ):
        assert call(f"{url}/v1/bans", "POST", {"key": key("y"), "reason": "", "evidence": proof("y")})[0] == 401
        asyncio.run(go(url, at))


# -- directories and hellos ------------------------------------------------------------------------------------------


class FakeDiscovery:
    """A DHT that lists fixed endpoints (``net.dht.Discovery.alookup``'s answer)."""

    def __init__(self, urls):
        self.endpoints = [(u.split("//")[1].rsplit(":", 1)[0], int(u.rsplit(":", 1)[1])) for u in urls]

    async def alookup(self, key, timeout):
        return list(self.endpoints)


def fake_node(answer, name: str):
    """A node that answers ``GET /v1/advertisement`` with ``answer(base_url, query)`` (a JSON object), and the
    signed challenge of ``GET /v1/reach/probe`` with test key ``name`` (a directory proves an address first)."""
    app = web.Application()

    async def ad(request):
        base = f"http://{request.host}"
        return web.json_response(answer(base, request.query))

    app.router.add_get("/v1/advertisement", ad)
    add_probe_route(app, identities.identity(name))
    return app


def test_directory_drops_forged_stale_and_banned_advertisements_from_peers():
    """On the DHT: an honest node, a node whose advertisement was altered after signing, one with a stale
    signature, a banned one, and a forged peer-of-peer that only the honest node names. Only the honest one is
    listed and planned through."""
    forger_url = {}

    def honest(base, q):
        out = signed_ad(ad_of("honest", url=base))
        if q.get("peers"):
            out["peers"] = [forger_url["url"]]  # outside the signature, as a node adds it
        return out

    forged = lambda base, q: {**signed_ad(ad_of("forged", url="http://elsewhere")), "url": base, "layers": [0, 4]}
    stale = lambda base, q: signed_ad(ad_of("stale", url=base), signed_at=time.time() - 1000)
    banned = lambda base, q: signed_ad(ad_of("banned", url=base))
    with (
        AppThread(lambda: fake_node(honest, "honest")) as h,
        AppThread(lambda: fake_node(forged, "forged")) as f,
        AppThread(lambda: fake_node(stale, "stale")) as s,
        AppThread(lambda: fake_node(banned, "banned")) as b,
        AppThread(lambda: fake_node(forged, "forged")) as peer_only,
    ):
        forger_url["url"] = peer_only
        directory = Directory("tiny", [], FakeDiscovery([h, f, s, b]), "00" * 32)
        directory.ban(key("banned").upper())  # any spelling

        async def go():
            async with aiohttp.ClientSession() as http:
                listed = await directory.nodes(http)
                planned = await directory.route(http, {"max_length": 16})
                return listed, planned

        listed, planned = asyncio.run(go())
        assert [a["url"] for a in listed] == [h], listed
        check_signed(listed[0])  # as the node signed it ("peers" taken off)
        assert [hop["node_id"] for hop in planned["route"]] == [key("honest")] and planned["source"] == "dht"
        assert directory.banned == {key("banned")}


def test_directory_follows_its_trackers_bans_and_re_plans_around_local_ones(tiny_artifact):
    async def go(url, directory):
        async with aiohttp.ClientSession() as http:
            first = {a["node_id"] for a in await directory.nodes(http)}
            await TrackerClient(url).aban(http, key("b"), "lied", proof("b", ("a", "c")))  # a, c: its witnesses
            await directory.refresh_bans(http, force=True)
            after_ban = {a["node_id"] for a in await directory.nodes(http)}
            directory.ban(key("a"))  # the tracker does not know: its plans through a are asked for again without it
            planned = await directory.route(http, {"max_length": 16})
            return first, after_ban, planned

    with AppThread(lambda: make_app(TrackerConfig(db=":memory:", witness_age_s=0))) as url, running("a", "c") as at:
        publish(url, tiny_artifact)
        for name in ("a", "b", "c"):
            ad = signed_ad(ad_of(name, url=at.get(name), decode_ms={"a": 1.0, "b": 2.0, "c": 9.0}[name]))
            assert call(f"{url}/nodes/heartbeat", "POST", ad)[0] == 200
        directory = Directory("tiny", [url])
        first, after_ban, planned = asyncio.run(go(url, directory))
        assert first == {key("a"), key("b"), key("c")} and after_ban == {key("a"), key("c")}
        assert [h["node_id"] for h in planned["route"]] == [key("c")] and planned["source"] == "tracker"
        assert directory.banned == {key("a"), key("b")}


class StandIn:
    """The fields of a NodeState the hello handlers read (no model loaded)."""

    def __init__(self, directory):
        self.config = SimpleNamespace(swarm_name="tiny", model="tiny")
        self.url = "http://receiver"
        self.heard: dict[str, float] = {}
        self.directory = directory


def test_a_node_refuses_unsigned_forged_and_banned_hellos_and_stops_passing_on_banned_peers(monkeypatch):
    import ggufswarm.node.discovery as discovery

    directory = Directory("tiny", [])
    directory.ban(key("banned"))
    state = StandIn(directory)
    own = signed_ad(ad_of("receiver", url=state.url))
    monkeypatch.setattr(discovery, "advertisement", lambda _state: dict(own))

    def app():
        app = web.Application(middlewares=[json_errors_middleware()])
        app[NODE] = state
        app.router.add_post("/v1/peers", hello_route)
        app.router.add_get("/v1/advertisement", advertisement_route)
        return app

    with AppThread(app) as url:
        good = signed_ad(ad_of("peer", url="http://peer:1"))
        for sent, status, code in (
            ({k: v for k, v in good.items() if k != "sig"}, 401, "bad_signature"),
            ({**good, "url": "http://attacker:1"}, 401, "bad_signature"),
            (signed_ad(ad_of("peer", url="http://peer:1"), signed_at=time.time() - 3600), 401, "bad_signature"),
            (signed_ad(ad_of("banned", url="http://banned:1")), 403, "banned"),
            ({"junk": 1}, 400, "bad_request"),
        ):
            got, body = call(f"{url}/v1/peers", "POST", sent)
            assert (got, body["error"]["code"]) == (status, code), body
        assert state.heard == {}
        assert call(f"{url}/v1/peers", "POST", good) == (200, {"ok": True})
        assert call(f"{url}/v1/peers", "POST", signed_ad(ad_of("other", url="http://other:1")))[0] == 200
        status, body = call(f"{url}/v1/advertisement?peers=1")
        assert status == 200 and sorted(body.pop("peers")) == ["http://other:1", "http://peer:1"]
        check_signed(body)
        directory.ban(key("peer"))  # banned since its hello: no longer passed on
        assert call(f"{url}/v1/advertisement?peers=1")[1]["peers"] == ["http://other:1"]


def test_a_planned_route_goes_only_through_nodes_that_prove_their_keys(tiny_artifact):
    """A gateway's directory sends the swarm token only to nodes that sign its challenge with the key listed for
    them: a tracker's plan through an advertisement naming some other service (or a key that is not the one
    answering there) is asked for again without it, and that service never sees the token."""
    seen = []

    @web.middleware
    async def record(request, handler):
        seen.append(request.headers.get("X-Ggufswarm-Token"))
        return await handler(request)

    other = lambda: web.Application(middlewares=[record])

    async def go(url, directory):
        async with aiohttp.ClientSession(headers={"X-Ggufswarm-Token": "sekret"}) as http:
            return [await directory.route(http, {"max_length": 16}) for _ in range(3)]

    with (
        AppThread(lambda: make_app(TrackerConfig(db=":memory:", token="sekret"))) as url,
        AppThread(other) as service,
        running("real") as at,
    ):
        headers = {"X-Ggufswarm-Token": "sekret"}
        body = json.dumps(
            {"manifest": json.loads(tiny_artifact[1].to_json()), "torrent_hex": make_torrent([tiny_artifact[0]]).hex()}
        ).encode()
        req = urllib.request.Request(
            f"{url}/manifests/tiny", body, {**headers, "Content-Type": "application/json"}, method="PUT"
        )
        assert urllib.request.urlopen(req, timeout=10).status == 200
        for name, where, ms in (("fast-fake", service, 0.01), ("real", at["real"], 5.0)):
            ad = json.dumps(signed_ad(ad_of(name, url=where, decode_ms=ms))).encode()
            req = urllib.request.Request(f"{url}/nodes/heartbeat", ad, {**headers, "Content-Type": "application/json"})
            assert urllib.request.urlopen(req, timeout=10).status == 200
        routes = asyncio.run(go(url, Directory("tiny", [url], token="sekret")))
    assert all([h["node_id"] for h in r["route"]] == [key("real")] for r in routes), routes
    assert seen and set(seen) == {None}  # asked to prove itself (without the token), never sent a frame or the token
