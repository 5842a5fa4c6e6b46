"""Finding nodes without a tracker: announce and look up node endpoints on a private BitTorrent DHT (BEP 5).

Nodes announce their HTTP port under a key derived from the model's identity (``swarm_key``); gateways and nodes
look it up, with libtorrent's ``dht_announce`` and ``dht_get_peers``. The DHT bootstraps only from the contacts a join
link gives, with the public DHT's per-IP rules relaxed; an entry may outlive its node, so consumers contact each
endpoint before trusting it. ``Discovery`` owns its session's only alert pump: anything else that wants that
session's alerts must ``subscribe``. Settings and why: docs/protocol.md, "Discovery without a tracker"."""

from __future__ import annotations

import asyncio
import atexit
import hashlib
import logging
import threading
import time
from dataclasses import dataclass, field

import libtorrent as lt

log = logging.getLogger(__name__)

PUBLIC_ROUTER = "dht.libtorrent.org:25401"  # libtorrent's default dht_bootstrap_nodes: never used here
KEY_PREFIX = b"ggufswarm/nodes/1/"
# For sessions that keep the DHT off: no bootstrap list either, so turning DHT on later cannot reach the public one.
NO_PUBLIC_BOOTSTRAP = {"enable_dht": False, "dht_bootstrap_nodes": ""}
DHT_ALERTS = (
    lt.alert_category.dht | lt.alert_category.dht_operation | lt.alert_category.error | lt.alert_category.status
)
_MESSAGES_IN, _MESSAGES_OUT = "dht.dht_messages_in", "dht.dht_messages_out"


class DHTError(RuntimeError):
    """The DHT cannot be used: it is off in this session, or the Discovery was closed."""


def parse_contact(contact: str) -> tuple[str, int]:
    """``"host:port"`` (``"[v6]:port"`` for IPv6) as ``(host, port)``. Raises ValueError when malformed."""
    host, sep, port = contact.strip().rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"a DHT contact must be host:port with a port in 1..65535, got {contact!r}")
    return host, int(port)


def dht_settings(bootstrap: list[str], enabled: bool = True) -> dict:
    """libtorrent settings for a ggufswarm DHT, to merge into a session's settings pack.

    ``bootstrap``: ``"host:port"`` contacts (UDP), joined with commas into ``dht_bootstrap_nodes`` (libtorrent
    treats them as routers: used to bootstrap and when a lookup has fewer than 3 candidates, but never kept in
    the routing table). ``[]`` means no bootstrap at all: the session sends nothing until someone contacts it or
    ``Discovery.add_contacts`` is called. ``enabled=False`` gives the DHT-off settings (still no public router).
    Raises ValueError for a malformed contact.
    """
    for contact in bootstrap:
        parse_contact(contact)
    if not enabled:
        return dict(NO_PUBLIC_BOOTSTRAP, enable_lsd=False)
    return {
        "enable_dht": True,
        "dht_bootstrap_nodes": ",".join(c.strip() for c in bootstrap),
        "enable_lsd": False,  # multicast on the LAN: announces the session outside what the user asked for
        # many nodes share one IP (loopback, behind one NAT) or one /24 (a test network): keep them all
        "dht_restrict_routing_ips": False,
        "dht_restrict_search_ips": False,
        # BEP 42 (node id derived from the IP) cannot hold behind NATs or for private addresses
        "dht_enforce_node_id": False,
        "dht_prefer_verified_node_ids": False,
        # "dark internet" includes 10/8, 100.64/10, 127/8, 172.16/12, 192.168/16, 198.18/15: our networks
        "dht_ignore_dark_internet": False,
        # the DoS blocker allows 5 queries/s per source IP: a NAT or loopback puts every node behind one IP
        "dht_block_ratelimit": 1000,
        "dht_max_fail_count": 2,  # a swarm node that stops answering leaves routing tables after 2 timeouts, not 20
        "dht_upload_rate_limit": 256 * 1024,
        "dht_max_peers_reply": 100,
        "dht_aggressive_lookups": True,
        "dht_privacy_lookups": False,
        "dht_read_only": False,
    }


def swarm_key(model_id: str) -> lt.sha1_hash:
    """The 20-byte DHT key under which nodes serving ``model_id`` (a hex digest naming the model artifact)
    announce: ``sha1(b"ggufswarm/nodes/1/" + model_id)``. ``bytes(key.to_bytes())`` gives the raw bytes."""
    return lt.sha1_hash(hashlib.sha1(KEY_PREFIX + model_id.encode()).digest())


def _as_key(key) -> lt.sha1_hash:
    if isinstance(key, lt.sha1_hash):
        return key
    if isinstance(key, (bytes, bytearray)) and len(key) == 20:
        return lt.sha1_hash(bytes(key))
    raise TypeError(f"a DHT key is 20 bytes or an lt.sha1_hash, got {key!r}")


@dataclass
class _Lookup:
    key: str  # hex
    first_stats: int  # index of the first dht_stats_alert requested after dht_get_peers
    peers: dict = field(default_factory=dict)  # (host, port) -> None, in arrival order
    done: bool = False


class Discovery:
    """Announce and look up node endpoints on the DHT of one libtorrent session.

    Wraps an existing session (a node's ``Swarm.session``: its DHT is switched on with
    ``dht_settings(bootstrap)``, its alert mask widened to ``DHT_ALERTS``) or one it creates (``standalone``).
    Starts the session's alert pump thread; ``close`` stops it. Thread-safe.
    """

    def __init__(self, session: lt.session, bootstrap: list[str], *, owns_session: bool = False,
                 reannounce_s: float = 60.0, poll_s: float = 1.0):  # fmt: skip
        """``bootstrap``: DHT contacts ``"host:port"`` (may be empty). ``reannounce_s``: seconds between our own
        re-announces (libtorrent's storage forgets after 30 min). ``poll_s``: seconds between routing-table
        statistics polls. Raises ValueError for a malformed contact."""
        self.session = session
        self.owns_session = owns_session
        self.reannounce_s = reannounce_s
        self.poll_s = poll_s
        current = session.get_settings()
        session.apply_settings({"alert_mask": int(current.get("alert_mask", 0)) | int(DHT_ALERTS)})
        # only what differs: re-applying dht_bootstrap_nodes would make libtorrent bootstrap again
        session.apply_settings({k: v for k, v in dht_settings(bootstrap).items() if current.get(k) != v})
        self._cond = threading.Condition()
        self._announced: dict[tuple[str, int], list] = {}  # (key hex, port) -> [sha1_hash, next due (monotonic)]
        self._lookups: list[_Lookup] = []
        self._listeners: list = []
        self._stats_requested = 0  # dht_stats_alerts asked for / received: they come back in order
        self._stats_received = 0
        self._nodes = 0  # nodes in the routing table (last stats)
        self._messages_in = 0
        self._messages_out = 0
        self._bootstrap_done = False
        self._has_contacts = bool(bootstrap)
        self._connected = False
        self._closed = False
        self._next_poll = 0.0
        self._thread = threading.Thread(target=self._pump, name="dht-alert-pump", daemon=True)
        self._thread.start()
        # libtorrent treats dht_bootstrap_nodes as routers: asked only while a lookup has few candidates, never put
        # in the routing table nor sent announce_peer. In a small private DHT the contacts ARE the swarm's nodes:
        # add them as ordinary nodes too, so that announces are stored on them and lookups ask them
        for host, port in (parse_contact(c) for c in bootstrap):
            session.add_dht_node((host, port))
        atexit.register(self.close)  # a pump still waiting on a session at interpreter exit aborts the process

    @classmethod
    def standalone(cls, bind_host: str, port: int, bootstrap: list[str], **kw) -> Discovery:
        """A Discovery with its own session (a gateway's) listening on ``bind_host:port`` (UDP for the DHT, TCP
        unused; port 0: OS-chosen). UPnP/NAT-PMP/LSD off. ``close`` closes the session."""
        session = lt.session(
            {
                "listen_interfaces": f"[{bind_host}]:{port}" if ":" in bind_host else f"{bind_host}:{port}",
                "enable_upnp": False,
                "enable_natpmp": False,
                "alert_mask": int(DHT_ALERTS),
                **dht_settings(bootstrap),
            }
        )
        return cls(session, bootstrap, owns_session=True, **kw)

    # --- announcing -------------------------------------------------------------------------------------

    def announce(self, port: int, key) -> None:
        """Announce ``port`` (the public HTTP port of a node; a relay announces one port per relayed node) under
        ``key`` (``swarm_key``) now, again every ``reannounce_s`` seconds, once the DHT first answers and soon
        after ``add_contacts``.
        libtorrent's ``dht_announce`` (BEP 5 get_peers + announce_peer); the stored IP is our source address as
        the storing nodes see it. Several ports under one key are all stored. Raises ValueError for a port
        outside 1..65535, DHTError when closed."""
        if not 0 < int(port) < 65536:
            raise ValueError(f"port must be in 1..65535, got {port}")
        key = _as_key(key)
        with self._cond:
            self._check_open()
            self._announced[(str(key), int(port))] = [key, time.monotonic() + self.reannounce_s]
            self.session.dht_announce(key, int(port), 0)

    def stop_announcing(self, port: int, key=None) -> None:
        """Stop re-announcing ``port`` (under ``key``, or under every key when None). Entries already stored stay
        up to 30 min in the DHT (BEP 5 has no withdraw)."""
        hexkey = None if key is None else str(_as_key(key))
        with self._cond:
            for k in [k for k in self._announced if k[1] == int(port) and hexkey in (None, k[0])]:
                del self._announced[k]

    # --- looking up -------------------------------------------------------------------------------------

    def lookup(self, key, timeout_s: float = 5.0) -> list[tuple[str, int]]:
        """Endpoints ``(ip, port)`` stored under ``key``, deduplicated, in arrival order (blocking).

        Waits (within ``timeout_s`` seconds in all) for the DHT to have bootstrapped or been contacted, then runs
        one libtorrent ``dht_get_peers`` traversal (BEP 5 get_peers) and collects every
        ``dht_get_peers_reply_alert`` until the traversal settles (``post_dht_stats`` polled every 10 ms shows no
        get_peers traversal with nodes left to ask or requests younger than libtorrent's ~2 s short timeout;
        concurrent announces of this session count too and can delay that) or the timeout, whichever comes
        first: on timeout it returns what arrived. Raises DHTError when the DHT is off or Discovery is closed.
        """
        key = _as_key(key)
        deadline = time.monotonic() + timeout_s
        with self._cond:
            self._check_open()
            if not self.session.is_dht_running():
                raise DHTError("the DHT is not running in this session")
            if self._has_contacts:  # with none, there is nothing to wait for (no dht_bootstrap_alert either)
                self._cond.wait_for(lambda: self._bootstrap_done or self._connected or self._closed, timeout_s)
            self.session.dht_get_peers(key)
            job, asked = _Lookup(str(key), self._request_stats()), time.monotonic()
            self._lookups.append(job)
            try:
                while not job.done and not self._closed:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        log.debug(
                            "DHT lookup %s timed out after %.1f s with %d peers", job.key, timeout_s, len(job.peers)
                        )
                        break
                    self._cond.wait(min(left, max(asked + 0.01 - time.monotonic(), 0.001)))
                    if self._stats_received >= self._stats_requested and time.monotonic() >= asked + 0.01:
                        self._request_stats()  # ask again whether the traversal is still running
                        asked = time.monotonic()
            finally:
                self._lookups.remove(job)
            return list(job.peers)

    async def alookup(self, key, timeout_s: float = 5.0) -> list[tuple[str, int]]:
        """``lookup`` for asyncio code (runs it in the loop's default executor)."""
        return await asyncio.get_running_loop().run_in_executor(None, self.lookup, key, timeout_s)

    # --- contacts and state -----------------------------------------------------------------------------

    def add_contacts(self, contacts: list[str]) -> None:
        """Add DHT contacts ``"host:port"`` later (libtorrent ``add_dht_node``: pinged, kept in the routing table
        once they answer), and re-announce everything soon after. Raises ValueError for a malformed one."""
        parsed = [parse_contact(c) for c in contacts]
        with self._cond:
            self._check_open()
            for host, port in parsed:
                self.session.add_dht_node((host, port))
            self._has_contacts = self._has_contacts or bool(parsed)
            soon = time.monotonic() + 1.0  # once they have answered the ping
            for entry in self._announced.values():
                entry[1] = min(entry[1], soon)

    def wait_bootstrapped(self, timeout_s: float) -> bool:
        """True once this session is part of a DHT (within ``timeout_s`` seconds): a node in its routing table,
        or a DHT message received (a bootstrap contact is a libtorrent *router*, never put in the routing table,
        so in a two-session DHT the table stays empty). False on timeout."""
        with self._cond:
            self._next_poll = 0.0
            return self._cond.wait_for(lambda: self._connected or self._closed, timeout_s) and not self._closed

    @property
    def live_nodes(self) -> int:
        """Nodes in the routing table at the last poll (routers not counted)."""
        return self._nodes

    @property
    def messages(self) -> tuple[int, int]:
        """DHT messages (received, sent) by this session at the last poll (libtorrent session counters)."""
        return self._messages_in, self._messages_out

    def contact(self, host: str | None = None) -> str:
        """This session's DHT contact ``"host:port"`` for a join link: its UDP listen port (the same number as
        ``session.listen_port()``) on ``host``, by default the first listen interface. Raises DHTError when
        that is a wildcard address (pass the address others reach) or nothing listens."""
        self._check_open()
        port = self.session.listen_port()
        if host is None:
            first = self.session.get_settings()["listen_interfaces"].split(",")[0]
            host = first.rpartition(":")[0].strip("[]")
        if not port or host in ("", "0.0.0.0", "::"):
            raise DHTError(f"no reachable DHT contact to give (listening on {host or '?'}:{port}): pass host")
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    def subscribe(self, callback) -> None:
        """Call ``callback(alert)`` on the pump thread for every alert of the session (exceptions are logged).
        The only way for other code to see this session's alerts: nothing else may pop them."""
        with self._cond:
            self._listeners.append(callback)

    def close(self) -> None:
        """Stop announcing and the pump thread; close the session when this Discovery created it. Idempotent."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._announced.clear()
            self._cond.notify_all()
        atexit.unregister(self.close)
        self._thread.join(timeout=5)
        if self.owns_session:
            self.session.apply_settings({"enable_dht": False, "listen_interfaces": ""})
            self.session.pause()
            del self.session

    def __enter__(self) -> Discovery:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- the pump -------------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise DHTError("this Discovery is closed")

    def _request_stats(self) -> int:
        """Ask for a dht_stats_alert (under the lock); returns its index."""
        self._stats_requested += 1
        self.session.post_dht_stats()
        return self._stats_requested

    def _pump(self) -> None:
        while not self._closed:
            self.session.wait_for_alert(100)
            alerts = self.session.pop_alerts()
            with self._cond:
                if self._closed:
                    return
                listeners = list(self._listeners)
                for alert in alerts:
                    self._dispatch(alert)
                self._tick()
                self._cond.notify_all()
            for alert in alerts:
                for callback in listeners:
                    try:
                        callback(alert)
                    except Exception:
                        log.exception("DHT alert listener failed on %s", type(alert).__name__)

    def _dispatch(self, alert) -> None:
        if isinstance(alert, lt.dht_get_peers_reply_alert):
            key = str(alert.info_hash)
            peers = alert.peers()
            for job in self._lookups:
                if job.key == key:
                    job.peers.update((tuple(p), None) for p in peers)
        elif isinstance(alert, lt.dht_stats_alert):
            self._stats_received += 1
            self._nodes = sum(b["num_nodes"] for b in alert.routing_table)
            # a traversal has settled when nobody is left to ask and every request in flight is past libtorrent's
            # short timeout (~2 s: a dead contact would otherwise hold it up to the full 15 s rpc timeout)
            busy = any(
                "get_peers" in r["type"] and (r["nodes_left"] > 0 or r["outstanding_requests"] > r["first_timeout"])
                for r in alert.active_requests
            )
            for job in self._lookups:
                if not busy and self._stats_received >= job.first_stats:
                    job.done = True
            if self._nodes:
                self._set_connected()
        elif isinstance(alert, lt.session_stats_alert):
            values = alert.values
            self._messages_in, self._messages_out = values[_MESSAGES_IN], values[_MESSAGES_OUT]
            if self._messages_in:
                self._set_connected()
        elif isinstance(alert, lt.dht_bootstrap_alert):
            self._bootstrap_done = True
        elif isinstance(alert, lt.dht_announce_alert):
            log.debug("DHT: %s", alert.message())
        elif isinstance(alert, (lt.tracker_error_alert, lt.portmap_error_alert)):
            # a tracker that is down (the DHT carries on without it) or a home without a port-mapping router: the
            # commands say what that means once (node/reach.py, directory/trackers.py), not on every re-announce
            log.debug("libtorrent: %s", alert.message())
        elif alert.category() & lt.alert_category.error:
            log.warning("libtorrent: %s", alert.message())

    def _set_connected(self) -> None:
        if not self._connected:
            self._connected = True
            for entry in self._announced.values():
                entry[1] = 0.0  # announce again now that the DHT answers: earlier announces reached no one

    def _tick(self) -> None:
        now = time.monotonic()
        if now >= self._next_poll:
            self._next_poll = now + (self.poll_s if self._connected else min(self.poll_s, 0.1))
            self._request_stats()
            self.session.post_session_stats()
        for (_, port), entry in self._announced.items():
            if now >= entry[1]:
                entry[1] = now + self.reannounce_s
                self.session.dht_announce(entry[0], port, 0)
