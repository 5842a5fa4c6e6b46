"""Signed shard advertisements and ban evidence for tests: trackers, directories and nodes refuse unsigned ones
(net/identity.py), and bans without proof (net/commitments.py).

``ad_of(name, ...)`` writes one; ``signed_ad(ad)`` signs ``ad`` with the test key named by its ``node_id`` ("a",
"node-b", ...: one key pair per name for the whole run), replacing ``node_id`` by that key; ``key("a")`` is the
node id a tracker then lists. ``proof(accused, witnesses)`` is evidence that test node ``accused`` lied, signed by
it and by the witnesses, who must be nodes the checker knows serve ``CONTEXT`` (``ad_of(..., extra=SERVES)``).
"""

from __future__ import annotations

import contextlib
import time
import uuid

from ggufswarm.net.commitments import EVIDENCE_KIND, commit_context, context_digest, signed_body
from ggufswarm.net.identity import NodeIdentity, canonical, deregistration

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


def deregister_path(name: str, signed_at: float | None = None) -> str:
    """``/nodes/{key}?signed_at=&sig=``: test node ``name``'s own signed removal of its advertisement."""
    at = round(time.time(), 3) if signed_at is None else signed_at
    return f"/nodes/{key(name)}?signed_at={at}&sig={identity(name).sign(deregistration(key(name), at))}"


# what the tiny model's nodes of layers 0:4 compute, as their advertisements say (SERVES) and commitments sign
CONTEXT = commit_context("fp-tiny", 0, 4, True, True, "numerics-1", "f32", {"temperature": 0.0})
SERVES = {"hop": {"model_fingerprint": "fp-tiny"}, "numerics": {"id": "numerics-1"}}


def commitment(name: str, out: str, *, context: dict = CONTEXT, inp: str = "11" * 16, prev: str | None = None) -> dict:
    """Test node ``name``'s signed commitment (evidence form) to a first step of a new session: 3 tokens at 0, input
    digest ``inp``, output digest ``out``, for ``context`` (history: its digest, unless ``prev`` is given)."""
    ctx = context_digest(context)
    c = {"in": inp, "out": out, "mode": 0, "ctx": ctx, "prev": ctx if prev is None else prev, "key": key(name)}
    body = signed_body(uuid.uuid4(), 1, 0, 3, c)
    return {**body, "sig": identity(name).sign(canonical(body))}


def proof(accused: str, witnesses=("w1", "w2"), *, context: dict = CONTEXT, **kw) -> dict:
    """Evidence that test node ``accused`` lied: its commitment (output ``aa…``) and the ``witnesses``' (output
    ``bb…``) to the same step after the same history (``kw``: ``commitment``'s, for all)."""
    return {
        "kind": EVIDENCE_KIND,
        "context": context,
        "accused": commitment(accused, "aa" * 16, context=context, **kw),
        "witnesses": [commitment(w, "bb" * 16, context=context, **kw) for w in witnesses],
    }


def probe_app(name: str):
    """A stand-in node: it answers only ``GET /v1/reach/probe``'s challenge, signed with test key ``name``."""
    from aiohttp import web

    from ggufswarm.net.reach import add_probe_route

    app = web.Application()
    add_probe_route(app, identity(name))
    return app


@contextlib.contextmanager
def running(*names: str):
    """Stand-in nodes of test keys ``names`` (``probe_app``), each on a loopback port: ``{name: URL}``. A tracker
    takes a ban only on witnesses that answer its challenge where they are listed (tracker/bans.py)."""
    from ggufswarm.net.http import ServerThread

    servers = {name: ServerThread(probe_app(name)) for name in names}
    try:
        yield {name: server.start() for name, server in servers.items()}
    finally:
        for server in servers.values():
            server.stop()
