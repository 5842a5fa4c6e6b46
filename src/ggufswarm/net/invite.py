"""Join links: one string that lets a new node or gateway join a swarm (its model, how to find peers, its secret).

``ggufswarm://join?v=1&model=NAME&id=DIGEST&dht=HOST:PORT,...&tracker=URL&relay=URL&cache=URL&secret=S``, plain URL
syntax like a magnet link (RFC 3986 query, ``urllib.parse``). ``id`` is the SHA-256 of the model's manifest
(``manifest_digest``): it names the swarm's DHT key and checks any manifest a peer hands out. The link is as secret
as the token it carries. The fields: docs/protocol.md, "Join links"."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from urllib.parse import parse_qs, urlencode, urlsplit

SCHEME = "ggufswarm"
VERSION = "1"


class JoinLinkError(ValueError):
    """A join link that cannot be used (the message says which part is wrong)."""


def info_hash(torrent: bytes) -> str:
    """Hex v1 info-hash (SHA-1) of a bencoded torrent, as trackers key it (libtorrent, loaded on first use): the
    manifest names its torrent by it."""
    import libtorrent as lt

    return str(lt.torrent_info(lt.bdecode(torrent)).info_hashes().v1)


def manifest_digest(manifest: dict) -> str:
    """The model's identity in a swarm: hex SHA-256 of the manifest's canonical JSON (sorted keys, no spaces)."""
    return hashlib.sha256(json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _endpoint(text: str) -> str:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise JoinLinkError(f"a DHT contact is HOST:PORT with a port in 1..65535, got {text!r}")
    return f"{host}:{int(port)}"


@dataclass(frozen=True)
class JoinLink:
    """The parts of a join link (docs/protocol.md, "Join links")."""

    model: str
    model_id: str
    dht: tuple[str, ...] = ()
    trackers: tuple[str, ...] = ()
    relays: tuple[str, ...] = ()
    secret: str | None = field(default=None, repr=False)
    caches: tuple[str, ...] = ()  # snapshot caches (``ggufswarm cache``) the swarm's nodes use: a joiner repairs fast

    def __post_init__(self):
        if not self.model:
            raise JoinLinkError("a join link names its model (model=NAME)")
        if len(self.model_id) != 64 or any(c not in "0123456789abcdef" for c in self.model_id):
            raise JoinLinkError(f"a join link's id is the manifest's hex SHA-256 (64 digits), got {self.model_id!r}")
        if not self.dht and not self.trackers:
            raise JoinLinkError("a join link needs a DHT contact (dht=HOST:PORT) or a tracker (tracker=URL)")
        for url in self.trackers + self.relays + self.caches:
            if urlsplit(url).scheme not in ("http", "https"):
                raise JoinLinkError(f"trackers, relays and caches are http(s) URLs, got {url!r}")

    def format(self) -> str:
        """The link as one string (``parse`` reads it back)."""
        query = [("v", VERSION), ("model", self.model), ("id", self.model_id)]
        if self.dht:
            query.append(("dht", ",".join(self.dht)))
        query += [("tracker", t) for t in self.trackers] + [("relay", r) for r in self.relays]
        query += [("cache", c) for c in self.caches]
        if self.secret:
            query.append(("secret", self.secret))
        return f"{SCHEME}://join?{urlencode(query)}"

    @classmethod
    def parse(cls, text: str) -> JoinLink:
        """Read a link made by ``format``. Raises JoinLinkError naming what is wrong."""
        parts = urlsplit(text.strip())
        if parts.scheme != SCHEME or parts.netloc != "join":
            raise JoinLinkError(f"a join link starts with {SCHEME}://join?, got {text[:40]!r}")
        q = parse_qs(parts.query, keep_blank_values=False)
        version = q.get("v", [VERSION])[0]
        if version != VERSION:
            raise JoinLinkError(f"join link version {version!r}; this ggufswarm reads version {VERSION}")
        for key in ("model", "id"):
            if key not in q:
                raise JoinLinkError(f"the join link has no {key}=")
        dht = tuple(_endpoint(e) for item in q.get("dht", []) for e in item.split(",") if e)
        return cls(
            q["model"][0],
            q["id"][0].lower(),
            dht,
            tuple(q.get("tracker", [])),
            tuple(q.get("relay", [])),
            q.get("secret", [None])[0],
            tuple(q.get("cache", [])),
        )


__all__ = ["JoinLink", "JoinLinkError", "info_hash", "manifest_digest"]
