"""Issue 37: what a holder of the swarm token who is not the operator can no longer do (docs/protocol.md, "Threat
model"). Each test acts as such an attacker, with keys of its own, against in-process trackers, relays and nodes:

1. ban an honest node without proof (no evidence, forged or made-up witnesses, witnesses of other numerics or too
   young, another history), lift or bypass bans with the swarm token alone;
2. make the tracker dial an address of its choice with the token (tests/test_tracker.py,
   ``test_a_reported_node_is_dropped_only_when_the_tracker_finds_it_down``: no token is ever sent, and a closed port
   and something else listening look the same);
3. through a relay, make a node dial its own machine; share one rate limit with every relayed peer;
4. remove an honest node, or replay its deregistration or an old advertisement;
5. grow the tracker's bans, its evidence, its node list, its peer lists or a relay's slots without bound;
6. have a loopback tracker open relayed ports on every interface.
Honest nodes stay listed and routed throughout, and a ban with real evidence still holds.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request
from functools import partial
from types import SimpleNamespace

import aiohttp
import identities
import pytest
from aiohttp import web
from apphost import AppThread
from identities import CONTEXT, commitment, deregister_path, key, proof, signed_ad
from identities import ad_of as tiny_ad

import ggufswarm.net.relay as relay_module
import ggufswarm.tracker.registry as registry_module
from ggufswarm.net.auth import OPERATOR_HEADER
from ggufswarm.net.commitments import commit_context
from ggufswarm.net.reach import add_dialback_route
from ggufswarm.net.relay_client import RelayClient
from ggufswarm.node.app import _requester
from ggufswarm.tracker.app import TrackerConfig, make_app

TOKEN, OPERATOR = "swarm-token", "operator-secret"
SERVES = {"hop": {"n_layers": 4, "model_fingerprint": "fp-tiny"}, "numerics": {"id": "numerics-1"}}


def call(url: str, method: str = "GET", body=None, headers: dict | None = None) -> tuple[int, dict]:
    """(status, JSON body) of one request carrying the swarm token (and ``headers``)."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode() if body is not None else None
    h = {"Content-Type": "application/json", "X-Ggufswarm-Token": TOKEN, **(headers or {})}
    req = urllib.request.Request(url, data=data, method=method, headers=h)
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def ad(name: str, **kw) -> dict:
    """A signed advertisement of test node ``name`` serving the tiny model's layers 0:4 as identities.CONTEXT says."""
    return signed_ad(tiny_ad(name, **{"extra": SERVES, **kw}))


def listed(url: str) -> set[str]:
    return {a["node_id"] for a in call(f"{url}/nodes")[1]["nodes"]}


def tracker(**kw):
    return AppThread(lambda: make_app(TrackerConfig(db=":memory:", token=TOKEN, **kw)))


def refused(url: str, body: dict, code: str, why: str) -> None:
    status, answer = call(f"{url}/v1/bans", "POST", body)
    assert status in (400, 403, 413) and answer["error"]["code"] == code, (body.get("evidence"), answer)
    assert why in answer["error"]["message"], answer


def test_a_token_holder_cannot_ban_an_honest_node_without_proof():
    """Finding 1: every ban the attacker can make up is refused with what it lacks; the honest node stays listed. The
    attacker's own keys (sybils) witness nothing: not while unknown, not while young, not while they are not ready
    nodes, not while they do not answer where they are listed."""
    with tracker(witness_age_s=0.5) as url, identities.running("w1", "w2") as at:
        for name in ("honest", "w1", "w2"):
            assert call(f"{url}/nodes/heartbeat", "POST", ad(name, url=at.get(name)))[0] == 200
        victim = key("honest")
        refused(url, {"key": victim, "reason": "anything", "evidence": {}}, "bad_evidence", "kind")
        refused(url, {"key": victim}, "bad_evidence", "evidence must be a JSON object")
        # keys made for the occasion sign whatever they like: they are no nodes of this swarm
        refused(url, {"key": victim, "evidence": proof("honest", ("sybil1", "sybil2"))}, "bad_evidence", "not a node")
        # advertised a moment ago: too young to witness; advertised as not ready: not serving anything yet
        for sybil in ("sybil1", "sybil2"):
            assert call(f"{url}/nodes/heartbeat", "POST", ad(sybil, url=f"http://{sybil}.invalid:1"))[0] == 200
        assert call(f"{url}/nodes/heartbeat", "POST", ad("sybil3", state="loading"))[0] == 200
        refused(url, {"key": victim, "evidence": proof("honest", ("sybil1", "sybil2"))}, "bad_evidence", "for 0 s")
        time.sleep(0.6)  # from now on w1, w2 and the sybils count as nodes of these layers...
        refused(url, {"key": victim, "evidence": proof("honest", ("w1", "sybil3"))}, "bad_evidence", "not a ready")
        # ...but the sybils are advertisements, not nodes: nothing answers their challenge where they are listed
        sybils = proof("honest", ("sybil1", "sybil2"))
        refused(url, {"key": victim, "evidence": sybils}, "bad_evidence", "does not answer as itself")
        # one witness is not enough; the accused's own commitment is needed, signed by it
        one = proof("honest", ("w1",))
        refused(url, {"key": victim, "evidence": one}, "bad_evidence", "2 to 8 signed commitments")
        forged = proof("honest")
        forged["accused"] = {**forged["accused"], "out": "cc" * 16}  # altered after signing
        refused(url, {"key": victim, "evidence": forged}, "bad_evidence", "does not verify")
        framed = proof("sybil1")  # a commitment of another node cannot stand for the victim's
        refused(url, {"key": victim, "evidence": framed}, "bad_evidence", "not by the key banned")
        # the witnesses must have computed the same step after the same history: honest nodes fed another history
        # (or another input) answer otherwise, and that proves nothing
        other_history = proof("honest")
        other_history["witnesses"] = [commitment(w, "bb" * 16, prev="ee" * 16) for w in ("w1", "w2")]
        refused(url, {"key": victim, "evidence": other_history}, "bad_evidence", "another prev")
        other_input = proof("honest")
        other_input["witnesses"] = [commitment(w, "bb" * 16, inp="22" * 16) for w in ("w1", "w2")]
        refused(url, {"key": victim, "evidence": other_input}, "bad_evidence", "another in")
        agreeing = proof("honest")
        agreeing["witnesses"] = [commitment(w, "aa" * 16) for w in ("w1", "w2")]
        refused(url, {"key": victim, "evidence": agreeing}, "bad_evidence", "agree with the accused")
        # nodes of another build or CPU kind compute other bits: they witness nothing about this one's
        elsewhere = commit_context("fp-tiny", 0, 4, True, True, "numerics-2", "f32", {"temperature": 0.0})
        refused(url, {"key": victim, "evidence": proof("honest", context=elsewhere)}, "bad_evidence", "numerics")
        no_numerics = {**CONTEXT, "numerics": ""}
        refused(url, {"key": victim, "evidence": proof("honest", context=no_numerics)}, "bad_evidence", "numerics")
        refused(url, {"key": victim, "evidence": {**proof("honest"), "kind": "trust-me"}}, "bad_evidence", "kind")
        assert victim in listed(url) and call(f"{url}/v1/bans")[1]["bans"] == []
        # a witness must be listed now: one that stopped advertising witnesses nothing
        assert call(f"{url}{deregister_path('w2')}", "DELETE")[0] == 200
        refused(url, {"key": victim, "evidence": proof("honest")}, "bad_evidence", "lists now")
        assert victim in listed(url) and call(f"{url}/v1/bans")[1]["bans"] == []


def test_only_the_operator_lifts_a_ban_or_removes_another_node():
    """Findings 1 and 4: the swarm token lifts no ban and removes no other node; the operator's credential does; a
    node removes itself with its own signature, which cannot be replayed once it advertised again."""
    with tracker(witness_age_s=0, operator_token=OPERATOR) as url, identities.running("w1", "w2") as at:
        for name in ("liar", "honest", "w1", "w2"):
            assert call(f"{url}/nodes/heartbeat", "POST", ad(name, url=at.get(name)))[0] == 200
        assert call(f"{url}/v1/bans", "POST", {"key": key("liar"), "evidence": proof("liar")})[0] == 200
        status, body = call(f"{url}/v1/bans/{key('liar')}", "DELETE")
        assert status == 403 and body["error"]["code"] == "operator_only", body
        status, body = call(f"{url}/nodes/{key('honest')}", "DELETE")  # evict an honest node: no
        assert status == 403 and body["error"]["code"] == "operator_only" and key("honest") in listed(url)
        status, body = call(f"{url}/nodes/{key('honest')}?signed_at={time.time()}&sig=00", "DELETE")
        assert status == 401 and body["error"]["code"] == "bad_signature", body
        operator = {OPERATOR_HEADER: OPERATOR}
        assert call(f"{url}/v1/bans/{key('liar')}", "DELETE", headers=operator) == (200, {"lifted": key("liar")})
        assert call(f"{url}/v1/bans/{key('liar')}", "DELETE", headers=operator)[0] == 404
        assert call(f"{url}/nodes/{key('w2')}", "DELETE", headers=operator) == (200, {"ok": True})
        # the node itself: its signed deregistration works once; replayed after it advertised again, it is stale
        leave = deregister_path("honest")
        assert call(f"{url}{leave}", "DELETE") == (200, {"ok": True}) and key("honest") not in listed(url)
        time.sleep(0.01)
        assert call(f"{url}/nodes/heartbeat", "POST", ad("honest"))[0] == 200
        status, body = call(f"{url}{leave}", "DELETE")
        assert status == 409 and body["error"]["code"] == "stale_advertisement" and key("honest") in listed(url)
    with tracker() as url:  # a tracker without an operator credential: nobody lifts or evicts
        status, body = call(f"{url}/v1/bans/{key('liar')}", "DELETE", headers={OPERATOR_HEADER: ""})
        assert status == 403 and "has none" in body["error"]["message"], body


def test_a_replayed_advertisement_changes_nothing():
    """Finding 4: an advertisement copied off the wire and sent again neither brings a node back after a newer one
    nor keeps a node that stopped listed past the TTL."""
    with tracker(ttl_s=1.0) as url:
        old = ad("node")
        time.sleep(0.01)
        new = ad("node")
        assert call(f"{url}/nodes/heartbeat", "POST", new)[0] == 200
        status, body = call(f"{url}/nodes/heartbeat", "POST", old)
        assert status == 409 and body["error"]["code"] == "stale_advertisement", body
        deadline = time.monotonic() + 20
        while key("node") in listed(url):  # the node stopped; the attacker replays its last advertisement
            assert call(f"{url}/nodes/heartbeat", "POST", new)[0] == 200
            assert time.monotonic() < deadline, "a replayed advertisement kept the node listed"
            time.sleep(0.1)


def test_the_tracker_bounds_what_one_token_holder_can_store(monkeypatch):
    """Finding 5: a ban's body and evidence, the number of bans, node keys advertised from one address and BitTorrent
    peers announced from one address are bounded; honest ones from elsewhere still get in."""
    monkeypatch.setattr(registry_module, "MAX_BANS", 1)
    monkeypatch.setattr(registry_module, "MAX_NODES_PER_ADDRESS", 5)
    monkeypatch.setattr(registry_module, "MAX_PEERS_PER_ADDRESS", 2)
    with tracker(witness_age_s=0) as url, identities.running("w1", "w2") as at:
        status, body = call(f"{url}/v1/bans", "POST", b'{"key": "' + b"0" * (40 << 20) + b'"}')
        assert status == 413 and body["error"]["code"] == "body_too_large"  # refused on its length: nothing stored
        padded = {**proof("a"), "padding": "x" * 65_600}
        refused(url, {"key": key("a"), "evidence": padded}, "bad_evidence", "over")
        for name in ("w1", "w2", "a", "b"):
            assert call(f"{url}/nodes/heartbeat", "POST", ad(name, url=at.get(name)))[0] == 200
        assert call(f"{url}/v1/bans", "POST", {"key": key("a"), "evidence": proof("a")})[0] == 200
        status, body = call(f"{url}/v1/bans", "POST", {"key": key("b"), "evidence": proof("b")})
        assert status == 507 and body["error"]["code"] == "too_many_bans", body
        # w1, w2, b listed from 127.0.0.1 (a was banned): two more new keys fit, the third does not
        for name in ("c", "d"):
            assert call(f"{url}/nodes/heartbeat", "POST", ad(name))[0] == 200
        status, body = call(f"{url}/nodes/heartbeat", "POST", ad("e"))
        assert status == 429 and body["error"]["code"] == "too_many_nodes", body
        assert call(f"{url}/nodes/heartbeat", "POST", ad("d"))[0] == 200  # a known one goes on
    # BitTorrent peers: one address fills no more than its share of a torrent's list
    reg = registry_module.Registry(":memory:")
    info_hash = b"\xab" * 20
    for i in range(5):
        reg.announce(info_hash, f"-ATTACK-{i:012d}".encode(), "10.0.0.66", 6881 + i, 0, "started")
    reg.announce(info_hash, b"-HONEST-000000000000", "10.0.0.7", 6881, 0, "started")
    kept = [(p["ip"], p["port"]) for p in reg.peers(info_hash)]
    assert len(kept) == 3 and ("10.0.0.7", 6881) in kept, kept


async def _serve(app: web.Application, host: str = "127.0.0.1") -> tuple[web.AppRunner, int]:
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, host, 0)
    await site.start()
    return runner, site._server.sockets[0].getsockname()[1]


async def _answer(_request: web.Request) -> web.Response:
    return web.json_response({"ok": True})


def _from(address: str) -> aiohttp.ClientSession:
    """An HTTP client whose connections come from ``address`` (127.0.0.2, ...: another machine, as far as the
    servers on 127.0.0.1 can tell)."""
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(local_addr=(address, 0)), headers={"X-Ggufswarm-Token": TOKEN}
    )


def test_a_relayed_node_dials_back_its_requester_not_its_own_machine(monkeypatch):
    """Finding 3: a request relayed to a node behind a NAT comes in over the relay client's local connection, but its
    dial-back goes to the address the relay saw, with a rate limit of its own: a token holder cannot make the node
    probe ports of its own machine. Findings 5 and 6: one address takes at most MAX_CLIENTS_PER_ADDRESS relay slots,
    and a tracker on loopback opens relayed ports on loopback only."""
    monkeypatch.setattr(relay_module, "MAX_CLIENTS_PER_ADDRESS", 2)

    async def go():
        relay_app = make_app(TrackerConfig(db=":memory:", token=TOKEN, relay=True, public_host="127.0.0.1"))
        relay_runner, relay_port = await _serve(relay_app)
        secret = web.Application()  # a service on the node's own machine, on loopback only
        secret.router.add_get("/v1/reach/probe", _answer)
        secret_runner, secret_port = await _serve(secret)
        state = SimpleNamespace(relay_client=None)
        node = web.Application()
        add_dialback_route(node, requester=partial(_requester, state))
        node_runner, node_port = await _serve(node)
        async with aiohttp.ClientSession() as http:
            state.relay_client = RelayClient(f"http://127.0.0.1:{relay_port}", node_port, TOKEN)
            host, public = await state.relay_client.start(http)
            listener = next(iter(relay_app[relay_module.RELAY].clients.values())).listener
            assert listener.sockets[0].getsockname()[0] == "127.0.0.1"  # where the tracker listens, not 0.0.0.0
            try:
                async with _from("127.0.0.2") as attacker, _from("127.0.0.3") as other:
                    url = f"http://{host}:{public}/v1/reach/dialback"
                    async with attacker.post(url, json={"port": secret_port}) as r:
                        seen = await r.json()
                    assert r.status == 200 and seen["observed_ip"] == "127.0.0.2", seen
                    assert seen["reachable"] is False  # 127.0.0.2 has nothing there; the node's own port is not asked
                    async with attacker.post(url, json={"port": secret_port, "host": "127.0.0.1"}) as r:
                        assert r.status == 400  # and it cannot ask for another address
                    for _ in range(9):
                        async with attacker.post(url, json={"port": secret_port}) as r:
                            pass
                    async with attacker.post(url, json={"port": secret_port}) as r:
                        assert r.status == 429  # its own limit is spent...
                    async with other.post(url, json={"port": secret_port}) as r:
                        assert r.status == 200 and (await r.json())["observed_ip"] == "127.0.0.3"  # ...not another's
                    # relay slots: a second attachment from the attacker's address fits, a third does not
                    attach = f"http://127.0.0.1:{relay_port}/v1/relay/attach"
                    held = [await attacker.ws_connect(attach) for _ in range(2)]
                    with pytest.raises(aiohttp.WSServerHandshakeError) as full:
                        await attacker.ws_connect(attach)
                    assert full.value.status == 503
                    async with other.ws_connect(attach) as ws:  # another address still attaches
                        assert "port" in json.loads((await ws.receive()).data)
                    for ws in held:
                        await ws.close()
            finally:
                await state.relay_client.close()
        for runner in (node_runner, secret_runner, relay_runner):
            await runner.cleanup()

    asyncio.run(go())


def test_a_node_sends_the_token_only_to_a_next_hop_that_proves_its_key():
    """Finding 2, on a node: an advertisement names any address it likes, so a next hop the tracker lists must also
    prove, by a signed challenge, that it holds the key listed for it before the node sends it a frame (with the
    swarm token). An attacker's advertisement pointing at another service is refused (next_hop_unknown) and that
    service never sees the token; a real node passes."""
    from ggufswarm.directory.trackers import TrackerClient
    from ggufswarm.net.auth import auth_headers
    from ggufswarm.net.reach import Proven, add_probe_route
    from ggufswarm.node.advertise import check_registered
    from ggufswarm.protocol import ProtocolError

    seen = []

    @web.middleware
    async def record(request, handler):
        seen.append((request.path, request.headers.get("X-Ggufswarm-Token")))
        return await handler(request)

    def service(name: str | None):
        app = web.Application(middlewares=[record])
        if name is not None:
            add_probe_route(app, identities.identity(name))
        app.router.add_post("/v1/step", _answer)
        return app

    with (
        tracker() as url,
        AppThread(lambda: service(None)) as victim,  # some service on the node's network, not a node
        AppThread(lambda: service("real")) as real,
    ):
        assert call(f"{url}/nodes/heartbeat", "POST", ad("sybil", url=victim))[0] == 200
        assert call(f"{url}/nodes/heartbeat", "POST", ad("real", url=real))[0] == 200

        async def go():
            async with aiohttp.ClientSession(headers=auth_headers(TOKEN)) as client:
                state = SimpleNamespace(
                    tracker=TrackerClient(url, TOKEN), directory=None, config=SimpleNamespace(swarm_name="tiny"),
                    peers={}, peers_at=0.0, proven=Proven(), client=client,
                )  # fmt: skip
                with pytest.raises(ProtocolError) as refused_hop:
                    await check_registered(state, victim)
                assert refused_hop.value.code == "next_hop_unknown" and "not the node listed" in str(refused_hop.value)
                await check_registered(state, real)  # listed and proven: frames may go there

        asyncio.run(go())
    assert seen and all(token is None for _path, token in seen) and {p for p, _ in seen} == {"/v1/reach/probe"}


def test_an_advertisement_names_no_other_service():
    """Finding 2, at the source: the tracker dials advertised addresses (reports, a ban's witnesses), so one may
    only be ``http(s)://HOST[:PORT]``: no other scheme, credentials, path, query or fragment, no link-local or
    multicast address, and a loopback one only from the tracker's own machine, in whatever spelling of an IP a
    resolver reads."""
    from ggufswarm.tracker.app import url_problem

    remote = "10.0.0.9"
    for url in ("http://10.0.0.5:8471", "https://node.example:443", "http://node-b:5", "http://[2001:db8::1]:80/"):
        assert url_problem(url, remote) is None, url
    for url, why in (
        ("file:///etc/passwd", "http(s)://HOST:PORT"),
        ("gopher://10.0.0.5:70", "http(s)://HOST:PORT"),
        ("http://10.0.0.5:99999", "http(s)://HOST:PORT"),
        ("http://user:pw@10.0.0.5:1", "no user, path"),
        ("http://10.0.0.5:1/path?x=", "no user, path"),
        ("http://10.0.0.5:1#x", "no user, path"),
        ("http://169.254.169.254:80", "link-local"),
        ("http://[::ffff:169.254.169.254]:80", "link-local"),
        ("http://[fe80::1]:80", "link-local"),
        ("http://0.0.0.0:8475", "unspecified"),
        ("http://224.0.0.1:80", "multicast"),
        ("http://127.0.0.1:8475", "loopback-only"),
        ("http://localhost:8475", "loopback-only"),
        ("http://[::1]:8475", "loopback-only"),
        ("http://[::ffff:127.0.0.1]:8475", "loopback-only"),
        ("http://127.1:8475", "loopback-only"),
        ("http://0x7f000001:8475", "loopback-only"),
        ("http://2130706433:8475", "loopback-only"),
    ):
        said = url_problem(url, remote)
        assert said is not None and why in said, (url, said)
    assert url_problem("http://127.0.0.1:8475", "127.0.0.1") is None  # a node on the tracker's own machine
    with tracker() as url:
        status, body = call(f"{url}/nodes/heartbeat", "POST", ad("odd", url="http://user:pw@10.0.0.5:1"))
        assert status == 400 and body["error"]["code"] == "bad_advertisement", body
        assert key("odd") not in listed(url)
