"""Tracker HTTP service: node registry with heartbeats, manifests, BitTorrent announce, route queries, status page."""

from __future__ import annotations

import json
import logging
import socket
import struct
from collections import Counter
from dataclasses import dataclass
from urllib.parse import unquote_to_bytes, urlsplit

import libtorrent as lt
from aiohttp import web

from ..artifact.manifest import Manifest
from ..directory.routing import (
    Advertisement,
    NoRoute,
    check_signed,
    free_kv_tokens,
    parse_measured,
    plan_route,
    route_context,
    route_wire_bytes_per_token,
)
from ..net.addresses import ip_of, is_loopback
from ..net.auth import token_middleware
from ..net.http import json_errors_middleware, read_json
from ..net.identity import IdentityError
from ..net.reach import RateLimit, add_dialback_route, add_probe_route, prove, skip_public_paths
from ..net.relay import RELAY, add_relay_routes
from ..protocol.errors import ProtocolError
from .bans import add_ban_routes
from .registry import NODE_STATES, Registry, StaleAdvertisement

log = logging.getLogger(__name__)

ANNOUNCE_INTERVAL_S = 5
REPORT_PROBE_S = 2.0  # how long POST /nodes/report waits for the reported node's answer to its challenge
REPORTS_PER_MIN = 30  # reports one address may make a minute (each may dial a node)


@dataclass
class TrackerConfig:
    """``db``: SQLite path (``:memory:`` keeps nothing); ``ttl_s``: node/peer expiry; ``hop_ms``: assumed
    network latency per hop for route planning."""

    db: str = "tracker.sqlite"
    ttl_s: float = 15.0
    hop_ms: float = 1.0
    token: str | None = None  # swarm token required on every endpoint (None: an open swarm)
    relay: bool = False  # also relay for nodes that cannot be dialled (net/relay.py)
    public_host: str | None = None  # with relay: the address relayed nodes are reached at (default: 127.0.0.1)
    host: str = "127.0.0.1"  # where it listens: relayed nodes' ports are opened on this address too
    operator_token: str | None = None  # the operator's credential (lift bans, remove nodes); None: nobody may
    witness_age_s: float = 300.0  # a ban's witnesses must have served their layers here this long (tracker/bans.py)


async def _json_body(request: web.Request) -> dict:
    """The body as a JSON object; ProtocolError ``bad_json`` (400) otherwise, ``body_too_large`` (413)."""
    return await read_json(request, code="bad_json")


def make_app(config: TrackerConfig) -> web.Application:
    """The tracker as an aiohttp app (tests drive it in process; ``ggufswarm tracker`` serves it)."""
    app = web.Application(
        client_max_size=64 << 20,
        middlewares=[skip_public_paths(token_middleware(config.token)), json_errors_middleware()],
    )
    registry = Registry(config.db, config.ttl_s)
    routed: Counter[str] = Counter()  # sessions handed each node (load spreading)
    reports = RateLimit(REPORTS_PER_MIN)

    def n_layers(model: str) -> int | None:
        found = registry.manifest(model)
        return Manifest.from_json(found[0]).n_layers if found else None

    layer_counts: dict[str, int | None] = {}  # published name -> its layer count (a heartbeat reads no manifest)

    def layers_of(model: str) -> int | None:
        if model not in layer_counts:
            layer_counts[model] = n_layers(model)
        return layer_counts[model]

    async def heartbeat(request: web.Request) -> web.Response:
        """``POST /nodes/heartbeat``: a node's signed advertisement. 400 bad_advertisement for a malformed one, then
        401 bad_signature when its ``sig`` does not verify against its ``node_id`` or its ``signed_at`` is over 300 s
        from this clock, 403 banned for a banned key, 409 stale_advertisement when it was signed before the newest
        one taken from that key (a replay; a copy of the newest changes nothing), 429 too_many_nodes for a new key
        past the registry's bounds (per address and in all)."""
        b = await _json_body(request)
        try:
            ad = Advertisement.from_json(b)
            if not (0 <= ad.free_kv_tokens < 2**62 and 0.0 <= ad.decode_ms < 1e9 and ad.layers[1] < 2**31):
                raise ValueError("free_kv_tokens, decode_ms and layers must be finite, non-negative and in range")
            if ad.state not in NODE_STATES or not 0 <= ad.layers[0] <= ad.layers[1]:
                raise ValueError(f"state must be one of {', '.join(NODE_STATES)} and layers a range [start, end]")
            free_kv_tokens(ad)  # a malformed extra.accounting is refused here, not while planning
            why = url_problem(ad.url, request.remote) or stages_problem(ad, layers_of(ad.model))
            if why:
                raise ValueError(why)
        except (KeyError, TypeError, ValueError, IndexError, OverflowError) as exc:
            raise ProtocolError("bad_advertisement", f"bad advertisement: {exc}") from None
        try:
            check_signed(b)
        except IdentityError as exc:
            raise ProtocolError("bad_signature", f"advertisement of node {ad.node_id[:16]}…: {exc}") from None
        if registry.banned(ad.node_id):
            raise ProtocolError("banned", f"node key {ad.node_id[:16]}… is banned from this swarm")
        try:
            registry.heartbeat(ad, signed_at=float(b["signed_at"]), source=request.remote)
        except StaleAdvertisement as exc:
            raise ProtocolError("stale_advertisement", f"advertisement of node {ad.node_id[:16]}…: {exc}") from None
        except OverflowError as exc:
            raise ProtocolError(
                "too_many_nodes", f"advertisement of node {ad.node_id[:16]}… not taken: {exc}"
            ) from None
        return web.json_response({"ok": True, "ttl_s": config.ttl_s})

    async def report(request: web.Request) -> web.Response:
        """``POST /nodes/report {"url"}``: a client saw this node fail. The tracker checks the node itself: it asks
        ``GET URL/v1/reach/probe?challenge=…`` (2 s; no swarm token is sent, no redirect followed) for a signature
        by the key advertised there, and drops the advertisements at ``url`` at once when none comes, instead of
        after the heartbeat TTL; a node that answers stays (a report alone removes nothing), and another key advertised
        at the same address is dropped (each key proves itself at its own address). Only an address a node
        advertises is ever dialled, and whatever else listens there looks the same as nothing: the answer says
        whether the *node* answered, never whether a port is open. 404 for a URL no node advertises, 429
        rate_limited past REPORTS_PER_MIN a minute from one address; 200 ``{"url", "alive", "removed"}``."""
        b = await _json_body(request)
        url = str(b.get("url", "")).rstrip("/")
        ads = [a for a in registry.nodes() if a.url.rstrip("/") == url]
        if not url or not ads:
            raise ProtocolError("unknown_node", f"no node advertises {url!r}")
        if not reports.allow(request.remote or ""):
            raise ProtocolError("rate_limited", f"at most {REPORTS_PER_MIN} reports a minute from one address")
        key, reason = await prove(url, REPORT_PROBE_S)
        alive = key in {a.node_id for a in ads}
        if key is not None and not alive:
            reason = "what answers there is not the node advertised at that address"
        removed = sum(registry.deregister(a.node_id) for a in ads if a.node_id != key)  # each key proves itself
        if removed:
            why = reason or "another key answers there"
            log.warning("node %s reported failing: dropped %d advertisement(s) not proven there: %s", url, removed, why)
        return web.json_response({"url": url, "alive": alive, "removed": removed})

    async def nodes(request: web.Request) -> web.Response:
        return web.json_response({"nodes": [a.to_json() for a in registry.nodes(request.query.get("model"))]})

    async def put_manifest(request: web.Request) -> web.Response:
        name = request.match_info["name"]
        b = await _json_body(request)
        try:
            manifest = Manifest.from_json(json.dumps(b["manifest"]))
            torrent = bytes.fromhex(b["torrent_hex"])
            info_hash = str(lt.torrent_info(lt.bdecode(torrent)).info_hashes().v1)
        except (KeyError, TypeError, ValueError, RuntimeError) as exc:
            raise ProtocolError("bad_manifest", f"bad manifest or torrent: {exc}") from None
        registry.put_manifest(name, manifest.to_json(), torrent, info_hash)
        layer_counts.pop(name, None)
        return web.json_response({"ok": True, "info_hash": info_hash})

    async def get_manifest(request: web.Request) -> web.Response:
        found = registry.manifest(request.match_info["name"])
        if not found:
            raise ProtocolError("unknown_model", f"no model named {request.match_info['name']!r} is published")
        return web.json_response({"manifest": json.loads(found[0]), "torrent_hex": found[1].hex()})

    async def announce(request: web.Request) -> web.Response:
        # info_hash and peer_id are raw bytes, URL-encoded: parse the raw query, not the str-decoded one
        q = dict(
            (k, unquote_to_bytes(v))
            for k, v in (part.split("=", 1) for part in request.query_string.split("&") if "=" in part)
        )
        try:
            info_hash, peer_id, port = q["info_hash"], q["peer_id"], int(q["port"])
            left = int(q.get("left", b"0") or 0)
        except (KeyError, ValueError):
            return web.Response(body=lt.bencode({"failure reason": b"info_hash, peer_id and port are required"}))
        if len(info_hash) != 20 or not 0 < port < 65536:
            return web.Response(body=lt.bencode({"failure reason": b"bad info_hash or port"}))
        ip = request.remote or "127.0.0.1"
        peers = registry.announce(info_hash, peer_id, ip, port, left, q.get("event", b"").decode("latin-1"))
        local = is_loopback(ip)  # a peer that announced from loopback is reached on this machine only
        compact = b"".join(
            socket.inet_aton(p_ip) + struct.pack(">H", p_port)
            for p_ip, p_port in peers
            if ":" not in p_ip and (local or not is_loopback(p_ip))
        )
        return web.Response(
            body=lt.bencode({"interval": ANNOUNCE_INTERVAL_S, "min interval": 1, "peers": compact}),
            content_type="text/plain",
        )

    async def swarm_peers(request: web.Request) -> web.Response:
        """``GET /peers?model=NAME``: the BitTorrent peers of the model's torrent as they announced themselves here
        (``{"peers": [{"ip", "port", "left"}]}``, seeds first: what a stalled fetch names); 404 unknown_model."""
        name = request.query.get("model", "")
        found = registry.manifest(name)
        if not found:
            raise ProtocolError("unknown_model", f"no model named {name!r} is published")
        info = json.loads(found[0]).get("info_hash") or ""
        try:
            key = bytes.fromhex(info)
        except ValueError:
            key = b""
        return web.json_response({"peers": registry.peers(key) if len(key) == 20 else []})

    async def route(request: web.Request) -> web.Response:
        model = request.query.get("model", "")
        try:
            max_length = int(request.query.get("max_length", "1"))
        except ValueError:
            raise ProtocolError("bad_request", "max_length must be an integer") from None
        layers = n_layers(model)
        if layers is None:
            raise ProtocolError("unknown_model", f"no model named {model!r} is published")
        exclude = {u.rstrip("/") for u in request.query.get("exclude", "").split(",") if u}
        try:
            span = (int(request.query.get("start", "0")), int(request.query.get("end", str(layers))))
        except ValueError:
            raise ProtocolError("bad_request", "start and end must be layer indices") from None
        try:
            measured = parse_measured(request.query.get("measured", ""))
        except ValueError as exc:
            raise ProtocolError("bad_request", str(exc)) from None
        try:
            ads = [a for a in registry.nodes(model) if a.url.rstrip("/") not in exclude]
            chain = plan_route(ads, layers, max_length, config.hop_ms, routed, span, measured)
        except NoRoute as exc:
            raise ProtocolError("no_route", f"{model}: {exc}") from None
        routed.update(a.node_id for a in chain)
        return web.json_response(
            {
                "model": model,
                "route": [a.to_json() for a in chain],
                "context": route_context(chain),
                "wire_bytes_per_token": route_wire_bytes_per_token(chain),
            }
        )

    async def models(request: web.Request) -> web.Response:
        """``GET /models``: ``{"models": [servable now, end to end], "published": [...], "unservable": {name:
        why}}`` (why: the planner's NoRoute reason, which names layers, never addresses)."""
        out, why = [], {}
        for name in registry.manifest_names():
            try:
                plan_route(registry.nodes(name), n_layers(name), 1, config.hop_ms)
                out.append(name)
            except NoRoute as exc:
                why[name] = str(exc)
        return web.json_response({"models": out, "published": registry.manifest_names(), "unservable": why})

    async def status_json(request: web.Request) -> web.Response:
        return web.json_response(status_snapshot(registry))

    async def index(request: web.Request) -> web.Response:
        return web.Response(text=STATUS_PAGE, content_type="text/html")

    app.add_routes(
        [
            web.post("/nodes/heartbeat", heartbeat),
            web.get("/nodes", nodes),
            web.post("/nodes/report", report),
            web.put("/manifests/{name}", put_manifest),
            web.get("/manifests/{name}", get_manifest),
            web.get("/announce", announce),
            web.get("/peers", swarm_peers),
            web.get("/route", route),
            web.get("/models", models),
            web.get("/status.json", status_json),
            web.get("/", index),
        ]
    )
    add_ban_routes(app, registry, config.operator_token, config.witness_age_s)
    app.on_cleanup.append(lambda _app: _close(registry))
    add_dialback_route(app)  # nodes behind NATs ask whether they can be dialled (node/reach.py)
    add_probe_route(app)
    if config.relay:
        app[RELAY] = add_relay_routes(app, config.public_host or "127.0.0.1", config.host)
    return app


def url_problem(url: str, source: str | None) -> str | None:
    """Why a node may not be advertised at ``url``, heard from address ``source``; None when it may. A node's URL is
    ``http(s)://HOST:PORT`` and nothing more (the tracker dials it when a node is reported: no credentials, path or
    query of an advertiser's choosing), not a link-local, multicast or unspecified address, and a loopback one only
    from this machine (another cannot be reached there)."""
    parts = urlsplit(url)
    try:
        parts.port  # noqa: B018 (a port out of range or not a number raises)
    except ValueError:
        return f"url must be http(s)://HOST:PORT, got {url[:80]!r}"
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return f"url must be http(s)://HOST:PORT, got {url[:80]!r}"
    if parts.username or parts.password or parts.query or parts.fragment or parts.path not in ("", "/"):
        return f"url is http(s)://HOST:PORT with no user, path, query or fragment, got {url[:80]!r}"
    ip = ip_of(parts.hostname)
    if ip is not None and (ip.is_link_local or ip.is_multicast or ip.is_unspecified):
        return f"url {url[:80]!r} is a link-local, multicast or unspecified address: no node is reached there"
    loopback = parts.hostname == "localhost" or (ip is not None and ip.is_loopback)
    if loopback and source and not is_loopback(source):
        return f"url {url[:80]!r} is loopback-only, advertised from {source}: no other machine reaches it there"
    return None


def stages_problem(ad: Advertisement, n_layers: int | None) -> str | None:
    """Why ``ad``'s stages do not fit its model of ``n_layers`` layers (None when they do, or the model is not
    published here): a head that does not end at the last layer, an embedding stage that does not start at 0."""
    if n_layers is not None and ad.head and ad.layers[1] != n_layers:
        return f"a head (--head) serves layers up to {n_layers}, the model's last, not {ad.layers[0]}:{ad.layers[1]}"
    if ad.embed and ad.layers[0] != 0:
        return f"an embedding stage (--embed) serves layers from 0, not {ad.layers[0]}:{ad.layers[1]}"
    return None


async def _close(registry: Registry) -> None:
    registry.close()


def status_snapshot(registry: Registry) -> dict:
    """Per published model: layer count and live nodes (for ``ggufswarm status`` and the page)."""
    out = {}
    for name in registry.manifest_names():
        found = registry.manifest(name)
        out[name] = {
            "n_layers": Manifest.from_json(found[0]).n_layers,
            "nodes": [a.to_json() for a in registry.nodes(name)],
        }
    return {"models": out}


def coverage_bar(n_layers: int, layers: tuple[int, int], width: int = 36) -> str:
    """Text bar: ``█`` over the layers a node serves, ``·`` elsewhere, ``width`` characters."""
    cells = []
    for i in range(width):
        layer = i * n_layers // width
        cells.append("█" if layers[0] <= layer < layers[1] else "·")
    return "".join(cells)


STATUS_PAGE = """<!doctype html>
<html><head><meta charset="utf-8"><title>ggufswarm tracker</title>
<style>
body{font:14px system-ui,sans-serif;margin:2em;color:#222}
h2{margin-top:1.5em} table{border-collapse:collapse}
td,th{padding:4px 10px;text-align:left;border-bottom:1px solid #ddd}
.bar{display:flex;width:360px;height:14px;background:#eee;border-radius:3px;overflow:hidden}
.seg{height:100%} .ready{background:#2a9d8f} .loading{background:#e9c46a} .fetching{background:#f4a261}
</style></head><body>
<h1>ggufswarm tracker</h1><div id="models">loading…</div>
<noscript>This page draws the live view with JavaScript; the same data is at <a href="/status.json">/status.json</a>.</noscript>
<script>
const esc = (t) => String(t).replace(/[&<>"']/g, (c) => ({'&':'&amp;','<':'&lt;','>':'&gt;','"':'&quot;',"'":'&#39;'}[c]));
async function refresh(){
  const r = await fetch('/status.json' + location.search); const s = await r.json(); let h = '';
  for (const [name, m] of Object.entries(s.models)) {
    h += `<h2>${esc(name)} <small>(${m.n_layers} layers, ${m.nodes.length} nodes)</small></h2>`;
    h += '<table><tr><th>node</th><th>layers</th><th>coverage</th><th>state</th><th>free KV tokens</th><th>decode ms</th></tr>';
    for (const n of m.nodes) {
      const left = 100 * n.layers[0] / m.n_layers, w = 100 * (n.layers[1] - n.layers[0]) / m.n_layers;
      h += `<tr><td>${esc(n.url)}</td><td>${n.layers[0]}:${n.layers[1]}${n.embed ? ' +embed' : ''}${n.head ? ' +head' : ''}</td>`
         + `<td><div class="bar"><div class="seg" style="width:${left}%"></div>`
         + `<div class="seg ${n.state}" style="width:${w}%"></div></div></td>`
         + `<td>${esc(n.state)}</td><td>${esc(n.free_kv_tokens)}</td><td>${Number(n.decode_ms || 0).toFixed(1)}</td></tr>`;
    }
    h += '</table>';
  }
  document.getElementById('models').innerHTML = h || 'no models published yet';
}
refresh(); setInterval(refresh, 2000);
</script></body></html>
"""
