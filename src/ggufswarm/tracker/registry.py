"""Tracker state in SQLite: nodes and their shard advertisements (TTL heartbeats), manifests, swarm peers, bans."""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from pathlib import Path

from ..directory.routing import Advertisement
from ..net.commitments import served_context

SCHEMA = """
CREATE TABLE IF NOT EXISTS nodes (
    node_id TEXT PRIMARY KEY, url TEXT NOT NULL, model TEXT NOT NULL,
    layer_start INTEGER NOT NULL, layer_end INTEGER NOT NULL, embed INTEGER NOT NULL, head INTEGER NOT NULL,
    state TEXT NOT NULL, free_kv_tokens INTEGER NOT NULL, decode_ms REAL NOT NULL,
    extra TEXT NOT NULL, last_seen REAL NOT NULL, signed TEXT, source TEXT);
CREATE TABLE IF NOT EXISTS manifests (
    name TEXT PRIMARY KEY, manifest TEXT NOT NULL, torrent BLOB NOT NULL, info_hash TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS peers (
    info_hash BLOB NOT NULL, peer_id BLOB NOT NULL, ip TEXT NOT NULL, port INTEGER NOT NULL,
    left_bytes INTEGER NOT NULL, last_seen REAL NOT NULL, PRIMARY KEY (info_hash, peer_id));
CREATE TABLE IF NOT EXISTS bans (key TEXT PRIMARY KEY, reason TEXT NOT NULL, evidence TEXT NOT NULL, at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS seen (
    key TEXT PRIMARY KEY, what TEXT NOT NULL, first_seen REAL NOT NULL, signed_at REAL NOT NULL);
"""
NODE_STATES = ("fetching", "loading", "ready")
MAX_BANS = 10_000  # bans a tracker keeps; past it a new one is refused (each needs real evidence: a swarm's worth)
MAX_PEERS_PER_ADDRESS = 64  # BitTorrent peers of one torrent recorded from one address
MAX_PEERS = 4096  # BitTorrent peers of one torrent recorded in all
MAX_NODES = 4096  # node keys advertised at once
MAX_NODES_PER_ADDRESS = 64  # of them, advertised from one address (a home's nodes share its NAT's)


class StaleAdvertisement(ValueError):
    """An advertisement (or a deregistration) signed before the newest one taken from its key: a replay."""


def serves(ad: Advertisement) -> str:
    """What a node serves, as the ``seen`` table keeps it: net.commitments.served_context and whether it is
    ``ready``, as canonical JSON (a change of either restarts its ``first_seen``)."""
    return json.dumps(
        {**served_context(ad.extra, ad.layers, ad.embed, ad.head), "ready": ad.state == "ready"}, sort_keys=True
    )


class Registry:
    """Thread-safe SQLite registry. ``ttl_s``: a node or peer not heard from for this long is gone.

    State survives a restart when ``path`` is a file (default ``:memory:`` for tests).
    """

    def __init__(self, path: str | Path = ":memory:", ttl_s: float = 15.0):
        self.ttl_s = ttl_s
        self._lock = threading.Lock()
        self._db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL") if str(path) != ":memory:" else None
        self._db.executescript(SCHEMA)
        columns = [r[1] for r in self._db.execute("PRAGMA table_info(nodes)")]
        for column in ("signed", "source"):  # a database of an older one
            if column not in columns:
                self._db.execute(f"ALTER TABLE nodes ADD COLUMN {column} TEXT")

    def _q(self, sql: str, args=()) -> list[tuple]:
        with self._lock:
            return self._db.execute(sql, args).fetchall()

    # nodes ---------------------------------------------------------------------------------------
    def heartbeat(
        self, ad: Advertisement, now: float | None = None, signed_at: float | None = None, source: str | None = None
    ) -> bool:
        """Insert or refresh a node's advertisement (with the object it signed, ``ad.signed``, kept as sent); False
        (nothing changed) for a copy of the newest one taken from its key. ``signed_at``: when the node signed it
        (unix s): one signed before the newest taken from that key (advertisement or deregistration) raises
        StaleAdvertisement, so a replayed advertisement changes nothing. ``source``: the address it came from: a new
        key past MAX_NODES_PER_ADDRESS live ones from there, or past MAX_NODES in all, raises OverflowError.
        ValueError for an unknown state or bad range."""
        if ad.state not in NODE_STATES:
            raise ValueError(f"state must be one of {', '.join(NODE_STATES)}, got {ad.state!r}")
        if not 0 <= ad.layers[0] <= ad.layers[1]:
            raise ValueError(f"bad layer range {ad.layers}")
        now = now or time.time()
        what = serves(ad)
        with self._lock:
            row = self._db.execute("SELECT what, first_seen, signed_at FROM seen WHERE key = ?", (ad.node_id,))
            row = row.fetchone()
            if signed_at is not None and row is not None:
                if signed_at < row[2]:
                    raise StaleAdvertisement(f"signed at {signed_at}, before the newest taken ({row[2]})")
                if signed_at == row[2]:
                    return False
            listed = self._db.execute("SELECT 1 FROM nodes WHERE node_id = ?", (ad.node_id,)).fetchone()
            if not listed:
                live, there = self._db.execute(
                    "SELECT count(*), sum(source = ?) FROM nodes WHERE last_seen >= ?", (source, now - self.ttl_s)
                ).fetchone()
                if live >= MAX_NODES or (source is not None and (there or 0) >= MAX_NODES_PER_ADDRESS):
                    raise OverflowError(
                        f"this tracker lists {live} nodes ({there or 0} from {source}); at most {MAX_NODES} "
                        f"({MAX_NODES_PER_ADDRESS} from one address)"
                    )
            first = row[1] if row is not None and row[0] == what else now  # serving something else: new again
            self._db.execute(
                "INSERT OR REPLACE INTO seen VALUES (?,?,?,?)", (ad.node_id, what, first, signed_at or now)
            )
            self._db.execute(
                "INSERT OR REPLACE INTO nodes VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                (
                    ad.node_id,
                    ad.url,
                    ad.model,
                    ad.layers[0],
                    ad.layers[1],
                    int(ad.embed),
                    int(ad.head),
                    ad.state,
                    int(ad.free_kv_tokens),
                    float(ad.decode_ms),
                    json.dumps(ad.extra),
                    now,
                    json.dumps(ad.signed) if ad.signed is not None else None,
                    source,
                ),
            )
        return True

    def deregister(self, node_id: str, signed_at: float | None = None) -> bool:
        """Remove a node; False when it was not registered. ``signed_at``: when the node signed its deregistration
        (unix s): StaleAdvertisement when that is before the newest advertisement taken from it (a replay), and no
        advertisement signed before it is taken afterwards."""
        with self._lock:
            if signed_at is not None:
                row = self._db.execute("SELECT signed_at FROM seen WHERE key = ?", (node_id,)).fetchone()
                if row is not None and signed_at <= row[0]:
                    raise StaleAdvertisement(f"signed at {signed_at}, not after the newest taken ({row[0]})")
                self._db.execute("UPDATE seen SET signed_at = ? WHERE key = ?", (signed_at, node_id))
            return self._db.execute("DELETE FROM nodes WHERE node_id = ?", (node_id,)).rowcount > 0

    def listed(self, key: str, now: float | None = None) -> bool:
        """Whether node key ``key`` is listed now (advertised within the TTL, not banned)."""
        cutoff = (now or time.time()) - self.ttl_s
        return bool(self._q("SELECT 1 FROM nodes WHERE node_id = ? AND last_seen >= ?", (key, cutoff)))

    def url_of(self, key: str) -> str | None:
        """The URL node key ``key`` is listed at now (None: not listed)."""
        rows = self._q("SELECT url FROM nodes WHERE node_id = ?", (key,))
        return rows[0][0] if rows else None

    def serving(self, key: str) -> tuple[dict, float] | None:
        """What node key ``key`` last advertised it serves (``serves``: net.commitments.served_context and
        ``ready``) and since when (unix s), whether or not it is listed now; None for a key never seen here."""
        row = self._q("SELECT what, first_seen FROM seen WHERE key = ?", (key,))
        return (json.loads(row[0][0]), row[0][1]) if row else None

    def nodes(self, model: str | None = None, now: float | None = None) -> list[Advertisement]:
        """Live advertisements (heard from within the TTL), optionally of one model, none of a banned key; expired
        ones are dropped."""
        cutoff = (now or time.time()) - self.ttl_s
        self._q("DELETE FROM nodes WHERE last_seen < ?", (cutoff,))
        rows = self._q(
            "SELECT node_id, url, model, layer_start, layer_end, embed, head, state, free_kv_tokens, "
            "decode_ms, extra, signed FROM nodes WHERE node_id NOT IN (SELECT key FROM bans)"
            + (" AND model = ?" if model else "")
            + " ORDER BY node_id",
            (model,) if model else (),
        )
        return [
            Advertisement(
                r[0],
                r[1],
                r[2],
                (r[3], r[4]),
                bool(r[5]),
                bool(r[6]),
                r[7],
                r[8],
                r[9],
                json.loads(r[10]),
                json.loads(r[11]) if r[11] is not None else None,
            )
            for r in rows
        ]

    # bans ----------------------------------------------------------------------------------------
    def ban(self, key: str, reason: str, evidence: dict, now: float | None = None) -> int:
        """Ban node key ``key`` (``reason``: one line; ``evidence``: a JSON object kept with it) and drop its
        advertisements at once; banning it again keeps the first ban. The number of advertisements dropped.
        OverflowError when MAX_BANS are kept already."""
        with self._lock:
            if self._db.execute("SELECT count(*) FROM bans").fetchone()[0] >= MAX_BANS:
                raise OverflowError(f"this tracker keeps {MAX_BANS} bans already")
            self._db.execute(
                "INSERT OR IGNORE INTO bans VALUES (?,?,?,?)",
                (key, reason, json.dumps(evidence), now or time.time()),
            )
            return self._db.execute("DELETE FROM nodes WHERE node_id = ?", (key,)).rowcount

    def lift(self, key: str) -> bool:
        """Lift the ban of node key ``key``; False when it was not banned."""
        with self._lock:
            return self._db.execute("DELETE FROM bans WHERE key = ?", (key,)).rowcount > 0

    def banned(self, key: str) -> bool:
        """Whether node key ``key`` is banned."""
        return bool(self._q("SELECT 1 FROM bans WHERE key = ?", (key,)))

    def bans(self) -> list[dict]:
        """Every ban, oldest first: ``[{"key", "reason", "at" (unix s), "evidence"}]``."""
        rows = self._q("SELECT key, reason, at, evidence FROM bans ORDER BY at")
        return [{"key": r[0], "reason": r[1], "at": r[2], "evidence": json.loads(r[3])} for r in rows]

    # manifests -----------------------------------------------------------------------------------
    def put_manifest(self, name: str, manifest_json: str, torrent: bytes, info_hash: str) -> None:
        """Register (or replace) a model artifact under ``name``."""
        self._q("INSERT OR REPLACE INTO manifests VALUES (?,?,?,?)", (name, manifest_json, torrent, info_hash))

    def manifest(self, name: str) -> tuple[str, bytes] | None:
        """``(manifest JSON, torrent bytes)`` of ``name``, or None."""
        rows = self._q("SELECT manifest, torrent FROM manifests WHERE name = ?", (name,))
        return (rows[0][0], bytes(rows[0][1])) if rows else None

    def manifest_names(self) -> list[str]:
        """Names of all registered artifacts."""
        return [r[0] for r in self._q("SELECT name FROM manifests ORDER BY name")]

    # BitTorrent peers ----------------------------------------------------------------------------
    def announce(
        self,
        info_hash: bytes,
        peer_id: bytes,
        ip: str,
        port: int,
        left: int,
        event: str,
        now: float | None = None,
        max_peers: int = 50,
    ) -> list[tuple[str, int]]:
        """Record an announce and return up to ``max_peers`` other live peers ``(ip, port)`` of the swarm. A torrent
        keeps at most MAX_PEERS_PER_ADDRESS peers announced from one address and MAX_PEERS in all: past those a new
        peer is answered but not recorded (one address cannot fill the list others get)."""
        now = now or time.time()
        self._q("DELETE FROM peers WHERE last_seen < ?", (now - max(self.ttl_s, 60.0) * 4,))
        if event == "stopped":
            self._q("DELETE FROM peers WHERE info_hash = ? AND peer_id = ?", (info_hash, peer_id))
        else:
            with self._lock:
                known = self._db.execute(
                    "SELECT 1 FROM peers WHERE info_hash = ? AND peer_id = ?", (info_hash, peer_id)
                ).fetchone()
                from_ip, total = self._db.execute(
                    "SELECT sum(ip = ?), count(*) FROM peers WHERE info_hash = ?", (ip, info_hash)
                ).fetchone()
                if known or ((from_ip or 0) < MAX_PEERS_PER_ADDRESS and total < MAX_PEERS):
                    self._db.execute(
                        "INSERT OR REPLACE INTO peers VALUES (?,?,?,?,?,?)", (info_hash, peer_id, ip, port, left, now)
                    )
        rows = self._q(
            "SELECT ip, port FROM peers WHERE info_hash = ? AND peer_id != ? ORDER BY left_bytes LIMIT ?",
            (info_hash, peer_id, max_peers),
        )
        return [(r[0], r[1]) for r in rows]

    def peers(self, info_hash: bytes, now: float | None = None) -> list[dict]:
        """The live peers of a torrent as its announces gave them: ``[{"ip", "port", "left"}]`` (``left``: bytes
        the peer still wants; 0 = a seed), seeds first."""
        since = (now or time.time()) - max(self.ttl_s, 60.0) * 4
        rows = self._q(
            "SELECT ip, port, left_bytes FROM peers WHERE info_hash = ? AND last_seen >= ? ORDER BY left_bytes, ip",
            (info_hash, since),
        )
        return [{"ip": r[0], "port": r[1], "left": r[2]} for r in rows]

    def close(self) -> None:
        """Close the database."""
        self._db.close()
