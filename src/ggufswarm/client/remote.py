"""A route session over HTTP nodes: open on every node, step through the first, collect per-hop telemetry."""

from __future__ import annotations

import http.client
import json
import os
import select
import socket
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import websocket

from ..protocol import encode_tokens, step_timeout_s
from ..protocol.auth import auth_headers
from ..protocol.snapshots import BLOCK_TOKENS
from ..runtime.sampling import SamplingParams


_OPEN_POOL = ThreadPoolExecutor(max_workers=16, thread_name_prefix="open")  # opens a session's nodes at once


class RouteError(RuntimeError):
    """A route operation failed. ``status``: HTTP status to pass on; ``code``: protocol error code;
    ``hop``: URL of the node that failed (the message names it too); ``late``: it came back along the route
    for an earlier step the head had already answered (the route is broken; the step now waiting was not
    lost on its own connection, so it is not resent as is)."""

    def __init__(self, message: str, status: int = 502, code: str = "hop_failed", hop: str | None = None):
        super().__init__(message)
        self.status = status
        self.code = code
        self.hop = hop
        self.late = False


# Errors that mean a node of the route is gone or lost the session: a repair can replace it.
REPAIRABLE = frozenset({"hop_failed", "hop_timeout", "internal", "unknown_session"})


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
    model_fingerprint: str | None = None  # SHA-256 of the model's GGUF headers (None: a node that does not say)
    model_name: str | None = None
    cache: bool | None = None  # whether the node has a snapshot cache (None: it does not say)
    max_verify_tokens: int | None = None  # head: most tokens of a speculative verify step (None: it cannot verify)

    @classmethod
    def from_advertisement(cls, ad: dict) -> "Hop | None":
        """The Hop a tracker advertisement describes (``url``, ``layers``, ``embed``, ``head`` and
        ``extra.hop``), or None when it lacks a field (a node that does not advertise them: ask its /health)."""
        hop = (ad.get("extra") or {}).get("hop")
        if not isinstance(hop, dict):
            return None
        try:
            return cls(str(ad["url"]).rstrip("/"), int(ad["layers"][0]), int(ad["layers"][1]), bool(ad["embed"]),
                       bool(ad["head"]), **{k: hop[k] for k in ("n_embd", "n_layers", "max_length", "max_step_tokens")},
                       model_fingerprint=hop.get("model_fingerprint"), model_name=hop.get("model_name"),
                       cache=hop.get("cache"), max_verify_tokens=hop.get("max_verify_tokens"))
        except (KeyError, TypeError, ValueError, IndexError):
            return None


def _conn(url: str, timeout: float) -> http.client.HTTPConnection:
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        raise ValueError(f"node URL must look like http://HOST:PORT, got {url!r}")
    return http.client.HTTPConnection(parts.hostname, parts.port or 80, timeout=timeout)


def _request(conn: http.client.HTTPConnection, url: str, method: str, path: str, body: bytes | None = None,
             content_type: str = "application/json", *, token: str | None = None) -> tuple[int, bytes]:
    headers = {"Content-Type": content_type, **auth_headers(token)} if body is not None else auth_headers(token)
    try:
        conn.request(method, path, body=body, headers=headers)
        resp = conn.getresponse()
        return resp.status, resp.read()
    except TimeoutError:
        conn.close()
        raise RouteError(f"node {url} did not answer within {conn.timeout:g} s", 504, "hop_timeout", url) from None
    except (OSError, http.client.HTTPException) as exc:
        conn.close()
        raise RouteError(f"node {url} failed: {type(exc).__name__}: {exc}", 502, "hop_failed", url) from None


class StepLink:
    """This session's WebSocket to the first node's ``GET /v1/link`` (docs/protocol.md, "Links"): each step frame
    goes as one binary message and its reply comes back as one (24-byte frame key, uint16 status, JSON body).

    A plain ``POST /v1/step`` costs ~1.1 ms on loopback when the client has been idle during the step, a link
    message ~0.5 ms (measured here: an aiohttp echo server, 20 ms idle between requests), and a decode token
    pays it once. A node that answers the upgrade with 404/405 (no links) is sent ``POST /v1/step`` instead.
    ``websocket-client`` is synchronous: the reply is read on the calling thread, with no hand-off to a reader
    thread (another wake-up per token). ``token``: the swarm token, sent with the upgrade (and each POST).
    """

    def __init__(self, url: str, timeout: float, token: str | None = None, replies: uuid.UUID | None = None):
        self.url = url
        self.timeout = timeout
        self.token = token
        self.replies = replies  # a session id: this is that session's reply link to the head (receive only)
        self.http_only = False
        self._ws: websocket.WebSocket | None = None
        self._conn: http.client.HTTPConnection | None = None

    @classmethod
    def reply_link(cls, url: str, session: uuid.UUID, timeout: float, token: str | None) -> "StepLink | None":
        """Session ``session``'s reply link to the head ``url`` (``GET /v1/link?replies=``), connected; None when
        the head cannot give one (a node without reply links, or any refusal): replies then come back along the
        route only."""
        link = cls(url, timeout, token, replies=session)
        try:
            link._connect()
        except (RouteError, OSError, websocket.WebSocketException):
            return None
        return link if link._ws is not None else None

    def _connect(self) -> None:
        """Open the WebSocket (``_ws``), or note that the node has no links (``http_only``)."""
        parts = urlsplit(self.url)
        path = "/v1/link" + (f"?replies={self.replies}" if self.replies is not None else "")
        try:
            ws = websocket.create_connection(f"ws://{parts.netloc}{path}", timeout=self.timeout,
                                             header=[f"{k}: {v}" for k, v in auth_headers(self.token).items()],
                                             sockopt=[(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)],
                                             enable_multithread=False)
        except websocket.WebSocketBadStatusException as exc:
            if exc.status_code in (404, 405):
                self.http_only = True
                return
            raise RouteError(f"node {self.url} refused a link: HTTP {exc.status_code}", exc.status_code
                             if exc.status_code >= 400 else 502, "hop_failed", self.url) from None
        self._ws = ws

    def step(self, frame: bytes, timeout: float | None = None, replies: "StepLink | None" = None,
             late=None) -> tuple[int, bytes, bool]:
        """Send one step frame; (HTTP status, JSON reply bytes, whether the reply came on ``replies``).

        ``replies``: the session's reply link to the head; the first of its reply and this link's is taken (the
        head's comes first: one message from the head instead of one per hop back). ``late(key, status, body)``
        gets this link's replies to earlier steps that were answered on ``replies`` (their full per-hop
        telemetry). RouteError ``hop_timeout`` (504) when no reply comes within ``timeout`` s (default: the
        link's), ``hop_failed`` (502) when this link's connection fails; the link is closed then. A reply link
        that fails is closed and the reply awaited here."""
        timeout = self.timeout if timeout is None else timeout
        try:
            if self._ws is None and not self.http_only:
                self._connect()
            if self._ws is None:  # a node without links
                if self._conn is None:
                    self._conn = _conn(self.url, timeout)
                self._conn.timeout = timeout
                if self._conn.sock is not None:
                    self._conn.sock.settimeout(timeout)
                status, body = _request(self._conn, self.url, "POST", "/v1/step", frame, "application/octet-stream",
                                        token=self.token)
                return status, body, False
            key = frame[8:32]
            self._ws.settimeout(timeout)
            self._ws.send_binary(frame)
            deadline = time.monotonic() + timeout
            while True:
                if replies is not None and replies._ws is not None:
                    mine, theirs = self._ws.sock, replies._ws.sock
                    ready = select.select([mine, theirs], [], [], max(deadline - time.monotonic(), 0.0))[0]
                    if not ready:
                        raise websocket.WebSocketTimeoutException("no reply")
                    if theirs in ready and (body := replies._take(key)) is not None:
                        return 200, body, True
                    if mine not in ready:
                        continue
                opcode, data = self._ws.recv_data()
                if opcode == websocket.ABNF.OPCODE_BINARY and len(data) >= 26:
                    if data[:24] == key:
                        return int.from_bytes(data[24:26], "little"), data[26:], False
                    if late is not None:
                        late(data[:24], int.from_bytes(data[24:26], "little"), data[26:])
        except websocket.WebSocketTimeoutException:
            self.close()
            raise RouteError(f"node {self.url} did not answer within {timeout:g} s", 504, "hop_timeout",
                             self.url) from None
        except (OSError, websocket.WebSocketException) as exc:
            self.close()
            raise RouteError(f"node {self.url} failed: link {type(exc).__name__}: {exc}", 502, "hop_failed",
                             self.url) from None

    def _take(self, key: bytes) -> bytes | None:
        """Read one message of this reply link: its JSON body when it is the successful reply to the step with
        frame ``key``, else None (another step's; a failed link is closed)."""
        try:
            opcode, data = self._ws.recv_data()
        except (OSError, websocket.WebSocketException):
            self.close()
            return None
        if opcode == websocket.ABNF.OPCODE_CLOSE:
            self.close()
            return None
        if opcode == websocket.ABNF.OPCODE_BINARY and len(data) >= 26 and data[:24] == key \
                and int.from_bytes(data[24:26], "little") == 200:
            return data[26:]
        return None

    def drain(self, late, until, wait_s: float) -> None:
        """Pass this link's replies to ``late`` (as in step) until ``until()`` is true or ``wait_s`` seconds pass;
        a connection that fails is closed."""
        if self._ws is None:
            return
        deadline = time.monotonic() + wait_s
        try:
            while not until():
                left = deadline - time.monotonic()
                if left <= 0 or not select.select([self._ws.sock], [], [], left)[0]:
                    return
                opcode, data = self._ws.recv_data()
                if opcode == websocket.ABNF.OPCODE_BINARY and len(data) >= 26:
                    late(data[:24], int.from_bytes(data[24:26], "little"), data[26:])
        except (OSError, websocket.WebSocketException):
            self.close()

    def close(self) -> None:
        if self._ws is not None:
            try:
                self._ws.close(timeout=0.1)
            except (OSError, websocket.WebSocketException):
                pass
            self._ws = None
        if self._conn is not None:
            self._conn.close()
            self._conn = None


def fetch_model_headers(url: str, data_dir: Path, timeout: float = 30.0, *,
                        token: str | None = None) -> tuple[Path, dict]:
    """The model node ``url`` serves, for a client without its GGUF: ``GET /v1/model``, then each file's header
    (``GET /v1/model/header/{i}``) written into a sparse file of the file's full size under
    ``data_dir/models/<fingerprint[:16]>/`` (reused when already there). Enough for the vocabulary and chat
    template (llama.cpp's vocab-only load), not for weights. ``token``: the swarm token. Returns (first file's
    path, the /v1/model body).

    Raises RouteError (node unreachable, refused, or no /v1/model) and ValueError (the headers do not hash to
    the fingerprint the node gave).
    """
    from ..artifact.gguf_file import GGUFModelFile

    url = url.rstrip("/")
    conn = _conn(url, timeout)
    try:
        info = _check(url, *_request(conn, url, "GET", "/v1/model", token=token), "model")
        folder = Path(data_dir) / "models" / str(info["fingerprint"])[:16]
        paths = [folder / Path(f["name"]).name for f in info["files"]]
        if not all(p.is_file() and p.stat().st_size == f["bytes"] for p, f in zip(paths, info["files"])):
            folder.mkdir(parents=True, exist_ok=True)
            for i, (path, f) in enumerate(zip(paths, info["files"])):
                status, header = _request(conn, url, "GET", f"/v1/model/header/{i}", token=token)
                if status != 200 or len(header) != f["header_bytes"]:
                    _check(url, status if status >= 400 else 502, header[:200], f"model header {i}")
                with open(path, "wb") as out:
                    out.write(header)
                    out.truncate(f["bytes"])  # sparse: the tensor data is never read
    finally:
        conn.close()
    if GGUFModelFile(paths[0]).fingerprint != info["fingerprint"]:
        raise ValueError(f"the model headers from {url} do not match its fingerprint {info['fingerprint'][:12]}")
    return paths[0], info


def _check(url: str, status: int, body: bytes, what: str) -> dict:
    try:
        data = json.loads(body)
    except ValueError:
        data = None
    if status >= 400 or not isinstance(data, dict):
        err = (data or {}).get("error", {}) if isinstance(data, dict) else {}
        message = err.get("message") or body[:200].decode(errors="replace")
        code = err.get("code", "hop_failed")
        hop = err.get("hop") if isinstance(err.get("hop"), str) and err.get("hop") else url
        if url in message:
            text = message
        elif hop != url:  # a later node's error passed back: that node first
            text = f"{what}: node {hop} (via node {url}): {message}"
        else:
            text = f"{what} on node {url}: {message}"
        raise RouteError(text, status if status >= 400 else 502, code, hop)
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
    times out first and the error names it; both scale with a frame's size (``step_timeout_s``: x1 up to
    512 tokens, x8 for 4096). Raises RouteError when a node is unreachable and
    ValueError when the shards do not chain or serve different models. ``part=True`` accepts a chain
    covering only some layers (the replacement for a failed hop's span). ``model``: the GGUF fingerprint
    (``GGUFModelFile.fingerprint``) the client's tokenizer is for; every node must serve it (ValueError
    naming both models otherwise), and sessions are opened with it (``model_mismatch`` from a node that
    has changed since). ``token``: the swarm token, sent on every request to the route's nodes (None: an open
    swarm).
    """

    def __init__(self, urls: list[str], hop_timeout_s: float = 30.0, part: bool = False, model: str | None = None,
                 *, token: str | None = None):
        if not urls:
            raise ValueError("a route needs at least one node URL")
        self.hop_timeout_s = hop_timeout_s
        self.token = token
        self._set_hops([self._describe(u.rstrip("/")) for u in urls], part, model)

    @classmethod
    def of_hops(cls, hops: list[Hop], hop_timeout_s: float, part: bool = False,
                model: str | None = None, *, token: str | None = None) -> "RemoteRoute":
        """A route over already described hops (no /health calls; ``part``, ``model`` and ``token`` as in the
        constructor); ValueError when they do not chain or serve another model."""
        route = cls.__new__(cls)
        route.hop_timeout_s = hop_timeout_s
        route.token = token
        route._set_hops(list(hops), part, model)
        return route

    def _set_hops(self, hops: list[Hop], part: bool = False, model: str | None = None) -> None:
        self.hops = hops
        self.timeout_s = self.hop_timeout_s * len(self.hops) + 1.0
        # One model end to end: every node's GGUF fingerprint equals ``model`` (the client's) when given, else
        # each other's. Sessions then open with it, so a node since restarted with another model refuses them.
        said = [h for h in hops if h.model_fingerprint is not None]
        self.model = model or (said[0].model_fingerprint if said else None)
        other = next((h for h in said if h.model_fingerprint != self.model), None)
        if other is not None:
            mine = next((h for h in said if h.model_fingerprint == self.model), None)
            want = f"{mine.model_name} ({self.model[:12]}, at {mine.url})" if mine else f"model {self.model[:12]}"
            raise ValueError(f"node {other.url} serves {other.model_name} (GGUF fingerprint "
                             f"{other.model_fingerprint[:12]}), not {want}: a route serves one model")
        first, last = self.hops[0], self.hops[-1]
        if not part and (not first.embed or not last.head or first.start != 0 or last.end != last.n_layers):
            raise ValueError(f"route must start at layer 0 with the embedding stage and end at layer "
                             f"{last.n_layers} with the head; got {self.describe()}")
        for a, b in zip(self.hops, self.hops[1:]):
            if a.end != b.start or a.head or b.embed:
                raise ValueError(f"route does not chain at {a.url} ({a.start}:{a.end}) → {b.url} ({b.start}:{b.end})")

    def _describe(self, url: str) -> Hop:
        conn = _conn(url, min(self.hop_timeout_s, 10.0))
        try:
            h = _check(url, *_request(conn, url, "GET", "/health", token=self.token), "health")
        finally:
            conn.close()
        return Hop(url, h["layers"][0], h["layers"][1], h["embed"], h["head"], h["n_embd"], h["n_layers"],
                   h["max_length"], h["max_step_tokens"], h.get("model_fingerprint"), h.get("model_name"),
                   bool(h["cache"]) if "cache" in h else None, h.get("max_verify_tokens"))

    def describe(self) -> list[dict]:
        """``[{"node": URL, "layers": [start, end]}, ...]`` in route order."""
        return [{"node": h.url, "layers": [h.start, h.end]} for h in self.hops]

    @property
    def max_length(self) -> int:
        """The longest session every node of the route can hold (tokens)."""
        return min(h.max_length for h in self.hops)

    def open(self, max_length: int, sampling: SamplingParams | None = None, wire_dtype: str = "f32",
             top_logprobs: int = 0, replan=None, reuse_prefix: bool = True,
             lease_s: float | None = None, logprobs: bool = False) -> "RemoteSession":
        """Open a session on every node (head first); RouteError (with the node's status) when one refuses.

        ``lease_s``: the nodes drop the session after that many idle seconds (not only after their session
        TTL): a client that dies frees the route's KV that soon. The session renews it while it waits.

        ``replan(exclude, span) -> RemoteRoute``: plans a replacement for the layers ``span`` avoiding the
        node URLs in ``exclude``; with it the session repairs itself when a node fails (see RemoteSession).

        ``top_logprobs`` (0..20): the head returns that many most likely ``[id, logprob]`` pairs with each sample
        (``RemoteSession.last_logprobs``); ``logprobs``: it returns the sampled token's logprob too
        (``RemoteSession.last_token_logprob``). Both are log-softmax of the raw logits.
        """
        return RemoteSession(self, max_length, sampling or SamplingParams(), wire_dtype, top_logprobs, replan,
                             reuse_prefix, lease_s, logprobs)


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


@dataclass
class RouteTelemetry:
    """What a session measured: one StepTiming per step, and each repair of its route."""

    steps: list[StepTiming] = field(default_factory=list)
    repairs: list[dict] = field(default_factory=list)
    prefix_tokens_restored: int = 0
    direct_replies: int = 0  # steps whose reply came straight from the head (its reply link)

    def summary(self, route: RemoteRoute) -> dict:
        """Per-hop compute/network ms (mean, p95) over decode steps, payload bytes per decode token, KV held."""
        decode = [s for s in self.steps if s.n_tokens == 1 or s.verify]
        prefill = [s for s in self.steps if s.n_tokens > 1 and not s.verify]

        def per_hop(steps: list[StepTiming], url: str, field_name: str) -> list[float]:
            return [getattr(s, field_name)[s.urls.index(url)] for s in steps if url in s.urls]

        hops = []
        for hop in route.hops:
            comp = per_hop(decode, hop.url, "compute_ms")
            net = per_hop(decode, hop.url, "network_ms")
            sent = [s.bytes_in[s.urls.index(hop.url)] / s.n_tokens for s in decode if hop.url in s.urls]
            kv = per_hop(self.steps, hop.url, "kv_tokens")
            hops.append({
                "node": hop.url, "layers": [hop.start, hop.end],
                "compute_ms": {"mean": round(sum(comp) / len(comp), 3) if comp else 0.0, "p95": round(_pct(comp, .95), 3)},
                "network_ms": {"mean": round(sum(net) / len(net), 3) if net else 0.0, "p95": round(_pct(net, .95), 3)},
                "prefill_compute_ms": round(sum(per_hop(prefill, hop.url, "compute_ms")), 3),
                "payload_bytes_per_decode_token": round(sum(sent) / len(sent), 1) if sent else 0.0,
                "kv_tokens": kv[-1] if kv else 0,
            })
        return {"hops": hops,
                "payload_bytes_per_decode_token": round(sum(h["payload_bytes_per_decode_token"] for h in hops), 1),
                "kv_tokens_held": {h["node"]: h["kv_tokens"] for h in hops},
                "prefix_tokens_restored": self.prefix_tokens_restored, "repairs": list(self.repairs),
                "direct_replies": self.direct_replies}


class RemoteSession:
    """A RouteSession whose shards live on HTTP nodes. ``step`` sends one frame to the first node;
    the nodes push it along the route and the head's sampled token comes back.

    Steps are numbered from 1; a step whose connection drops is sent once more with the same number
    (the node answers a retry from its record, never applying it twice).

    Route repair (with ``replan``): when a step fails because a node died, timed out, answered 5xx or
    lost the session, the failed node's layer span is re-planned without it, the new nodes open the
    session and restore the longest cached prefix snapshot of the history (``/restore``), every other
    node is truncated to the common position, the tokens since then are replayed, and the step is
    sent again: the caller sees the same tokens as without the failure (greedy sampling). When no node
    serves exactly the failed span, the whole route is re-planned instead (a node serving more layers,
    such as a whole-model one, takes over; nodes it leaves out are released); the hop boundaries then
    move, so with f16/bf16 frames the text after the failure can differ from an uninterrupted run (f32
    frames: llama.cpp shards chain bit for bit, so it does not). Each repair is recorded in
    ``telemetry.repairs`` (``replaced_layers``: the layers re-planned). Without ``replan`` the RouteError
    is raised.

    Prefix reuse (``reuse_prefix``): the first step restores the longest cached prefix of the prompt on
    every node and computes only the rest.
    """

    MAX_REPAIRS_PER_STEP = 3
    OPEN_WAIT_S = 60.0  # how long an open waits for a node's free session slot (kv_budget_full) before failing

    def __init__(self, route: RemoteRoute, max_length: int, sampling: SamplingParams, wire_dtype: str = "f32",
                 top_logprobs: int = 0, replan=None, reuse_prefix: bool = True, lease_s: float | None = None,
                 logprobs: bool = False):
        self.route = route
        self.id = uuid.UUID(bytes=os.urandom(16))  # 128 random bits: unguessable
        self.max_length = max_length
        self.sampling = sampling.validate()
        self.wire_dtype = wire_dtype
        self.top_logprobs = top_logprobs
        self.logprobs = logprobs
        self.replan = replan
        self.reuse_prefix = reuse_prefix
        self.lease_s = lease_s
        self._renewed = time.monotonic()
        # while one step takes longer than a third of the lease (a long prefill on a loaded node), a keeper thread
        # renews the lease on every node: the nodes after the busy one see nothing of the session meanwhile
        self._step_since: float | None = None  # time.monotonic() when the step in flight started
        self._keeper: threading.Thread | None = None
        self._closed = threading.Event()
        self.position = 0      # tokens every node of the route holds
        self.tokens: list[int] = []  # the whole history fed so far (position <= len(tokens) during a repair)
        # Positions where a step ended. llama.cpp's numerics depend on how tokens are grouped into steps, so a
        # repair rolls back to one of these and replays the same steps: the output stays bit for bit the same.
        self.boundaries: set[int] = {0}
        self.step_no = 0
        self._telemetry = RouteTelemetry()
        self._replaying: dict | None = None  # the repair (telemetry entry) whose history is being replayed
        # the reply link to the head (StepLink.reply_link), opened after the first step; heads that gave none
        self._replies: StepLink | None = None
        self._replies_opening = None  # a Future of StepLink.reply_link, opened off the step path
        self._no_replies: set[str] = set()
        # steps answered on the reply link whose reply along the route (per-hop telemetry) is still to be read:
        # frame key -> (perf_counter s sent, n_tokens, hop urls, verify step, start position)
        self._unacked: dict[bytes, tuple[float, int, list[str], bool, int]] = {}
        self.last_logprobs = None
        self.last_token_logprob: float | None = None  # the last sample's logprob (sessions opened with logprobs)
        self.last_tokens: list[int] | None = None  # a verify step's samples, one per position
        self._rewinding = False  # the nodes hold rejected drafts past ``position``: the next frame rewinds (drop)
        self._conns = {}
        self._links: dict[str, StepLink] = {}
        self._opened: list[str] = []
        self._excluded: set[str] = set()
        try:
            self._open_all(route.hops)
        except BaseException:
            self.close()
            raise

    @property
    def telemetry(self) -> RouteTelemetry:
        """What the session measured (RouteTelemetry). Replies that came back along the route after the head's
        own reached the client are read first (up to 1 s), so that every step's per-hop numbers are in."""
        if self._unacked:
            link = self._links.get(self.route.hops[0].url)
            if link is not None:
                link.drain(lambda *a: self._late(*a, strict=False), lambda: not self._unacked, 1.0)
            self._unacked.clear()
        return self._telemetry

    def _open_all(self, hops: list[Hop]) -> None:
        """Open the session on every node at once: one round trip for the whole route, not one per node (TTFT).
        When a node's session slots are all taken (kv_budget_full), what was opened is closed and the session
        opens head first instead, waiting for slots (``_open_on``). Raises the first refusal in route order."""
        if len(hops) == 1:
            self._open_on(hops, 0)
            return

        def attempt(i: int) -> RouteError | None:
            try:
                self._open_on(hops, i, wait=False)
                return None
            except RouteError as exc:
                return exc

        errors = [e for e in _OPEN_POOL.map(attempt, range(len(hops))) if e is not None]
        if not errors:
            return
        if any(e.code != "kv_budget_full" for e in errors):
            raise next(e for e in errors if e.code != "kv_budget_full")
        self._close_opened()
        for i in reversed(range(len(hops))):
            self._open_on(hops, i)

    def _open_on(self, hops: list[Hop], i: int, wait: bool = True) -> None:
        hop = hops[i]
        body = {"session_id": str(self.id), "max_length": self.max_length, "wire_dtype": self.wire_dtype,
                "next_hop": hops[i + 1].url if i + 1 < len(hops) else None,
                "hop_timeout_s": self.route.hop_timeout_s * max(len(hops) - 1 - i, 1)}
        if hop.head:
            body["sampling"] = self.sampling.to_dict()
            body["top_logprobs"] = self.top_logprobs
            if self.logprobs:
                body["logprobs"] = True
        if self.lease_s is not None:
            body["lease_s"] = self.lease_s
        if self.route.model is not None:
            body["model"] = self.route.model
        # A node whose session slots are all taken answers 429 kv_budget_full: wait for one (as llama-server
        # queues requests beyond --parallel). A session that waits opens head first (_open_all), so the ones
        # holding this node's slots already hold the later nodes too and will finish: waiting cannot deadlock.
        deadline, pause = time.monotonic() + self.OPEN_WAIT_S, 0.02
        while True:
            try:
                self._call(hop.url, "POST", "/v1/sessions", body, "open session")
                break
            except RouteError as exc:
                if not wait or exc.code != "kv_budget_full" or time.monotonic() + pause > deadline:
                    raise
                time.sleep(pause)
                pause = min(pause * 2, 0.5)
                if self.lease_s is not None and time.monotonic() - self._renewed > self.lease_s / 3:
                    self.renew()  # the nodes opened already hold the session for us meanwhile
        self._opened.append(hop.url)

    def _conn(self, url: str) -> http.client.HTTPConnection:
        conn = self._conns.get(url)  # one per node (and per thread: _open_all opens each node on its own)
        if conn is None:
            conn = self._conns[url] = _conn(url, self.route.timeout_s)
        return conn

    def _call(self, url: str, method: str, path: str, body: dict | None, what: str) -> dict:
        data = json.dumps(body).encode() if body is not None else None
        return _check(url, *_request(self._conn(url), url, method, path, data, token=self.route.token), what)

    def step(self, token_ids: list[int], sample: bool = True) -> int | None:
        """Feed ``token_ids`` (prefill: many, decode: one) through the route; the head's sampled next token id.

        Prompts longer than the route's smallest max_step_tokens go in chunks (only the last is sampled).
        Raises RouteError naming the failing node (status/code from the node) when it cannot be repaired,
        ValueError for no ids.
        """
        if not token_ids:
            raise ValueError("a step needs at least one token id")
        if self.reuse_prefix and not self.tokens and len(token_ids) > BLOCK_TOKENS \
                and any(h.cache is not False for h in self.route.hops):  # no cache on any node: nothing to restore
            restored = self._restore_prefix(token_ids[:-1])  # at least one token is computed: it is sampled
            self.tokens.extend(token_ids[:restored])
            token_ids = token_ids[restored:]
        token = None
        i = 0
        if self.lease_s is not None and self._keeper is None:
            self._keeper = threading.Thread(target=self._keep_lease, name=f"lease-{self.id.hex[:8]}", daemon=True)
            self._keeper.start()
        self._step_since = time.monotonic()
        try:
            while i < len(token_ids):
                chunk = token_ids[i:i + min(h.max_step_tokens for h in self.route.hops)]
                i += len(chunk)
                token = self._step(chunk, sample and i >= len(token_ids))
        finally:
            self._step_since = None
        return token

    def _keep_lease(self) -> None:
        """The keeper thread: every ``lease_s / 3`` s, when a step has been in flight that long, renew the session on
        every node it is open on (own connections; a refusal or a dead node is left to the step to find)."""
        while not self._closed.wait(self.lease_s / 3):
            since = self._step_since
            if since is None or time.monotonic() - since < self.lease_s / 3:
                continue
            for url in list(self._opened):
                self._best_effort(url, "POST", f"/v1/sessions/{self.id}/renew", min(self.lease_s / 3, 10.0))

    @property
    def max_verify_tokens(self) -> int:
        """Most tokens of one ``verify`` step on this route: the head's limit (0: the head cannot verify)."""
        return min(self.route.hops[-1].max_verify_tokens or 0, min(h.max_step_tokens for h in self.route.hops))

    def verify(self, token_ids: list[int]) -> list[int]:
        """Speculative decoding: feed ``token_ids`` (the last sampled token, then drafted ones) as one step whose
        head samples after every position; the token a one-token step would have sampled after each
        (``[len(token_ids)]``). The session then holds them all: ``drop`` the rejected drafts. ValueError for more
        than ``max_verify_tokens`` ids; RouteError as ``step`` (``bad_route`` when the head answers no samples)."""
        if not token_ids or len(token_ids) > self.max_verify_tokens:
            raise ValueError(f"a verify step takes 1..{self.max_verify_tokens} token ids on this route "
                             f"(the head's max_verify_tokens), got {len(token_ids)}")
        self._step(token_ids, True, verify=True)
        samples = self.last_tokens
        if not isinstance(samples, list) or len(samples) != len(token_ids):
            raise RouteError(f"head {self.route.hops[-1].url} answered a verify step of {len(token_ids)} tokens "
                             f"with {samples!r}: it does not do speculative decoding", 502, "bad_route",
                             self.route.hops[-1].url)
        return samples

    def drop(self, n: int) -> None:
        """Forget the last ``n`` tokens fed (a verify step's rejected drafts). No request: the next step's frame
        starts at the shorter position with FLAG_REWIND, and every node drops them before applying it."""
        if not 0 <= n <= self.position:
            raise ValueError(f"cannot drop {n} of {self.position} tokens")
        if n == 0:
            return
        old = self.position
        self.position -= n
        del self.tokens[self.position:]
        self.boundaries.discard(old)
        self.boundaries.add(self.position)
        self._rewinding = True

    def _step(self, ids: list[int], sample: bool, verify: bool = False) -> int | None:
        """One chunk, repairing the route (at most MAX_REPAIRS_PER_STEP times) when a node fails."""
        repairs, pending = 0, None
        while True:
            try:
                if pending is not None:
                    self._repair(pending)
                    pending = None
                while self.position < len(self.tokens):  # replay after a repair, step by original step
                    end = min(b for b in self.boundaries | {len(self.tokens)} if b > self.position)
                    chunk = self.tokens[self.position:min(end, self.position + min(h.max_step_tokens
                                                                                   for h in self.route.hops))]
                    self._send(chunk, False)
                    if self._replaying is not None:  # what the repair actually replayed, counted as it goes
                        self._replaying["tokens_replayed"] += len(chunk)
                self._replaying = None
                token = self._send(ids, sample, verify=True) if verify else self._send(ids, sample)
                self.tokens.extend(ids)
                return token
            except RouteError as exc:
                if self._replaying is not None:  # the replay failed halfway: that repair says how far it got
                    self._replaying["error"] = f"replay failed: {exc}"[:300]
                    self._replaying = None
                if self.replan is None or exc.code not in REPAIRABLE or repairs >= self.MAX_REPAIRS_PER_STEP:
                    raise
                repairs += 1
                pending = exc

    def _send(self, ids: list[int], sample: bool, verify: bool = False) -> int | None:
        first, head = self.route.hops[0], self.route.hops[-1]
        self.step_no += 1
        frame = encode_tokens(self.id, self.step_no, self.position, ids, sample, verify, self._rewinding)
        link = self._links.get(first.url)
        if link is None:
            link = self._links[first.url] = StepLink(first.url, self.route.timeout_s, self.route.token)
        elif self._replies is None and head is not first and not link.http_only and head.url not in self._no_replies:
            # after the first step (it opened the session everywhere): the head's replies come straight to us,
            # one message after it sampled, not back through every hop (docs/protocol.md). Opened in the
            # background and used once open: a head that does not answer never holds a step up.
            if self._replies_opening is None:
                self._replies_opening = _OPEN_POOL.submit(StepLink.reply_link, head.url, self.id,
                                                          min(self.route.timeout_s, 5.0), self.route.token)
            elif self._replies_opening.done():
                self._replies, self._replies_opening = self._replies_opening.result(), None
                if self._replies is None:
                    self._no_replies.add(head.url)
        timeout = step_timeout_s(self.route.timeout_s - 1.0, len(ids)) + 1.0  # long prefill chunks wait longer
        t0 = time.perf_counter()
        try:
            status, body, direct = link.step(frame, timeout, self._replies, self._late)
        except RouteError as exc:
            if exc.code != "hop_failed" or exc.late:
                raise
            # a fresh connection; same step number: never applied twice
            status, body, direct = link.step(frame, timeout, self._replies, self._late)
        rtt = (time.perf_counter() - t0) * 1e3
        reply = _check(first.url, status, body, f"step {self.step_no}")
        self._rewinding = False
        self.position += len(ids)
        self.boundaries.add(self.position)
        urls = [h.url for h in self.route.hops]
        if direct:  # the head's own reply: the route's, with every hop's numbers, is read later (_late)
            self._unacked[frame[8:32]] = (t0, len(ids), urls, verify, self.position - len(ids))
            self._telemetry.direct_replies += 1
        else:
            self._record_timing(reply, rtt, len(ids), urls, verify, self.position - len(ids))
        self.last_tokens = reply.get("tokens")
        self.last_logprobs = reply.get("logprobs")
        self.last_token_logprob = reply.get("token_logprob")
        return reply["token"]

    def _record_timing(self, reply: dict, rtt: float, n_tokens: int, urls: list[str], verify: bool = False,
                       start: int = -1) -> None:
        """One StepTiming from a reply that came back along the route (``hops``: each node's numbers, ms) and
        its round trip ``rtt`` (ms): a hop's network time is what its caller waited beyond its handling."""
        hops = reply["hops"]
        network = []
        outer = rtt
        for hop in hops:
            network.append(max(outer - hop["handle_ms"], 0.0))
            outer = hop.get("push_ms", 0.0)
        self._telemetry.steps.append(StepTiming(n_tokens, [h["compute_ms"] for h in hops], network,
                                                [h["bytes_in"] for h in hops], [h["kv_tokens"] for h in hops], urls,
                                                verify, start))

    def _late(self, key: bytes, status: int, body: bytes, strict: bool = True) -> None:
        """The route's reply to a step the head already answered on the reply link: its telemetry. An error
        there (a node failed after passing the step on) means the route is broken: raised as RouteError with
        ``strict``, so that the step now waiting fails (and is repaired) at once, not after its own timeout."""
        entry = self._unacked.pop(key, None)
        if entry is None:
            return
        if status != 200:
            if strict:
                try:
                    _check(self.route.hops[0].url, status, body, "an earlier step")
                except RouteError as exc:
                    exc.late = True
                    raise
            return
        try:
            reply = json.loads(body)
        except ValueError:
            return
        t0, n_tokens, urls, verify, start = entry
        self._record_timing(reply, (time.perf_counter() - t0) * 1e3, n_tokens, urls, verify, start)

    def _drop_replies(self) -> None:
        """Close the reply link (one still opening is closed once open) and forget the replies it answered."""
        if self._replies is not None:
            self._replies.close()
            self._replies = None
        if self._replies_opening is not None:
            self._replies_opening.add_done_callback(lambda f: f.result() and f.result().close())
            self._replies_opening = None
        self._unacked.clear()

    # -- prefix snapshots --------------------------------------------------------------------------
    def _restore_many(self, hops: list[Hop], tokens: list[int],
                      boundaries: list[int] | None = None) -> dict[str, tuple[int, list[int] | None]]:
        """``/restore`` on each of ``hops`` at once: per node URL the tokens it now holds and, from a llama.cpp
        node, the step boundaries of what it restored (None from a torch node). ``boundaries``: the session's
        own step ends, for a repair (the node then restores only a prefix computed with exactly those steps)."""
        def one(hop: Hop) -> tuple[int, list[int] | None]:
            conn = _conn(hop.url, self.route.timeout_s)  # own connection: the calls run in parallel
            try:
                body = {"tokens": tokens, "step": self.step_no}
                if boundaries is not None:
                    body["boundaries"] = boundaries
                reply = _check(hop.url, *_request(conn, hop.url, "POST", f"/v1/sessions/{self.id}/restore",
                                                  json.dumps(body).encode(), token=self.route.token), "restore")
                return int(reply["length"]), reply.get("boundaries")
            finally:
                conn.close()

        with ThreadPoolExecutor(max_workers=max(len(hops), 1)) as pool:
            return dict(zip((h.url for h in hops), pool.map(one, hops)))

    @staticmethod
    def _common_prefix(held: dict[str, tuple[int, list[int] | None]]) -> tuple[int, list[int]]:
        """The longest prefix every node can keep, and its step boundaries: no longer than any node holds, and
        on llama.cpp nodes (which report boundaries) ending at a step boundary they all share with the same
        steps before it — otherwise their KV would come from differently grouped computations."""
        cap = min(length for length, _ in held.values())
        lists = [b for _, b in held.values() if b is not None]
        if not lists:
            return cap, []
        common: list[int] = []
        for column in zip(*lists):
            if column[0] > cap or any(b != column[0] for b in column):
                break
            common.append(column[0])
        return (common[-1] if common else 0), common

    def _rewind(self, hops: list[Hop], held: dict[str, int], length: int, relink: bool) -> None:
        """Truncate every hop holding more than ``length`` tokens (all of them with ``relink``, which also
        sets each one's next_hop to its successor in ``hops``) and set their step counters to ``step_no``."""
        for i, hop in enumerate(hops):
            if relink or held.get(hop.url, 0) > length:
                body = {"length": length, "step": self.step_no}
                if relink and not hop.head:
                    body["next_hop"] = hops[i + 1].url
                self._call(hop.url, "POST", f"/v1/sessions/{self.id}/truncate", body, "truncate")
        self.position = length

    def _restore_prefix(self, prompt: list[int]) -> int:
        """Restore the longest cached prefix of ``prompt`` on every node; tokens restored (0: none)."""
        try:
            held = self._restore_many(self.route.hops, prompt)
            length, steps = self._common_prefix(held)
            self._rewind(self.route.hops, {url: n for url, (n, _) in held.items()}, length, relink=False)
            self.boundaries.update(steps)
            self.boundaries.add(length)
        except RouteError:  # a failing node shows again at the first step, which repairs the route
            for hop in self.route.hops:
                try:
                    self._call(hop.url, "POST", f"/v1/sessions/{self.id}/truncate", {"length": 0}, "truncate")
                except RouteError:
                    pass
            self.position = 0
            return 0
        self._telemetry.prefix_tokens_restored = length
        return length

    def _replacement(self, failed: Hop) -> tuple["RemoteRoute", tuple[int, int]]:
        """A chain from ``replan`` and the layers ``(start, end)`` it replaces: ``failed``'s own layers when some
        node serves exactly them, else the whole route's (every hop re-planned: a node serving more layers than
        the failed one, such as a whole-model node, can then take over). Each plan first avoids every node that
        failed this session, then, when none is left, any but ``failed`` itself: a node that failed earlier may be
        healthy again (restarted, its fault passed), and the open or restore on it tells. RouteError (the one for
        ``failed``'s own layers) when there is none."""
        span = (failed.start, failed.end)
        whole = (self.route.hops[0].start, self.route.hops[-1].end)
        try:
            return self._plan(failed, span), span
        except RouteError as err:
            if span == whole:
                raise
            try:
                return self._plan(failed, whole), whole
            except RouteError:
                raise err from None

    def _plan(self, failed: Hop, span: tuple[int, int]) -> "RemoteRoute":
        try:
            return self.replan(frozenset(self._excluded), span)
        except RouteError:
            if self._excluded == {failed.url}:
                raise
        spare = self.replan(frozenset({failed.url}), span)
        self._excluded = {failed.url}
        return spare

    def _repair(self, exc: RouteError) -> None:
        """Replace the node named by ``exc`` (see the class docstring). RouteError when no replacement exists."""
        t0 = time.perf_counter()
        old = self.route
        failed = next((h for h in old.hops if h.url == exc.hop), old.hops[0])
        self._excluded.add(failed.url)
        try:
            spare, span = self._replacement(failed)
        except RouteError as err:
            self._telemetry.repairs.append({
                "hop": failed.url, "layers": [failed.start, failed.end], "cause": exc.code, "message": str(exc)[:300],
                "replacement": None, "error": str(err)[:300], "ms": round((time.perf_counter() - t0) * 1e3, 1)})
            raise RouteError(f"node {failed.url} (layers {failed.start}:{failed.end}) failed ({exc}); no replacement: "
                             f"{err}", 503, "no_replacement", failed.url) from None
        replaced = [h for h in old.hops if span[0] <= h.start and h.end <= span[1]]  # failed alone, or every hop
        i, j = old.hops.index(replaced[0]), old.hops.index(replaced[-1])
        hops = old.hops[:i] + spare.hops + old.hops[j + 1:]
        self.route = RemoteRoute.of_hops(hops, old.hop_timeout_s, model=old.model, token=old.token)
        self._drop_replies()  # the head may have changed; late replies of the old route carry nothing we need
        kept = {h.url for h in hops}
        for h in replaced:
            if h.url in kept:  # a node of the old route that the new plan uses again keeps its session
                continue
            self._conns.pop(h.url, None)
            link = self._links.pop(h.url, None)
            if link is not None:
                link.close()
            if h.url in self._opened:
                self._opened.remove(h.url)
                if h is not failed:  # a live node the new route leaves out: its KV is freed now
                    self._close_on(h.url)
        target = self.position
        try:
            fresh = [h for h in spare.hops if h.url not in self._opened]
            for h in reversed(fresh):
                self._open_on(hops, hops.index(h))
            own = sorted(b for b in self.boundaries if 0 < b <= target)
            held = {url: n for url, (n, _) in self._restore_many(fresh, self.tokens[:target], own).items()} \
                if fresh else {}
            length = max(b for b in self.boundaries if b <= min([target] + list(held.values())))
            self.position = length  # if this repair fails midway, the next one starts from here
            try:
                self._rewind(hops, held, length, relink=True)
            except RouteError as err:
                if err.code != "state_not_at_position" or not length:
                    raise
                # a recurrent (hybrid) node holds no exact state at ``length``: every node starts again from 0
                length = 0
                self._rewind(hops, {}, 0, relink=True)
        except RouteError as err:  # failed halfway (the replacement failed too): recorded, then the caller retries
            self._telemetry.repairs.append({
                "hop": failed.url, "layers": [failed.start, failed.end], "cause": exc.code,
                "message": str(exc)[:300], "replacement": [h.url for h in spare.hops], "replaced_layers": list(span),
                "restored_tokens": 0, "tokens_replayed": 0, "error": str(err)[:300],
                "ms": round((time.perf_counter() - t0) * 1e3, 1)})
            raise
        # tokens_replayed counts up as the history from ``length`` to ``target`` is replayed (_step); ms is the
        # repair's own time (plan, open, restore, relink), without the replay
        self._replaying = {
            "hop": failed.url, "layers": [failed.start, failed.end], "cause": exc.code, "message": str(exc)[:300],
            "replacement": [h.url for h in spare.hops], "replaced_layers": list(span), "restored_tokens": length,
            "tokens_replayed": 0, "ms": round((time.perf_counter() - t0) * 1e3, 1)}
        self._telemetry.repairs.append(self._replaying)

    def renew(self) -> None:
        """Restart the idle clock (lease) of the session on every node it is open on; RouteError on a refusal."""
        for url in list(self._opened):
            self._call(url, "POST", f"/v1/sessions/{self.id}/renew", None, "renew")
        self._renewed = time.monotonic()

    def truncate(self, length: int) -> None:
        """Roll every node back to ``length`` tokens; RouteError when a node refuses."""
        for hop in self.route.hops:
            self._call(hop.url, "POST", f"/v1/sessions/{self.id}/truncate", {"length": length}, "truncate")
        self.position = length
        self._rewinding = False
        del self.tokens[length:]
        self.boundaries = {b for b in self.boundaries if b <= length} | {length}

    def close(self) -> None:
        """Release the session on every node it was opened on (best effort: errors are ignored)."""
        self._closed.set()
        for conn in self._conns.values():
            conn.close()
        self._conns = {}
        for link in self._links.values():
            link.close()
        self._links = {}
        self._drop_replies()
        self._close_opened()

    def _close_opened(self) -> None:
        for url in self._opened:
            self._close_on(url)
        self._opened = []

    def _close_on(self, url: str) -> None:
        """Release the session on node ``url`` (best effort: errors are ignored)."""
        self._best_effort(url, "DELETE", f"/v1/sessions/{self.id}", min(self.route.hop_timeout_s, 5.0))

    def _best_effort(self, url: str, method: str, path: str, timeout_s: float) -> None:
        """One request to node ``url`` on its own connection; a refusal or a dead node is ignored."""
        conn = _conn(url, timeout_s)
        try:
            _request(conn, url, method, path, token=self.route.token)
        except RouteError:
            pass
        finally:
            conn.close()
