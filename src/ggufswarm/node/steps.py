"""A node's step pipeline: each step frame (from node/step_handlers.py) is replayed (a retry) or applied to its
session's KV cache, then answered by the head or pushed to the session's next hop and relayed back.

A non-head node pushes its output frame straight to the session's next hop and answers with the head's reply, its
own hop timings prepended; a quiet step (ring decode) is answered only when it fails (docs/protocol.md, "Steps",
"Links" and "Quiet steps").
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from functools import partial

from ..net.link import reply_error
from ..protocol import Frame, ProtocolError, decode_frame, encode_hidden
from ..protocol.frame import (
    FLAG_NO_SAMPLE,
    FLAG_QUIET,
    FLAG_REWIND,
    FLAG_VERIFY,
    WIRE_DTYPES,
    frame_digest,
    is_quiet,
    step_timeout_s,
)
from ..protocol.link import encode_reply
from ..runtime.session_state import Session, StepRecord
from . import ring
from .commit import input_digest, output_digest, step_commit
from .lies import parse_lie
from .step_path import StepPath

# bytes a frame or link message may exceed max_body by before it is refused unread (aiohttp's own framing slack)
BODY_SLACK = 1024
FORWARDED_FLAGS = FLAG_NO_SAMPLE | FLAG_VERIFY | FLAG_REWIND | FLAG_QUIET  # frame flags a node passes on
OK = 200
HOPS_FIRST = b'{"hops": ['  # how a step's reply starts (_head_reply's key order, json.dumps's separators)


def frame_too_large(path: StepPath) -> ProtocolError:
    """ProtocolError too_many_tokens for a frame body over the node's ``max_body``."""
    return ProtocolError(
        "too_many_tokens",
        f"frame body over {path.max_body} bytes: more than max_step_tokens {path.max_step_tokens} tokens",
    )


async def _send_direct(path: StepPath, frame: Frame, body: bytes, reply: bytes) -> None:
    """The head's reply to ``body`` (a step of ``frame``'s session) on the session's reply link, if it has one;
    a link that fails is dropped (the reply still goes back along the route)."""
    ws = path.reply_links.get(frame.session_id)
    if ws is None or ws.closed:
        return
    try:
        await ws.send_bytes(encode_reply(body, OK, reply))
        path.metrics.messages_sent["direct"].inc()
    except (ConnectionError, RuntimeError):
        path.reply_links.pop(frame.session_id, None)


async def apply_frame(
    path: StepPath, body: bytes, t0: float, upstream: Callable[[int, bytes], None] | None = None
) -> tuple[int, bytes]:
    """Apply one step frame (the body of ``POST /v1/step`` or a link message) received at ``t0``
    (perf_counter s): (HTTP status, JSON reply bytes) — ``{token, logprobs, hops}``, or an error body
    (StepPath.error_reply: the status the HTTP middleware would answer the same error with). ``upstream(status,
    body)``: answers the frame later on the link it came on (None: a POST); with it a quiet step (FLAG_QUIET) that
    went on to the next hop is answered ``(200, b"")`` at once, and its error, if one comes back, through it."""
    try:
        if len(body) > path.max_body + BODY_SLACK:  # a chunked body (no Content-Length) or a link message
            raise frame_too_large(path)
        frame = decode_frame(body, path.n_embd_in, path.max_step_tokens)
        kind = "decode" if frame.n_tokens == 1 or frame.verify else "prefill"  # a verify step decodes several
        path.metrics.bytes_in[kind].inc(len(body))
        if (frame.dtype == "ids") != path.spec.embed:
            want = "token ids (dtype ids)" if path.spec.embed else f"hidden states ({', '.join(WIRE_DTYPES)})"
            raise ProtocolError(
                "bad_dtype", f"layers {path.spec.start}:{path.spec.end} take {want}; got a {frame.dtype} frame"
            )
        if frame.verify and path.spec.head and frame.n_tokens > path.max_verify_tokens:
            raise ProtocolError(
                "too_many_tokens",
                f"a verify step (frame flag 4) holds at most "
                f"{path.max_verify_tokens} tokens on this head, "
                f"got {frame.n_tokens}",
            )
        session = path.store.get(frame.session_id)
        session.stepping += 1  # in a step until its reply is back: never expired meanwhile (next hops may be slow)
        path.active_sessions += session.stepping == 1
        try:
            return await _apply_session_frame(path, session, frame, body, kind, t0, upstream)
        finally:
            session.stepping -= 1
            path.active_sessions -= session.stepping == 0
            session.last_used = time.monotonic()
    except Exception as exc:
        return path.error_reply(exc)


async def _apply_session_frame(
    path: StepPath,
    session: Session,
    frame: Frame,
    body: bytes,
    kind: str,
    t0: float,
    upstream: Callable[[int, bytes], None] | None,
) -> tuple[int, bytes]:
    """Apply one step of ``session``, in parts: replay or apply the step (_replay, _apply) under the session's
    lock; the head answers (_head_reply) and records its reply (_record) under the lock too; another node
    pushes its output to the next hop (_push) under the lock, then releases it and waits for that hop's reply
    (_relayed) and records it. The session's next step can run here while this one is still downstream: steps
    reach the next hop in order (one link, in push order), and it applies each under its own lock. With the
    head's reply link the client sends the next step as soon as the head has sampled, and no node holds it up
    waiting for the reply of the one before. A quiet step (``upstream`` given, a session without ``commit``) keeps
    this node's numbers for the client (``Session.quiet_hops``) and is not waited for downstream. Raises what the
    step raises."""
    quiet = frame.quiet and upstream is not None and not session.commit
    async with session.lock:
        digest = frame_digest(body)
        record = _replay(path, session, frame, digest)
        applied = record is None
        if applied:  # the next step
            record = _apply(path, session, frame, digest)
            if isinstance(record, asyncio.Future):
                record = await record
            session.settle_quiet()  # the quiet step sent on before this one went through
            if path.test_lie:  # testing only (node/lies.py)
                if lie_delay := parse_lie(path.test_lie).delay_ms:
                    await asyncio.sleep(lie_delay / 1e3)
                if record.output is not None:
                    _lie(path, frame, record)
        elif record.reply is not None:  # a retry of a step answered: the same answer
            if path.spec.head:
                await _send_direct(path, frame, body, record.reply)
            return OK, record.reply
        elif record.relay is not None and not record.relay.done():  # a retry while the step is downstream
            pending = record.relay
            record = None
        # else a retry of a step whose relay failed: its recorded output is relayed again
        if record is not None:
            if path.spec.head:
                # ring decode: the head sends the next step itself (node/ring.py), first: the step's metrics, the
                # commitment's signature, the reply and the client's copy of it are off the route's critical path
                try:
                    nxt = ring.next_frame(path, session, frame, record)
                    if nxt is not None and (waits := await _ring_push(path, session, *nxt)) is not None:
                        task = asyncio.ensure_future(waits)
                        path.link_tasks.add(task)
                        task.add_done_callback(path.link_tasks.discard)
                finally:
                    if applied:
                        _applied(path, session, frame, record, kind)
                hop = _hop(session, record, body)
                if session.commit:
                    hop["commit"] = _commit(path, session, frame, body, record, record.out_digest)
                answer = _head_reply(record, hop)
                if nxt is not None:
                    answer["ring"] = frame.step + 1
                    if is_quiet(nxt[0]):
                        answer["quiet"] = True  # the client reads that step's numbers from the nodes
                reply = _record(record, answer, hop, t0)
                if frame.quiet and not session.commit:
                    _keep_hop(session, frame.step, hop)
                await _send_direct(path, frame, body, reply)
                return OK, reply
            try:
                sent = await _push(path, session, frame, record, kind, quiet)
            finally:  # (after the push: the next hop computes meanwhile)
                if applied:
                    _applied(path, session, frame, record, kind)
            hop = _hop(session, record, body)
            if session.commit:  # the frame is on its way: its digests and signature overlap the next hops' work
                out = None if record.commit else output_digest(sent.frame, frame, path.n_embd_out, session.wire_dtype)
                hop["commit"] = _commit(path, session, frame, body, record, out)
            if quiet:
                hop["handle_ms"] = round((time.perf_counter() - t0) * 1e3, 3)
                _keep_hop(session, frame.step, hop)
                if sent.ordered:  # no reply comes unless the step fails downstream; a retry relays it again
                    session.quiet_sent = sent.reply
                    sent.reply.add_done_callback(partial(_quiet_failed, path, sent.url, upstream))
                    return OK, b""
            pending = record.relay = asyncio.ensure_future(_relayed(sent, record, hop, t0))
            pending.add_done_callback(lambda f: f.cancelled() or f.exception())  # its waiters may have gone
            if not sent.ordered:  # plain POSTs may overtake each other: keep the session until the reply
                return OK, await asyncio.shield(pending)
    return OK, await asyncio.shield(pending)


def _applied(path: StepPath, session: Session, frame: Frame, record: StepRecord, kind: str) -> None:
    """After a step applied here went on (pushed, or the head's ring step sent): its metrics, and the session's
    snapshot when one is due (node/snapshots.py)."""
    metrics = path.metrics
    metrics.steps[kind].inc()
    metrics.step_seconds[kind].observe(record.compute_ms / 1e3)
    metrics.busy_seconds[kind].inc(record.compute_ms / 1e3 / record.batch_size)
    if path.snapshots is not None:
        path.snapshots.after_step(session, kind == "prefill" and frame.sample)


def _hop(session: Session, record: StepRecord, body: bytes) -> dict:
    """This node's numbers of a step (of frame ``body``): compute_ms, bytes_in, kv_tokens (the session's length
    after it)."""
    return {"compute_ms": round(record.compute_ms, 3), "bytes_in": len(body), "kv_tokens": session.length}


def _replay(path: StepPath, session: Session, frame: Frame, digest: int) -> StepRecord | None:
    """The StepRecord of the session's last step when ``frame`` retries it (same step number, same content,
    CRC-32 ``digest`` of the frame): answer it again, never apply it twice. None when ``frame`` is the
    session's next step. StepConflict otherwise: position_mismatch, step_conflict, stale_step or step_gap."""
    record = path.store.replay(session, frame.step, digest, frame.start, frame.n_tokens, frame.rewind)
    if record is not None:
        path.metrics.replays.inc()
    return record


def _apply(path: StepPath, session: Session, frame: Frame, digest: int) -> StepRecord | asyncio.Future:
    """Apply the session's next step: its StepRecord when it ran here, or an asyncio.Future of it when it went
    to the worker pool (await it). Raises (or the future does) what SessionStore.apply raises. On a shard that
    batches (``supports_batch``) the step goes through the batcher (node/batching.py: run together with other
    sessions' steps, a prefill in pieces), except a speculative verify step (all rows' logits at the head), which
    runs alone; elsewhere every step runs alone."""
    args = (session, frame.step, digest, frame.start, frame.data, frame.token_ids, frame.sample)
    if frame.verify:
        args += (True,)
    elif path.batcher is not None:  # batched with other sessions' steps, prefills in pieces
        # alone: no other session's step is in flight here, nor read and about to start: a step run inline on the
        # loop would otherwise hold up the steps its batch could have taken along
        return path.batcher.submit(
            args, alone=path.active_sessions <= 1 and not path.frames_waiting, more=path.frames_waiting > 0
        )
    lock = path.inline_lock if frame.n_tokens == 1 else None
    if lock is not None and lock.acquire(blocking=False):
        # A decode step when the shard is idle runs right here on the event loop: it is short, and the hand-off
        # to a worker thread and back would cost a sizeable part of it (measured in bench/bench_llamacpp.py).
        # With the shard busy (a prefill, a snapshot) it queues in the pool, so the loop never waits for another
        # step.
        try:
            return path.store.apply(*args)
        finally:
            lock.release()
    return asyncio.get_running_loop().run_in_executor(path.pool, path.store.apply, *args)


async def _ring_push(path: StepPath, session: Session, nxt: bytes, first: str | None) -> Coroutine | None:
    """Ring decode (node/ring.py): send the session's next step ``nxt`` to the route's first node ``first`` now, when
    the link to it is open (None: it is applied here, a route of one node); the coroutine (run it as a task) that
    waits for that step's reply, the route's (or the error that stopped it), and passes it to the client on the
    session's reply link. The head's own reply to the step before (``_send_direct``) goes out after this send, the
    route's later. A link still to open is opened by the coroutine: a first node slow to answer never holds up the
    head's reply. A quiet step (node/ring.py opens them) has nothing to wait for: None, and only its error, if one
    comes back, goes to the client."""
    t0 = time.perf_counter()
    sent: asyncio.Future | None = None
    error: Exception | None = None
    if first is not None and path.links.ready(first):
        quiet = is_quiet(nxt)
        try:
            sent = await _ring_send(path, session, nxt, first, quiet)
        except Exception as exc:
            error = exc
        else:
            if quiet:
                session.quiet_sent = sent
                sent.add_done_callback(partial(_ring_quiet_done, path, session, nxt, first))
                return None
    return _ring_replied(path, session, nxt, first, t0, sent, error)


async def _ring_send(path: StepPath, session: Session, nxt: bytes, first: str, quiet: bool = False) -> asyncio.Future:
    sent, _ = await path.links.send(first, nxt, step_timeout_s(session.hop_timeout_s, 1), quiet)
    path.metrics.messages_sent["frame"].inc()
    return sent


def _quiet_error(sent: asyncio.Future) -> BaseException | tuple[int, bytes] | None:
    """How a quiet step sent on ended: None when it went through (no answer within its timeout, settled, or a POST's
    200), else the link's failure or the error reply ``(status, body)``."""
    if sent.cancelled():
        return None
    if (error := sent.exception()) is not None:
        return error
    answer = sent.result()
    return None if answer is None or answer[0] == OK else answer[:2]


def _ring_quiet_done(path: StepPath, session: Session, nxt: bytes, first: str, sent: asyncio.Future) -> None:
    """A quiet ring step's end at the head: counted ok when it went through, else its error to the client on the reply
    link, as ``_ring_replied`` does."""
    if (error := _quiet_error(sent)) is None:
        path.metrics.ring_steps["ok"].inc()
        return
    status, reply = path.error_reply(error) if isinstance(error, BaseException) else error
    task = asyncio.ensure_future(_ring_answered(path, session, nxt, status, reply))
    path.link_tasks.add(task)
    task.add_done_callback(path.link_tasks.discard)


def _quiet_failed(path: StepPath, url: str, upstream: Callable[[int, bytes], None], sent: asyncio.Future) -> None:
    """A quiet step pushed to next hop ``url``: when it failed there (an error came back, or the link failed), pass
    the error upstream, as a relayed reply would."""
    if (error := _quiet_error(sent)) is not None:
        upstream(*path.error_reply(error if isinstance(error, BaseException) else reply_error(error[1], error[0], url)))


def _keep_hop(session: Session, step: int, hop: dict) -> None:
    """Keep a quiet step's numbers on the session for the client (``POST /v1/sessions/{id}/hops``), the newest
    ``max_length`` of them (a client that never reads them costs no more than that)."""
    if len(session.quiet_hops) >= session.max_length:
        del session.quiet_hops[0]
    session.quiet_hops.append((step, hop["compute_ms"], hop["bytes_in"], hop["kv_tokens"], hop.get("handle_ms")))


async def _ring_replied(
    path: StepPath,
    session: Session,
    nxt: bytes,
    first: str | None,
    t0: float,
    sent: asyncio.Future | None,
    error: Exception | None,
) -> None:
    """The rest of ``_ring_push``: the reply to ``nxt`` (sent to ``first`` here when it was not ``sent`` and there was
    no send ``error``; applied here when ``first`` is None) to the client on the reply link."""
    try:
        if error is not None:
            raise error
        if first is None:
            status, reply = await apply_frame(path, nxt, t0)
        else:
            if sent is None:
                sent = await _ring_send(path, session, nxt, first)
            status, reply, _ = await sent
    except Exception as exc:
        status, reply = path.error_reply(exc)
    await _ring_answered(path, session, nxt, status, reply)


async def _ring_answered(path: StepPath, session: Session, nxt: bytes, status: int, reply: bytes) -> None:
    """A ring step's end at the head: counted, and its reply (the route's, or the error) to the client."""
    closed = path.store.sessions.get(session.id) is not session  # closed meanwhile: nobody is waiting
    path.metrics.ring_steps["ok" if status == OK else "closed" if closed else "failed"].inc()
    if status != OK:  # a first node that fails once is not sent the next steps: the client sends them (or re-grants)
        ring.drop(path, session.id)
    ws = path.reply_links.get(session.id)
    if ws is not None and not ws.closed:
        try:
            await ws.send_bytes(encode_reply(nxt, status, reply))
            path.metrics.messages_sent["direct"].inc()
        except (ConnectionError, RuntimeError):
            pass  # the client went away: the lease or its close frees the session


def _commit(path: StepPath, session: Session, frame: Frame, body: bytes, record: StepRecord, out: str | None) -> dict:
    """The step's signed commitment (node/commit.py), made once per step and kept on its record: a retry answers
    the same one. IN digests ``body``'s payload; ``out``: the OUT digest (unused when the record has one)."""
    if record.commit is None:
        record.commit = step_commit(path.identity, frame, input_digest(body, frame), out, session.chain, session.ctx)
    return record.commit


def _lie(path: StepPath, frame: Frame, record: StepRecord) -> None:
    """Testing only (``--test-lie``, node/lies.py): replace the step's output with the lie's version of it, once, so
    that a retry sends the same."""
    noisy = parse_lie(path.test_lie).tamper(frame.session_id, frame.step, record.output)
    if noisy is not None:
        record.output = noisy


def _head_reply(record: StepRecord, hop: dict) -> dict:
    """The head's reply to a step: ``{token, hops: [hop]}``, with ``logprobs`` / ``token_logprob`` when the
    session asked for them."""
    reply = {"hops": [hop], "token": record.token}  # hops first: the nodes before put theirs in front (_relayed)
    if record.tokens is not None:  # a verify step: the token sampled after each of its positions
        reply["tokens"] = record.tokens
    if record.logprobs is not None:
        reply["logprobs"] = record.logprobs
    if record.token_logprob is not None:
        reply["token_logprob"] = record.token_logprob
    return reply


@dataclass
class _Sent:
    """A step pushed to the next hop ``url`` at ``t_push`` (perf_counter s); ``reply``: the future of its
    (status, body, direct); ``ordered``: it went over a link, so later steps of the session reach the hop after it;
    ``frame``: the frame's bytes."""

    url: str
    t_push: float
    reply: asyncio.Future
    ordered: bool
    frame: bytes


async def _push(
    path: StepPath, session: Session, frame: Frame, record: StepRecord, kind: str, quiet: bool = False
) -> _Sent:
    """Send the step's output (in the session's wire dtype, with the route's token ids) to the session's next
    hop over its link, waiting at most ``step_timeout_s`` of the session's ``hop_timeout_s`` (seconds) for the
    reply; ``quiet``: as a quiet step (else FLAG_QUIET is not passed on: this node waits for the reply).
    ProtocolError naming the hop when it cannot be sent (hop_failed, hop_timeout)."""
    ids = frame.data if frame.dtype == "ids" else frame.token_ids
    flags = frame.flags & FORWARDED_FLAGS & ~(0 if quiet else FLAG_QUIET)
    out = encode_hidden(frame.session_id, frame.step, frame.start, record.output, session.wire_dtype, ids, flags)
    url = session.next_hop
    t_push = time.perf_counter()
    timeout = step_timeout_s(session.hop_timeout_s, frame.n_tokens)
    reply, ordered = await path.links.send(url, out, timeout, quiet)
    path.metrics.bytes_out[kind].inc(len(out))
    path.metrics.messages_sent["frame"].inc()
    return _Sent(url, t_push, reply, ordered, out)


async def _relayed(sent: _Sent, record: StepRecord, hop: dict, t0: float) -> bytes:
    """The reply to a pushed step: the next hop's reply with ``hop`` (this node's timings, ``push_ms`` and
    ``handle_ms`` added) first in its ``hops`` (put in front of its bytes, not parsed and written again), recorded
    on the step's record. ProtocolError naming the hop on any failure: the hop's own error passed on, hop_failed
    or hop_timeout."""
    status, body, _ = await sent.reply
    if status != OK:
        raise reply_error(body, status, sent.url)
    record.output = None  # the next hop has it: a retry is answered with the reply (a prefill piece: megabytes)
    hop["push_ms"] = round((time.perf_counter() - sent.t_push) * 1e3, 3)
    if body.startswith(HOPS_FIRST) and body.endswith(b"}"):  # this node's entry put in front, nothing parsed
        hop["handle_ms"] = round((time.perf_counter() - t0) * 1e3, 3)
        record.reply = HOPS_FIRST + json.dumps(hop).encode() + b", " + body[len(HOPS_FIRST) :]
        return record.reply
    try:  # (a next hop that puts its hops elsewhere)
        reply = json.loads(body)
        reply["hops"].insert(0, hop)
    except (ValueError, KeyError, TypeError, AttributeError):
        raise ProtocolError("hop_failed", f"next hop {sent.url} answered a step with no hops", hop=sent.url) from None
    return _record(record, reply, hop, t0)


def _record(record: StepRecord, reply: dict, hop: dict, t0: float) -> bytes:
    """Finish the step: ``hop`` gets ``handle_ms`` (since ``t0``, perf_counter s) and the reply's JSON bytes
    are kept on the step's record (a retry of the step is answered with exactly these). The reply bytes."""
    hop["handle_ms"] = round((time.perf_counter() - t0) * 1e3, 3)
    record.reply = json.dumps(reply).encode()
    return record.reply


__all__ = ["apply_frame", "frame_too_large"]
