"""Ring decode, the client's side: the head sends a session's next decode step to the route's first node itself, and
the client, off the critical path, reads the tokens as they are sampled (node/ring.py).

The client grants ``GRANT_AHEAD`` steps ahead (again when half of them are used), takes the head's step when the
caller's next step is exactly it (``claim``), and otherwise takes the grant back (``revoke``: the head says where it
stopped), waits for the steps it sent and rolls every node back over them (``discard``), so the caller sees what it
would have seen without the ring. Most ring steps are quiet: no reply travels back along the route, and the nodes'
numbers of them are read at the end (``collect``). The grants, the step and its replies: docs/protocol.md, "Ring
decode" and "Quiet steps"."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..net.link import FrameLink
from ..protocol import encode_tokens
from ..protocol.errors import RouteError
from ..protocol.link import frame_key, step_key
from ..runtime.session_state import Recent
from .transport import BANNED, error_hop

if TYPE_CHECKING:
    from .session import AsyncRouteSession

GRANT_AHEAD = 16  # steps the head may send past the caller's (granted again when half of them are used)
EARLY_KEPT = 2 * GRANT_AHEAD  # replies nobody waited for kept for a step to take (the newest): a caller that lags
REPLY_LINK_TIMEOUT_S = 5.0  # most seconds the head may take to open a reply link
FINISH_WAIT_S = 1.0  # most seconds a closing session waits for the step the head sent (then releases anyway)


def result(task: asyncio.Task):
    """A finished task's result; None when it was cancelled or failed."""
    return None if task.cancelled() or task.exception() is not None else task.result()


@dataclass(eq=False)
class RingStep:
    """A step the head sent itself: its number, position, the token it feeds, its frame (as the client would send
    it) and that frame's key; ``reply``: the future of the head's reply ``(status, body, direct)``; ``t0``: when
    the client learned of it (perf_counter s); ``late``: the route's reply to it, when that came before the claim;
    ``quiet``: the head sent it as a quiet step."""

    step: int
    start: int
    token: int
    frame: bytes
    key: bytes
    reply: asyncio.Future
    t0: float
    late: tuple[int, bytes] | None = None
    quiet: bool = False  # a quiet step: no route reply comes, the nodes keep its numbers (``collect``)

    def takes(self, session: AsyncRouteSession, ids: list[int], sample: bool, verify: bool) -> bool:
        """Whether the caller's next step ``ids`` is this one: the sampled token fed at the next position."""
        return (
            sample
            and not verify
            and not session.rewinding
            and ids == [self.token]
            and self.step == session.step_no + 1
            and self.start == session.position
        )


class Ring:
    """The ring decode of one route session, which owns it (``AsyncRouteSession.decode_ring``): the session's reply
    link to the head, the last step granted to the head, and the step the head sent itself that the caller has not
    taken yet. ``on``: the session wants the ring (off: it never grants; a verify step turns it off)."""

    def __init__(self, session: AsyncRouteSession, on: bool):
        self.session = session
        self.on = on
        self.replies: FrameLink | None = None  # the reply link to the head, opened after the first step
        self.granted = 0  # the last step number granted to the head (0: no grant out)
        self.granted_max = 0  # the most granted since the head last said where it stopped (steps are numbered past it)
        self.head_sent = 0  # the last step the head said it sent itself when its grant was taken back (``revoke``)
        self.answered = 0  # the last step whose reply the caller read (learn)
        self.pending: RingStep | None = None  # the step the head sent itself, not yet taken by the caller
        self._opening: asyncio.Task | None = None  # the reply link, opened off the step path
        self._no_replies: set[str] = set()  # heads that gave no reply link
        # replies nobody waited for, by frame key: a head-sent step's own that came before its learn, or the head's to
        # a client-sent step whose waiter its link's failure took (``take_early``)
        self._early: Recent = Recent(EARLY_KEPT)
        self._claimed: set[bytes] = set()  # keys of head-sent steps taken whose route reply is still to come
        self.quiet: dict[int, tuple[int, list[str]]] = {}  # quiet steps taken, not collected: step -> (start, urls)
        self.abandoned: asyncio.Future | None = None  # the reply of a client-sent step its caller gave up waiting for
        self._acks: list[asyncio.Future] = []  # revokes waiting for the head's answer, oldest first

    @property
    def open_replies_link(self) -> FrameLink | None:
        """The reply link when it is open."""
        return self.replies if self.replies is not None and self.replies.connected else None

    def open_replies(self, head: str) -> None:
        """Open the session's reply link to ``head`` (after the first step, which opened the session everywhere): the
        head's replies come straight to the client, one message after it sampled, not back through every hop, and
        the ring's grants go on it (docs/protocol.md). Opened in the background and used once open (a later call
        takes it): a head that does not answer never holds a step up; one that gave none is not asked again."""
        s = self.session
        if head in self._no_replies:
            return
        if self._opening is None:

            async def opening() -> FrameLink | None:
                link = FrameLink(
                    s.http,
                    head,
                    min(s.route.timeout_s, REPLY_LINK_TIMEOUT_S),
                    s.route.token,
                    replies=s.id,
                    key=s.reply_key,
                    late=self._reply_late,
                    text=self._answered,
                )
                try:
                    await link.connect()
                except RouteError:
                    return None
                return link if link.connected else None

            self._opening = asyncio.get_running_loop().create_task(opening())
        elif self._opening.done():
            self.replies = result(self._opening)
            self._opening = None
            if self.replies is None:
                self._no_replies.add(head)

    async def grant(self, until: int, n_ids: int) -> None:
        """Let the head send the session's steps from number ``until`` on itself (the step being sent, of ``n_ids``
        ids, is ``until - 1``), ``GRANT_AHEAD`` of them: nothing when the ring is off, the reply link not open, more
        than half of them are granted already, or the step after would not fit the session's max_length (the head
        never sends a step past it)."""
        s, replies = self.session, self.open_replies_link
        if not self.on or self.granted - until >= GRANT_AHEAD // 2 or replies is None:
            return
        if s.position + n_ids + 1 > s.max_length:
            return
        if await replies.send_text(self._grant_text(until + GRANT_AHEAD - 1)):
            self.granted = until + GRANT_AHEAD - 1
            self.granted_max = max(self.granted_max, self.granted)

    def _grant_text(self, until: int, ack: bool = False) -> str:
        s, hops = self.session, self.session.route.hops
        first = None if len(hops) == 1 else hops[0].url
        # (with commit every step's reply counts: no quiet steps)
        return json.dumps({"ring": {"until": until, "first": first, "quiet": not s.commit, "ack": ack}})

    async def revoke(self) -> int:
        """Take the head's grant back (``until`` 0, with ``ack``) and learn where it stopped: the last step number it
        sent itself (0: none), also kept as ``head_sent``; ``granted_max`` when the reply link is closed or the head
        gives no answer within ``FINISH_WAIT_S`` (steps numbered past it are safe from any step the head sent: a node
        refuses them stale), and without a grant out what was known before."""
        granted, self.granted = self.granted, 0
        replies = self.open_replies_link
        if not granted:
            return max(self.head_sent, self.granted_max)
        answer = asyncio.get_running_loop().create_future()
        self._acks.append(answer)  # (before the send: its answer may come while the send awaits)
        if replies is None or not await replies.send_text(self._grant_text(0, ack=True)):
            self._acks.remove(answer)
            return max(self.head_sent, self.granted_max)
        await asyncio.wait([answer], timeout=FINISH_WAIT_S)  # one given up on stays in line: a late answer is its
        if not answer.done():
            return max(self.head_sent, self.granted_max)
        self.granted_max, self.head_sent = 0, max(self.head_sent, answer.result())
        return self.head_sent

    def _answered(self, text: str) -> None:
        """A text message of the head on the reply link: the answer to the oldest revoke (``{"ring": {"sent":
        STEP}}``); anything else is ignored."""
        try:
            sent = json.loads(text)["ring"]["sent"]
        except (ValueError, TypeError, KeyError):
            return
        if type(sent) is int and self._acks:
            answer = self._acks.pop(0)
            if not answer.done():
                answer.set_result(sent)

    def learn(self, reply: dict) -> None:
        """After a step's ``reply`` (the session advanced past it): when the head sent the next step itself
        (``ring``), expect its reply on the reply link (``pending``), whether or not the session still wants the
        ring (that step is on the nodes: the caller's next one takes it or undoes it). Without an open reply link its
        reply is lost to us: the caller's step, if it is the same, sends the same frame itself."""
        s = self.session
        self.answered = s.step_no
        nxt, token = reply.get("ring"), reply.get("token")
        replies = self.open_replies_link
        if nxt != s.step_no + 1 or type(token) is not int or replies is None:
            return
        frame = encode_tokens(s.id, nxt, s.position, [token])
        key = frame_key(frame)
        waiter = asyncio.get_running_loop().create_future()
        waiter.add_done_callback(lambda f: f.cancelled() or f.exception())  # a step nobody takes may fail unread
        early = self.take_early(key)
        if early is not None:  # it came before we got here
            waiter.set_result(early)
        else:
            replies.expect(key, waiter, own=True)
        quiet = reply.get("quiet") is True
        self.pending = RingStep(nxt, s.position, token, frame, key, waiter, time.perf_counter(), quiet=quiet)

    def _reply_late(self, key: bytes, status: int, body: bytes) -> None:
        """A reply link's message nobody waited for: the route's reply to a head-sent step (kept until the step is
        claimed, then its telemetry: ``AsyncRouteSession.route_reply``), or a head-sent step's own reply that came
        before ``learn`` (kept for it)."""
        pending = self.pending
        if pending is not None and key == pending.key:
            pending.late = (status, body)
        elif key in self._claimed:
            self._claimed.discard(key)
            self.session.route_reply(key, status, body)
        else:  # (a client-sent step's reply from the head after the route's, or after its link failed)
            self._early.add(key, (status, body))

    def take_early(self, key: bytes) -> tuple[int, bytes, bool] | None:
        """The head's reply to the step with frame ``key`` when it came with nobody waiting (``_reply_late``): (status,
        body, True), once; else None."""
        early = self._early.pop(key, None)
        return None if early is None else (*early, True)

    async def claim(self, pending: RingStep, link: FrameLink, timeout: float) -> tuple[int, bytes, bool]:
        """Take the head-sent step ``pending`` as the caller's: its reply ``(status, body, direct)``. When the head
        answers it with an error, the reply link fails or no reply comes within ``timeout`` s, the client sends the
        same frame on its step link ``link`` (nodes that applied it answer from their record): a node that is down
        fails that send and the route is repaired, but a first node the head could not reach (another network) is
        not taken for dead; the ring is off from then on. RouteError as a step sent by the client."""
        s = self.session
        first = s.route.hops[0].url
        if not pending.quiet:
            s.expect_route_reply(pending.key, pending.t0, 1, False, pending.start)
            if pending.late is not None:  # the route's reply came first: its telemetry
                s.route_reply(pending.key, *pending.late)
            else:
                self._claimed.add(pending.key)
        unreachable = False
        s.raise_broken()  # a late error of an earlier step, or a ban: repair first
        try:
            with s.waiting_on(pending.reply):  # session.fail() fails it
                async with asyncio.timeout(timeout):
                    status, body, direct = await pending.reply
            if status == 200:
                s.measured.ring_steps += 1
                if pending.quiet:
                    self.quiet[pending.step] = (pending.start, [h.url for h in s.route.hops])
                return status, body, direct
            unreachable = error_hop(body) == first  # the head could not send it to the first node
        except RouteError as exc:
            if exc.late or exc.code == BANNED:  # (session.fail: the route is broken, not this link)
                raise
        except TimeoutError:
            pass
        if self.replies is not None:
            self.replies.forget(pending.key)
        self._claimed.discard(pending.key)
        self.granted = 0  # the head dropped its grant when the step failed (or is slow): the next step grants again
        if pending.quiet:  # sent again with replies: the route's reply is its telemetry
            s.expect_route_reply(pending.key, pending.t0, 1, False, pending.start)
        answer = await s.exchange(link, pending.frame, pending.key, timeout)
        if unreachable and answer[0] == 200:  # ... and we can: the head cannot reach it (a dead one fails ours too)
            self.on = False
        return answer

    async def collect(self) -> None:
        """Read each node's numbers of the quiet steps taken (``POST /v1/sessions/{id}/hops``, one call per node, all
        at once) into the session's telemetry: one StepTiming per step every hop answered for, the steps in order. A
        node that does not answer leaves its steps without one."""
        if not self.quiet:
            return
        s, steps, self.quiet = self.session, self.quiet, {}
        urls = sorted({url for _, hop_urls in steps.values() for url in hop_urls})

        async def read(url: str) -> dict[int, dict]:
            try:
                hops = (await s.call(url, "POST", f"/v1/sessions/{s.id}/hops", None, "hops")).get("hops")
            except RouteError:
                return {}
            return {h.get("step"): h for h in hops if isinstance(h, dict)} if isinstance(hops, list) else {}

        got = dict(zip(urls, await asyncio.gather(*(read(url) for url in urls))))
        for step, (start, hop_urls) in steps.items():
            s.measured.record_quiet(step, start, hop_urls, [got[url].get(step) for url in hop_urls])
        s.measured.steps.sort(key=lambda timing: timing.step)

    async def finish(self) -> None:
        """At the session's close: take the grant back (``revoke``) and wait (up to ``FINISH_WAIT_S`` each) for the
        steps still on the nodes, so that they release the session after them rather than under them (they would
        answer them session_closed): a step the client sent whose caller gave up waiting (``abandoned``: a stream
        aborted during a prefill, say), and the steps the head sent that the caller did not take: the one it learned
        of, and the last the head sent."""
        last = await self.revoke()
        abandoned, self.abandoned = self.abandoned, None
        if abandoned is not None:
            await _reply_or_none(abandoned, FINISH_WAIT_S)
        pending, self.pending = self.pending, None
        if pending is not None:
            await _reply_or_none(pending.reply, FINISH_WAIT_S)
        await self._wait_step(last, max(self.answered, pending.step if pending is not None else 0), FINISH_WAIT_S)

    async def _wait_step(self, step: int, done: int, timeout: float) -> None:
        """Wait up to ``timeout`` s for the head's reply to its step ``step`` on the reply link (the steps before it
        are over then), unless ``step <= done`` (its reply was read) or the reply came already."""
        replies, key = self.open_replies_link, step_key(self.session.id, step)
        if replies is None or step <= done or self._early.pop(key, None) is not None:
            return
        waiter = asyncio.get_running_loop().create_future()
        replies.expect(key, waiter, own=True)
        try:
            await _reply_or_none(waiter, timeout)
        finally:
            replies.forget(key, waiter)

    async def discard(self, pending: RingStep, timeout: float) -> None:
        """Undo the head-sent step ``pending`` the caller did not take, and any the head sent after it: take the grant
        back (``revoke``), wait (up to ``timeout`` s each) for ``pending`` and the last step the head sent to end,
        then roll every node back to the session's position with the last of them as their last step number
        (applied or not there). RouteError when a node refuses the truncation."""
        s = self.session
        last = await self.revoke()
        await _reply_or_none(pending.reply, timeout)
        if self.replies is not None:
            self.replies.forget(pending.key)
        await self._wait_step(last, pending.step, timeout)
        s.step_no = max(s.step_no, pending.step, last)
        body = {"length": s.position, "step": s.step_no}
        for hop in s.route.hops:
            await s.call(hop.url, "POST", f"/v1/sessions/{s.id}/truncate", body, "truncate")
        s.measured.ring_discarded += 1

    async def drop(self) -> int:
        """Close the reply link (one still opening: once open) and forget the step the head sent and the grants (a
        repair changed the route): the last step number granted, which new steps must be numbered past (the head
        may still be sending it: no shared frame key)."""
        replies, self.replies = self.replies, None
        if replies is not None:
            await replies.close()
        opening, self._opening = self._opening, None
        if opening is not None:
            opening.cancel()
            link = result(opening) if opening.done() else None
            if link is not None:
                await link.close()
        self.pending = None
        self._early.clear()
        self._claimed.clear()
        self._acks.clear()
        granted, self.granted, self.granted_max = max(self.granted, self.granted_max), 0, 0
        return granted


async def _reply_or_none(reply: asyncio.Future, timeout: float) -> None:
    """Wait up to ``timeout`` s for a step's ``reply``, whatever it ends with (a result, an error, cancelled)."""
    await asyncio.wait([reply], timeout=timeout)
    if reply.done() and not reply.cancelled():
        reply.exception()  # (retrieved: an error here is no news)
