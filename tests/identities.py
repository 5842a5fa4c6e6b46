"""Signed shard advertisements for tests: trackers, directories and nodes refuse unsigned ones (net/identity.py).

``ad_of(name, ...)`` writes one; ``signed_ad(ad)`` signs ``ad`` with the test key named by its ``node_id`` ("a",
"node-b", ...: one key pair per name for the whole run), replacing ``node_id`` by that key; ``key("a")`` is the
node id a tracker then lists.
"""

from __future__ import annotations

import time

from ggufswarm.net.identity import NodeIdentity

_NAMED: dict[str, NodeIdentity] = {}


def identity(name: str) -> NodeIdentity:
    """The test key pair called ``name`` (made on first use, the same afterwards)."""
    if name not in _NAMED:
        _NAMED[name] = NodeIdentity.generate()
    return _NAMED[name]


def key(name: str) -> str:
    """The node id (public key, 64 hex characters) of the test key pair called ``name``."""
    return identity(name).key_id


def ad_of(name: str, url: str | None = None, layers=(0, 4), n=4, **kw) -> dict:
    """An unsigned advertisement of model ``tiny`` (``n`` layers) by test node ``name`` serving ``layers``, ready, 4096
    free KV tokens, 5 ms per decode step; ``kw`` adds or replaces fields (``signed_ad`` signs it)."""
    return {
        "node_id": name,
        "url": url or f"http://{name}",
        "model": "tiny",
        "layers": list(layers),
        "embed": layers[0] == 0,
        "head": layers[1] == n,
        "state": "ready",
        "free_kv_tokens": 4096,
        "decode_ms": 5.0,
        **kw,
    }


def signed_ad(ad: dict, ident: NodeIdentity | None = None, signed_at: float | None = None) -> dict:
    """``ad`` (a new dict) with ``node_id`` = the key of ``ident`` (default: the test key named by ``ad``'s
    ``node_id``), ``signed_at`` = ``signed_at`` (default: now) and ``sig`` its signature of everything else."""
    ident = ident or identity(str(ad.get("node_id", "")))
    body = {k: v for k, v in ad.items() if k != "sig"}
    body["node_id"] = ident.key_id
    body["signed_at"] = round(time.time(), 3) if signed_at is None else signed_at
    return ident.sign_json(body)
