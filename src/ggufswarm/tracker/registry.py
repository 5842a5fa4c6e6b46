"""Tracker state in SQLite: nodes and their shard advertisements (TTL heartbeats), manifests, swarm peers, bans."""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from pathlib import Path

from .routing import Advertisement

SCHEMA = """
CREATE TABLE IF NOT EXISTS nodes (
    node_id TEXT PRIMARY KEY, url TEXT NOT NULL, model TEXT NOT NULL,
    layer_start INTEGER NOT NULL, layer_end INTEGER NOT NULL, embed INTEGER NOT NULL, head INTEGER NOT NULL,
    state TEXT NOT NULL, free_kv_tokens INTEGER NOT NULL, decode_ms REAL NOT NULL,
    extra TEXT NOT NULL, last_seen REAL NOT NULL, signed TEXT);
CREATE TABLE IF NOT EXISTS manifests (
    name TEXT PRIMARY KEY, manifest TEXT NOT NULL, torrent BLOB NOT NULL, info_hash TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS peers (
    info_hash BLOB NOT NULL, peer_id BLOB NOT NULL, ip TEXT NOT NULL, port INTEGER NOT NULL,
    left_bytes INTEGER NOT NULL, last_seen REAL NOT NULL, PRIMARY KEY (info_hash, peer_id));
CREATE TABLE IF NOT EXISTS bans (key TEXT PRIMARY KEY, reason TEXT NOT NULL, evidence TEXT NOT NULL, at REAL NOT NULL);
"""
NODE_STATES = ("fetching", "loading", "ready")


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
        if "signed" not in [r[1] for r in self._db.execute("PRAGMA table_info(nodes)")]:  # a database of an older one
            self._db.execute("ALTER TABLE nodes ADD COLUMN signed TEXT")

    def _q(self, sql: str, args=()) -> list[tuple]:
        with self._lock:
            return self._db.execute(sql, args).fetchall()

    # nodes ---------------------------------------------------------------------------------------
    def heartbeat(self, ad: Advertisement, now: float | None = None) -> None:
        """Insert or refresh a node's advertisement (with the object it signed, ``ad.signed``, kept as sent).
        ValueError for an unknown state or bad range."""
        if ad.state not in NODE_STATES:
            raise ValueError(f"state must be one of {', '.join(NODE_STATES)}, got {ad.state!r}")
        if not 0 <= ad.layers[0] <= ad.layers[1]:
            raise ValueError(f"bad layer range {ad.layers}")
        self._q(
            "INSERT OR REPLACE INTO nodes VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)",
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
                now or time.time(),
                json.dumps(ad.signed) if ad.signed is not None else None,
            ),
        )

    def deregister(self, node_id: str) -> bool:
        """Remove a node; False when it was not registered."""
        with self._lock:
            return self._db.execute("DELETE FROM nodes WHERE node_id = ?", (node_id,)).rowcount > 0

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
        advertisements at once; banning it again replaces the reason and evidence. The number of advertisements
        dropped."""
        with self._lock:
            self._db.execute(
                "INSERT OR REPLACE INTO bans VALUES (?,?,?,?)",
                (key, reason, json.dumps(evidence), now or time.time()),
            )
            return self._db.execute("DELETE FROM nodes WHERE node_id = ?", (key,)).rowcount

    def banned(self, key: str) -> bool:
        """Whether node key ``key`` is banned."""
        return bool(self._q("SELECT 1 FROM bans WHERE key = ?", (key,)))

    def bans(self) -> list[dict]:
        """Every ban, oldest first: ``[{"key", "reason", "at" (unix s)}]`` (not the evidence)."""
        return [
            {"key": r[0], "reason": r[1], "at": r[2]} for r in self._q("SELECT key, reason, at FROM bans ORDER BY at")
        ]

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
        """Record an announce and return up to ``max_peers`` other live peers ``(ip, port)`` of the swarm."""
        now = now or time.time()
        if event == "stopped":
            self._q("DELETE FROM peers WHERE info_hash = ? AND peer_id = ?", (info_hash, peer_id))
        else:
            self._q("INSERT OR REPLACE INTO peers VALUES (?,?,?,?,?,?)", (info_hash, peer_id, ip, port, left, now))
        self._q("DELETE FROM peers WHERE last_seen < ?", (now - max(self.ttl_s, 60.0) * 4,))
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
