"""Route repair and prefix restore for a route session: replace a failed node, restore snapshots, rewind the rest.

Functions of an AsyncRouteSession (client/session.py) that change which nodes hold how much of its history:
``repair_route`` replaces the node a RouteError names (docs/protocol.md, "Snapshots and route repair"),
``restore_prefix`` restores the longest cached prefix of a prompt on every node. The session then replays the
history past the restored position step by original step (``AsyncRouteSession.step``).
"""

from __future__ import annotations

import asyncio
import inspect
import time
from typing import TYPE_CHECKING

from ..protocol.errors import RouteError
from . import opening
from .transport import BANNED

if TYPE_CHECKING:
    from .route import Hop, RemoteRoute
    from .session import AsyncRouteSession

MESSAGE_CHARS = 300  # how much of an error message a repair's telemetry entry keeps


def common_prefix(held: dict[str, tuple[int, list[int] | None]]) -> tuple[int, list[int]]:
    """The longest prefix every node can keep, and its step boundaries, from what each node restored (per URL:
    tokens held and, from a llama.cpp node, its step boundaries; None from a torch node): no longer than any
    node holds, and on llama.cpp nodes ending at a step boundary they all share with the same steps before
    it — otherwise their KV would come from differently grouped computations."""
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


async def restore_many(
    session: AsyncRouteSession, hops: list[Hop], tokens: list[int], boundaries: list[int] | None = None
) -> dict[str, tuple[int, list[int] | None]]:
    """``/restore`` on each of ``hops`` at once: per node URL the tokens it now holds and, from a llama.cpp
    node, the step boundaries of what it restored (None from a torch node). ``boundaries``: the session's
    own step ends, for a repair (the node then restores only a prefix computed with exactly those steps)."""

    async def one(hop: Hop) -> tuple[int, list[int] | None]:
        body = {"tokens": tokens, "step": session.step_no}
        if boundaries is not None:
            body["boundaries"] = boundaries
        reply = await session.call(hop.url, "POST", f"/v1/sessions/{session.id}/restore", body, "restore")
        return int(reply["length"]), reply.get("boundaries")

    return dict(zip((h.url for h in hops), await asyncio.gather(*(one(h) for h in hops))))


async def rewind(session: AsyncRouteSession, hops: list[Hop], held: dict[str, int], length: int, relink: bool) -> None:
    """Truncate every hop holding more than ``length`` tokens (all of them with ``relink``, which also
    sets each one's next_hop to its successor in ``hops``) and set their step counters to ``step_no``."""
    for i, hop in enumerate(hops):
        if relink or held.get(hop.url, 0) > length:
            body = {"length": length, "step": session.step_no}
            if relink and not hop.head:
                body["next_hop"] = hops[i + 1].url
            await session.call(hop.url, "POST", f"/v1/sessions/{session.id}/truncate", body, "truncate")
    session.position = length


async def restore_prefix(session: AsyncRouteSession, prompt: list[int]) -> int:
    """Restore the longest cached prefix of ``prompt`` on every node; tokens restored (0: none)."""
    hops = session.route.hops
    try:
        held = await restore_many(session, hops, prompt)
        length, steps = common_prefix(held)
        await rewind(session, hops, {url: n for url, (n, _) in held.items()}, length, relink=False)
        session.boundaries.update(steps)
        session.boundaries.add(length)
    except RouteError:  # a failing node shows again at the first step, which repairs the route
        for hop in hops:
            try:
                await session.call(hop.url, "POST", f"/v1/sessions/{session.id}/truncate", {"length": 0}, "truncate")
            except RouteError:
                pass
        session.position = 0
        return 0
    session.measured.prefix_tokens_restored = length
    return length


async def _plan(session: AsyncRouteSession, exclude: frozenset[str], span: tuple[int, int]) -> RemoteRoute:
    """``session.replan(exclude, span)``: awaited when it is a coroutine function, else run in a worker thread
    (a blocking planner must not hold up the loop)."""
    if inspect.iscoroutinefunction(session.replan):
        return await session.replan(exclude, span)
    return await asyncio.to_thread(session.replan, exclude, span)


async def _plan_avoiding(
    session: AsyncRouteSession, excluded: set[str], failed: Hop, span: tuple[int, int]
) -> RemoteRoute:
    """A plan for ``span`` avoiding every node that failed this session, then, when none is left, any but
    ``failed`` itself: a node that failed earlier may be healthy again (restarted, its fault passed), and the
    open or restore on it tells. ``excluded`` is narrowed to ``{failed}`` in that case."""
    try:
        return await _plan(session, frozenset(excluded), span)
    except RouteError:
        if excluded == {failed.url}:
            raise
    spare = await _plan(session, frozenset({failed.url}), span)
    excluded.clear()
    excluded.add(failed.url)
    return spare


async def replacement(
    session: AsyncRouteSession, excluded: set[str], failed: Hop
) -> tuple[RemoteRoute, tuple[int, int]]:
    """A chain from ``replan`` and the layers ``(start, end)`` it replaces: ``failed``'s own layers when some
    node serves exactly them, else the whole route's (every hop re-planned: a node serving more layers than
    the failed one, such as a whole-model node, can then take over). RouteError (the one for ``failed``'s own
    layers) when there is none."""
    span = (failed.start, failed.end)
    whole = (session.route.hops[0].start, session.route.hops[-1].end)
    try:
        return await _plan_avoiding(session, excluded, failed, span), span
    except RouteError as err:
        if span == whole:
            raise
        try:
            return await _plan_avoiding(session, excluded, failed, whole), whole
        except RouteError:
            raise err from None


def _entry(failed: Hop, exc: RouteError, t0: float, **more) -> dict:
    """A ``telemetry.repairs`` entry: the failed node, its layers, the cause, and ``more``."""
    return {
        "hop": failed.url,
        "layers": [failed.start, failed.end],
        "cause": exc.code,
        "message": str(exc)[:MESSAGE_CHARS],
        **more,
        "ms": round((time.perf_counter() - t0) * 1e3, 1),
    }


async def repair_route(session: AsyncRouteSession, excluded: set[str], exc: RouteError) -> dict:
    """Replace the node named by ``exc`` (see AsyncRouteSession), adding every node that failed to
    ``excluded``: plan a replacement, open the session on the new nodes, restore the longest snapshot of the
    history they have, and rewind and relink every node to the common position (for ``node_banned``, a node the
    gateway's verifier caught lying: nothing restored, every node rewound to 0, the whole history replayed).
    Returns the repair's telemetry entry (already in ``session.measured.repairs``; the caller counts
    ``tokens_replayed`` in it as it replays).
    RouteError ``no_replacement`` (503) when no replacement exists, or the error of a replacement that failed
    too (recorded, the caller retries)."""
    t0 = time.perf_counter()
    old = session.route
    failed = next((h for h in old.hops if h.url == exc.hop), old.hops[0])
    excluded.add(failed.url)
    try:
        spare, span = await replacement(session, excluded, failed)
    except RouteError as err:
        session.measured.repairs.append(_entry(failed, exc, t0, replacement=None, error=str(err)[:MESSAGE_CHARS]))
        raise RouteError(
            "no_replacement",
            f"node {failed.url} (layers {failed.start}:{failed.end}) failed ({exc}); no replacement: {err}",
            503,
            failed.url,
        ) from None
    replaced = [h for h in old.hops if span[0] <= h.start and h.end <= span[1]]  # failed alone, or every hop
    i, j = old.hops.index(replaced[0]), old.hops.index(replaced[-1])
    hops = old.hops[:i] + spare.hops + old.hops[j + 1 :]
    session.route = type(old).of_hops(hops, old.hop_timeout_s, model=old.model, token=old.token)
    await session.drop_links()  # the first node or head may have changed; late replies of the old route are moot
    kept = {h.url for h in hops}
    for h in replaced:
        if h.url in kept or h.url not in session.opened:  # a node the new plan uses again keeps its session
            continue
        session.opened.remove(h.url)
        if h is not failed:  # a live node the new route leaves out: its KV is freed now
            await opening.close_on(session, h.url)
    target = session.position
    try:
        fresh = [h for h in spare.hops if h.url not in session.opened]
        for h in reversed(fresh):
            await opening.open_on(session, hops, hops.index(h))
        own = sorted(b for b in session.boundaries if 0 < b <= target)
        banned = exc.code == BANNED  # the nodes after a banned one computed from its outputs: all start again from 0
        restored = await restore_many(session, fresh, session.tokens[:target], own) if fresh and not banned else {}
        held = {url: n for url, (n, _) in restored.items()}
        length = 0 if banned else max(b for b in session.boundaries if b <= min([target] + list(held.values())))
        session.position = length  # if this repair fails midway, the next one starts from here
        try:
            await rewind(session, hops, held, length, relink=True)
        except RouteError as err:
            if err.code != "state_not_at_position" or not length:
                raise
            # a recurrent (hybrid) node holds no exact state at ``length``: every node starts again from 0
            length = 0
            await rewind(session, hops, {}, 0, relink=True)
    except RouteError as err:  # failed halfway (the replacement failed too): recorded, then the caller retries
        session.measured.repairs.append(
            _entry(
                failed,
                exc,
                t0,
                replacement=[h.url for h in spare.hops],
                replaced_layers=list(span),
                restored_tokens=0,
                tokens_replayed=0,
                error=str(err)[:MESSAGE_CHARS],
            )
        )
        raise
    # tokens_replayed counts up as the history from ``length`` to ``target`` is replayed; ms is the repair's own
    # time (plan, open, restore, relink), without the replay
    entry = _entry(
        failed,
        exc,
        t0,
        replacement=[h.url for h in spare.hops],
        replaced_layers=list(span),
        restored_tokens=length,
        tokens_replayed=0,
    )
    session.measured.repairs.append(entry)
    return entry
