"""The gateway's verifier: audit route sessions by shadow replay, ban a node caught lying, repair around it.

With ``--verify-rate R > 0`` every session opens with step commitments on all its hops, and each (session, hop) is
audited with probability R: replayed when it ends with the hop served by another node of the same numerics id
(gateway/shadow.py), a mismatch confirmed on a third, the liar banned here and on every tracker, its live sessions
repaired and its answers listed as tainted (``GET /v1/verify``). How, and the bound ``sessions_to_catch(R)``:
docs/protocol.md, "Verification by shadow replay".
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import sys
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field, replace

from prometheus_client import CollectorRegistry, Counter

from ..client.route import Hop, describe_hops
from ..client.transport import BANNED
from ..directory.lookup import DirectoryError
from ..directory.trackers import TrackerClient, TrackerError
from ..net.commitments import EVIDENCE_KIND, BadEvidence, check_ban_evidence
from ..protocol.errors import RouteError
from .shadow import Recording, Unverifiable, Verdict, check_recording, compare, replay, shadow_route

log = logging.getLogger(__name__)

MISS_BOUND = 1e-6  # the chance of missing a liar that sessions_to_catch is computed for
RESULTS = ("match", "mismatch", "confirmed", "unconfirmed", "unverifiable")
MAX_WAITING = 64  # audits waiting for the worker; past it a session's audits are skipped (``skipped`` in /health)
KEEP_ANSWERS = 10_000  # answers remembered with the node keys of their route (tainted answers of a later ban)
KEEP_AUDITS = 100  # audit records /v1/verify shows (the most recent)


def sessions_to_catch(rate: float, miss: float = MISS_BOUND) -> int | None:
    """Sessions through a node that corrupts every step after which it has been audited with probability at least
    ``1 - miss``, at audit rate ``rate`` per (session, hop): ``ceil(ln(miss) / ln(1 - rate))`` (each session is
    audited independently: P(missed N times) = (1 - rate)^N). None for rate 0 (never), 1 for rate 1."""
    if rate <= 0:
        return None
    if rate >= 1:
        return 1
    return math.ceil(math.log(miss) / math.log1p(-rate))


def check_rate(rate: float) -> float:
    """``rate`` as a float in [0, 1]; ValueError otherwise."""
    rate = float(rate)
    if not 0.0 <= rate <= 1.0:
        raise ValueError(f"verify rate must be a fraction in [0, 1], got {rate}")
    return rate


@dataclass(eq=False)
class Watch:
    """A live session the verifier knows of: its ``response_id`` (the answer's ``chatcmpl-…`` / ``cmpl-…`` id), its
    route ``hops`` when it opened, the hop indices ``audited``, the node ``keys`` its routes used and those of them
    banned while it ran (``tainted``)."""

    session: object
    response_id: str | None
    hops: list[Hop]
    audited: list[int]
    keys: set[str] = field(default_factory=set)
    tainted: set[str] = field(default_factory=set)


class Verifier:
    """The verifier of one gateway (shared by the models of a gateway serving every model). ``rate``: the fraction
    of (session, hop) pairs audited, 0 = off. Its counters are ``ggufswarm_gateway_audits_total{result}`` in
    ``registry``: each audit counts once as ``match``, ``mismatch`` or ``unverifiable``, and each mismatch once more
    as ``confirmed`` (the node was banned) or ``unconfirmed``. Runs on the gateway's event loop."""

    def __init__(self, rate: float = 0.0, trackers=(), token: str | None = None, lease_s: float | None = None):
        self.rate = check_rate(rate)
        self.trackers = [TrackerClient(t, token) for t in trackers if t]
        self.lease_s = lease_s
        self.registry = reg = CollectorRegistry()
        self.audits_total = Counter(
            "ggufswarm_gateway_audits", "Audits of (session, hop) pairs by shadow replay", ["result"], registry=reg
        )
        for result in RESULTS:
            self.audits_total.labels(result)
        self.counts = dict.fromkeys(RESULTS, 0)
        self.skipped = 0  # audits not run: too many waiting
        self.bans: dict[str, dict] = {}  # node key -> {"key", "url", "reason", "at", "evidence", "tainted"}
        self.answers: OrderedDict[str, frozenset[str]] = OrderedDict()  # response id -> node keys of its routes
        self.live: set[Watch] = set()
        self.recent: deque[dict] = deque(maxlen=KEEP_AUDITS)
        self.planners: list = []  # RoutePlanners whose directories take the bans
        self._queue: asyncio.Queue | None = None
        self._worker: asyncio.Task | None = None
        self._pending = 0  # audits queued or running
        self._rng = random.SystemRandom()  # which pairs are audited must not be predictable

    @property
    def on(self) -> bool:
        """Whether sessions are audited (rate > 0): they then open with step commitments."""
        return self.rate > 0

    def attach(self, planner) -> None:
        """Have ``planner`` (a RoutePlanner) avoid banned nodes: its directory takes every ban, now and later."""
        planner.verifier = self
        self.planners.append(planner)

    def banned_urls(self) -> set[str]:
        """URLs of the banned nodes (new routes exclude them)."""
        return {b["url"] for b in self.bans.values() if b.get("url")}

    def _banned_hop(self, hops) -> Hop | None:
        return next((h for h in hops if h.node_id in self.bans or h.url in self.banned_urls()), None)

    # -- sessions ----------------------------------------------------------------------------------------------------
    def watch(self, session, response_id: str | None) -> Watch | None:
        """Start watching ``session`` (an AsyncRouteSession just opened with commitments): draw which of its hops are
        audited (each with probability ``rate``) and keep the frames of an audited one. A route planned before a ban
        that holds the banned node is repaired at its first step. None when verification is off."""
        if not self.on:
            return None
        hops = list(session.route.hops)
        audited = [i for i in range(len(hops)) if self._rng.random() < self.rate]
        if audited:  # its frames and commitments are kept (else only the nodes' keys, for tainted answers)
            session.sent = []
            session.measured.keep_commits = True
        watch = Watch(session, response_id, hops, audited, {h.node_id for h in hops if h.node_id})
        self.live.add(watch)
        banned = self._banned_hop(hops)
        if banned is not None:  # nothing went through it yet: the answer is not tainted
            self._repair(watch, banned, "banned before this session opened", taint=False)
        return watch

    def telemetry(self, watch: Watch | None) -> dict:
        """Fields the answer's telemetry gets: ``tainted_by`` (node keys banned while it ran through them)."""
        return {"tainted_by": sorted(watch.tainted)} if watch is not None and watch.tainted else {}

    def finish(self, watch: Watch | None, gw) -> None:
        """The session of ``watch`` ended (done, failed or cancelled; closed): remember the node keys its answer went
        through, and queue its audits (background: the answer is not held up). ``gw``: its Gateway (model, planner,
        HTTP session)."""
        if watch is None:
            return
        self.live.discard(watch)
        session = watch.session
        watch.keys |= {h.node_id for h in session.route.hops if h.node_id}
        for timing in session.measured.steps:
            watch.keys |= {c["key"] for c in timing.commits if isinstance(c, dict) and isinstance(c.get("key"), str)}
        for key in watch.keys & set(self.bans):
            watch.tainted.add(key)
        if watch.response_id is not None:
            self.answers[watch.response_id] = frozenset(watch.keys)
            while len(self.answers) > KEEP_ANSWERS:
                self.answers.popitem(last=False)
            for key in watch.tainted:
                tainted = self.bans[key]["tainted"]
                if watch.response_id not in tainted:
                    tainted.append(watch.response_id)
        if not watch.audited:
            return
        rec = Recording.of(session, watch.hops)
        if rec is None:
            return
        if self._queue is None:
            self._queue = asyncio.Queue()
            self._worker = asyncio.get_running_loop().create_task(self._work(), name="verifier")
        for i in watch.audited:
            if self._queue.qsize() >= MAX_WAITING:
                self.skipped += 1
                continue
            self._queue.put_nowait((gw, rec, i, watch.response_id))
            self._pending += 1

    async def idle(self, timeout_s: float) -> bool:
        """Wait (up to ``timeout_s`` s) until no audit is waiting or running; whether that happened (tests, bench)."""
        deadline = time.monotonic() + timeout_s
        while self._pending:
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.05)
        return True

    async def close(self) -> None:
        """Stop the worker (audits waiting are dropped)."""
        if self._worker is not None:
            self._worker.cancel()

    async def _work(self) -> None:
        while True:
            job = await self._queue.get()
            try:
                await self._audit(*job)
            except Exception:  # an audit must never take the gateway down: log it and go on
                log.exception("an audit failed")
            finally:
                self._pending -= 1

    # -- one audit ---------------------------------------------------------------------------------------------------
    def _count(self, result: str, entry: dict, **more) -> dict:
        entry = {**entry, "result": result, **more}
        self.counts[result] += 1
        self.audits_total.labels(result).inc()
        self.recent.append(entry)
        return entry

    async def _audit(self, gw, rec: Recording, i: int, response_id: str | None) -> None:
        """Audit hop ``i`` of ``rec``: a shadow replay on another node of the same numerics id, and on a mismatch a
        confirmation on a third one (module docstring)."""
        hop = rec.hops[i]
        entry = {
            "at": round(time.time(), 3),
            "response_id": response_id,
            "session": rec.sid,
            "hop": i,
            "layers": [hop.start, hop.end],
            "node": hop.url,
            "key": hop.node_id,
            "steps": len(rec.frames),
        }
        try:
            key = self._audited_key(rec, i)
            entry["key"] = key
            await asyncio.to_thread(check_recording, rec, i, key)
            numerics, candidates = await self._candidates(gw, hop, key)
            shadow, verdict = await self._replay_on(gw, rec, i, key, candidates)
        except Unverifiable as exc:
            self._count("unverifiable", entry, reason=str(exc))
            return
        entry |= {"shadow": shadow.url, "shadow_key": shadow.node_id, "compared": verdict.compared}
        if verdict.result == "match":
            self._count("match", entry)
            return
        evidence = {  # net/commitments.py: checkable by anyone once a third node confirms (a second witness)
            "kind": EVIDENCE_KIND,
            "context": rec.contexts[i] if i < len(rec.contexts) else None,
            "accused": verdict.real,
            "witnesses": [verdict.other],
            "model": gw.model_name,
            "layers": [hop.start, hop.end],
            "numerics": numerics,
            "step": verdict.real["step"],
        }
        self._count("mismatch", entry, evidence=evidence)
        rest = [c for c in candidates if c.url != shadow.url]
        try:
            third, check = await self._replay_on(gw, rec, i, key, rest)
        except Unverifiable as exc:
            self._count("unconfirmed", entry, evidence=evidence, reason=f"no confirmation: {exc}")
            return
        entry |= {"third": third.url, "third_key": third.node_id}
        agrees = _agrees(check, verdict)
        if agrees != "shadow":
            why = {
                "audited": "the third node agrees with the audited node, not with the shadow",
                "neither": "the third node agrees with neither",
            }[agrees]
            self._count("unconfirmed", entry, evidence=evidence, reason=why, agrees_with=agrees)
            return
        evidence["witnesses"].append(check.other)
        self._count("confirmed", entry, evidence=evidence)
        reason = (
            f"layers {hop.start}:{hop.end}: output of step {verdict.real['step']} differs from two other nodes of "
            f"numerics {numerics} given the same input (shadow replay)"
        )
        await self.ban(gw.http, key, hop.url, reason, evidence)

    def _audited_key(self, rec: Recording, i: int) -> str:
        """The audited node's key: the one it advertises, which its commitments must name. Unverifiable when it is
        not known or its commitments name another."""
        said = next((c[i]["key"] for c in rec.commits if isinstance(c[i], dict) and "key" in c[i]), None)
        key = rec.hops[i].node_id or said
        if not isinstance(key, str):
            raise Unverifiable("the audited node's key is not known (no advertisement, no commitment)")
        if said is not None and said != key:
            raise Unverifiable(f"the node signs with key {str(said)[:16]}… but advertises {key[:16]}…")
        return key

    async def _candidates(self, gw, hop: Hop, key: str) -> tuple[str, list[Hop]]:
        """The audited node's numerics id and, shuffled, the other ready nodes of the same numerics id serving exactly
        its layers and stages (not banned). Unverifiable when the directory cannot say or there is none."""
        try:
            ads = await gw.planner.directory.nodes(gw.http)
        except (DirectoryError, TrackerError) as exc:
            raise Unverifiable(f"cannot list the swarm's nodes: {exc}") from None
        mine = next((a for a in ads if a.get("node_id") == key), None)
        if mine is None:
            raise Unverifiable("the audited node is not listed any more (its numerics are not known)")
        numerics = _numerics_id(mine)
        if numerics is None:
            raise Unverifiable("the audited node advertises no numerics id")
        if (mine.get("extra") or {}).get("numerics", {}).get("batching", "exact") != "exact":
            # --batching throughput: its bits depend on the sessions batched with it; a replay alone would differ
            raise Unverifiable("the audited node batches for throughput: its outputs are not reproducible")
        found = []
        for ad in ads:
            if ad.get("node_id") in (key, None) or ad.get("node_id") in self.bans or ad.get("state") != "ready":
                continue
            if _numerics_id(ad) != numerics or str(ad.get("url", "")).rstrip("/") == hop.url:
                continue
            other = Hop.from_advertisement(ad) or await _described(gw, ad)
            if other is not None and (other.start, other.end, other.embed, other.head) == (
                hop.start,
                hop.end,
                hop.embed,
                hop.head,
            ):
                found.append(other)
        if not found:
            raise Unverifiable(f"no other node of numerics {numerics} serves layers {hop.start}:{hop.end}")
        self._rng.shuffle(found)
        return numerics, found

    async def _replay_on(self, gw, rec: Recording, i: int, key: str, candidates: list[Hop]) -> tuple[Hop, Verdict]:
        """Replay ``rec`` with hop ``i`` on the first of ``candidates`` that runs it to the end and whose commitments
        can be compared; (that node, the verdict). Unverifiable when none can."""
        reasons = []
        config = gw.config
        for other in candidates:
            try:
                route = shadow_route(rec, i, other, config.hop_timeout_s, gw.fingerprint, config.token)
                run = await replay(rec, route, gw.http, self.lease_s)
                return other, await asyncio.to_thread(compare, rec, run, i, key, other.node_id)
            except Exception as exc:  # a replay that failed for whatever reason: the next node, or none
                reasons.append(f"{other.url}: {exc or type(exc).__name__}")
        raise Unverifiable("; ".join(reasons) or "no other node to replay on")

    # -- bans --------------------------------------------------------------------------------------------------------
    async def ban(self, http, key: str, url: str | None, reason: str, evidence: dict) -> None:
        """Ban node ``key`` (last seen at ``url``): in every directory here (no route through it again), on every
        tracker (``POST /v1/bans`` through aiohttp session ``http``; a tracker that fails is logged), and repair every
        live session through it; the answers that went through it become tainted."""
        if key in self.bans:
            return
        tainted = [rid for rid, keys in self.answers.items() if key in keys]
        self.bans[key] = {
            "key": key,
            "url": url,
            "reason": reason,
            "at": round(time.time(), 3),
            "evidence": evidence,
            "tainted": tainted,
        }
        for planner in self.planners:
            planner.directory.ban(key)
        print(f"ggufswarm gateway: banned node {key} ({url}): {reason}", file=sys.stderr, flush=True)
        for watch in list(self.live):
            if key in watch.keys:
                watch.tainted.add(key)
            hop = next((h for h in watch.session.route.hops if h.node_id == key or h.url == url), None)
            if hop is not None:
                self._repair(watch, hop, reason)

        try:  # what every tracker and directory will check (the witnesses are nodes this gateway chose)
            check_ban_evidence(key, evidence, lambda _key, _context: None)
        except BadEvidence as exc:
            print(
                f"ggufswarm gateway: banned here only: the evidence proves nothing to others ({exc})", file=sys.stderr
            )
            return

        async def one(tracker: TrackerClient) -> None:
            try:
                await tracker.aban(http, key, reason, evidence)
            except TrackerError as exc:
                print(f"ggufswarm gateway: tracker {tracker.url} did not take the ban: {exc}", file=sys.stderr)

        await asyncio.gather(*(one(t) for t in self.trackers))

    def _repair(self, watch: Watch, hop: Hop, reason: str, taint: bool = True) -> None:
        """Have ``watch``'s session repaired around banned ``hop`` (its step in flight fails with ``node_banned``);
        ``taint``: the answer went through it."""
        if hop.node_id and taint:
            watch.tainted.add(hop.node_id)
            watch.keys.add(hop.node_id)
        watch.session.fail(RouteError(BANNED, f"node {hop.url} is banned: {reason}", 502, hop.url))

    # -- what it shows -----------------------------------------------------------------------------------------------
    def health(self) -> dict:
        """``/health``'s ``verify`` block: ``rate``, ``sessions_to_catch`` (for 1 - 1e-6), ``audits`` by result,
        ``waiting`` (audits queued or running), ``skipped`` (not run: too many waiting) and ``banned`` (node keys)."""
        return {
            "rate": self.rate,
            "sessions_to_catch": sessions_to_catch(self.rate),
            "audits": dict(self.counts),
            "waiting": self._pending,
            "skipped": self.skipped,
            "banned": sorted(self.bans),
        }

    def view(self) -> dict:
        """``GET /v1/verify``: the health block, every ban with its evidence and the ids of the answers that went
        through the node (``tainted``), all tainted answer ids, and the most recent audits."""
        return {
            **self.health(),
            "bans": [dict(b, tainted=list(b["tainted"])) for b in self.bans.values()],
            "tainted": sorted({rid for b in self.bans.values() for rid in b["tainted"]}),
            "recent": list(self.recent),
        }


def _agrees(check: Verdict, first: Verdict) -> str:
    """Whom the third node's run (``check``: the real run against the third) sides with at the first mismatch:
    ``shadow`` (it differs from the audited node exactly where the shadow did, with the shadow's output),
    ``audited`` (no difference from the audited node) or ``neither``."""
    if check.result == "match" and check.compared >= first.compared:
        return "audited"
    if check.result == "mismatch" and check.frame == first.frame and check.other["out"] == first.other["out"]:
        return "shadow"
    return "neither"


def _numerics_id(ad: dict):
    numerics = (ad.get("extra") or {}).get("numerics") if isinstance(ad.get("extra"), dict) else None
    return numerics.get("id") if isinstance(numerics, dict) else None


async def _described(gw, ad: dict) -> Hop | None:
    """The Hop of a node whose advertisement does not describe it (its /health asked); None when it does not answer."""
    try:
        [hop] = await describe_hops([str(ad["url"]).rstrip("/")], gw.config.hop_timeout_s, gw.config.token, gw.http)
    except (RouteError, ValueError, KeyError):
        return None
    return replace(hop, node_id=str(ad.get("node_id")))


__all__ = ["RESULTS", "Verifier", "Watch", "check_rate", "sessions_to_catch"]
