"""What a route session measures: per-hop timings of every step, prefix restores, repairs, direct replies."""

from __future__ import annotations

from dataclasses import dataclass, field

P95 = 0.95


def _pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def _mean(values: list[float]) -> float:
    return round(sum(values) / len(values), 3) if values else 0.0


@dataclass
class StepTiming:
    """Per-hop numbers of one step (ms, bytes), in route order; ``urls`` names the hops."""

    n_tokens: int
    compute_ms: list[float]
    network_ms: list[float]
    bytes_in: list[int]
    kv_tokens: list[int]
    urls: list[str] = field(default_factory=list)
    verify: bool = False  # a speculative verify step (a decode step of several tokens)
    start: int = -1  # position of the step's first token
    step: int = 0  # the step's number (0: not known)
    # per hop, its step commitment (``{"in", "out", "key", "sig"}``: docs/protocol.md) or None (a session opened
    # without ``commit``, or a node that sent none)
    commits: list[dict | None] = field(default_factory=list)
    # per hop, how long its caller waited for its reply (ms): the client's round trip for the first hop, the previous
    # node's ``push_ms`` for the others — a hop's time measured from outside it (``own_ms``)
    outer_ms: list[float] = field(default_factory=list)

    def own_ms(self) -> list[float]:
        """Per hop, the part of the step's time spent at it and on the way to it, as the hops before it measured:
        ``outer_ms[k] - outer_ms[k + 1]`` (the last hop: ``outer_ms[-1]``), never below 0. A hop's own numbers only
        enter through the time it says it waited for the next hop, so it cannot make itself look faster than it is
        without making the next one look slower by as much."""
        out = self.outer_ms
        return [max(out[k] - (out[k + 1] if k + 1 < len(out) else 0.0), 0.0) for k in range(len(out))]


@dataclass
class RouteTelemetry:
    """What a session measured: one StepTiming per step, and each repair of its route."""

    steps: list[StepTiming] = field(default_factory=list)
    repairs: list[dict] = field(default_factory=list)
    prefix_tokens_restored: int = 0
    direct_replies: int = 0  # steps whose reply came straight from the head (its reply link)
    ring_steps: int = 0  # steps the head sent to the first node itself (ring decode: client/ring.py)
    ring_discarded: int = 0  # head-sent steps rolled back: the caller fed something else (a verify step, other ids)
    keep_commits: bool = False  # keep each step's commitments (``StepTiming.commits``): a session being audited

    def record(
        self,
        reply: dict,
        rtt: float,
        n_tokens: int,
        urls: list[str],
        verify: bool = False,
        start: int = -1,
        step: int = 0,
    ) -> None:
        """One StepTiming from a reply that came back along the route (``hops``: each node's numbers, ms, and its
        ``commit`` when it sent one, kept with ``keep_commits``) and its round trip ``rtt`` (ms): a hop's network
        time is what its caller waited beyond its handling. ``step``: the step's number. A reply whose ``hops`` do
        not number one per URL of ``urls`` (the route the step was sent on) is not one of that route's: ignored."""
        hops = reply.get("hops")
        if not isinstance(hops, list) or len(hops) != len(urls):
            return
        network, waited = [], []
        outer = rtt
        for hop in hops:
            waited.append(outer)
            network.append(max(outer - hop["handle_ms"], 0.0))
            outer = hop.get("push_ms", 0.0)
        self.steps.append(
            StepTiming(
                n_tokens,
                [h["compute_ms"] for h in hops],
                network,
                [h["bytes_in"] for h in hops],
                [h["kv_tokens"] for h in hops],
                urls,
                verify,
                start,
                step,
                [h.get("commit") for h in hops] if self.keep_commits else [],
                waited,
            )
        )

    def record_quiet(self, step: int, start: int, urls: list[str], hops: list[dict | None]) -> None:
        """One StepTiming for a quiet decode step of ring decode (``step``, at position ``start``) from each hop's
        own numbers (``POST /v1/sessions/{id}/hops``: ``compute_ms``, ``bytes_in``, ``kv_tokens``), in the order of
        ``urls``. No hop of a quiet step is timed from outside: ``network_ms`` and ``outer_ms`` are empty (every
        ``node/ring.py`` MEASURED_EVERY-th ring step has them). A step that a hop has no numbers for is left out."""
        try:
            compute = [float(h["compute_ms"]) for h in hops]
            sent = [int(h["bytes_in"]) for h in hops]
            kv = [int(h["kv_tokens"]) for h in hops]
        except (KeyError, TypeError, ValueError):
            return
        self.steps.append(StepTiming(1, compute, [], sent, kv, list(urls), False, start, step))

    def summary(self, route) -> dict:
        """Per-hop compute/network ms (mean, p95) over decode steps of ``route`` (a RemoteRoute: its hops),
        payload bytes per decode token, KV held."""
        decode = [s for s in self.steps if s.n_tokens == 1 or s.verify]
        prefill = [s for s in self.steps if s.n_tokens > 1 and not s.verify]

        def per_hop(steps: list[StepTiming], url: str, field_name: str) -> list[float]:
            # (a quiet step has no network_ms)
            return [
                getattr(s, field_name)[s.urls.index(url)]
                for s in steps
                if url in s.urls and len(getattr(s, field_name)) == len(s.urls)
            ]

        hops = []
        for hop in route.hops:
            comp = per_hop(decode, hop.url, "compute_ms")
            net = per_hop(decode, hop.url, "network_ms")
            sent = [s.bytes_in[s.urls.index(hop.url)] / s.n_tokens for s in decode if hop.url in s.urls]
            kv = per_hop(self.steps, hop.url, "kv_tokens")
            hops.append(
                {
                    "node": hop.url,
                    "layers": [hop.start, hop.end],
                    "path": getattr(hop, "path", "direct"),  # direct, mapped (home router's port) or relayed
                    "compute_ms": {"mean": _mean(comp), "p95": round(_pct(comp, P95), 3)},
                    "network_ms": {"mean": _mean(net), "p95": round(_pct(net, P95), 3)},
                    "prefill_compute_ms": round(sum(per_hop(prefill, hop.url, "compute_ms")), 3),
                    "payload_bytes_per_decode_token": round(sum(sent) / len(sent), 1) if sent else 0.0,
                    "kv_tokens": kv[-1] if kv else 0,
                }
            )
        return {
            "hops": hops,
            "payload_bytes_per_decode_token": round(sum(h["payload_bytes_per_decode_token"] for h in hops), 1),
            "kv_tokens_held": {h["node"]: h["kv_tokens"] for h in hops},
            "prefix_tokens_restored": self.prefix_tokens_restored,
            "repairs": list(self.repairs),
            "direct_replies": self.direct_replies,
            "ring_steps": self.ring_steps,
            "ring_discarded": self.ring_discarded,
        }
