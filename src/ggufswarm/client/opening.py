"""Opening and releasing a route session on its nodes: every node at once (one round trip for the route), or
head first, waiting for free session slots, when a node's are all taken; release at close or when a repair
leaves a node out. Functions of an AsyncRouteSession (client/session.py)."""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

from ..protocol.errors import RouteError

if TYPE_CHECKING:
    from .route import Hop
    from .session import AsyncRouteSession

OPEN_WAIT_S = 60.0  # how long an open waits for a node's free session slot (kv_budget_full) before failing
FIRST_PAUSE_S, MAX_PAUSE_S = 0.02, 0.5  # an open waiting for a session slot (kv_budget_full) retries with backoff
CLOSE_TIMEOUT_S = 5.0  # most seconds a node may take to release a session at close


async def open_all(session: AsyncRouteSession, hops: list[Hop]) -> None:
    """Open the session on every node at once: one round trip for the whole route, not one per node (TTFT).
    When a node's session slots are all taken (kv_budget_full), what was opened is closed and the session
    opens head first instead, waiting for slots (``open_on``). Raises the first refusal in route order."""
    if len(hops) == 1:
        await open_on(session, hops, 0)
        return
    results = await asyncio.gather(
        *(open_on(session, hops, i, wait=False) for i in range(len(hops))), return_exceptions=True
    )
    errors = [e for e in results if e is not None]
    if not errors:
        return
    for e in errors:
        if not isinstance(e, RouteError) or e.code != "kv_budget_full":
            raise e
    await close_opened(session)
    for i in reversed(range(len(hops))):
        await open_on(session, hops, i)


async def open_on(session: AsyncRouteSession, hops: list[Hop], i: int, wait: bool = True) -> None:
    """Open the session on node ``hops[i]`` (its next hop ``hops[i + 1]``). ``wait``: while the node's session
    slots are all taken (kv_budget_full), retry for up to OPEN_WAIT_S. RouteError when it refuses."""
    hop = hops[i]
    body = {
        "session_id": str(session.id),
        "max_length": session.max_length,
        "wire_dtype": session.wire_dtype,
        "next_hop": hops[i + 1].url if i + 1 < len(hops) else None,
        "hop_timeout_s": session.route.hop_timeout_s * max(len(hops) - 1 - i, 1),
    }
    if hop.head:
        body["reply_key"] = session.reply_key  # only the head: no other node of the route can take the reply link
        body["sampling"] = session.sampling.to_dict()
        body["top_logprobs"] = session.top_logprobs
        if session.logprobs:
            body["logprobs"] = True
    if session.lease_s is not None:
        body["lease_s"] = session.lease_s
    if session.route.model is not None:
        body["model"] = session.route.model
    if session.commit:  # every node signs what it got and passed on, each step (docs/protocol.md)
        body["commit"] = True
    # A node whose session slots are all taken answers 429 kv_budget_full: wait for one (as llama-server
    # queues requests beyond --parallel). A session that waits opens head first (open_all), so the ones
    # holding this node's slots already hold the later nodes too and will finish: waiting cannot deadlock.
    deadline, pause = time.monotonic() + OPEN_WAIT_S, FIRST_PAUSE_S
    while True:
        try:
            answer = await session.call(hop.url, "POST", "/v1/sessions", body, "open session")
            break
        except RouteError as exc:
            exc.next_hop = body["next_hop"]
            if not wait or exc.code != "kv_budget_full" or time.monotonic() + pause > deadline:
                raise
            await asyncio.sleep(pause)
            pause = min(pause * 2, MAX_PAUSE_S)
            if session.lease_s is not None and time.monotonic() - session.renewed_at > session.lease_s / 3:
                await session.renew()  # the nodes opened already hold the session for us meanwhile
    session.opened.append(hop.url)
    if session.commit and isinstance(answer.get("commit_context"), dict):
        session.contexts[hop.url] = answer["commit_context"]


async def close_on(session: AsyncRouteSession, url: str) -> None:
    """Release the session on node ``url`` (best effort: errors are ignored)."""
    await session.best_effort(
        url, "DELETE", f"/v1/sessions/{session.id}", min(session.route.hop_timeout_s, CLOSE_TIMEOUT_S)
    )


async def close_opened(session: AsyncRouteSession) -> None:
    """Release the session on every node it is open on, at once (best effort)."""
    opened, session.opened = session.opened, []
    await asyncio.gather(*(close_on(session, url) for url in opened))


_closing: set[asyncio.Task] = set()  # releases still running after their session's task was cancelled


async def releases_done(timeout_s: float) -> None:
    """Wait (up to ``timeout_s`` seconds) for the releases of this loop's closed sessions still running on their
    nodes: call it before closing the aiohttp session they use (a server shutting down)."""
    loop = asyncio.get_running_loop()
    pending = [t for t in _closing if t.get_loop() is loop and not t.done()]
    if pending:
        await asyncio.wait(pending, timeout=timeout_s)


def _release_done(task: asyncio.Task) -> None:
    """A release finished: forget it, and take its error (a release is best effort, and one whose closer was
    cancelled has nobody else to take it: asyncio would print it as never retrieved)."""
    _closing.discard(task)
    if not task.cancelled():
        task.exception()


def track_release(task: asyncio.Task) -> None:
    """Keep the task releasing a closed session on its nodes until it ends (``releases_done`` waits for it)."""
    _closing.add(task)
    task.add_done_callback(_release_done)
