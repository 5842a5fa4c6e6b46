"""How a node is reached from outside its home network, decided once it listens: a dial-back check, a port mapping
on the home router (UPnP IGD / NAT-PMP, through libtorrent), or a relay — and the address it advertises for each.

``--reach direct`` (the default) advertises ``--public-host`` (or ``--host``) as it is. ``--reach auto`` tries, in
order, a dial-back (``direct``), a port mapping and a dial-back (``mapped``), then a relay (``relayed``): see
docs/protocol.md, "Reaching nodes behind NATs"."""

from __future__ import annotations

import asyncio
import sys
from dataclasses import dataclass
from urllib.parse import urlsplit

from ..net.reach import ReachError, check_reachable
from ..net.relay import RelayError
from ..net.relay_client import RelayClient
from .state import NodeState

MAP_TIMEOUT_S = 10.0  # most seconds to wait for the home router to map a port (UPnP discovery + NAT-PMP)
PATHS = ("direct", "mapped", "relayed")


class UnreachableError(RuntimeError):
    """This node cannot be dialled from outside and has no relay to attach to (the message says what was tried)."""


@dataclass
class Reach:
    """How others reach a node: ``url`` they dial (``http://HOST:PORT``), ``path`` (one of PATHS), ``via`` (the relay's
    URL when relayed), ``torrent`` (``"HOST:PORT"`` BitTorrent peers connect to; None: it only connects out)."""

    url: str
    path: str = "direct"
    via: str | None = None
    torrent: str | None = None

    def to_json(self) -> dict:
        """``{"path", "via", "torrent"}`` as advertisements and ``/health`` carry it."""
        return {"path": self.path, "via": self.via, "torrent": self.torrent}


def _say(text: str) -> None:
    print(f"ggufswarm node: {text}", file=sys.stderr, flush=True)


async def helpers(state: NodeState) -> list[str]:
    """URLs that can dial this node back: its trackers, its relays, then nodes the DHT lists (not itself)."""
    out = [t.url for t in state.trackers]
    out += list(state.config.relays)
    if state.directory is not None and state.discovery is not None:
        try:
            out += [str(a["url"]) for a in await state.directory.dht_nodes(state.client, fresh=True)]
        except (RuntimeError, OSError) as exc:  # a DHT that cannot be asked only removes candidates
            _say(f"DHT lookup for dial-back helpers failed: {exc}")
    return list(dict.fromkeys(u.rstrip("/") for u in out))


async def dial_back(state: NodeState, port: int, candidates: list[str]):
    """The first answer of a helper in ``candidates`` asked to dial ``port`` back (``net.reach.Reachability``);
    None when no helper answered."""
    for url in candidates:
        try:
            return await check_reachable(state.client, url, port, state.config.token)
        except ReachError as exc:
            _say(f"dial-back helper {url} did not answer ({exc})")
    return None


async def map_port(state: NodeState, port: int) -> int | None:
    """Ask the home router to forward TCP ``port`` (libtorrent's UPnP / NAT-PMP client on this node's swarm
    session, ``net.portmap``); the external port, or None when no router maps it within MAP_TIMEOUT_S."""
    mapper = state.port_mapper
    if mapper is None:
        return None
    got = await asyncio.get_running_loop().run_in_executor(None, mapper.map, port, MAP_TIMEOUT_S)
    if got is None:
        return None
    _say(f"the home router mapped port {port} to {got[0]} ({got[1]})")
    return got[0]


async def establish(state: NodeState, local_url: str) -> Reach:
    """How this node is reached (docs/protocol.md, "Reaching nodes behind NATs"); ``local_url``: where it listens.
    Raises UnreachableError with ``--reach auto`` when neither a dial-back, a mapping nor a relay works."""
    cfg = state.config
    port = urlsplit(local_url).port
    torrent_port = state.swarm.port if state.swarm is not None else None
    if cfg.reach != "auto":
        host = cfg.public_host or urlsplit(local_url).hostname
        return Reach(f"http://{host}:{port}", "direct", None, f"{host}:{torrent_port}" if torrent_port else None)
    candidates = await helpers(state)
    if not candidates and not cfg.relays:
        raise UnreachableError(
            "--reach auto needs a helper to dial this node back: a tracker, a relay (--relay-via) or DHT contacts"
        )
    _say(f"--reach auto: asking {', '.join(candidates) or 'no helper'} to dial port {port} back")
    seen = await dial_back(state, port, candidates)
    if seen is not None and seen.reachable:
        host = cfg.public_host or seen.observed_ip
        return Reach(f"http://{host}:{port}", "direct", None, f"{host}:{torrent_port}" if torrent_port else None)
    tried = [f"dial-back: {seen.error if seen is not None else 'no helper answered'}"]
    _say(f"not reachable ({tried[0]}); asking the home router to map the port (UPnP / NAT-PMP)")
    external = await map_port(state, port) if seen is not None else None  # without a helper it could not be checked
    if external is not None:
        mapped = await dial_back(state, external, candidates)
        if mapped is not None and mapped.reachable:
            torrent = await map_port(state, torrent_port) if torrent_port else None
            return Reach(
                f"http://{mapped.observed_ip}:{external}",
                "mapped",
                None,
                f"{mapped.observed_ip}:{torrent}" if torrent else None,
            )
        tried.append(f"port {external} mapped by the router, still not reachable")
    elif seen is not None:
        tried.append("no UPnP / NAT-PMP router mapped the port")
    for relay in cfg.relays or ([cfg.tracker] if cfg.tracker else []):

        async def moved(host: str, new_port: int, relay=relay) -> None:  # re-attached elsewhere: advertise it
            state.reach = Reach(f"http://{host}:{new_port}", "relayed", relay, None)
            state.url = state.reach.url
            state.readvertise()

        # the relay announces this node on the DHT for it (its own announce would name this NAT's address)
        query = f"?announce={cfg.model_id}" if cfg.model_id else ""
        _say(f"attaching to relay {relay}")
        client = RelayClient(relay + query, port, cfg.token, moved)
        try:
            host, public = await client.start(state.client)
        except RelayError as exc:
            tried.append(f"relay {relay}: {exc}")
            continue
        state.relay_client = client
        return Reach(f"http://{host}:{public}", "relayed", relay.rstrip("/"), None)
    raise UnreachableError("this node cannot be dialled from outside: " + "; ".join(tried))


__all__ = ["PATHS", "Reach", "UnreachableError", "establish"]
