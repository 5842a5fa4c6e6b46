"""Route planning: pick the chain of shard advertisements that covers a model at least estimated latency.

Pure functions over data (no I/O), so they are tested on synthetic advertisements. Admission works from
the numbers a node advertises about its own shard (``extra["accounting"]``, computed by the node from its
GGUF header with ``artifact.accounting``): KV bytes per token, fixed state bytes per session, bytes and
session slots free. Nothing here reads an architecture name or applies a per-architecture rule: an MLA
shard simply advertises a small ``kv_bytes_per_token``, a recurrent one ``kv_bytes_per_token = 0`` and a
``state_bytes_per_session``.
"""

from __future__ import annotations

import heapq
import math
import time
from dataclasses import asdict, dataclass, field

from ..net.identity import IdentityError, verify_json

SIGNED_WINDOW_S = 300.0  # an advertisement signed further than this (s) from the reader's clock is refused


class NoRoute(LookupError):
    """No chain of ready nodes covers the model (the message names the layers not served)."""


@dataclass(frozen=True)
class Advertisement:
    """What a node tells the tracker about one shard it serves.

    ``layers`` is ``(start, end)`` half-open; ``free_kv_tokens`` its KV capacity left (tokens);
    ``decode_ms`` its measured time per decode step for its layers (ms). ``signed``: the JSON object the node
    signed (with its ``sig`` and ``signed_at``), exactly as received, when it was signed: ``to_json`` answers it
    unchanged, so whoever gets it from a tracker can check the signature again (``check_signed``).
    """

    node_id: str
    url: str
    model: str
    layers: tuple[int, int]
    embed: bool = False
    head: bool = False
    state: str = "ready"  # fetching | loading | ready
    free_kv_tokens: int = 0
    decode_ms: float = 0.0
    extra: dict = field(default_factory=dict, compare=False, hash=False)
    signed: dict | None = field(default=None, compare=False, hash=False, repr=False)

    @classmethod
    def from_json(cls, d: dict) -> Advertisement:
        """The advertisement a node sends (``POST /nodes/heartbeat``, ``GET /v1/advertisement``) as JSON ``d``.
        Raises KeyError / TypeError / ValueError / IndexError when a field is missing or malformed."""
        return cls(
            str(d["node_id"]),
            str(d["url"]),
            str(d["model"]),
            (int(d["layers"][0]), int(d["layers"][1])),
            bool(d.get("embed")),
            bool(d.get("head")),
            str(d.get("state", "ready")),
            int(d.get("free_kv_tokens", 0)),
            float(d.get("decode_ms", 0.0)),
            dict(d.get("extra", {})),
            dict(d) if isinstance(d, dict) and "sig" in d else None,
        )

    def to_json(self) -> dict:
        """This advertisement as JSON (``from_json`` reads it back): the signed object as the node sent it when
        it was signed (a copy), else its fields."""
        if self.signed is not None:
            return dict(self.signed)
        out = {**asdict(self), "layers": list(self.layers)}
        del out["signed"]
        return out

    @property
    def accounting(self) -> dict | None:
        """``extra["accounting"]`` when the node advertised it (see ``free_kv_tokens``), else None."""
        acc = self.extra.get("accounting") if isinstance(self.extra, dict) else None
        return acc if isinstance(acc, dict) else None


def check_signed(d: dict, now: float | None = None, window_s: float = SIGNED_WINDOW_S) -> None:
    """Check that advertisement ``d`` (a JSON object) is signed by the key its ``node_id`` names (``sig``: the
    ed25519 signature of the canonical JSON of every other field, net/identity.py) and that its ``signed_at``
    (unix s) is within ``window_s`` seconds of ``now`` (default: this clock), so an old signed advertisement cannot
    be replayed for long. Raises IdentityError saying what is wrong (no signature, a malformed key, a signature
    that does not verify, a stale or future-dated advertisement)."""
    if not isinstance(d, dict):
        raise IdentityError("an advertisement is a JSON object")
    if "sig" not in d:
        raise IdentityError("unsigned advertisement: no 'sig' field (nodes sign their advertisements with their key)")
    key = d.get("node_id")
    if isinstance(key, str) and key != key.lower():  # one key, one spelling: a ban by key cannot be dodged
        raise IdentityError("a node_id is its public key in lowercase hex")
    verify_json(d, key)
    check_signed_at(d, now, window_s)


def check_signed_at(d: dict, now: float | None = None, window_s: float = SIGNED_WINDOW_S) -> None:
    """Check that advertisement ``d``'s ``signed_at`` (unix s) is within ``window_s`` seconds of ``now`` (default:
    this clock); the signature is not checked (``check_signed``). Raises IdentityError when not."""
    at = d.get("signed_at")
    try:
        if isinstance(at, bool) or not isinstance(at, (int, float)) or not math.isfinite(at):
            raise ValueError
    except (ValueError, OverflowError):  # OverflowError: an int past float's range
        shown = "an integer out of range" if isinstance(at, int) and not isinstance(at, bool) else repr(at)[:40]
        raise IdentityError(f"an advertisement's signed_at is unix seconds, got {shown}") from None
    skew = at - (time.time() if now is None else now)
    if abs(skew) > window_s:
        raise IdentityError(
            f"stale or future-dated advertisement: signed {abs(skew):.0f} s {'ahead of' if skew > 0 else 'before'} "
            f"this clock (at most {window_s:g} s either way)"
        )


UNBOUNDED = 2**62  # context a shard without per-token KV (all layers recurrent) allows, memory-wise


def _num(acc: dict, key: str, default: int | None = 0) -> int | None:
    v = acc.get(key, default)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
        raise ValueError(f"accounting.{key} must be a non-negative number, got {v!r}")
    return int(v)


def free_kv_tokens(ad: Advertisement) -> int:
    """Tokens of context one more session can have on this node, from its advertised numbers alone.

    With ``extra["accounting"]`` (bytes): ``(free_bytes - state_bytes_per_session) // kv_bytes_per_token``,
    0 when ``free_sessions`` is 0 or the fixed state alone does not fit, ``UNBOUNDED`` when
    ``kv_bytes_per_token`` is 0 (a recurrent shard: its state does not grow with context), and at most
    ``max_length`` when advertised. Without it (an older node): the ``free_kv_tokens`` field.
    Raises ValueError for a malformed accounting (a negative or non-numeric value).
    """
    acc = ad.accounting
    if acc is None:
        return ad.free_kv_tokens
    sessions = _num(acc, "free_sessions", None)
    if sessions is not None and sessions < 1:
        return 0
    free, state = _num(acc, "free_bytes"), _num(acc, "state_bytes_per_session")
    per_token = _num(acc, "kv_bytes_per_token")
    if free < state:
        return 0
    tokens = UNBOUNDED if per_token == 0 else (free - state) // per_token
    cap = _num(acc, "max_length", None)
    return min(tokens, cap) if cap is not None else tokens


def route_context(route: list[Advertisement]) -> int:
    """Longest session (tokens) the route admits now: the least ``free_kv_tokens`` over its nodes."""
    return min((free_kv_tokens(a) for a in route), default=0)


def route_wire_bytes_per_token(route: list[Advertisement]) -> int | None:
    """Hidden-state bytes one decode token sends between the route's nodes: the sum of the advertised
    ``boundary_bytes_per_token`` of every node but the head; None when a node did not advertise it."""
    total = 0
    for a in route[:-1]:
        acc = a.accounting
        if acc is None or acc.get("boundary_bytes_per_token") is None:
            return None
        total += _num(acc, "boundary_bytes_per_token")
    return total


def gaps(covered: set[int], n_layers: int) -> list[tuple[int, int]]:
    """Half-open ranges ``[(start, end)]`` of the layers in ``range(n_layers)`` not in ``covered``."""
    out, start = [], None
    for i in range(n_layers + 1):
        if i < n_layers and i not in covered:
            start = i if start is None else start
        elif start is not None:
            out.append((start, i))
            start = None
    return out


def uncovered(ads: list[Advertisement], n_layers: int) -> list[tuple[int, int]]:
    """Layer ranges ``[(start, end)]`` no advertisement in ``ads`` covers."""
    return gaps({i for ad in ads for i in range(max(ad.layers[0], 0), min(ad.layers[1], n_layers))}, n_layers)


def decode_estimates(ads: list[Advertisement], measured: dict[str, float] | None = None) -> dict[int, float]:
    """The decode time (ms per token) route planning assumes for each advertisement, by ``id(ad)``: its advertised
    ``decode_ms`` once it has decoded, else (a node that has not decoded yet advertises 0) the median per-layer time
    of the nodes that have, times its own layer count — a new node is neither free (it would take every route until
    its first steps, then lose them all) nor shunned. 0 when no node has decoded yet.

    ``measured`` (node_id → ms per decode step, as a client timed the node from outside: ``parse_measured``): a
    node's claim never counts for less than that — a node that advertises speed it does not have gets no more
    routes than its measured time earns."""
    measured = measured or {}
    per_layer = sorted(
        a.decode_ms / (a.layers[1] - a.layers[0]) for a in ads if a.decode_ms > 0 and a.layers[1] > a.layers[0]
    )
    typical = per_layer[len(per_layer) // 2] if per_layer else 0.0
    return {
        id(a): max(
            a.decode_ms if a.decode_ms > 0 else typical * max(a.layers[1] - a.layers[0], 0),
            measured.get(a.node_id, 0.0),
        )
        for a in ads
    }


MAX_MEASURED = 256  # nodes one route query may report timings of


def parse_measured(text: str) -> dict[str, float]:
    """``GET /route``'s ``measured`` parameter, ``node_id:ms,node_id:ms,...`` (a client's own timings of nodes, ms per
    decode step), as a dict; ValueError for a malformed entry, a time outside [0, 1e6) or more than MAX_MEASURED."""
    out: dict[str, float] = {}
    for item in filter(None, text.split(",")):
        key, sep, ms = item.partition(":")
        value = float(ms) if sep else -1.0
        if not key or not 0 <= value < 1e6:
            raise ValueError(f"measured takes node_id:ms pairs, got {item[:80]!r}")
        out[key] = value
    if len(out) > MAX_MEASURED:
        raise ValueError(f"measured lists {len(out)} nodes; at most {MAX_MEASURED}")
    return out


def plan_route(
    ads: list[Advertisement],
    n_layers: int,
    max_length: int,
    hop_ms: float = 1.0,
    load: dict[str, int] | None = None,
    span: tuple[int, int] | None = None,
    measured: dict[str, float] | None = None,
) -> list[Advertisement]:
    """The chain ``[ad_0, ..., ad_k]`` with ``ad_0`` holding the embedding stage and layers from 0,
    each next one starting where the previous ended, the last holding the head and ending at
    ``n_layers``, that minimizes ``sum(decode_ms + hop_ms)`` (``decode_estimates``: a node that has not decoded yet
    counts at the swarm's median per-layer time; none counts for less than ``measured`` says); only ready nodes with
    ``free_kv_tokens(ad) >= max_length`` qualify (the advertised bytes: a session of ``max_length``
    tokens costs ``max_length * kv_bytes_per_token + state_bytes_per_session`` on a node). Among equal-latency chains,
    nodes with fewer sessions
    in ``load`` (node_id → sessions routed) are preferred, which spreads load.

    ``span=(start, end)`` plans only that part of the route (a replacement for a failed hop): the chain
    starts at ``start`` (with the embedding stage when 0) and ends at ``end`` (with the head when
    ``n_layers``).

    Raises NoRoute naming the layers not served ("layers 6:12 are not served"), or the reason no
    chain fits (no free KV, no embedding/head stage, ranges that do not line up).
    """
    load = load or {}
    first, last = span or (0, n_layers)
    if not 0 <= first < last <= n_layers:
        raise NoRoute(f"span {first}:{last} is not inside layers 0:{n_layers}")
    outside = set(range(first)) | set(range(last, n_layers))

    def uncovered(group: list[Advertisement], n: int) -> list[tuple[int, int]]:
        return gaps(outside | {i for a in group for i in range(max(a.layers[0], 0), min(a.layers[1], n))}, n)

    ready = [a for a in ads if a.state == "ready"]
    missing = uncovered(ready, n_layers)
    if missing:
        names = ", ".join(f"{s}:{e}" for s, e in missing)
        raise NoRoute(f"layers {names} are not served by any ready node")
    fit = [a for a in ready if free_kv_tokens(a) >= max_length]
    missing = uncovered(fit, n_layers)
    if missing:
        names = ", ".join(f"{s}:{e}" for s, e in missing)
        raise NoRoute(f"no node serving layers {names} has {max_length} tokens of free KV cache")
    ms = decode_estimates(fit, measured)
    # Dijkstra over layer boundaries 0..n_layers; edge = one shard. Cost: (latency, load) lexicographic.
    best: dict[int, tuple[float, int]] = {first: (0.0, 0)}
    prev: dict[int, Advertisement] = {}
    heap: list[tuple[float, int, int]] = [(0.0, 0, first)]
    while heap:
        cost, spread, pos = heapq.heappop(heap)
        if (cost, spread) > best.get(pos, (float("inf"), 0)) or pos == last:
            continue
        for ad in fit:
            start, end = ad.layers
            if start != pos or end <= start or end > last:
                continue
            if pos == 0 and not ad.embed:
                continue
            if end == n_layers and not ad.head:
                continue
            key = (cost + ms[id(ad)] + hop_ms, spread + load.get(ad.node_id, 0))
            if key < best.get(end, (float("inf"), 0)):
                best[end] = key
                prev[end] = ad
                heapq.heappush(heap, (key[0], key[1], end))
    if last not in prev:
        raise NoRoute(
            f"the served ranges do not chain from layer {first}{' (with embedding)' if first == 0 else ''} "
            f"to {last}{' (with head)' if last == n_layers else ''} without overlapping"
        )
    route, pos = [], last
    while pos != first:
        ad = prev[pos]
        route.append(ad)
        pos = ad.layers[0]
    return route[::-1]
