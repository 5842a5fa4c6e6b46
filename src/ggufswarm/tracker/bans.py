"""The tracker's bans and node removals: what a token holder may do, and what needs the operator or the node itself.

``POST /v1/bans`` takes a ban only with evidence the tracker checks itself (``check_ban_evidence``);
``DELETE /v1/bans/{key}`` is the operator's; ``DELETE /nodes/{key}`` the node's own (signed) or the operator's.
The rules: docs/protocol.md, "Node identities and bans"."""

from __future__ import annotations

import asyncio
import hmac
import logging
import time

from aiohttp import web

from ..directory.routing import SIGNED_WINDOW_S
from ..net.auth import OPERATOR_HEADER
from ..net.commitments import MAX_EVIDENCE_BYTES, BadEvidence, check_ban_evidence, serves_context
from ..net.http import read_json
from ..net.identity import IdentityError, deregistration, public_key, verify
from ..net.reach import RateLimit, answers_as
from ..protocol.errors import ProtocolError
from .registry import Registry, StaleAdvertisement

log = logging.getLogger(__name__)

MAX_BAN_BODY = MAX_EVIDENCE_BYTES + 4096  # a ban request: the key, one line of reason and the evidence
WITNESS_PROBE_S = 2.0  # most seconds a witness may take to answer the tracker's challenge
BANS_PER_MIN = 30  # bans whose witnesses the tracker dials, a minute from one address


def is_operator(request: web.Request, operator_token: str | None) -> bool:
    """Whether ``request`` carries this tracker's operator credential (never true without one)."""
    given = request.headers.get(OPERATOR_HEADER, "")
    return bool(operator_token) and hmac.compare_digest(given.encode(), operator_token.encode())


def add_ban_routes(app: web.Application, registry: Registry, operator_token: str | None, witness_age_s: float) -> None:
    """The routes of the module docstring on the tracker's ``app``."""

    probes = RateLimit(BANS_PER_MIN)

    def witness(key: str, context: dict) -> str | None:
        """None when this tracker lists ``key`` now, has seen it serve the context's model, layers, stages and
        numerics for at least ``witness_age_s`` and it is not banned; else why it does not count as a witness."""
        if registry.banned(key):
            return "a banned key is no witness"
        found = registry.serving(key)
        if found is None:
            return "not a node this tracker has seen"
        if not registry.listed(key):
            return "not a node this tracker lists now (its advertisement expired or it left)"
        what, since = found
        if not what.pop("ready", False):
            return "not a ready node (it advertises no served layers yet)"
        differs = serves_context(what, context)
        if differs is not None:
            return differs
        age = time.time() - since
        if age < witness_age_s:
            return f"ready with these layers for {age:.0f} s only; a witness needs {witness_age_s:g} s"
        return None

    async def answering(evidence: dict) -> None:
        """BadEvidence unless every witness answers, at the address this tracker lists it at, a challenge signed
        by its key (net.reach.prove): a witness is a node that runs, not a key and an advertisement."""
        witnesses = evidence["witnesses"]
        urls = [registry.url_of(w["key"]) for w in witnesses]
        whys = await asyncio.gather(*(answers_as(u, {w["key"]}, WITNESS_PROBE_S) for u, w in zip(urls, witnesses)))
        for i, (url, why) in enumerate(zip(urls, whys)):
            if why is not None:
                raise BadEvidence(f"evidence.witnesses[{i}] does not answer as itself at {url}: {why}")

    async def ban(request: web.Request) -> web.Response:
        """``POST /v1/bans {"key", "reason", "evidence"}``: 200 ``{"banned": key}`` when the evidence proves the key
        lied (docs/protocol.md, "Bans by proof"): its advertisements are dropped at once and its heartbeats refused
        from then on (403 banned), at any address. 400 bad_request for a malformed key or reason, bad_evidence naming
        what the evidence lacks; 413 for a body over MAX_BAN_BODY; 507 too_many_bans past the registry's bound."""
        if (request.content_length or 0) > MAX_BAN_BODY:
            raise ProtocolError("body_too_large", f"a ban request is at most {MAX_BAN_BODY} bytes")
        b = await read_json(request, code="bad_json")
        key, reason, evidence = b.get("key"), b.get("reason", ""), b.get("evidence")
        try:
            public_key(key)
        except IdentityError as exc:
            raise ProtocolError("bad_request", f"ban: {exc}") from None
        if not isinstance(reason, str) or len(reason) > 1000:
            raise ProtocolError("bad_request", "ban: reason is a string of at most 1000 characters")
        key = key.lower()
        try:
            check_ban_evidence(key, evidence, witness)
            if not probes.allow(request.remote or ""):  # each ban that gets this far dials its witnesses
                raise ProtocolError("rate_limited", f"at most {BANS_PER_MIN} bans a minute from one address")
            await answering(evidence)
        except BadEvidence as exc:
            raise ProtocolError("bad_evidence", f"ban of {key[:16]}… refused: {exc}") from None
        try:
            removed = registry.ban(key, reason, evidence)
        except OverflowError as exc:
            raise ProtocolError("too_many_bans", str(exc)) from None
        log.warning("node key %s banned (%s): dropped %d advertisement(s)", key, reason or "no reason", removed)
        return web.json_response({"banned": key})

    async def bans(request: web.Request) -> web.Response:
        """``GET /v1/bans``: ``{"bans": [{"key", "reason", "at", "evidence"}]}`` (``at``: unix s), oldest first: the
        evidence with each, so whoever reads them checks them too."""
        return web.json_response({"bans": registry.bans()})

    async def lift(request: web.Request) -> web.Response:
        """``DELETE /v1/bans/{key}`` (operator): 200 ``{"lifted": key}``; 403 operator_only; 404 not_banned."""
        if not is_operator(request, operator_token):
            raise ProtocolError("operator_only", _operator_only("lifting a ban", operator_token))
        key = request.match_info["key"].lower()
        if not registry.lift(key):
            raise ProtocolError("not_banned", f"node key {key[:16]}… is not banned here")
        log.warning("ban of node key %s lifted by the operator", key)
        return web.json_response({"lifted": key})

    async def deregister(request: web.Request) -> web.Response:
        """``DELETE /nodes/{key}[?signed_at=T&sig=S]``: the node itself (``sig``: its signature of
        ``deregistration(key, T)``, T within the advertisement window and after its newest advertisement) or the
        operator. 200 ``{"ok": true}``; 401 bad_signature; 403 operator_only without either; 409 stale_advertisement
        for a replay; 404 unknown_node."""
        key = request.match_info["node_id"]
        signed_at = None
        if not is_operator(request, operator_token):
            sig = request.query.get("sig")
            if not sig:
                raise ProtocolError(
                    "operator_only", _operator_only("removing another node", operator_token) + "; a node signs its own"
                )
            try:
                signed_at = float(request.query.get("signed_at", ""))
                if abs(signed_at - time.time()) > SIGNED_WINDOW_S:
                    raise IdentityError(f"signed_at is over {SIGNED_WINDOW_S:g} s from this tracker's clock")
                verify(key, deregistration(key, signed_at), sig)
            except (IdentityError, ValueError) as exc:
                raise ProtocolError("bad_signature", f"deregistration of {key[:16]}…: {exc}") from None
        try:
            removed = registry.deregister(key, signed_at)
        except StaleAdvertisement as exc:
            raise ProtocolError("stale_advertisement", f"deregistration of {key[:16]}…: {exc}") from None
        if not removed:
            raise ProtocolError("unknown_node", f"node {key!r} is not registered")
        return web.json_response({"ok": True})

    app.add_routes(
        [
            web.post("/v1/bans", ban),
            web.get("/v1/bans", bans),
            web.delete("/v1/bans/{key}", lift),
            web.delete("/nodes/{node_id}", deregister),
        ]
    )


def _operator_only(what: str, operator_token: str | None) -> str:
    if not operator_token:
        return f"{what} needs the operator's credential, and this tracker has none (tracker --operator-token)"
    return f"{what} needs the operator's credential ({OPERATOR_HEADER} header), not the swarm token"


__all__ = ["add_ban_routes", "is_operator"]
