"""A route session over HTTP nodes: open on every node, step through the first, collect per-hop telemetry."""

from __future__ import annotations

import http.client
import json
import os
import time
import uuid
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from ..protocol import encode_tokens
from ..protocol.auth import auth_headers
from .sampling import SamplingParams


class RouteError(RuntimeError):
    """A route operation failed. ``status``: HTTP status to pass on; ``code``: protocol error code.

    The message names the node (URL) that failed."""

    def __init__(self, message: str, status: int = 502, code: str = "hop_failed"):
        super().__init__(message)
        self.status = status
        self.code = code


@dataclass(frozen=True)
class Hop:
    """One node of a route, as its ``/health`` describes it."""

    url: str
    start: int
    end: int
    embed: bool
    head: bool
    n_embd: int
    n_layers: int
    max_length: int
    max_step_tokens: int


def _conn(url: str, timeout: float) -> http.client.HTTPConnection:
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        raise ValueError(f"node URL must look like http://HOST:PORT, got {url!r}")
    return http.client.HTTPConnection(parts.hostname, parts.port or 80, timeout=timeout)


def _request(conn: http.client.HTTPConnection, url: str, method: str, path: str, body: bytes | None = None,
             content_type: str = "application/json") -> tuple[int, bytes]:
    headers = {"Content-Type": content_type, **auth_headers()} if body is not None else auth_headers()
    try:
        conn.request(method, path, body=body, headers=headers)
        resp = conn.getresponse()
        return resp.status, resp.read()
    except TimeoutError:
        conn.close()
        raise RouteError(f"node {url} did not answer within {conn.timeout:g} s", 504, "hop_timeout") from None
    except (OSError, http.client.HTTPException) as exc:
        conn.close()
        raise RouteError(f"node {url} failed: {type(exc).__name__}: {exc}", 502, "hop_failed") from None


def _check(url: str, status: int, body: bytes, what: str) -> dict:
    try:
        data = json.loads(body)
    except ValueError:
        data = None
    if status >= 400 or not isinstance(data, dict):
        err = (data or {}).get("error", {}) if isinstance(data, dict) else {}
        message = err.get("message") or body[:200].decode(errors="replace")
        code = err.get("code", "hop_failed")
        raise RouteError(f"{what} on node {url}: {message}" if url not in message else message,
                         status if status >= 400 else 502, code)
    return data


def _pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


class RemoteRoute:
    """An ordered list of node URLs whose shards cover ``[0, n_layers)``, embed first, head last.

    ``hop_timeout_s``: seconds one hop may take to answer. Node i of n waits ``(n - 1 - i) x`` that for
    its next hop, and the client ``n x`` that (+1 s) for the first node, so the deepest failing hop
    times out first and the error names it. Raises RouteError when a node is unreachable and
    ValueError when the shards do not chain.
    """

    def __init__(self, urls: list[str], hop_timeout_s: float = 30.0):
        if not urls:
            raise ValueError("a route needs at least one node URL")
        self.hop_timeout_s = hop_timeout_s
        self.hops = [self._describe(u.rstrip("/")) for u in urls]
        self.timeout_s = hop_timeout_s * len(self.hops) + 1.0
        first, last = self.hops[0], self.hops[-1]
        if not first.embed or not last.head or first.start != 0 or last.end != last.n_layers:
            raise ValueError(f"route must start at layer 0 with the embedding stage and end at layer "
                             f"{last.n_layers} with the head; got {self.describe()}")
        for a, b in zip(self.hops, self.hops[1:]):
            if a.end != b.start or a.head or b.embed:
                raise ValueError(f"route does not chain at {a.url} ({a.start}:{a.end}) → {b.url} ({b.start}:{b.end})")

    def _describe(self, url: str) -> Hop:
        conn = _conn(url, min(self.hop_timeout_s, 10.0))
        try:
            h = _check(url, *_request(conn, url, "GET", "/health"), "health")
        finally:
            conn.close()
        return Hop(url, h["layers"][0], h["layers"][1], h["embed"], h["head"], h["n_embd"], h["n_layers"],
                   h["max_length"], h["max_step_tokens"])

    def describe(self) -> list[dict]:
        """``[{"node": URL, "layers": [start, end]}, ...]`` in route order."""
        return [{"node": h.url, "layers": [h.start, h.end]} for h in self.hops]

    @property
    def max_length(self) -> int:
        """The longest session every node of the route can hold (tokens)."""
        return min(h.max_length for h in self.hops)

    def open(self, max_length: int, sampling: SamplingParams | None = None, wire_dtype: str = "f16",
             top_logprobs: int = 0) -> "RemoteSession":
        """Open a session on every node (head first); RouteError (with the node's status) when one refuses."""
        return RemoteSession(self, max_length, sampling or SamplingParams(), wire_dtype, top_logprobs)


@dataclass
class StepTiming:
    """Per-hop numbers of one step (ms, bytes)."""

    n_tokens: int
    compute_ms: list[float]
    network_ms: list[float]
    bytes_in: list[int]
    kv_tokens: list[int]


@dataclass
class RouteTelemetry:
    """What a session measured: one StepTiming per step."""

    steps: list[StepTiming] = field(default_factory=list)

    def summary(self, route: RemoteRoute) -> dict:
        """Per-hop compute/network ms (mean, p95) over decode steps, payload bytes per decode token, KV held."""
        decode = [s for s in self.steps if s.n_tokens == 1]
        prefill = [s for s in self.steps if s.n_tokens > 1]
        hops = []
        for i, hop in enumerate(route.hops):
            comp = [s.compute_ms[i] for s in decode]
            net = [s.network_ms[i] for s in decode]
            hops.append({
                "node": hop.url, "layers": [hop.start, hop.end],
                "compute_ms": {"mean": round(sum(comp) / len(comp), 3) if comp else 0.0, "p95": round(_pct(comp, .95), 3)},
                "network_ms": {"mean": round(sum(net) / len(net), 3) if net else 0.0, "p95": round(_pct(net, .95), 3)},
                "prefill_compute_ms": round(sum(s.compute_ms[i] for s in prefill), 3),
                "payload_bytes_per_decode_token": round(sum(s.bytes_in[i] for s in decode) / len(decode), 1)
                if decode else 0.0,
                "kv_tokens": self.steps[-1].kv_tokens[i] if self.steps else 0,
            })
        return {"hops": hops,
                "payload_bytes_per_decode_token": round(sum(h["payload_bytes_per_decode_token"] for h in hops), 1),
                "kv_tokens_held": {h["node"]: h["kv_tokens"] for h in hops}}


class RemoteSession:
    """A RouteSession whose shards live on HTTP nodes. ``step`` sends one frame to the first node;
    the nodes push it along the route and the head's sampled token comes back.

    Steps are numbered from 1; a step whose connection drops is sent once more with the same number
    (the node answers a retry from its record, never applying it twice).
    """

    def __init__(self, route: RemoteRoute, max_length: int, sampling: SamplingParams, wire_dtype: str = "f16",
                 top_logprobs: int = 0):
        self.route = route
        self.id = uuid.UUID(bytes=os.urandom(16))  # 128 random bits: unguessable
        self.max_length = max_length
        self.position = 0
        self.step_no = 0
        self.telemetry = RouteTelemetry()
        self.last_logprobs = None
        self._conns = {}
        self._opened: list[str] = []
        sampling = sampling.validate()
        try:
            for i in reversed(range(len(route.hops))):
                hop = route.hops[i]
                body = {"session_id": str(self.id), "max_length": max_length, "wire_dtype": wire_dtype,
                        "next_hop": route.hops[i + 1].url if i + 1 < len(route.hops) else None,
                        "hop_timeout_s": route.hop_timeout_s * max(len(route.hops) - 1 - i, 1)}
                if hop.head:
                    body["sampling"] = sampling.to_dict()
                    body["top_logprobs"] = top_logprobs
                _check(hop.url, *_request(self._conn(hop.url), hop.url, "POST", "/v1/sessions",
                                          json.dumps(body).encode()), "open session")
                self._opened.append(hop.url)
        except BaseException:
            self.close()
            raise

    def _conn(self, url: str) -> http.client.HTTPConnection:
        conn = self._conns.get(url)
        if conn is None:
            conn = self._conns[url] = _conn(url, self.route.timeout_s)
        return conn

    def step(self, token_ids: list[int], sample: bool = True) -> int | None:
        """Feed ``token_ids`` (prefill: many, decode: one) through the route; the head's sampled next token id.

        Prompts longer than the route's smallest max_step_tokens go in chunks (only the last is sampled).
        Raises RouteError naming the failing node (status/code from the node), ValueError for no ids.
        """
        if not token_ids:
            raise ValueError("a step needs at least one token id")
        limit = min(h.max_step_tokens for h in self.route.hops)
        token = None
        for i in range(0, len(token_ids), limit):
            chunk = token_ids[i:i + limit]
            token = self._step(chunk, sample and i + limit >= len(token_ids))
        return token

    def _step(self, ids: list[int], sample: bool) -> int | None:
        first = self.route.hops[0]
        self.step_no += 1
        frame = encode_tokens(self.id, self.step_no, self.position, ids, sample)
        t0 = time.perf_counter()
        try:
            status, body = _request(self._conn(first.url), first.url, "POST", "/v1/step", frame,
                                    "application/octet-stream")
        except RouteError as exc:
            if exc.code != "hop_failed":
                raise
            status, body = _request(self._conn(first.url), first.url, "POST", "/v1/step", frame,
                                    "application/octet-stream")  # same step number: never applied twice
        rtt = (time.perf_counter() - t0) * 1e3
        reply = _check(first.url, status, body, f"step {self.step_no}")
        self.position += len(ids)
        hops = reply["hops"]
        network = []
        outer = rtt
        for hop in hops:
            network.append(max(outer - hop["handle_ms"], 0.0))
            outer = hop.get("push_ms", 0.0)
        self.telemetry.steps.append(StepTiming(len(ids), [h["compute_ms"] for h in hops], network,
                                               [h["bytes_in"] for h in hops], [h["kv_tokens"] for h in hops]))
        self.last_logprobs = reply.get("logprobs")
        return reply["token"]

    def truncate(self, length: int) -> None:
        """Roll every node back to ``length`` tokens; RouteError when a node refuses."""
        for hop in self.route.hops:
            _check(hop.url, *_request(self._conn(hop.url), hop.url, "POST", f"/v1/sessions/{self.id}/truncate",
                                      json.dumps({"length": length}).encode()), "truncate")
        self.position = length

    def close(self) -> None:
        """Release the session on every node it was opened on (best effort: errors are ignored)."""
        for conn in self._conns.values():
            conn.close()
        self._conns = {}
        for url in self._opened:
            conn = _conn(url, min(self.route.hop_timeout_s, 5.0))
            try:
                _request(conn, url, "DELETE", f"/v1/sessions/{self.id}")
            except RouteError:
                pass
            finally:
                conn.close()
        self._opened = []
