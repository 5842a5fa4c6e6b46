"""Content-addressed, size-capped store of prefix KV snapshots on disk, with a block-hash prefix index (SQLite).

Blobs live in ``DIR/ab/abcdef….kv``; ``DIR/index.sqlite`` holds each blob's SHA-256 (checked on every
read), size and last use (for LRU eviction), and the prefix index: block chain hash → the snapshot
that holds that prefix. A blob no prefix points to any more (a longer snapshot of the same tokens
took over all its blocks) is deleted at once, so a session snapshotting every N tokens keeps one blob.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from .snapshot import BLOCK_TOKENS, Shard, SnapshotError, decode_snapshot, prefix_hashes, snapshot_key

log = logging.getLogger(__name__)

SCHEMA = """
CREATE TABLE IF NOT EXISTS blobs (key TEXT PRIMARY KEY, size INTEGER, sha256 TEXT, n_tokens INTEGER, last_used REAL);
CREATE TABLE IF NOT EXISTS prefixes (hash TEXT PRIMARY KEY, key TEXT, length INTEGER);
CREATE INDEX IF NOT EXISTS prefixes_key ON prefixes (key);
"""


class SnapshotMissing(KeyError):
    """No snapshot under this key (never stored, evicted, or dropped after failing its hash check); protocol
    code ``unknown_snapshot`` (404)."""

    code = "unknown_snapshot"

    def __init__(self, key: str):
        super().__init__(key)
        self.key = key

    def __str__(self) -> str:  # KeyError's own repr-quotes the key
        return f"no snapshot {self.key} (never stored, or evicted)"


class SnapshotTooLarge(SnapshotError):
    """A snapshot bigger than the whole cache (or than the largest upload); ``snapshot_too_large`` (413)."""

    code = "snapshot_too_large"


class SnapshotExists(SnapshotError):
    """A different blob is already stored under this key: the first one stays (``node``: who sent the new one);
    ``snapshot_exists`` (409)."""

    code = "snapshot_exists"

    def __init__(self, key: str, node: str):
        super().__init__(
            f"snapshot {key} already holds other bytes; the first upload stays (this one came from "
            f"node {node or 'unnamed'})"
        )
        self.key = key
        self.node = node


class SnapshotCorrupt(SnapshotMissing):
    """The stored bytes no longer match their SHA-256; the blob has been deleted. ``snapshot_corrupt`` (410)."""

    code = "snapshot_corrupt"

    def __str__(self) -> str:
        return f"snapshot {self.key} failed its SHA-256 check and was deleted"


@dataclass
class StoreStats:
    """Counters since start: lookups that found a prefix / found none, snapshots evicted, corrupt reads, and
    uploads refused because another blob already holds their key."""

    hits: int = 0
    misses: int = 0
    evictions: int = 0
    corrupt: int = 0
    refused: int = 0


class SnapshotStore:
    """Snapshots under ``root`` (created if missing), at most ``max_bytes`` bytes of blobs in all.

    Thread-safe. Raises OSError when ``root`` cannot be created or written.
    """

    def __init__(self, root: str | os.PathLike, max_bytes: int):
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be positive, got {max_bytes}")
        self.root = Path(root)
        if self.root.exists() and not self.root.is_dir():
            raise NotADirectoryError(f"--dir {self.root}: exists and is not a directory")
        self.root.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self.stats = StoreStats()
        self._lock = threading.Lock()
        self._db = sqlite3.connect(str(self.root / "index.sqlite"), check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.executescript(SCHEMA)
        for (key,) in self._db.execute("SELECT key FROM blobs").fetchall():  # drop rows whose file is gone
            if not self.path(key).is_file():
                self._drop(key)
        with self._lock:
            self._evict(self.max_bytes)  # restarted with a smaller cap

    def path(self, key: str) -> Path:
        """The file snapshot ``key`` (hex digest) is stored in, whether or not it exists."""
        return self.root / key[:2] / f"{key}.kv"

    # -- bookkeeping (caller holds the lock or is single-threaded) ---------------------------------
    def _drop(self, key: str) -> None:
        self._db.execute("DELETE FROM blobs WHERE key = ?", (key,))
        self._db.execute("DELETE FROM prefixes WHERE key = ?", (key,))
        path = self.path(key)
        path.unlink(missing_ok=True)
        try:
            path.parent.rmdir()  # only when empty
        except OSError:
            pass

    def _evict(self, limit: int, keep: str = "") -> list[str]:
        """Drop least recently used blobs (never ``keep``) until at most ``limit`` bytes remain."""
        total, evicted = self.total_bytes, []
        for k, size in self._db.execute(
            "SELECT key, size FROM blobs WHERE key != ? ORDER BY last_used", (keep,)
        ).fetchall():
            if total <= limit:
                break
            self._drop(k)
            total -= size
            evicted.append(k)
            self.stats.evictions += 1
        return evicted

    def _prefix_rows(self, hashes: list[str]) -> list[tuple[str, int]]:
        rows = []
        for i in range(0, len(hashes), 500):  # SQLite caps the number of bound parameters
            chunk = hashes[i : i + 500]
            rows += self._db.execute(
                f"SELECT key, length FROM prefixes WHERE hash IN ({','.join('?' * len(chunk))})", chunk
            ).fetchall()
        return rows

    @property
    def total_bytes(self) -> int:
        """Bytes of all stored blobs."""
        return int(self._db.execute("SELECT COALESCE(SUM(size), 0) FROM blobs").fetchone()[0])

    @property
    def count(self) -> int:
        """Snapshots stored."""
        return int(self._db.execute("SELECT COUNT(*) FROM blobs").fetchone()[0])

    # -- operations --------------------------------------------------------------------------------
    def put(self, blob: bytes) -> dict:
        """Store a snapshot blob under its content address; returns ``{key, n_tokens, bytes, blocks, evicted}``.

        Every whole block of its tokens is indexed to it (taking over from older, shorter snapshots of
        the same tokens, which are then deleted); least recently used blobs are evicted to stay under
        ``max_bytes``. The first blob stored under a key stays: the same bytes again are a no-op (``existing``
        True), other bytes raise SnapshotExists (nobody can replace what other sessions restore). Raises
        SnapshotError for a blob that is not a snapshot, carries a signature that does not verify, is shorter than one
        block, or alone exceeds ``max_bytes``.
        """
        snap = decode_snapshot(blob)
        snap.check_signature()  # a signed snapshot whose signature fails is refused (unsigned ones: open swarms)
        shard, tokens = snap.shard, snap.tokens.tolist()
        if len(tokens) < BLOCK_TOKENS:
            raise SnapshotError(f"snapshot holds {len(tokens)} tokens; the cache keeps whole blocks of {BLOCK_TOKENS}")
        if len(blob) > self.max_bytes:
            raise SnapshotTooLarge(f"snapshot is {len(blob)} bytes; this cache holds at most {self.max_bytes}")
        key = snapshot_key(shard, tokens)
        hashes = prefix_hashes(shard, tokens)
        sha = hashlib.sha256(blob).hexdigest()
        with self._lock:
            row = self._db.execute("SELECT sha256 FROM blobs WHERE key = ?", (key,)).fetchone()
        if row is not None:
            try:
                same = row[0] == sha or decode_snapshot(self.get(key)).content_digest() == snap.content_digest()
            except SnapshotMissing:  # unreadable now (corrupt, evicted meanwhile): the new blob takes the key
                same, row = False, None
        if row is not None:
            if not same:
                self.stats.refused += 1
                # info, not a warning: concurrent sessions on one prompt do this all the time (the same prefix
                # computed in other steps); /health's ``refused`` counts them, a faulty node shows there too
                log.info(
                    "kept the first snapshot under key %s, refused other content from node %s (the same "
                    "prefix computed in other steps, or a faulty node)",
                    key,
                    snap.node or "?",
                )
                raise SnapshotExists(key, snap.node)
            return {
                "key": key,
                "n_tokens": len(tokens),
                "bytes": len(blob),
                "blocks": len(hashes),
                "evicted": [],
                "existing": True,
            }
        path = self.path(key)
        tmp = self.root / f".{key}.tmp{threading.get_ident()}"
        tmp.write_bytes(blob)
        with self._lock:  # (eviction removes emptied subfolders under this lock)
            path.parent.mkdir(exist_ok=True)
            os.replace(tmp, path)
            self._db.execute(
                "INSERT OR REPLACE INTO blobs VALUES (?,?,?,?,?)", (key, len(blob), sha, len(tokens), time.time())
            )
            old = {k for k, _ in self._prefix_rows(hashes)}
            self._db.executemany(
                "INSERT OR REPLACE INTO prefixes VALUES (?,?,?)",
                [(h, key, (i + 1) * BLOCK_TOKENS) for i, h in enumerate(hashes)],
            )
            for k in old - {key}:  # snapshots whose every block now points at the new one
                if self._db.execute("SELECT 1 FROM prefixes WHERE key = ? LIMIT 1", (k,)).fetchone() is None:
                    self._drop(k)
            evicted = self._evict(self.max_bytes, keep=key)
        return {
            "key": key,
            "n_tokens": len(tokens),
            "bytes": len(blob),
            "blocks": len(hashes),
            "evicted": evicted,
            "existing": False,
        }

    def get(self, key: str) -> bytes:
        """The blob stored under ``key``, checked against its SHA-256.

        Raises SnapshotMissing (unknown key) or SnapshotCorrupt (bytes changed on disk: deleted).
        """
        with self._lock:
            row = self._db.execute("SELECT sha256 FROM blobs WHERE key = ?", (key,)).fetchone()
            if row is None:
                raise SnapshotMissing(key)
            self._db.execute("UPDATE blobs SET last_used = ? WHERE key = ?", (time.time(), key))
        try:
            blob = self.path(key).read_bytes()
        except FileNotFoundError:
            with self._lock:
                self._drop(key)
            raise SnapshotMissing(key) from None
        if hashlib.sha256(blob).hexdigest() != row[0]:
            with self._lock:
                self._drop(key)
                self.stats.corrupt += 1
            raise SnapshotCorrupt(key)
        return blob

    def lookup(self, shard: Shard, tokens: list[int]) -> tuple[str, int] | None:
        """The snapshot holding the longest whole-block prefix of ``tokens`` for ``shard``: ``(key, length)``
        with ``length`` a multiple of BLOCK_TOKENS, or None."""
        hashes = prefix_hashes(shard, tokens)
        best = None
        with self._lock:
            for key, length in self._prefix_rows(hashes):
                if best is None or length > best[1]:
                    best = (key, length)
            if best is None:
                self.stats.misses += 1
            else:
                self.stats.hits += 1
        return best

    def close(self) -> None:
        self._db.close()
