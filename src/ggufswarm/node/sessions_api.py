"""A node's session endpoints (docs/protocol.md): open, renew, close, truncate and restore a route session.

Handlers raise ProtocolError or the runtime's typed errors; the app's json_errors_middleware answers them.
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from urllib.parse import urlsplit

from aiohttp import web

from ..net.commitments import commit_context, context_digest
from ..net.http import read_json
from ..protocol import ProtocolError
from ..protocol.fields import json_field
from ..protocol.frame import WIRE_DTYPES
from ..runtime.sampling import SamplingParams
from .advertise import check_registered
from .numerics import numerics
from .state import NODE, NodeState, json_response, parse_session_id

MAX_STEP = 2**63 - 1  # step numbers are uint64 in a frame's header; JSON ones stay below 2**63
MAX_TOP_LOGPROBS = 20
MAX_URL_CHARS = 2048  # longest next_hop URL taken
MAX_REPLY_KEY_CHARS = 128  # longest reply_key taken
MAX_MESSAGE_CHARS = 300  # error messages quoting a client's value are cut to this
SESSION_ID_BYTES = 16  # a session id the node picks: 128 random bits


async def open_session(request: web.Request) -> web.Response:
    """``POST /v1/sessions`` {session_id, max_length, next_hop, sampling, wire_dtype, top_logprobs, logprobs,
    lease_s, hop_timeout_s, model, commit, reply_key} → 201; ``model`` (optional): the GGUF fingerprint the client
    expects, 409 ``model_mismatch`` when this node serves another model; ``commit`` (bool, default false): every
    step's hop record carries this node's signed step commitment (node/commit.py; 400 bad_request for a non-bool);
    ``reply_key`` (head, optional): the secret the session's reply link must present (``?key=``), so that only the
    client that opened it (not another node of its route, which knows its id) gets its replies and grants its
    ring."""
    state: NodeState = request.app[NODE]
    body = await read_json(request)
    sid = parse_session_id(body.get("session_id") or uuid.UUID(bytes=os.urandom(SESSION_ID_BYTES)))
    max_length = json_field(body, "max_length", int, positive=True, unit="tokens")
    next_hop = next_hop_url(state, body.get("next_hop"))
    await check_registered(state, next_hop)
    wire = body.get("wire_dtype", "f32")
    if wire not in WIRE_DTYPES:
        raise ProtocolError("bad_dtype", f"wire_dtype must be one of {', '.join(WIRE_DTYPES)}, got {wire!r}")
    n_logprobs = json_field(body, "top_logprobs", int, 0, min=0, max=MAX_TOP_LOGPROBS)
    want_logprob = json_field(body, "logprobs", bool, False)
    commit = json_field(body, "commit", bool, False)
    reply_key = body.get("reply_key")
    if reply_key is not None and not (isinstance(reply_key, str) and 16 <= len(reply_key) <= MAX_REPLY_KEY_CHARS):
        raise ProtocolError("bad_request", f"reply_key must be a string of 16 to {MAX_REPLY_KEY_CHARS} characters")
    lease = json_field(body, "lease_s", float, None, positive=True, unit="seconds")
    hop_timeout = json_field(body, "hop_timeout_s", float, state.config.hop_timeout_s, positive=True, unit="seconds")
    model = body.get("model")
    if model is not None and model != state.executor.model.fingerprint:
        raise ProtocolError(
            "model_mismatch",
            f"this node serves {state.model_name} (GGUF fingerprint "
            f"{state.executor.model.fingerprint[:12]}), the session is for "
            f"another model (fingerprint {str(model)[:12]})",
        )
    sampling = body.get("sampling") or {}
    if not isinstance(sampling, dict):
        raise ProtocolError("bad_request", "sampling must be an object")
    try:
        params = SamplingParams(**sampling).validate()
    except TypeError as exc:
        raise ProtocolError("bad_request", f"sampling: {exc}") from None
    session = state.store.open(sid, max_length, next_hop, params, wire, n_logprobs, want_logprob)
    session.lock = asyncio.Lock()
    session.hop_timeout_s = float(hop_timeout)
    session.lease_s = lease
    session.commit = commit
    session.reply_key = reply_key if state.spec.head else None
    answer = {
        "session_id": str(sid),
        "max_length": max_length,
        "layers": [state.spec.start, state.spec.end],
        "kv_tokens_reserved": state.store.reserved_tokens,
        "kv_budget_tokens": state.store.budget_tokens,
    }
    if commit:  # what this node's commitments will sign as their context (net/commitments.py)
        spec = state.spec
        context = commit_context(
            state.executor.model.fingerprint,
            spec.start,
            spec.end,
            spec.embed,
            spec.head,
            numerics(state)["id"],
            wire,
            params.to_dict(),
        )
        session.ctx = context_digest(context)
        session.chain = [(0, session.ctx)]
        answer["commit_context"] = context
    state.readvertise()
    return json_response(answer, 201)


async def renew_session(request: web.Request) -> web.Response:
    """``POST /v1/sessions/{id}/renew`` → 200 {session_id, lease_s}: the client is alive; the session's idle
    clock restarts (its lease, or the node's session TTL, counts from now). 404 unknown_session."""
    state: NodeState = request.app[NODE]
    session = state.store.get(parse_session_id(request.match_info["sid"]))  # (restarts its idle clock)
    return json_response({"session_id": str(session.id), "lease_s": session.lease_s or state.store.ttl_s})


async def session_hops(request: web.Request) -> web.Response:
    """``POST /v1/sessions/{id}/hops`` → 200 ``{"hops": [{step, compute_ms, bytes_in, kv_tokens, handle_ms}]}``: this
    node's numbers of the session's quiet steps (ring decode, docs/protocol.md "Quiet steps") since the last call,
    oldest first; each is answered once. 404 unknown_session."""
    state: NodeState = request.app[NODE]
    session = state.store.get(parse_session_id(request.match_info["sid"]))
    hops, session.quiet_hops = session.quiet_hops, []
    keys = ("step", "compute_ms", "bytes_in", "kv_tokens", "handle_ms")
    return json_response({"hops": [dict(zip(keys, hop)) for hop in hops]})


async def close_session(request: web.Request) -> web.Response:
    """``DELETE /v1/sessions/{id}`` → 200 {closed, kv_tokens}; 404 unknown_session."""
    state: NodeState = request.app[NODE]
    session = state.store.close(parse_session_id(request.match_info["sid"]))
    session.settle_quiet()
    state.readvertise()
    replies = state.path.reply_links.pop(session.id, None)
    if replies is not None:
        await replies.close()
    from .memory import trim_if_idle

    await trim_if_idle(state.store, state.executor)  # the last one: idle memory back to the OS
    return json_response({"closed": str(session.id), "kv_tokens": session.length})


def next_hop_url(state: NodeState, next_hop) -> str | None:
    """A validated next_hop for this shard: None on the head, the next node's ``http(s)://HOST:PORT`` otherwise
    (``node_url``). ProtocolError bad_request otherwise."""
    if state.spec.head and next_hop:
        raise ProtocolError("bad_request", "this node holds the head stage; it takes no next_hop")
    if state.spec.head:
        return None
    return node_url(
        next_hop, f"layers {state.spec.start}:{state.spec.end} are not the last shard: next_hop (the next node)"
    )


def node_url(value, what: str) -> str:
    """``value`` as another node's ``http(s)://HOST:PORT`` without a trailing slash (no path, query, fragment or user
    info: a node posts frames, with the swarm token, only to another node's endpoints). ProtocolError bad_request
    (its message starts with ``what``) otherwise."""
    bad = not (isinstance(value, str) and len(value) <= MAX_URL_CHARS)
    if not bad:
        try:
            parts = urlsplit(value)
            bad = (
                parts.scheme not in ("http", "https")
                or not parts.hostname
                or parts.port is None
                or parts.username is not None
                or parts.password is not None
                or parts.path not in ("", "/")
                or parts.query
                or parts.fragment
                or "?" in value
                or "#" in value
            )
        except ValueError:  # a port out of range or not a number
            bad = True
    if bad:
        raise ProtocolError(
            "bad_request",
            f"{what} must be a node's http://HOST:PORT (no path, query or user info), got {value!r}"[
                :MAX_MESSAGE_CHARS
            ],
        )
    return value.rstrip("/")


async def truncate_session(request: web.Request) -> web.Response:
    """``POST /v1/sessions/{id}/truncate`` {length[, step][, next_hop]} → 200 {length}: roll the KV cache back.

    Route repair also sets ``step`` (the last step number applied; the next is ``step + 1``) and, for a
    node whose successor was replaced, ``next_hop``.
    """
    state: NodeState = request.app[NODE]
    body = await read_json(request)
    length = json_field(body, "length", int)
    step_no = json_field(body, "step", int, None, min=0, max=MAX_STEP)
    next_hop = next_hop_url(state, body["next_hop"]) if "next_hop" in body else None
    await check_registered(state, next_hop)
    session = state.store.get(parse_session_id(request.match_info["sid"]))
    async with session.lock:
        state.store.truncate(session.id, length)
        if step_no is not None:
            state.store.set_step(session, step_no)
        if "next_hop" in body:
            session.next_hop = next_hop
    return json_response({"session_id": str(session.id), "length": session.length})


def _restore_request(body: dict) -> tuple[list[int], int | None, list[int] | None]:
    """(tokens, step, boundaries) of a restore request; ProtocolError bad_request for values of the wrong shape."""
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(type(t) is int for t in tokens):
        raise ProtocolError("bad_request", "tokens must be a list of token ids")
    step_no = json_field(body, "step", int, None, min=0, max=MAX_STEP)
    wanted = body.get("boundaries")
    if wanted is not None and (
        not isinstance(wanted, list)
        or not all(type(b) is int for b in wanted)
        or wanted != sorted(set(wanted))
        or (wanted and wanted[0] <= 0)
    ):
        raise ProtocolError("bad_request", "boundaries must be ascending positive token positions")
    return tokens, step_no, wanted


async def restore_session(request: web.Request) -> web.Response:
    """``POST /v1/sessions/{id}/restore`` {tokens[, step][, boundaries]} → 200 {length, reason[, boundaries]}:
    fill an empty session's KV cache with the longest cached prefix of ``tokens`` from the snapshot cache.

    On a shard whose numerics depend on step grouping (``step_grouping_matters``: llama.cpp) the prefix ends where
    a step of the cached computation ended, and the reply's ``boundaries`` lists those step ends (up to
    ``length``): the route keeps only a prefix all its nodes restored with the same steps. ``boundaries`` in the
    request (a route repair: the session's step ends) restores only a prefix computed with exactly those steps
    (SnapshotLink.fetch).

    ``length`` 0 when there is no cache, no cached prefix, or the cache fails (the caller recomputes).
    409 session_not_empty when the session already holds tokens; 400 bad_token for ids out of vocabulary,
    bad_request for boundaries that are not ascending positions.
    """
    state: NodeState = request.app[NODE]
    t0 = time.perf_counter()
    tokens, step_no, wanted = _restore_request(await read_json(request))
    session = state.store.get(parse_session_id(request.match_info["sid"]))
    if len(tokens) > session.max_length:
        raise ProtocolError(
            "context_overflow", f"{len(tokens)} tokens exceed the session's max_length {session.max_length}"
        )
    if tokens and not 0 <= min(tokens) <= max(tokens) < state.cfg.n_vocab:
        raise ProtocolError("bad_token", f"token id out of range [0, {state.cfg.n_vocab})")
    async with session.lock:
        if session.length:
            raise ProtocolError(
                "session_not_empty",
                f"session holds {session.length} tokens; restore needs an empty session (truncate to 0 first)",
            )
        snap, n, reason = (
            (None, 0, "no cache configured") if state.snapshots is None else await state.snapshots.fetch(tokens, wanted)
        )
        if snap is not None and snap.state is not None:  # a whole state (llama.cpp), then the shared prefix
            try:
                await asyncio.get_running_loop().run_in_executor(
                    state.pool, state.executor.load_state, session.kv, snap.state, snap.n_tokens
                )
                if n < snap.n_tokens:
                    session.kv.truncate(n)
            except (RuntimeError, ValueError) as exc:  # another build, or --max-sessions (no 0016)
                snap, reason = None, f"snapshot not loadable here: {exc}"
                if session.length:  # loaded but not cut back (a recurrent shard refuses the cut): start empty
                    session.kv.truncate(0)
        elif snap is not None:
            session.kv.load([k[:n] for k in snap.keys], [v[:n] for v in snap.values])
        if snap is not None:
            session.mark_restored(tokens[:n], snap.boundaries)
            state.snapshots.counters["restored"] += 1
            state.snapshots.counters["restored_tokens"] += n
        if step_no is not None:
            state.store.set_step(session, step_no)
    reply = {
        "session_id": str(session.id),
        "length": session.length,
        "reason": reason,
        "ms": round((time.perf_counter() - t0) * 1e3, 3),
    }
    if state.executor.step_grouping_matters:
        reply["boundaries"] = session.boundaries
    return json_response(reply)


__all__ = [
    "MAX_STEP",
    "close_session",
    "next_hop_url",
    "node_url",
    "open_session",
    "renew_session",
    "restore_session",
    "truncate_session",
]
