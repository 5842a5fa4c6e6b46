"""The step path's handlers: ``POST /v1/step`` and ``GET /v1/link``, on which a previous hop sends step frames (each
answered by one message, a quiet step only when it fails) or a client holds its reply link to the head (ring grants
in, the session's replies out). Each frame goes to ``steps.apply_frame``; docs/protocol.md, "Links"."""

from __future__ import annotations

import asyncio
import hmac
import time
import uuid
from functools import partial

import aiohttp
from aiohttp import web

from ..net.http import JSON
from ..protocol import ProtocolError
from ..protocol.frame import is_quiet
from ..protocol.link import encode_reply
from . import ring
from .state import parse_session_id
from .step_path import STEP_PATH, StepPath
from .steps import BODY_SLACK, OK, apply_frame, frame_too_large


async def step(request: web.Request) -> web.Response:
    """``POST /v1/step``: one frame (application/octet-stream) → 200 JSON ``{token, logprobs, hops}``."""
    path: StepPath = request.app[STEP_PATH]
    t0 = time.perf_counter()
    if (request.content_length or 0) > path.max_body + BODY_SLACK:
        raise frame_too_large(path)
    try:
        body = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise frame_too_large(path) from None
    status, reply = await apply_frame(path, body, t0)
    return web.Response(body=reply, status=status, content_type=JSON)


async def link(request: web.Request) -> web.StreamResponse:
    """``GET /v1/link``: a WebSocket on which a previous hop sends step frames (binary messages, each the
    body of a ``POST /v1/step``); each is answered by one binary message (protocol/link.py: frame key, status,
    JSON reply). Frames are applied concurrently, each session's in order; a bad frame gets its error
    reply and the link stays open.

    ``GET /v1/link?replies=<session id>`` (head only, an open session): the client's **reply link**. The head
    sends each successful step reply of that session on it as well (same message), as soon as it has it,
    before the reply travels back along the route: the client has the token one message after the head
    sampled it instead of one per hop. A later reply link for the session replaces the earlier one."""
    path: StepPath = request.app[STEP_PATH]
    ws = web.WebSocketResponse(max_msg_size=path.max_body + BODY_SLACK, autoping=True)
    if not ws.can_prepare(request).ok:
        raise ProtocolError(
            "bad_request",
            "GET /v1/link opens a WebSocket: send Connection: Upgrade and Upgrade: "
            'websocket (docs/protocol.md, "Links")',
        )
    if "replies" in request.query:
        if not path.spec.head:
            raise ProtocolError("bad_request", "only the head sends replies: a reply link goes to the node with --head")
        session = path.store.get(parse_session_id(request.query["replies"]))
        if session.reply_key is not None and not hmac.compare_digest(
            request.query.get("key", "").encode(), session.reply_key.encode()
        ):
            raise ProtocolError("unauthorized", "the session's reply link takes the key its client opened it with")
        return await _reply_link(path, ws, request, session.id)
    await ws.prepare(request)
    path.links_in.add(ws)
    tasks = path.link_tasks  # strong references: the loop keeps only weak ones to running tasks

    async def answer(body: bytes, t0: float) -> None:
        path.frames_waiting -= 1  # (a task cancelled before it starts only happens at shutdown)
        status, reply = await apply_frame(path, body, t0, partial(_answer_later, path, ws, body))
        if status != OK or not is_quiet(body):  # a quiet step is answered only when it fails
            await _answer(path, ws, body, status, reply)

    try:
        async for msg in ws:
            t0 = time.perf_counter()
            if msg.type == aiohttp.WSMsgType.BINARY:
                path.frames_waiting += 1
                task = asyncio.create_task(answer(msg.data, t0))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            elif msg.type == aiohttp.WSMsgType.TEXT:
                status, reply = path.error_reply(ProtocolError("bad_frame", "a link takes binary frames"))
                await ws.send_bytes(encode_reply(b"", status, reply))
    finally:
        path.links_in.discard(ws)
    return ws


async def _answer(path: StepPath, ws: web.WebSocketResponse, body: bytes, status: int, reply: bytes) -> None:
    """Answer the frame ``body`` on the link ``ws`` it came on."""
    if not ws.closed:
        try:
            await ws.send_bytes(encode_reply(body, status, reply))
            path.metrics.messages_sent["reply"].inc()
        except (ConnectionError, RuntimeError):
            pass  # the previous hop went away: it retries or repairs the route


def _answer_later(path: StepPath, ws: web.WebSocketResponse, body: bytes, status: int, reply: bytes) -> None:
    """``_answer`` from a callback: a quiet step that failed downstream after its frame went on."""
    task = asyncio.ensure_future(_answer(path, ws, body, status, reply))
    path.link_tasks.add(task)
    task.add_done_callback(path.link_tasks.discard)


async def _reply_link(
    path: StepPath, ws: web.WebSocketResponse, request: web.Request, sid: uuid.UUID
) -> web.WebSocketResponse:
    """Hold ``ws`` as session ``sid``'s reply link until the client closes it, or the session is closed. The client's
    text messages are ring grants (node/ring.py), one with ``ack`` answered by a text message; a bad one is answered
    with its error (key NO_KEY) and changes nothing."""
    await ws.prepare(request)
    old = path.reply_links.get(sid)
    path.reply_links[sid] = ws
    ring.drop(path, sid)  # a grant is the link's: a new link starts without one
    if old is not None:
        await old.close()
    path.links_in.add(ws)
    try:
        async for msg in ws:
            if (
                msg.type not in (aiohttp.WSMsgType.TEXT, aiohttp.WSMsgType.BINARY)
                or path.reply_links.get(sid) is not ws
            ):
                continue
            try:
                if msg.type != aiohttp.WSMsgType.TEXT:
                    raise ProtocolError("bad_request", "a reply link takes text messages (ring grants) only")
                grant = await ring.parse_grant(path, msg.data)
            except ProtocolError as exc:
                await ws.send_bytes(encode_reply(b"", *path.error_reply(exc)))  # (key NO_KEY)
                continue
            if path.reply_links.get(sid) is ws:
                path.rings[sid] = grant
                if grant.ack:  # where the head stopped: a step sent before this grant took effect is counted
                    await ws.send_str(ring.ack_text(path.store.sessions.get(sid)))
    finally:
        path.links_in.discard(ws)
        if path.reply_links.get(sid) is ws:
            del path.reply_links[sid]
            ring.drop(path, sid)
    return ws


__all__ = ["link", "step"]
