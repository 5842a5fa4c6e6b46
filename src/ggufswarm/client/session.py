"""The route session on a loop: open a session on every node, step frames through the first, repair, renew, close.
``AsyncRouteSession`` is the one implementation; client/blocking.py runs it for blocking callers."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
import uuid
from typing import TYPE_CHECKING

import aiohttp

from ..net.link import FrameLink, request, timed_out
from ..protocol import encode_tokens, step_timeout_s
from ..protocol.errors import RouteError
from ..protocol.link import frame_key
from ..protocol.snapshots import BLOCK_TOKENS
from ..runtime.sampling import SamplingParams
from . import opening, repair
from .ring import Ring
from .telemetry import RouteTelemetry
from .transport import REPAIRABLE, call, check_reply, error_code, new_http_session

if TYPE_CHECKING:
    from .route import RemoteRoute

LATE_WAIT_S = 1.0  # how long reading the telemetry waits for the route's replies to directly answered steps
RENEW_TIMEOUT_S = 10.0  # most seconds one lease renewal by the keeper may take


class AsyncRouteSession:
    """A session on a route of HTTP nodes, on the caller's event loop. ``step`` sends one frame to the first node
    over a WebSocket (FrameLink); the nodes push it along the route and the head's sampled token comes back, on
    the session's reply link to the head once it is open (one message from the head, not one per hop back).

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
    ``repairs`` (``replaced_layers``: the layers re-planned). Without ``replan`` the RouteError is raised.

    Prefix reuse (``reuse_prefix``): the first step restores the longest cached prefix of the prompt on every node.
    Open it with ``await RemoteRoute.aopen(...)``; ``async with`` closes it. Cancelling a coroutine awaiting
    ``step`` or ``verify`` leaves the session unusable: close it (``close`` finishes releasing it on its nodes
    even when the task closing it is cancelled too).
    """

    MAX_REPAIRS_PER_STEP = 3

    def __init__(
        self,
        route: RemoteRoute,
        max_length: int,
        sampling: SamplingParams | None = None,
        wire_dtype: str = "f32",
        top_logprobs: int = 0,
        replan=None,
        reuse_prefix: bool = True,
        lease_s: float | None = None,
        logprobs: bool = False,
        *,
        http: aiohttp.ClientSession | None = None,
        commit: bool = False,
        ring: bool = True,
    ):
        """A session not yet open on its nodes: use ``open`` (or ``RemoteRoute.aopen``: the arguments after ``route``).

        ``sampling``: the head's sampling parameters (default ``SamplingParams()``). ``lease_s``: the nodes drop
        the session after that many idle seconds (not only after their session TTL): a client that dies frees the
        route's KV that soon. The session renews it while it waits.

        ``replan(exclude, span) -> RemoteRoute`` (a plain function, run in a worker thread, or a coroutine
        function): plans a replacement for the layers ``span`` avoiding the node URLs in ``exclude``; with it
        the session repairs itself when a node fails (see the class docstring).

        ``top_logprobs`` (0..20): the head returns that many most likely ``[id, logprob]`` pairs with each sample
        (``last_logprobs``); ``logprobs``: it returns the sampled token's logprob too (``last_token_logprob``).
        Both are log-softmax of the raw logits. ``http``: the aiohttp session to talk over (one of the
        session's own, closed with it, by default; ``transport.new_http_session`` makes a shareable one). ``commit``:
        every node signs a commitment of each step (its hop's ``commit`` in the step's StepTiming; docs/protocol.md).
        ``ring``: ring decode (client/ring.py): the head sends each next decode step itself (a session that verifies
        turns it off).
        """
        self.route = route
        self.id = uuid.UUID(bytes=os.urandom(16))  # 128 random bits: unguessable
        self.reply_key = os.urandom(16).hex()  # given to the head only: its reply link is ours alone (client/ring.py)
        self.max_length = max_length
        self.sampling = (sampling or SamplingParams()).validate()
        self.wire_dtype = wire_dtype
        self.top_logprobs = top_logprobs
        self.logprobs = logprobs
        self.replan = replan
        self.reuse_prefix = reuse_prefix
        self.commit = commit
        self.decode_ring = Ring(self, ring)  # ring decode: its reply link, grants, the step the head sent (ring.py)
        self.sent: list[tuple] | None = None  # when a list: each frame sent, (step, start, ids, sample, verify)
        self.lease_s = lease_s
        self.http = http or new_http_session()
        self._own_http = http is None
        self.position = 0  # tokens every node of the route holds
        self.tokens: list[int] = []  # the whole history fed so far (position <= len(tokens) during a repair)
        # Positions where a step ended. llama.cpp's numerics depend on how tokens are grouped into steps, so a
        # repair rolls back to one of these and replays the same steps: the output stays bit for bit the same.
        self.boundaries: set[int] = {0}
        self.step_no = 0
        self.opened: list[str] = []  # URLs of the nodes the session is open on
        self.contexts: dict[str, dict] = {}  # with commit: node URL -> the context its commitments sign
        self.measured = RouteTelemetry()  # as measured so far (``telemetry`` first waits for late replies)
        self.last_logprobs = None
        self.last_token_logprob: float | None = None  # the last sample's logprob (sessions opened with logprobs)
        self.last_tokens: list[int] | None = None  # a verify step's samples, one per position
        self._excluded: set[str] = set()  # nodes that failed this session (repairs avoid them)
        self.rewinding = False  # the nodes hold rejected drafts past ``position``: the next frame rewinds (drop)
        self.renewed_at = time.monotonic()  # time.monotonic() of the last lease renewal
        # while one step takes longer than a third of the lease (a long prefill on a loaded node), a keeper task
        # renews the lease on every node: the nodes after the busy one see nothing of the session meanwhile
        self._step_since: float | None = None  # time.monotonic() when the step in flight started
        self._keeper: asyncio.Task | None = None
        self._closed = False
        self._link: FrameLink | None = None  # to the first node
        # steps whose route reply (telemetry) is to be read: frame key -> (t0 s, n_tokens, hop urls, verify, start)
        self._unacked: dict[bytes, tuple[float, int, list[str], bool, int]] = {}
        self._waiter: asyncio.Future | None = None  # the reply of the step in flight
        self._broken: RouteError | None = None  # a late error seen between steps: the next step raises it
        self._drained: asyncio.Future | None = None  # set when the last late reply is in (``telemetry``)

    @classmethod
    async def open(cls, route: RemoteRoute, *args, **kwargs) -> AsyncRouteSession:
        """A session opened on every node of ``route`` (the constructor's arguments); RouteError (with the node's
        status) when one refuses, after closing it where it opened."""
        session = cls(route, *args, **kwargs)
        try:
            await opening.open_all(session, route.hops)
        except BaseException:
            await session.close()
            raise
        return session

    async def __aenter__(self) -> AsyncRouteSession:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def call(self, url: str, method: str, path: str, body: dict | None, what: str) -> dict:
        """A JSON call to node ``url`` of this session (RouteError naming it on failure)."""
        return await call(
            self.http, url, method, path, body, what, token=self.route.token, timeout=self.route.timeout_s
        )

    async def best_effort(self, url: str, method: str, path: str, timeout_s: float) -> None:
        """One request to node ``url``; a refusal or a dead node is ignored."""
        try:
            await request(self.http, url, method, path, token=self.route.token, timeout=timeout_s)
        except RouteError:
            pass

    async def step(self, token_ids: list[int], sample: bool = True) -> int | None:
        """Feed ``token_ids`` (prefill: many, decode: one) through the route; the head's sampled next token id
        (None when not ``sample``).

        Prompts longer than the route's smallest max_step_tokens go in chunks (only the last is sampled).
        Raises RouteError naming the failing node (status/code from the node) when it cannot be repaired,
        ValueError for no ids.
        """
        if not token_ids:
            raise ValueError("a step needs at least one token id")
        caches = any(h.cache is not False for h in self.route.hops)  # no cache on any node: nothing to restore
        if self.reuse_prefix and not self.tokens and len(token_ids) > BLOCK_TOKENS and caches:
            restored = await repair.restore_prefix(self, token_ids[:-1])  # at least one token is computed: sampled
            self.tokens.extend(token_ids[:restored])
            token_ids = token_ids[restored:]
        token = None
        i = 0
        if self.lease_s is not None and self._keeper is None:
            self._keeper = asyncio.get_running_loop().create_task(self._keep_lease(), name=f"lease-{self.id.hex[:8]}")
        self._step_since = time.monotonic()
        try:
            while i < len(token_ids):
                chunk = token_ids[i : i + self.route.max_step_tokens]
                i += len(chunk)
                token = await self._step(chunk, sample and i >= len(token_ids))
        finally:
            self._step_since = None
        return token

    async def _keep_lease(self) -> None:
        """The keeper task: every ``lease_s / 3`` s, when a step has been in flight that long, renew the session on
        every node it is open on (a refusal or a dead node is left to the step to find)."""
        period = self.lease_s / 3
        while True:
            await asyncio.sleep(period)
            since = self._step_since
            if since is None or time.monotonic() - since < period:
                continue
            await asyncio.gather(
                *(
                    self.best_effort(url, "POST", f"/v1/sessions/{self.id}/renew", min(period, RENEW_TIMEOUT_S))
                    for url in list(self.opened)
                )
            )

    @property
    def max_verify_tokens(self) -> int:
        """Most tokens of one ``verify`` step on this route: the head's limit (0: the head cannot verify)."""
        return min(self.route.hops[-1].max_verify_tokens or 0, self.route.max_step_tokens)

    async def verify(self, token_ids: list[int]) -> list[int]:
        """Speculative decoding: feed ``token_ids`` (the last sampled token, then drafted ones) as one step whose
        head samples after every position; the token a one-token step would have sampled after each
        (``[len(token_ids)]``). The session then holds them all: ``drop`` the rejected drafts. ValueError for more
        than ``max_verify_tokens`` ids; RouteError as ``step`` (``bad_route`` when the head answers no samples)."""
        self.decode_ring.on = False  # speculative decoding drives its own steps: the head's would be undone each time
        if not token_ids or len(token_ids) > self.max_verify_tokens:
            raise ValueError(
                f"a verify step takes 1..{self.max_verify_tokens} token ids on this route "
                f"(the head's max_verify_tokens), got {len(token_ids)}"
            )
        await self._step(token_ids, True, verify=True)
        samples = self.last_tokens
        if not isinstance(samples, list) or len(samples) != len(token_ids):
            raise RouteError(
                "bad_route",
                f"head {self.route.hops[-1].url} answered a verify step of {len(token_ids)} tokens "
                f"with {samples!r}: it does not do speculative decoding",
                502,
                self.route.hops[-1].url,
            )
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
        del self.tokens[self.position :]
        self.boundaries.discard(old)
        self.boundaries.add(self.position)
        self.rewinding = True

    async def _step(self, ids: list[int], sample: bool, verify: bool = False) -> int | None:
        """One chunk, repairing the route (at most MAX_REPAIRS_PER_STEP times) when a node fails."""
        repairs, pending, replaying = 0, None, None
        while True:
            try:
                if pending is not None:
                    replaying = await self.repair(pending)
                    pending = None
                while self.position < len(self.tokens):  # replay after a repair, step by original step
                    end = min(b for b in self.boundaries | {len(self.tokens)} if b > self.position)
                    chunk = self.tokens[self.position : min(end, self.position + self.route.max_step_tokens)]
                    await self._send(chunk, False)
                    if replaying is not None:  # what the repair actually replayed, counted as it goes
                        replaying["tokens_replayed"] += len(chunk)
                replaying = None
                token = await self._send(ids, sample, verify)
                self.tokens.extend(ids)
                return token
            except RouteError as exc:
                if replaying is not None:  # the replay failed halfway: that repair says how far it got
                    replaying["error"] = f"replay failed: {exc}"[: repair.MESSAGE_CHARS]
                    replaying = None
                if self.replan is None or exc.code not in REPAIRABLE or repairs >= self.MAX_REPAIRS_PER_STEP:
                    raise
                repairs += 1
                pending = exc

    async def repair(self, exc: RouteError) -> dict:
        """Replace the node named by ``exc`` (see the class docstring): ``repair.repair_route``. Its telemetry
        entry; RouteError when no replacement exists."""
        return await repair.repair_route(self, self._excluded, exc)

    async def _send(self, ids: list[int], sample: bool, verify: bool = False) -> int | None:
        """One frame of ``ids`` at ``position``: sent (once more on a fresh connection when the link fails), its
        reply checked, the session advanced; the head's token."""
        first, head = self.route.hops[0], self.route.hops[-1]
        timeout = step_timeout_s(self.route.timeout_s - 1.0, len(ids)) + 1.0  # long prefill chunks wait longer
        dr = self.decode_ring
        pending, dr.pending = dr.pending, None  # a step the head sent itself (ring decode): this one, or undone
        if pending is not None and not pending.takes(self, ids, sample, verify):
            await dr.discard(pending, timeout)
            pending = None
        self.step_no += 1
        frame = encode_tokens(self.id, self.step_no, self.position, ids, sample, verify, self.rewinding)
        link = self._link
        if link is None or link.url != first.url:
            if link is not None:
                await link.close()
            link = self._link = FrameLink(
                self.http, first.url, self.route.timeout_s, self.route.token, late=self.route_reply
            )
        elif dr.replies is None and (head is not first or dr.on) and not link.http_only:
            dr.open_replies(head.url)
        key = frame_key(frame)
        if self.sent is not None:  # a session the gateway's verifier audits (gateway/verify.py)
            self.sent.append((self.step_no, self.position, list(ids), sample, verify))
        t0 = time.perf_counter()
        urls = [h.url for h in self.route.hops]
        start = self.position
        if sample and not verify:
            await dr.grant(self.step_no + 1, len(ids))
        try:
            if pending is not None:
                status, body, direct = await dr.claim(pending, link, timeout)
            else:
                self.expect_route_reply(key, t0, len(ids), verify, start)
                status, body, direct = await self.exchange(link, frame, key, timeout, resend=True)
        except BaseException:
            self._unacked.pop(key, None)
            raise
        rtt = (time.perf_counter() - t0) * 1e3
        if not direct:
            self._unacked.pop(key, None)
        reply = check_reply(first.url, status, body, f"step {self.step_no}")
        self.rewinding = False
        self.position += len(ids)
        self.boundaries.add(self.position)
        if direct:  # the head's own reply: the route's, with every hop's numbers, is read later (route_reply)
            self.measured.direct_replies += 1
        else:
            self.measured.record(reply, rtt, len(ids), urls, verify, start, self.step_no)
        self.last_tokens = reply.get("tokens")
        self.last_logprobs = reply.get("logprobs")
        self.last_token_logprob = reply.get("token_logprob")
        dr.learn(reply)
        return reply["token"]

    async def exchange(
        self, link: FrameLink, frame: bytes, key: bytes, timeout: float, resend: bool = False
    ) -> tuple[int, bytes, bool]:
        """Send ``frame`` on ``link``; the first of its reply there and the head's on the reply link: (status, body,
        whether the reply link's). ``resend``: again on a fresh connection when the link fails (a ``stale_step`` then:
        the ring ran past it; the head's reply answers). RouteError hop_timeout, hop_failed, or a late error."""
        self.raise_broken()
        for attempt in (1, 2):
            early = self.decode_ring.take_early(key) if attempt == 2 else None  # came while the link failed
            try:
                answer = early or await self._exchange_once(link, frame, key, timeout, True)
            except RouteError as exc:
                if not resend or attempt == 2 or exc.code != "hop_failed" or exc.late:
                    raise
                continue  # the same step number: never applied twice
            if attempt == 1:
                return answer
            # a resend: its route reply may say stale_step (the first send's went with the failed link)
            self._unacked.pop(key, None)
            if answer[0] == 200 or error_code(answer[1]) != "stale_step" or not self.decode_ring.open_replies_link:
                return answer
            return self.decode_ring.take_early(key) or await self._exchange_once(link, None, key, timeout, False)

    async def _exchange_once(
        self, link: FrameLink, frame: bytes | None, key: bytes, timeout: float, on_link: bool
    ) -> tuple[int, bytes, bool]:
        """``exchange``'s one wait: one waiter for the reply on the reply link and, ``on_link``, for ``frame``'s on
        ``link`` (sent there); without ``on_link`` the reply link's alone."""
        waiter = self._waiter = asyncio.get_running_loop().create_future()
        replies = self.decode_ring.open_replies_link
        if replies is not None:
            replies.expect(key, waiter)
        try:
            if on_link:
                await link.send(frame, waiter, timeout)
            async with asyncio.timeout(timeout):
                return await waiter
        except TimeoutError:
            await link.close()
            raise timed_out(link.url, timeout) from None
        except asyncio.CancelledError:  # the caller gave up (an aborted stream): the session's close waits for it
            if on_link:  # (the cancelled wait took its waiter along: the route's reply goes to a fresh one)
                link.expect(key, abandoned := asyncio.get_running_loop().create_future())
                abandoned.add_done_callback(lambda f: f.cancelled() or f.exception())  # (no news if it fails)
                self.decode_ring.abandoned = abandoned
            raise
        finally:
            self._waiter = None
            if replies is not None:
                replies.forget(key)

    def expect_route_reply(self, key: bytes, t0: float, n_tokens: int, verify: bool, start: int) -> None:
        """A step (frame ``key``, sent at ``t0`` perf_counter s) whose route reply (``route_reply``) is to be read."""
        self._unacked[key] = (t0, n_tokens, [h.url for h in self.route.hops], verify, start)

    def raise_broken(self) -> None:
        """Raise the late error seen since the last step (a node failed after passing a step on, or a ban), once."""
        if (broken := self._broken) is not None:
            self._broken = None
            raise broken

    @contextlib.contextmanager
    def waiting_on(self, waiter: asyncio.Future):
        """While in the block, ``waiter`` is the step in flight: ``fail`` fails it."""
        self._waiter = waiter
        try:
            yield waiter
        finally:
            self._waiter = None

    def route_reply(self, key: bytes, status: int, body: bytes) -> None:
        """The route's reply to a step the head already answered on the reply link: its telemetry. An error
        there (a node failed after passing the step on) means the route is broken: the step in flight fails
        with it at once (and is repaired), not after its own timeout; between steps, the next step does."""
        entry = self._unacked.pop(key, None)
        if entry is None:
            return
        if status != 200:
            try:
                check_reply(self.route.hops[0].url, status, body, "an earlier step")
            except RouteError as exc:
                exc.late = True
                self.fail(exc)
            return
        try:
            reply = json.loads(body)
        except ValueError:
            return
        t0, n_tokens, urls, verify, start = entry
        step = int.from_bytes(key[16:24], "little")  # the frame key: session id, step number
        self.measured.record(reply, (time.perf_counter() - t0) * 1e3, n_tokens, urls, verify, start, step)
        if not self._unacked and self._drained is not None and not self._drained.done():
            self._drained.set_result(None)

    def fail(self, exc: RouteError) -> None:
        """Fail the step in flight with ``exc`` (between steps: the next one); a repairable error repairs the route
        (a late error of an earlier step; ``node_banned``: the gateway's verifier banned a node of the route)."""
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_exception(exc)
        else:
            self._broken = exc

    async def drop_links(self) -> None:
        """Close the reply link (one still opening: once open) and the step link unless it goes to the route's first
        node still; forget their replies to come (a repair changed the route); number new steps past any granted."""
        granted = await self.decode_ring.drop()
        if self._link is not None and self._link.url != self.route.hops[0].url:
            await self._link.close()
            self._link = None
        self._unacked.clear()
        self._broken = None
        # the head may still be sending a step it was granted: new steps are numbered past it (no shared frame key)
        self.step_no = max(self.step_no, granted)

    @property
    def repairs(self) -> list[dict]:
        """Each repair of the route so far (``telemetry().repairs`` without waiting for late replies)."""
        return self.measured.repairs

    async def telemetry(self) -> RouteTelemetry:
        """What the session measured (RouteTelemetry), once the nodes' numbers of quiet ring steps are read
        (``Ring.collect``) and the route's replies to steps the head answered first are in (waited up to 1 s). The
        head's grant is taken back meanwhile (``Ring.revoke``: the answer is over; a next step grants again)."""
        await asyncio.gather(self.decode_ring.revoke(), self.decode_ring.collect())
        if self._unacked and self._link is not None and self._link.connected:
            self._drained = asyncio.get_running_loop().create_future()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._drained, LATE_WAIT_S)
            self._drained = None
        self._unacked.clear()
        self._broken = None  # read for its telemetry: a late error is dropped, as the next step would repair
        return self.measured

    async def renew(self) -> None:
        """Restart the idle clock (lease) of the session on every node it is open on; RouteError on a refusal."""
        for url in list(self.opened):
            await self.call(url, "POST", f"/v1/sessions/{self.id}/renew", None, "renew")
        self.renewed_at = time.monotonic()

    async def truncate(self, length: int) -> None:
        """Roll every node back to ``length`` tokens; RouteError when a node refuses."""
        pending, self.decode_ring.pending = self.decode_ring.pending, None
        if pending is not None:  # a step the head sent itself: over before the truncation
            await self.decode_ring.discard(pending, self.route.timeout_s)
        for hop in self.route.hops:
            await self.call(hop.url, "POST", f"/v1/sessions/{self.id}/truncate", {"length": length}, "truncate")
        self.position = length
        self.rewinding = False
        del self.tokens[length:]
        self.boundaries = {b for b in self.boundaries if b <= length} | {length}

    async def close(self) -> None:
        """Release the session on every node it was opened on (best effort: errors are ignored), after reading
        the per-hop replies still on their way (as ``telemetry``). Idempotent; when the awaiting task is
        cancelled the release still finishes in the background."""
        if self._closed:
            return
        self._closed = True
        if self._keeper is not None:
            self._keeper.cancel()
        task = asyncio.get_running_loop().create_task(self._release())
        opening.track_release(task)
        try:
            await asyncio.shield(task)
        except (RouteError, aiohttp.ClientError, RuntimeError, OSError):
            pass  # best effort: a node or connection gone (or, at shutdown, the aiohttp session closed) frees it

    async def _release(self) -> None:
        await self.decode_ring.finish()  # a step the head sent and nobody took: over before the release
        await self.telemetry()  # the route's replies to directly answered steps: their per-hop numbers
        await self.drop_links()
        if self._link is not None:
            await self._link.close()
        await opening.close_opened(self)
        if self._own_http:
            await self.http.close()
