"""Session store of one node: route sessions over one ShardExecutor, with KV budget, idle expiry and step dedup.
Thread-safe bookkeeping; the caller serializes the steps of one session (``Session.lock``), not of different ones.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable

import numpy as np

from .digest import logits_digest
from .kv import ContextOverflow, TokenOutOfRange, check_max_length
from .sampling import SamplingParams, token_logprobs
from .session_state import (
    AdmissionRefused,
    Recent,
    Session,
    SessionClosed,
    SessionError,
    StepConflict,
    StepRecord,
    UnknownSession,
    cut_boundaries,
)

MAX_EVICTED = 1024  # evicted sessions whose reason a node remembers, and closed ones


def _free(session: Session) -> None:
    """Release a dropped session's KV now (a llama.cpp sequence id and its cells; torch frees on GC)."""
    session.kv.close()


class SessionStore:
    """Sessions of one shard (any backend, see ``runtime.backends``) with a KV budget in tokens: ``budget_tokens``,
    the most all open sessions may reserve together (each its ``max_length``); ``ttl_s``: idle seconds after which a
    session is dropped (by ``expire``, also tried before refusing an open)."""

    def __init__(self, executor, budget_tokens: int, ttl_s: float = 300.0):
        self.executor = executor
        self.budget_tokens = budget_tokens
        self.max_session_tokens: int | None = None  # the longest one session may reserve (None: the budget)
        # where KV memory becomes resident only as it is written (a paged node): bytes the machine has available now
        # (None: unknown), and bytes its buffers may still take besides (see open)
        self.memory_available: Callable[[], int | None] | None = None
        self.memory_margin_bytes = 0
        self.ttl_s = ttl_s
        self.sessions: dict[uuid.UUID, Session] = {}
        self.evicted, self.closed = Recent(MAX_EVICTED), Recent(MAX_EVICTED)  # why each evicted one went; closed
        self._lock = threading.Lock()

    # -- bookkeeping -------------------------------------------------------------------------
    @property
    def reserved_tokens(self) -> int:
        """Tokens reserved by open sessions (sum of their max_length)."""
        return sum(s.max_length for s in list(self.sessions.values()))

    @property
    def held_tokens(self) -> int:
        """Tokens actually held in KV caches."""
        return sum(s.kv.length for s in list(self.sessions.values()))

    def free_tokens(self) -> int:
        """Tokens a new session could reserve now (the advertisement's): the budget's unreserved ones, and where
        memory is watched no more than the memory available holds beyond what is committed (``memory``)."""
        free = max(self.budget_tokens - self.reserved_tokens, 0)
        if memory := self.memory():
            free = min(free, max(memory[0] - memory[1], 0) // max(self.kv_bytes_per_token(), 1))
        return free

    def memory(self) -> tuple[int, int] | None:
        """Where memory is watched (``memory_available``): (bytes available on the machine, bytes committed: KV the
        open sessions may still write, their reserved tokens not yet held, + ``memory_margin_bytes``); else None."""
        if (available := self.memory_available() if self.memory_available else None) is None:
            return None
        pending = max(self.reserved_tokens - self.held_tokens, 0) * self.kv_bytes_per_token()
        return available, pending + self.memory_margin_bytes

    def kv_bytes_per_token(self) -> int:
        """KV bytes one token costs on this shard (all its layers, keys and values)."""
        return self.executor.kv_bytes_per_token()

    def open(
        self,
        session_id: uuid.UUID,
        max_length: int,
        next_hop: str | None = None,
        sampling: SamplingParams | None = None,
        wire_dtype: str = "f32",
        n_logprobs: int = 0,
        logprobs: bool = False,
    ) -> Session:
        """Open a session reserving ``max_length`` tokens of the budget. On the head, ``n_logprobs`` (0..20) most
        likely tokens and, with ``logprobs``, the sampled token's logprob come with each sample.

        Raises ContextOverflow (max_length out of 1..model limit), SessionError("session_exists"),
        AdmissionRefused: "kv_budget_too_small" (max_length over the budget or ``max_session_tokens``),
        "kv_budget_full" (other sessions hold the budget or the memory; after expiring idle ones); ValueError for a
        ``logit_bias`` token outside the vocabulary, or a ``grammar`` the head cannot use."""
        check_max_length(max_length, self.executor.cfg.max_length)
        if max_length > self.budget_tokens:
            raise AdmissionRefused(
                f"max_length {max_length} exceeds this node's whole KV budget of {self.budget_tokens} tokens",
                "kv_budget_too_small",
            )
        if self.max_session_tokens is not None and max_length > self.max_session_tokens:
            raise AdmissionRefused(
                f"max_length {max_length} exceeds the longest session this node holds, "
                f"{self.max_session_tokens} tokens (its --ctx-size, within its KV budget of {self.budget_tokens} "
                "tokens and its memory)",
                "kv_budget_too_small",
            )
        if self.executor.spec.head:
            sampler = self.executor.sampler_class(sampling or SamplingParams())
            sampler.check_vocab(self.executor.cfg.n_vocab)
            sampler.bind(self.executor)  # ValueError: a grammar that does not parse
        else:
            sampler = None
        with self._lock:
            if session_id in self.sessions:
                raise SessionError(f"session {session_id} is already open on this node", "session_exists")
            if self.reserved_tokens + max_length > self.budget_tokens:
                self._expire_locked(time.monotonic())
            free = self.budget_tokens - self.reserved_tokens
            if max_length > free:
                raise AdmissionRefused(
                    f"KV budget full: {free} of {self.budget_tokens} tokens free, session asks "
                    f"max_length {max_length}; retry later or ask for less"
                )
            self._check_memory_locked(max_length)
            try:
                kv = self.executor.new_session(max_length)
            except RuntimeError as exc:  # llama.cpp: no free sequence slot, or max_length over its cells
                if getattr(exc, "code", None) in ("kv_budget_full", "kv_budget_too_small"):
                    raise AdmissionRefused(str(exc), exc.code) from None
                raise
            session = Session(session_id, kv, max_length, next_hop, wire_dtype, sampler, n_logprobs, logprobs)
            self.sessions[session_id] = session
        return session

    def _check_memory_locked(self, max_length: int) -> None:
        """AdmissionRefused("kv_budget_full") where memory is watched and ``max_length`` tokens of KV do not fit in
        the memory available beside what is committed (other processes may have taken memory since the start)."""
        if memory := self.memory():
            need = max_length * self.kv_bytes_per_token()
            if memory[1] + need > memory[0]:
                raise AdmissionRefused(
                    f"memory full: {memory[0] >> 20} MiB are available (the machine's, or its GPU's for KV), this "
                    f"node's open sessions and buffers may still take {memory[1] >> 20} MiB, and max_length "
                    f"{max_length} needs {need >> 20} MiB; retry later or ask for less"
                )

    def get(self, session_id: uuid.UUID) -> Session:
        """The open session; UnknownSession when never opened, evicted or expired (SessionClosed: closed lately)."""
        session = self.sessions.get(session_id)
        if session is None:
            raise self._gone(session_id)
        session.last_used = time.monotonic()
        return session

    def close(self, session_id: uuid.UUID) -> Session:
        """Drop a session and its KV cache; UnknownSession (SessionClosed: closed already) if not open."""
        with self._lock:
            if (session := self.sessions.pop(session_id, None)) is not None:
                self.closed.add(session_id)
        if session is None:
            raise self._gone(session_id)
        _free(session)
        return session

    def evict(self, session_id: uuid.UUID, reason: str) -> None:
        """Close an open session for ``reason``: its next step raises UnknownSession saying it. UnknownSession."""
        self.close(session_id)
        self.evicted.add(session_id, reason)

    def _gone(self, session_id: uuid.UUID) -> UnknownSession:
        if reason := self.evicted.get(session_id):
            return UnknownSession(f"session {session_id} was evicted: {reason}")
        if session_id in self.closed:
            return SessionClosed(f"session {session_id} was closed by its client on this node")
        return UnknownSession(f"unknown session {session_id} (never opened on this node, closed, or expired)")

    def credit_stall(self, seconds: float) -> None:
        """Time the node's event loop stalled (``seconds``) is no client's idle time: every idle clock moves on by
        it, or the reaper, first to run after a stall, would drop sessions whose steps wait in the socket."""
        if seconds > 0:
            with self._lock:
                for s in self.sessions.values():
                    s.last_used += seconds

    def expire(self, now: float | None = None) -> list[uuid.UUID]:
        """Drop sessions idle for more than ``ttl_s``, or their own shorter ``lease_s`` (never one in the middle of a
        step); returns their ids."""
        with self._lock:
            return self._expire_locked(time.monotonic() if now is None else now)

    def _expire_locked(self, now: float) -> list[uuid.UUID]:
        dead = [
            sid
            for sid, s in self.sessions.items()
            if not s.busy and not s.stepping and now - s.last_used > min(self.ttl_s, s.lease_s or self.ttl_s)
        ]
        for sid in dead:
            _free(self.sessions.pop(sid))
        return dead

    def truncate(self, session_id: uuid.UUID, length: int) -> Session:
        """Roll a session back to ``length`` tokens (its sampler history too). The step counter is
        kept: the next step is ``last.step + 1`` at position ``length``. ValueError past the end."""
        session = self.get(session_id)
        session.kv.truncate(length)
        del session.history[length:]
        cut_boundaries(session, length)
        session.snapshot_at = min(session.snapshot_at, length)
        if session.last is not None:
            session.last = StepRecord(session.last.step, -1, -1, 0, reply=None)
        return session

    @staticmethod
    def _rewind(session: Session, start: int) -> None:
        """Drop the tokens from ``start`` on (the rejected drafts of the previous step); its recorded step
        boundary moves to ``start``."""
        held = session.kv.length
        session.kv.truncate(start)
        del session.history[start:]
        session.snapshot_at = min(session.snapshot_at, start)
        if (
            session.boundaries
            and session.boundaries[-1] == held
            and (len(session.boundaries) < 2 or session.boundaries[-2] < start)
        ):
            session.boundaries[-1] = start
        else:
            cut_boundaries(session, start)

    @staticmethod
    def set_step(session: Session, step: int) -> None:
        """Make ``step`` the last step applied (the next one is ``step + 1``): after a route repair every
        node of the route, old or new, continues from the same step number. ValueError when negative."""
        if not isinstance(step, int) or isinstance(step, bool) or not 0 <= step < 2**63:
            raise ValueError(f"step must be an integer in [0, 2**63), got {step!r}")
        session.last = StepRecord(step, -1, -1, 0) if step else None

    # -- steps -------------------------------------------------------------------------------
    @staticmethod
    def replay(
        session: Session, step: int, digest: int, start: int, n_tokens: int, rewind: bool = False
    ) -> StepRecord | None:
        """Check a step number against the last one applied: None for the next step (``last.step + 1``) at the
        right position (with ``rewind``, speculative decoding: ``last.start < start <= held``, ``apply`` drops the
        rejected drafts first); the last StepRecord for an identical retry (same number and digest: do not apply).
        Raises StepConflict for a conflicting retry, an older step, a gap, or a wrong start position, and
        ContextOverflow when the step would end past ``max_length`` (before a rewind drops anything)."""
        last = session.last
        expected = 1 if last is None else last.step + 1
        if step == expected:
            held = session.kv.length
            if rewind and start < held and (last is None or start <= last.start or last.n_tokens < 1):
                raise StepConflict(
                    f"step {step} rewinds to position {start}: a rewind stays inside the previous "
                    f"step (positions {(last.start + 1) if last else held}..{held})",
                    "position_mismatch",
                )
            if start != held and not (rewind and start < held):
                raise StepConflict(
                    f"step {step} starts at position {start}; the session holds {session.kv.length} tokens",
                    "position_mismatch",
                )
            if start + n_tokens > session.max_length:  # before a rewind drops anything: a refused step loses nothing
                raise ContextOverflow(
                    f"step {step} ends at position {start + n_tokens}; the session's max_length is {session.max_length}"
                )
            return None
        if last is not None and step == last.step:
            if digest == last.digest and start == last.start and n_tokens == last.n_tokens:
                return last
            raise StepConflict(
                f"step {step} was already applied with different content; "
                f"steps are never applied twice (next step is {expected})",
                "step_conflict",
            )
        if step < expected:
            raise StepConflict(f"step {step} is older than the last step applied ({expected - 1})", "stale_step")
        raise StepConflict(f"step {step} skips ahead; the next step of this session is {expected}", "step_gap")

    def _check_token_ids(self, token_ids: np.ndarray | None) -> None:
        n_vocab = self.executor.cfg.n_vocab
        if token_ids is not None and token_ids.size and (int(token_ids.min()) < 0 or int(token_ids.max()) >= n_vocab):
            raise TokenOutOfRange(f"token id out of range [0, {n_vocab}) in the frame's token-id trailer")

    def _ids(self, token_ids: np.ndarray | None) -> dict:
        """``{"token_ids": ...}`` for an executor whose graph reads token ids with hidden states (``needs_token_ids``:
        the llama.cpp backend's DeepSeek-V4 shards), else ``{}``."""
        return {"token_ids": token_ids} if self.executor.needs_token_ids else {}

    def _begin(self, session: Session, start: int) -> tuple:
        """Before a step's forward pass: drop a rewound step's rejected drafts (``start`` below the tokens held, see
        ``apply``); (KV length, history length, history_complete) to restore on an error."""
        if start < session.kv.length:
            self._rewind(session, start)
        return session.kv.length, len(session.history), session.history_complete

    def apply(
        self,
        session: Session,
        step: int,
        digest: int,
        start: int,
        inputs: np.ndarray,
        token_ids: np.ndarray | None,
        sample: bool = True,
        verify: bool = False,
    ) -> StepRecord:
        """Run one step (blocking; call off the event loop) and record it as the session's last step.

        A ``start`` below the tokens held (a rewind ``replay`` allowed) first drops the tokens from ``start`` on: the
        previous step's rejected drafts; the step boundary that step recorded moves to ``start`` (the kept tokens
        count as the previous step). ``verify`` (head): sample after every position, not only the last
        (``record.tokens``; the draw after position ``p`` sees the history up to ``p`` and is keyed by ``p + 1``,
        exactly as in a one-token step there).

        ``inputs``: int64 ids ``[T]`` (embedding shard) or float32 hidden ``[T, n_embd]`` (numpy);
        ``token_ids``: the route's input ids ``[T]`` (the head's sampler history), may be None.
        Raises ContextOverflow / ValueError from the executor, and TokenOutOfRange when a
        ``token_ids`` entry is outside ``[0, n_vocab)``; on any error the KV cache and the session's
        history are unchanged (but for the rejected drafts a rewind dropped: a retry starts where they were).
        """
        self._check_token_ids(token_ids)
        session.busy += 1
        try:
            t0 = time.perf_counter()
            kept = self._begin(session, start)
            all_rows = self.executor.spec.head and verify and sample
            out = self.executor.forward(
                session.kv, inputs, logits="all" if all_rows else "last", **self._ids(token_ids)
            )
            record = self._finish(session, step, digest, start, inputs, token_ids, sample, out, kept, 0.0, all_rows)
            record.compute_ms = (time.perf_counter() - t0) * 1e3
            return record
        finally:
            session.busy -= 1
            session.last_used = time.monotonic()

    def apply_chunked(
        self,
        session: Session,
        step: int,
        digest: int,
        start: int,
        inputs: np.ndarray,
        token_ids: np.ndarray | None,
        sample: bool = True,
        chunk: int = 512,
    ):
        """``apply`` as a generator that runs the forward pass in pieces of ``chunk`` tokens and yields (None)
        between pieces, so a scheduler can run other sessions' steps in between; its return value
        (``StopIteration.value``) is the StepRecord. Each ``next()`` blocks (call off the event loop).

        With ``chunk`` = the llama.cpp backend's ``n_ubatch`` the pieces are exactly the ubatches llama.cpp
        would split the whole step into, so the result is bitwise the one of ``apply``. ``compute_ms`` is the
        sum of the pieces' times. Raises as ``apply``; on an error (or ``close()`` before the end) the KV
        cache and history are as before the step (a recurrent shard's session restarts empty, see ``_undo``).
        """
        self._check_token_ids(token_ids)
        if chunk < 1:
            raise ValueError(f"chunk must be at least 1 token, got {chunk}")
        session.busy += 1
        try:
            kept = self._begin(session, start)
            outs, ms = [], 0.0
            try:
                for a in range(0, int(inputs.shape[0]), chunk):
                    if a:
                        yield None
                    t0 = time.perf_counter()
                    outs.append(
                        self.executor.forward(
                            session.kv,
                            inputs[a : a + chunk],
                            **self._ids(None if token_ids is None else token_ids[a : a + chunk]),
                        )
                    )
                    ms += (time.perf_counter() - t0) * 1e3
            except BaseException:
                # a session closed between two pieces has given its cells (and sequence id) back: nothing to undo
                if session.kv.length != kept[0] and not session.kv.closed:
                    self._undo(session, kept)
                raise
            out = outs[-1] if self.executor.spec.head else np.concatenate(outs)
            return self._finish(session, step, digest, start, inputs, token_ids, sample, out, kept, ms)
        finally:
            session.busy -= 1
            session.last_used = time.monotonic()

    def apply_batch(self, items: list[tuple]) -> list[StepRecord | Exception]:
        """Run one step of each of several different sessions together (blocking; call off the event loop):
        the executor's ``forward_batch`` (llama.cpp: one ``llama_decode`` for the single-token steps).

        ``items``: ``(session, step, digest, start, inputs, token_ids, sample)`` as ``apply``'s arguments (no verify
        steps: those run alone). Returns one entry per item, in order: its StepRecord, or the exception it raised
        (the same errors as ``apply``; one session's error leaves the others' steps applied and its own KV and
        history as before). ``compute_ms`` of each record is the whole batch's time. ValueError when two items
        share a session.
        """
        if len({id(it[0]) for it in items}) != len(items):
            raise ValueError("apply_batch takes at most one step per session")
        results: list = [None] * len(items)
        todo, kept = [], {}
        for i, (session, _step, _digest, start, _inputs, token_ids, _sample) in enumerate(items):
            try:
                self._check_token_ids(token_ids)
                kept[i] = self._begin(session, start)
            except Exception as exc:
                results[i] = exc
                continue
            todo.append(i)
            session.busy += 1
        try:
            t0 = time.perf_counter()
            outs = self.executor.forward_batch(
                [(items[i][0].kv, items[i][4], *self._ids(items[i][5]).values()) for i in todo]
            )
            ms = (time.perf_counter() - t0) * 1e3
            for i, out in zip(todo, outs):
                if isinstance(out, Exception):
                    results[i] = out
                    continue
                session, step, digest, start, inputs, token_ids, sample = items[i]
                try:
                    results[i] = self._finish(session, step, digest, start, inputs, token_ids, sample, out, kept[i], ms)
                    results[i].batch_size = len(todo)
                except Exception as exc:
                    results[i] = exc
        finally:
            for i in todo:
                items[i][0].busy -= 1
                items[i][0].last_used = time.monotonic()
        return results

    @staticmethod
    def _undo(session: Session, kept: tuple) -> None:
        """Return a session to ``kept`` (KV length, history length, history_complete) after a failed step. A
        recurrent shard that holds no exact state there (it cannot truncate partway) restarts the session empty."""
        try:
            session.kv.truncate(kept[0])
        except RuntimeError:  # a recurrent shard holding no state at kept[0]: the session restarts empty
            session.kv.truncate(0)
            kept = (0, 0, True)
            cut_boundaries(session, 0)
            session.snapshot_at = 0
        del session.history[kept[1] :]
        session.history_complete = kept[2]

    def _finish(
        self,
        session: Session,
        step: int,
        digest: int,
        start: int,
        inputs: np.ndarray,
        token_ids: np.ndarray | None,
        sample: bool,
        out,
        kept: tuple,
        compute_ms: float,
        all_rows: bool = False,
    ) -> StepRecord:
        """Record a step whose forward pass gave ``out``: history, the head's sample (``all_rows``: a verify step's
        sample after every position), the session's last step. ``kept``: (KV length, history length,
        history_complete) before the step, restored on an error."""
        record = StepRecord(step, digest, start, inputs.shape[0])
        try:
            ids = token_ids if token_ids is not None else (inputs if inputs.ndim == 1 else None)
            if ids is not None:
                session.history.extend(ids.tolist())
            else:
                session.history_complete = False
            if self.executor.spec.head:
                if all_rows:
                    base = kept[1]
                    record.tokens = [
                        session.sampler.sample(out[i], session.history[: base + i + 1]) for i in range(out.shape[0])
                    ]
                    record.token = record.tokens[-1]
                elif sample:
                    logits = out[-1]
                    record.token = session.sampler.sample(logits, session.history)
                    if session.n_logprobs or session.want_logprob:
                        lp, top = token_logprobs(logits, record.token, session.n_logprobs)
                        record.logprobs = top if session.n_logprobs else None
                        record.token_logprob = lp if session.want_logprob else None
                if session.commit:  # the rows computed (a verify step's all, else the last) and the draws
                    drawn = record.tokens or ([] if record.token is None else [record.token])
                    record.out_digest = logits_digest(out if all_rows else out[-1:], drawn)
            else:
                record.output = out
        except BaseException:  # a step that fails after the forward pass leaves the session as it was
            self._undo(session, kept)
            raise
        record.compute_ms = compute_ms
        if not session.grouping_cut:
            session.boundaries.append(session.kv.length)
        session.last = record
        return record


__all__ = [
    "AdmissionRefused",
    "ContextOverflow",
    "Session",
    "SessionError",
    "SessionStore",
    "StepConflict",
    "StepRecord",
    "UnknownSession",
    "cut_boundaries",
]
