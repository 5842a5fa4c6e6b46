"""Ring decode, the client's side: the head sends a session's next decode step to the route's first node itself, and
the client, off the critical path, reads the tokens as they are sampled (node/ring.py).

The client grants one step ahead, takes the head's step when the caller's next step is exactly it (``claim``), and
otherwise waits for it and rolls every node back over it (``discard``), so the caller sees what it would have seen
without the ring. The grants, the step and its replies: docs/protocol.md, "Ring decode"."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..net.link import FrameLink
from ..protocol import encode_tokens
from ..protocol.errors import RouteError
from ..protocol.link import frame_key
from .transport import BANNED

if TYPE_CHECKING:
    from .session import AsyncRouteSession

REPLY_LINK_TIMEOUT_S = 5.0  # most seconds the head may take to open a reply link
FINISH_WAIT_S = 1.0  # most seconds a closing session waits for the step the head sent (then releases anyway)


def result(task: asyncio.Task):
    """A finished task's result; None when it was cancelled or failed."""
    return None if task.cancelled() or task.exception() is not None else task.result()


def open_replies(session: AsyncRouteSession, head: str) -> None:
    """Open the session's reply link to ``head`` (after the first step, which opened the session everywhere): the
    head's replies come straight to the client, one message after it sampled, not back through every hop, and the
    ring's grants go on it (docs/protocol.md). Opened in the background and used once open (a later call takes
    it): a head that does not answer never holds a step up."""
    if session._replies_opening is None:

        async def opening() -> FrameLink | None:
            link = FrameLink(
                session.http,
                head,
                min(session.route.timeout_s, REPLY_LINK_TIMEOUT_S),
                session.route.token,
                replies=session.id,
                key=session.reply_key,
                late=lambda key, status, body: reply_late(session, key, status, body),
            )
            try:
                await link.connect()
            except RouteError:
                return None
            return link if link.connected else None

        session._replies_opening = asyncio.get_running_loop().create_task(opening())
    elif session._replies_opening.done():
        session._replies = result(session._replies_opening)
        session._replies_opening = None
        if session._replies is None:
            session._no_replies.add(head)


@dataclass(eq=False)
class RingStep:
    """A step the head sent itself: its number, position, the token it feeds, its frame (as the client would send
    it) and that frame's key; ``reply``: the future of the head's reply ``(status, body, direct)``; ``t0``: when
    the client learned of it (perf_counter s); ``late``: the route's reply to it, when that came before the claim."""

    step: int
    start: int
    token: int
    frame: bytes
    key: bytes
    reply: asyncio.Future
    t0: float
    late: tuple[int, bytes] | None = None

    def takes(self, session: AsyncRouteSession, ids: list[int], sample: bool, verify: bool) -> bool:
        """Whether the caller's next step ``ids`` is this one: the sampled token fed at the next position."""
        return (
            sample
            and not verify
            and not session._rewinding
            and ids == [self.token]
            and self.step == session.step_no + 1
            and self.start == session.position
        )


async def grant(session: AsyncRouteSession, until: int, n_ids: int) -> None:
    """Let the head send the session's steps up to number ``until`` itself (the step being sent, of ``n_ids`` ids,
    is ``until - 1``): nothing when the session has no ring, no open reply link, granted that already, or the step
    after would not fit its max_length."""
    replies = session._replies
    if (
        not session.ring
        or until <= session._granted
        or replies is None
        or not replies.connected
        or session.position + n_ids + 1 > session.max_length
    ):
        return
    hops = session.route.hops
    first = None if len(hops) == 1 else hops[0].url
    if await replies.send_text(json.dumps({"ring": {"until": until, "first": first}})):
        session._granted = until


def learn(session: AsyncRouteSession, reply: dict) -> None:
    """After a step's ``reply`` (the session advanced past it): when the head sent the next step itself (``ring``),
    expect its reply on the reply link (``session._ring``), whether or not the session still wants the ring (that
    step is on the nodes: the caller's next one takes it or undoes it). Without an open reply link its reply is lost
    to us: the caller's step, if it is the same, sends the same frame itself."""
    nxt, token = reply.get("ring"), reply.get("token")
    replies = session._replies
    if nxt != session.step_no + 1 or type(token) is not int or replies is None or not replies.connected:
        return
    frame = encode_tokens(session.id, nxt, session.position, [token])
    key = frame_key(frame)
    waiter = asyncio.get_running_loop().create_future()
    waiter.add_done_callback(lambda f: f.cancelled() or f.exception())  # a step nobody takes may fail unread
    early, session._early = session._early, None
    if early is not None and early[0] == key:  # it came before we got here
        waiter.set_result((early[1], early[2], True))
    else:
        replies.expect(key, waiter, own=True)
    session._ring = RingStep(nxt, session.position, token, frame, key, waiter, time.perf_counter())


def reply_late(session: AsyncRouteSession, key: bytes, status: int, body: bytes) -> None:
    """A reply link's message nobody waited for: the route's reply to a head-sent step (kept until the step is claimed,
    then its telemetry: ``session._late``), or a head-sent step's own reply that came before ``learn`` (kept for
    it)."""
    pending = session._ring
    if pending is not None and key == pending.key:
        pending.late = (status, body)
    elif key in session._ring_claimed:
        session._ring_claimed.discard(key)
        session._late(key, status, body)
    else:  # (a client-sent step's reply from the head after the route's, or after it was sent alone: nothing new)
        session._early = (key, status, body)


async def claim(
    session: AsyncRouteSession, pending: RingStep, link: FrameLink, timeout: float
) -> tuple[int, bytes, bool]:
    """Take the head-sent step ``pending`` as the caller's: its reply ``(status, body, direct)``. When the head
    answers it with an error, the reply link fails or no reply comes within ``timeout`` s, the client sends the same
    frame on its step link (nodes that applied it answer from their record): a node that is down fails that send
    and the route is repaired, but a first node the head could not reach (another network) is not taken for
    dead; the session's ring is off from then on. RouteError as a step sent by the client."""
    first = session.route.hops[0].url
    session._unacked[pending.key] = (pending.t0, 1, [h.url for h in session.route.hops], False, pending.start)
    if pending.late is not None:  # the route's reply came first: its telemetry
        session._late(pending.key, *pending.late)
    else:
        session._ring_claimed.add(pending.key)
    unreachable = False
    if session._broken is not None:  # a late error of an earlier step, or a ban: repair first
        broken, session._broken = session._broken, None
        raise broken
    session._waiter = pending.reply  # session.fail() fails it
    try:
        async with asyncio.timeout(timeout):
            status, body, direct = await pending.reply
        if status == 200:
            session.measured.ring_steps += 1
            return status, body, direct
        unreachable = _failed_hop(body) == first  # the head could not send it to the first node
    except RouteError as exc:
        if exc.late or exc.code == BANNED:  # (session.fail: the route is broken, not this link)
            raise
    except TimeoutError:
        pass
    finally:
        session._waiter = None
    if session._replies is not None:
        session._replies.forget(pending.key)
    session._ring_claimed.discard(pending.key)
    answer = await session._exchange(link, pending.frame, pending.key, timeout)
    if unreachable and answer[0] == 200:  # ... and we can: the head cannot reach it (a dead one fails ours too)
        session.ring = False
    return answer


def _failed_hop(body: bytes) -> str | None:
    """The node an error reply names (``error.hop``), if any."""
    try:
        hop = json.loads(body)["error"].get("hop")
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
    return hop if isinstance(hop, str) else None


async def finish(session: AsyncRouteSession) -> None:
    """At the session's close: wait (up to ``FINISH_WAIT_S``) for a head-sent step the caller did not take, so that
    the nodes release the session after it rather than under it."""
    pending, session._ring = session._ring, None
    if pending is None:
        return
    try:
        async with asyncio.timeout(FINISH_WAIT_S):
            await pending.reply
    except (RouteError, TimeoutError):
        pass


async def discard(session: AsyncRouteSession, pending: RingStep, timeout: float) -> None:
    """Undo the head-sent step ``pending`` the caller did not take: wait (up to ``timeout`` s) for it to end, then roll
    every node back to the session's position with ``pending.step`` as their last step number (applied or not
    there). RouteError when a node refuses the truncation."""
    try:
        async with asyncio.timeout(timeout):
            await pending.reply
    except (RouteError, TimeoutError):
        pass
    if session._replies is not None:
        session._replies.forget(pending.key)
    session.step_no = max(session.step_no, pending.step)
    body = {"length": session.position, "step": session.step_no}
    for hop in session.route.hops:
        await session.call(hop.url, "POST", f"/v1/sessions/{session.id}/truncate", body, "truncate")
    session.measured.ring_discarded += 1


__all__ = ["RingStep", "claim", "discard", "finish", "grant", "learn", "open_replies", "reply_late", "result"]
