"""How a node is found without a tracker: its advertisement over the API, its DHT announces (and those it makes for
the nodes it relays), and hellos to the peers it knows (``POST /v1/peers``), so that a node that joined a moment ago
is listed by its peers before its DHT announce has spread (docs/protocol.md, "Discovery without a tracker")."""

from __future__ import annotations

import asyncio
import itertools
import time
import weakref

import aiohttp
from aiohttp import web

from ..directory.lookup import DirectoryError
from ..directory.routing import Advertisement, check_signed
from ..net.auth import auth_headers
from ..net.http import read_json
from ..net.identity import IdentityError
from ..protocol import ProtocolError
from .advertise import advertisement
from .state import NODE, NodeState, json_response

PEER_TTL_S = 90.0  # a peer's hello is passed on this long (s) unless it says hello again
HELLO_SCHEDULE_S = (0.0, 3.0, 10.0)  # after the node knows its address: hellos at these times (s), then every ...
HELLO_EVERY_S = 30.0
HELLO_TIMEOUT_S = 2.0
MAX_HEARD = 256  # peers remembered at once (the oldest are forgotten)
HEARD_KEYS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # NodeState -> {peer URL: its node key}


async def advertisement_route(request: web.Request) -> web.Response:
    """``GET /v1/advertisement``: this node's shard advertisement, as the tracker gets it (node/advertise.py): how a
    gateway or node that found it on the DHT learns its range, free KV and how to reach it; signed with the node's
    key (``sig``, ``signed_at``). ``?peers=1`` adds ``peers`` (outside the signed fields): the URLs of the peers that
    said hello lately and whose keys are not banned since. 503 before it knows its public address."""
    state: NodeState = request.app[NODE]
    if not state.url:
        raise ProtocolError("not_ready", "this node does not know its public address yet")
    body = advertisement(state)
    if request.query.get("peers"):  # the peers that said hello lately (directory.lookup reads them too)
        now, keys = time.monotonic(), HEARD_KEYS.get(state, {})
        banned = state.directory.banned if state.directory is not None else frozenset()
        body["peers"] = [u for u, until in state.heard.items() if until > now and keys.get(u) not in banned]
    return json_response(body)


async def hello_route(request: web.Request) -> web.Response:
    """``POST /v1/peers`` with a node's signed advertisement: remember its URL for PEER_TTL_S seconds and pass it on
    to whoever lists this node's peers (``GET /v1/advertisement?peers=1``). Only a URL is kept: readers fetch each
    peer's advertisement from the peer itself (and check its signature again). 400 bad_request for a body that is
    not an advertisement of this node's model; 401 bad_signature when it is not signed by its ``node_id``'s key
    within 300 s of this clock; 403 banned for a key this node's directory (its trackers' bans) refuses."""
    state: NodeState = request.app[NODE]
    body = await read_json(request)
    try:
        ad = Advertisement.from_json(body)
    except (KeyError, TypeError, ValueError, IndexError):
        raise ProtocolError("bad_request", "a hello is a shard advertisement (GET /v1/advertisement's body)") from None
    try:
        check_signed(body)
    except IdentityError as exc:
        raise ProtocolError("bad_signature", f"hello from {ad.url[:80]}: {exc}") from None
    if state.directory is not None and ad.node_id in state.directory.banned:
        raise ProtocolError("banned", f"node key {ad.node_id[:16]}… is banned from this swarm")
    model = state.config.swarm_name or state.config.model
    if ad.model != model or not ad.url.startswith(("http://", "https://")):
        raise ProtocolError("bad_request", f"a hello for model {ad.model!r} at {ad.url!r}; this node serves {model!r}")
    now = time.monotonic()
    state.heard = {u: t for u, t in state.heard.items() if t > now}
    keys = HEARD_KEYS.setdefault(state, {})
    for gone in set(keys) - set(state.heard):
        del keys[gone]
    if ad.url != state.url and (ad.url in state.heard or len(state.heard) < MAX_HEARD):
        state.heard[ad.url] = now + PEER_TTL_S
        keys[ad.url] = ad.node_id
    return json_response({"ok": True})


async def hellos(state: NodeState) -> None:
    """Say hello (``POST /v1/peers``, this node's advertisement) to every node the directory lists, at
    HELLO_SCHEDULE_S after the node knows its address and every HELLO_EVERY_S after; failures are ignored."""
    while not state.url:
        await asyncio.sleep(0.2)
    began = time.monotonic()
    later = (HELLO_SCHEDULE_S[-1] + HELLO_EVERY_S * k for k in itertools.count(1))
    for at in itertools.chain(HELLO_SCHEDULE_S, later):
        await asyncio.sleep(max(began + at - time.monotonic(), 0.0))
        try:
            listed = await state.directory.nodes(state.client)
        except DirectoryError:
            continue
        own = advertisement(state)
        targets = {str(a["url"]).rstrip("/"): str(a.get("node_id")) for a in listed}
        targets.pop(state.url, None)
        await asyncio.gather(*(_hello(state, url, key, own) for url, key in targets.items()))


async def _hello(state: NodeState, url: str, key: str, own: dict) -> None:
    """Say hello to the node listed at ``url`` with ``key``, once it proved to hold that key (the hello carries the
    swarm token: never to an address an advertisement merely names)."""
    if await state.proven.check(url, key, HELLO_TIMEOUT_S) is not None:
        return
    try:
        async with state.client.post(
            url + "/v1/peers",
            json=own,
            headers=auth_headers(state.config.token),
            timeout=aiohttp.ClientTimeout(total=HELLO_TIMEOUT_S),
        ) as r:
            await r.read()
    except (TimeoutError, aiohttp.ClientError):
        pass


def announce_relayed(state: NodeState, event: str, request: web.Request, port: int) -> None:
    """A relay announces the nodes it relays on the DHT (at its own address and the port it holds for each), when
    they ask for it (``?announce=MODEL_ID`` on the attach) and serve this node's model."""
    model_id = request.query.get("announce")
    if state.discovery is None or not model_id or model_id != state.config.model_id:
        return
    from ..net.dht import swarm_key

    if event == "attached":
        state.discovery.announce(port, swarm_key(model_id))
    else:
        state.discovery.stop_announcing(port)


async def announce(state: NodeState) -> None:
    """Announce this node on the DHT under its model's key once it knows its public address, and again whenever
    that changes (net.dht.Discovery re-announces it periodically). A relayed node is announced by its relay."""
    from ..net.dht import swarm_key

    announced = None
    while True:
        reach = state.reach
        if reach is not None and reach.path != "relayed" and state.config.model_id:
            port = int(reach.url.rsplit(":", 1)[1])
            if port != announced:
                if announced is not None:
                    state.discovery.stop_announcing(announced)
                state.discovery.announce(port, swarm_key(state.config.model_id))
                announced = port
        await asyncio.sleep(1.0)


__all__ = ["advertisement_route", "announce", "announce_relayed", "hello_route", "hellos"]
