"""Where a swarm's nodes are listed: its trackers (any number) and the BitTorrent DHT, behind one interface.

A gateway plans routes and a node checks its next hops through a ``Directory``: trackers first; when none answers,
the endpoints the DHT holds under the model's key, each contacted over the authenticated API before it is listed,
and routes planned with the tracker's own ``directory.routing.plan_route``. Every advertisement must be signed by its
``node_id``'s key, recent and of a key not banned (a tracker's ban counts once its evidence checks out here).
The listing, its timeouts and what is verified: docs/protocol.md, "Discovery without a tracker"."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections import Counter
from urllib.parse import quote

import aiohttp

from ..net.auth import auth_headers
from ..net.commitments import (
    BadEvidence,
    UnknownWitness,
    check_ban_evidence,
    served_context,
    serves_context,
)
from ..net.identity import IdentityError, canonical
from ..net.invite import info_hash, manifest_digest
from ..net.reach import Proven
from .routing import (
    Advertisement,
    NoRoute,
    check_signed,
    check_signed_at,
    parse_measured,
    plan_route,
    route_context,
    route_wire_bytes_per_token,
)
from .trackers import TrackerClient, TrackerError

log = logging.getLogger(__name__)

AD_TIMEOUT_S = 2.0  # most seconds one node's /v1/advertisement may take during a DHT listing
LOOKUP_TIMEOUT_S = 5.0  # most seconds one DHT lookup may take (a tiny swarm answers in well under one)
CACHE_S = 2.0  # DHT listings younger than this are reused (a burst of route plans does one lookup)
HOP_MS = 1.0  # the per-hop network cost the local planner adds, as the tracker's default
MAX_HEARD = 64  # most peers-of-peers one listing reads advertisements of
LOOKUPS = 3  # DHT lookups one listing makes at most while it has found no node that answers
KNOWN_S = 120.0  # a node listed once is asked again in DHT listings this long (s) after it last answered
BANS_EVERY_S = 5.0  # the trackers' bans are fetched again, with a listing or a plan, at most this often (s)
BANS_TIMEOUT_S = 2.0  # most seconds one tracker's GET /v1/bans may take
VERIFIED_MAX = 4096  # advertisements whose signature verified, remembered (by digest) so they are not verified again
ROUTE_TRIES = 3  # tracker plans asked for at most, each avoiding the hops of the last that did not verify
REPORT_EVERY_S = 30.0  # a node that failed to prove its key is reported to a tracker at most this often (s)
REPORT_TIMEOUT_S = 10.0  # POST /nodes/report: how long the tracker may take to check the reported node (s)
MAX_REPORTED = 1024  # node URLs whose last report time is remembered


class DirectoryError(RuntimeError):
    """No source of the directory could answer (every tracker down and the DHT empty or off)."""


class Directory:
    """The nodes of model ``model`` (a published name) whose identity is ``model_id`` (``manifest_digest``; None:
    unknown, no DHT), from ``trackers`` (URLs) and ``discovery`` (a ``net.dht.Discovery``, or None).

    ``token``: the swarm token, sent to trackers and nodes. All calls are coroutines on the caller's aiohttp
    session; the DHT lookups run in libtorrent's thread."""

    def __init__(self, model: str, trackers=(), discovery=None, model_id: str | None = None, token=None):
        self.model, self.model_id, self.token = model, model_id, token
        self.trackers = [TrackerClient(t, token) for t in trackers]
        self.discovery = discovery
        self._listed: tuple[float, list[dict]] | None = None
        self._known: dict[str, float] = {}  # node URL -> when it last answered (monotonic s); see dht_nodes
        self.heard = lambda: ()  # a node's own peers that said hello (node/discovery.py): asked in listings too
        self._locks: dict[asyncio.AbstractEventLoop, asyncio.Lock] = {}  # one per loop (a node fetches on another)
        self.routed: Counter[str] = Counter()  # sessions this directory planned through each node (load spreading)
        self.local_bans: set[str] = set()  # node keys banned here (Directory.ban)
        self._tracker_bans: dict[str, frozenset[str]] = {}  # tracker URL -> the keys it banned, as last fetched
        self._banned: frozenset[str] = frozenset()  # the union of both
        self._bans_at = -BANS_EVERY_S  # when the trackers' bans were last fetched (monotonic s)
        self._bans_down: set[str] = set()  # trackers whose last GET /v1/bans failed
        self._verified: set[bytes] = set()  # SHA-256 of the canonical JSON of advertisements that verified
        self._serving: dict[str, dict] = {}  # node key -> what its last trusted advertisement serves (witnesses)
        self.proven = Proven()  # addresses the DHT named that proved to hold their keys (the token goes there)
        self._reported: dict[str, float] = {}  # node URL -> when it was last reported to a tracker (monotonic s)
        self._reports: set[asyncio.Task] = set()  # reports under way (kept referenced until done)
        self._judged: dict[bytes, bool | int] = {}  # a tracker ban's digest -> proven, or the witnesses known then

    # -- identities and bans ---------------------------------------------------------------------------------------
    @property
    def banned(self) -> frozenset[str]:
        """The node keys this directory refuses: its trackers' bans (as last fetched) and its own."""
        return self._banned

    def ban(self, key: str) -> None:
        """Ban node key ``key`` here (a gateway that caught a node lying): its advertisements are dropped from every
        listing and plan from now on, whatever the trackers say."""
        self.local_bans.add(str(key).lower())
        self._update_banned()

    def _update_banned(self) -> None:
        self._banned = frozenset(self.local_bans.union(*self._tracker_bans.values()))
        if self._listed is not None:
            self._listed = (self._listed[0], [a for a in self._listed[1] if a.get("node_id") not in self._banned])

    async def refresh_bans(self, http: aiohttp.ClientSession, force: bool = False, skip_down: bool = False) -> None:
        """Fetch every tracker's bans (``GET /v1/bans``, BANS_TIMEOUT_S each, at most every BANS_EVERY_S unless
        ``force``; ``skip_down``: not from trackers whose last answer failed, so a route plan does not wait on a
        tracker that is down). A tracker that does not answer keeps the set it gave last. Never raises."""
        now = time.monotonic()
        if not self.trackers or (not force and now - self._bans_at < BANS_EVERY_S):
            return
        self._bans_at = now

        async def one(t: TrackerClient) -> None:
            try:
                found = await t.abans(http, timeout_s=BANS_TIMEOUT_S)
            except TrackerError:
                self._bans_down.add(t.url)
                return
            self._bans_down.discard(t.url)
            self._tracker_bans[t.url] = frozenset(str(b["key"]).lower() for b in found if self._ban_holds(b, t.url))

        await asyncio.gather(*(one(t) for t in self.trackers if not (skip_down and t.url in self._bans_down)))
        self._update_banned()

    def _ban_holds(self, ban: dict, source: str) -> bool:
        """Whether a tracker's ``ban`` (``{"key", "evidence", ...}``) proves its key lied, checked here
        (net.commitments.check_ban_evidence; witnesses: nodes this directory has listed serving the accused's
        layers and numerics). A verdict is kept; one that failed for want of a known witness is judged again once
        more nodes have been listed."""
        digest = hashlib.sha256(canonical({"key": ban.get("key"), "evidence": ban.get("evidence")})).digest()
        verdict = self._judged.get(digest)  # True / False: judged; a count: the witnesses known when one was missing
        if verdict is True or verdict is False or verdict == len(self._serving):
            return verdict is True
        if len(self._judged) >= VERIFIED_MAX:
            self._judged.clear()
        try:
            check_ban_evidence(str(ban["key"]).lower(), ban.get("evidence"), self._witness)
            self._judged[digest] = True
        except BadEvidence as exc:
            if digest not in self._judged:
                log.warning("tracker %s bans %s on evidence that proves nothing here: %s", source, ban["key"], exc)
            self._judged[digest] = len(self._serving) if isinstance(exc, UnknownWitness) else False
        return self._judged[digest] is True

    def _witness(self, key: str, context: dict) -> str | None:
        served = self._serving.get(key)
        if served is None:
            return "not a node this directory has listed"
        return serves_context(served, context)

    def trusted(self, ad: dict) -> bool:
        """Whether advertisement ``ad`` (a JSON object) may be listed: signed by its ``node_id``'s key within
        SIGNED_WINDOW_S of this clock, and that key not banned. A signature that verified once is not verified
        again (remembered by the digest of the whole signed object)."""
        if not isinstance(ad, dict) or not isinstance(ad.get("node_id"), str) or ad["node_id"] in self._banned:
            return False
        try:
            digest = hashlib.sha256(canonical(ad)).digest()
            if digest in self._verified:
                check_signed_at(ad)
                return True
            check_signed(ad)
        except (IdentityError, TypeError, ValueError) as exc:
            log.info("dropped an advertisement of %s: %s", str(ad.get("url"))[:80], exc)
            return False
        if len(self._verified) >= VERIFIED_MAX:
            self._verified.clear()
        self._verified.add(digest)
        try:
            self._serving[ad["node_id"]] = served_context(
                ad.get("extra"), ad["layers"], ad.get("embed"), ad.get("head")
            )
        except (KeyError, TypeError, ValueError, IndexError):
            pass
        while len(self._serving) > VERIFIED_MAX:
            self._serving.pop(next(iter(self._serving)))
        return True

    @property
    def key(self) -> bytes | None:
        """The DHT key of this model's nodes (None without a model identity)."""
        if self.model_id is None:
            return None
        from ..net.dht import swarm_key

        return swarm_key(self.model_id)

    async def dht_nodes(self, http: aiohttp.ClientSession, fresh: bool = False) -> list[dict]:
        """Advertisements of this model's nodes found without a tracker: those announced on the DHT under its key,
        those this directory listed before (for KNOWN_S seconds after they last answered: a DHT lookup in a small
        swarm where nodes just died can come back short), and the peers those nodes heard from lately (``POST
        /v1/peers``: a node that joined a moment ago is known to its peers before its DHT announce has spread).
        Each one is read from the node itself (``GET /v1/advertisement`` within AD_TIMEOUT_S) and must serve this
        model; [] without a DHT."""
        if self.discovery is None or self.key is None:
            return []
        lock = self._locks.setdefault(asyncio.get_running_loop(), asyncio.Lock())
        async with lock:
            now = time.monotonic()
            if not fresh and self._listed and now - self._listed[0] < CACHE_S:
                return self._listed[1]
            self._known = {u: t for u, t in self._known.items() if now - t < KNOWN_S}
            listed, urls = {}, []
            for _attempt in range(LOOKUPS):  # libtorrent's lookups in a small DHT with dead nodes come back short,
                endpoints = await self.discovery.alookup(self.key, LOOKUP_TIMEOUT_S)  # and differ from one another
                announced = [f"http://{host}:{port}" for host, port in endpoints]
                new = [u for u in dict.fromkeys(announced + list(self._known) + list(self.heard())) if u not in urls]
                urls += new
                found = await asyncio.gather(*(self._advertisement(http, u, with_peers=True) for u in new))
                listed |= {str(a["url"]).rstrip("/"): a for a in found if a is not None}
                if listed:
                    break
            heard = {str(p).rstrip("/") for a in listed.values() for p in a.pop("peers", ()) or ()}
            heard -= set(listed) | set(urls)
            for ad in await asyncio.gather(*(self._advertisement(http, u) for u in sorted(heard)[:MAX_HEARD])):
                if ad is not None:
                    listed.setdefault(str(ad["url"]).rstrip("/"), ad)
            self.remember(listed)
            self._listed = (time.monotonic(), list(listed.values()))
            return self._listed[1]

    def remember(self, urls) -> None:
        """Node URLs that just answered (a listing's, or a tracker's): asked again in DHT listings for KNOWN_S s."""
        now = time.monotonic()
        for url in urls:
            self._known[str(url).rstrip("/")] = now

    async def _advertisement(self, http: aiohttp.ClientSession, base: str, with_peers: bool = False) -> dict | None:
        """The advertisement of the node the DHT (or a peer) names at ``base``, once it proved to hold the key it
        signs with (a signed challenge, net.reach.Proven: the swarm token goes to no address that did not); None
        when it does not answer, does not prove, or its advertisement does not check out."""
        key, _why = await self.proven.key_of(base, AD_TIMEOUT_S)
        if key is None:
            return None
        url = f"{base}/v1/advertisement" + ("?peers=1" if with_peers else "")
        try:
            async with http.get(
                url, headers=auth_headers(self.token), timeout=aiohttp.ClientTimeout(total=AD_TIMEOUT_S)
            ) as r:
                if r.status != 200:
                    return None
                ad = await r.json(content_type=None)
            Advertisement.from_json(ad)
        except (TimeoutError, aiohttp.ClientError, ValueError, KeyError, TypeError, IndexError):
            return None
        peers = ad.pop("peers", None)  # not signed: added to the node's advertisement by ?peers=1
        if ad.get("model") != self.model or ad.get("node_id") != key or not self.trusted(ad):
            return None
        if isinstance(peers, list):
            ad["peers"] = [p for p in peers if isinstance(p, str)]
        return ad

    async def nodes(self, http: aiohttp.ClientSession) -> list[dict]:
        """This model's advertisements: from the first tracker that answers, merged with the DHT's (by URL); only
        those ``trusted`` (signed, not banned). The trackers' bans are fetched meanwhile (``refresh_bans``).
        Raises DirectoryError when no tracker answers and the DHT lists nothing."""
        listed, _ = await asyncio.gather(self._nodes(http), self.refresh_bans(http))
        return [a for a in listed if a.get("node_id") not in self._banned]

    async def _nodes(self, http: aiohttp.ClientSession) -> list[dict]:
        ads: dict[str, dict] = {}
        reasons = []
        for t in self.trackers:
            try:
                for ad in await t.anodes(http, self.model):
                    if self.trusted(ad):
                        ads[str(ad["url"]).rstrip("/")] = ad
                self.remember(ads)  # should the tracker go away, the DHT listings still ask these
                break
            except (TrackerError, KeyError, TypeError) as exc:
                reasons.append(str(exc))
        if not ads or self.discovery is not None:
            for ad in await self.dht_nodes(http):
                ads.setdefault(str(ad["url"]).rstrip("/"), ad)
        if not ads and reasons:
            raise DirectoryError("; ".join(reasons) + ("; the DHT lists no node" if self.discovery else ""))
        return list(ads.values())

    async def route(self, http: aiohttp.ClientSession, query: dict, count: bool = True) -> dict:
        """A route plan, as the tracker's ``GET /route`` answers it (``{"route": [ad, ...], "context",
        "wire_bytes_per_token", "source"}``), for ``query`` (``max_length``, optional ``exclude`` (comma-separated
        URLs), ``start``/``end``). The first tracker that answers plans it; with none, it is planned here from the
        DHT's advertisements (``count``: the planned nodes' load counts it, for load spreading). Raises
        TrackerError: the tracker's refusal (``no_route``), or status None (unreachable) when no source answered."""
        unreachable = []
        await self.refresh_bans(http, skip_down=True)  # the listings (nodes) ask the trackers that were down
        for t in self.trackers:
            try:
                planned = await self._tracker_route(http, t, query)
                self.remember(str(a["url"]) for a in planned.get("route", ()))
                return {**planned, "source": "tracker"}
            except TrackerError as exc:
                if exc.status is not None:  # it answered: its refusal stands
                    raise
                unreachable.append(exc.reason or str(exc))
        if self.discovery is None:
            raise TrackerError("; ".join(unreachable) or "no tracker", None, "the tracker cannot be reached")
        exclude = {u.rstrip("/") for u in str(query.get("exclude", "")).split(",") if u}
        # a plan that avoids nodes (a failed hop, a repair) lists the swarm anew, and so does a plan the listing of
        # the last CACHE_S seconds cannot make: the swarm just changed
        for fresh in (False, True) if not exclude else (True,):
            listed = map(Advertisement.from_json, filter(self.trusted, await self.dht_nodes(http, fresh=fresh)))
            ads = [a for a in listed if a.url not in exclude]
            n_layers = next((int(a.extra["hop"]["n_layers"]) for a in ads if "hop" in a.extra), None)
            if n_layers is None:
                refused = TrackerError("the DHT lists no node of this model yet", 503, "no node of it is announced")
                continue
            span = (int(query.get("start", 0)), int(query.get("end", n_layers)))
            try:
                measured = parse_measured(str(query.get("measured", "")))
                chain = plan_route(ads, n_layers, int(query.get("max_length", 1)), HOP_MS, self.routed, span, measured)
                break
            except NoRoute as exc:
                refused = TrackerError(f"no_route: {exc}", 503, str(exc))
        else:
            raise refused
        if count:  # a session will use it (not a health probe)
            self.routed.update(a.node_id for a in chain)
        return {
            "model": self.model,
            "route": [a.to_json() for a in chain],
            "context": route_context(chain),
            "wire_bytes_per_token": route_wire_bytes_per_token(chain),
            "source": "dht",
        }

    async def _tracker_route(self, http: aiohttp.ClientSession, t: TrackerClient, query: dict) -> dict:
        """Tracker ``t``'s plan for ``query``, whose every hop is ``trusted`` and proved to hold its key where it is
        listed (``proven``: the swarm token goes to no address an advertisement merely names): a plan through a node
        whose advertisement does not verify, whose key is banned here or that does not prove its key is asked for
        again without it (ROUTE_TRIES plans at most). TrackerError as ``acall``, or 503 when no plan it makes
        avoids such nodes."""
        exclude = [u for u in str(query.get("exclude", "")).split(",") if u]
        for _ in range(ROUTE_TRIES):
            asked = {**query, "model": self.model} | ({"exclude": ",".join(exclude)} if exclude else {})
            planned = await t.acall(http, "route", query=asked, timeout_s=t.timeout_s)
            hops = planned.get("route") if isinstance(planned, dict) else None
            if not isinstance(hops, list):
                raise TrackerError(f"tracker {t.url}: GET /route answered no route", 502, "not a route")
            bad = [str(a.get("url", "")) if isinstance(a, dict) else "" for a in hops if not self.trusted(a)]
            if not bad:  # a route's nodes get the swarm token: each must hold, where it is listed, the key listed
                whys = await asyncio.gather(*(self.proven.check(str(a["url"]), str(a["node_id"])) for a in hops))
                bad = [str(a["url"]) for a, why in zip(hops, whys) if why is not None]
                for url in bad:  # it listed a node that is down or not itself: it can drop it now, not at its TTL
                    self._report(http, t, url)
            if not bad:
                return planned
            exclude += [u for u in bad if u]
        raise TrackerError(
            f"tracker {t.url}: no_route: its routes go through nodes that are banned, whose advertisements do not "
            "verify, or that do not answer as themselves",
            503,
            "no route avoids nodes that are banned, whose advertisements do not verify or that do not answer",
        )

    def _report(self, http: aiohttp.ClientSession, t: TrackerClient, url: str) -> None:
        """Report ``url`` to tracker ``t`` (``POST /nodes/report``, in the background, once per REPORT_EVERY_S):
        the tracker checks the node itself and drops it when it does not prove its key there."""
        now = time.monotonic()
        if now - self._reported.get(url, -REPORT_EVERY_S) < REPORT_EVERY_S:
            return
        self._reported[url] = now
        while len(self._reported) > MAX_REPORTED:
            self._reported.pop(next(iter(self._reported)))

        async def report() -> None:
            try:
                await t.acall(http, "nodes/report", "POST", {"url": url}, timeout_s=REPORT_TIMEOUT_S)
            except TrackerError as exc:  # best effort: its TTL still runs out
                log.info("reporting node %s to tracker %s failed: %s", url, t.url, exc.reason)

        task = asyncio.get_running_loop().create_task(report())
        self._reports.add(task)
        task.add_done_callback(self._reports.discard)

    async def manifest(self, http: aiohttp.ClientSession) -> dict:
        """``{"manifest": ..., "torrent_hex": ...}`` of this model: from a tracker, else from a node the DHT lists
        (``GET /v1/manifest``). With a ``model_id``, a manifest whose digest differs is refused (a peer cannot
        hand out another model under this one's name). Raises DirectoryError when no source has it."""
        reasons = []
        for t in self.trackers:
            try:
                found = await t.acall(http, f"manifests/{quote(self.model, safe='')}", timeout_s=t.timeout_s)
                return self._checked(found, f"tracker {t.url}")
            except (TrackerError, ValueError) as exc:
                reasons.append(str(exc))
        for ad in await self.dht_nodes(http, fresh=True):
            url = str(ad["url"]).rstrip("/") + "/v1/manifest"
            try:
                async with http.get(
                    url, headers=auth_headers(self.token), timeout=aiohttp.ClientTimeout(total=30)
                ) as r:
                    if r.status == 200:
                        return self._checked(await r.json(content_type=None), url)
                    reasons.append(f"{url}: {r.status}")
            except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
                reasons.append(f"{url}: {exc}")
        if self.discovery is not None:
            reasons.append("the DHT lists no node that has it (are the join link's dht= contacts up?)")
        raise DirectoryError(f"no source has the manifest of {self.model}: " + ("; ".join(reasons) or "no peers"))

    def _checked(self, found: dict, source: str) -> dict:
        if not isinstance(found, dict) or "manifest" not in found or "torrent_hex" not in found:
            raise ValueError(f"{source}: not a manifest answer")
        if self.model_id is not None and manifest_digest(found["manifest"]) != self.model_id:
            raise ValueError(f"{source}: its manifest of {self.model} is not the one the join link names; refused")
        try:  # the torrent must be the manifest's: its pieces are what BitTorrent checks
            same = info_hash(bytes.fromhex(found["torrent_hex"])) == found["manifest"].get("info_hash")
        except (ValueError, RuntimeError, AttributeError):
            same = False
        if not same:
            raise ValueError(f"{source}: its torrent is not the one the manifest of {self.model} names; refused")
        return found


__all__ = ["Directory", "DirectoryError"]
