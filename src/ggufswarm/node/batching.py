"""Cross-session step scheduler of a llama.cpp node: steps of different sessions that arrive while the shard is
busy run together, and long prefills yield to decode steps between their ubatches.

No waiting window: a step that finds the shard idle starts at once. Queued decode steps run as one batch
(``SessionStore.apply_batch``), the oldest queued prefill one ``n_ubatch`` piece at a time
(``SessionStore.apply_chunked``), alternating when both wait. Why, and what stays bitwise: docs/protocol.md,
"How a node schedules steps"."""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass, field

from ..runtime.session_state import StepRecord
from ..runtime.sessions import SessionStore


@dataclass
class _Job:
    args: tuple  # SessionStore.apply's arguments
    future: asyncio.Future
    pieces: object = None  # prefill: the apply_chunked generator once started
    n_tokens: int = field(default=0)


class StepBatcher:
    """Schedules one shard's steps (see the module docstring). ``store``: the node's SessionStore over a shard
    backend that ``supports_batch`` and declares its ``step_lock`` and ``n_ubatch`` (llama.cpp); ``pool``: the worker
    threads that run jobs.

    ``submit`` is called on the event loop; counters (``batches``, ``batched_steps``, ``largest_batch``,
    ``prefill_pieces``) are for /health.
    """

    def __init__(self, store: SessionStore, pool):
        self.store = store
        self.pool = pool
        self.lock = store.executor.step_lock
        self.chunk = store.executor.n_ubatch
        self.decodes: deque[_Job] = deque()
        self.prefills: deque[_Job] = deque()
        self.running = False
        self.last_was_decode = False
        self.batches = self.batched_steps = self.largest_batch = self.prefill_pieces = 0

    def counters(self) -> dict:
        return {
            "batches": self.batches,
            "batched_steps": self.batched_steps,
            "largest_batch": self.largest_batch,
            # ubatches of the shared decodes (llama.cpp splits a batch: exact mode, only consecutive sequence ids)
            "ubatches": self.store.executor.decode_ubatches,
            "largest_ubatch": self.store.executor.largest_ubatch,
            "stream_copies": self.store.executor.stream_copies,  # exact mode: sessions moved to consecutive ids
            "prefill_pieces": self.prefill_pieces,
            "queued": len(self.decodes) + len(self.prefills),
        }

    def submit(self, args: tuple, alone: bool, more: bool = False) -> StepRecord | asyncio.Future:
        """Schedule one step (``SessionStore.apply``'s arguments). ``alone``: no other session has a step in flight
        on this node; ``more``: other steps have been read and are about to be submitted (in this turn of the event
        loop): an idle shard then starts after them, so that they share the first batch. Returns the StepRecord when
        it ran inline (an idle shard, a lone decode step), else an asyncio.Future of it (raising what the step
        raised)."""
        n_tokens = int(args[4].shape[0])
        idle = not self.running and not self.decodes and not self.prefills
        if idle and alone and n_tokens == 1 and self.lock.acquire(blocking=False):
            # as before batching: one short step on the loop beats the hand-off to a worker and back; with other
            # sessions active the step goes to a worker so the loop can gather the steps arriving meanwhile
            try:
                return self.store.apply(*args)
            finally:
                self.lock.release()
        job = _Job(args, asyncio.get_running_loop().create_future(), n_tokens=n_tokens)
        (self.decodes if n_tokens == 1 else self.prefills).append(job)
        if not self.running:
            if more:  # the steps read with this one queue first (their tasks run before call_soon's callback)
                self.running = True
                job.future.get_loop().call_soon(self._start)
            else:
                self._next()
        return job.future

    def _start(self) -> None:
        self.running = False
        self._next()

    def _next(self) -> None:
        """Start the next job in a worker (on the event loop), or mark the shard idle."""
        if not self.decodes and not self.prefills:
            self.running = False
            return
        self.running = True
        loop = asyncio.get_running_loop()
        if self.prefills and (not self.decodes or self.last_was_decode):
            job = self.prefills[0]
            self.last_was_decode = False
            done = loop.run_in_executor(self.pool, self._piece, job)
            done.add_done_callback(lambda f: self._piece_done(job, f))
        else:
            jobs, seen, later = [], set(), deque()
            for job in self.decodes:  # one step per session (a retry after a cancelled wait could queue a second)
                (later if id(job.args[0]) in seen else jobs).append(job)
                seen.add(id(job.args[0]))
            self.decodes = later
            self.last_was_decode = True
            done = loop.run_in_executor(self.pool, self._batch, jobs)
            done.add_done_callback(lambda f: self._batch_done(jobs, f))

    # -- decode batches --------------------------------------------------------------------------
    def _batch(self, jobs: list[_Job]) -> list:
        if len(jobs) == 1:
            try:
                return [self.store.apply(*jobs[0].args)]
            except Exception as exc:
                return [exc]
        return self.store.apply_batch([j.args for j in jobs])

    def _batch_done(self, jobs: list[_Job], done: asyncio.Future) -> None:
        try:
            results = done.result()
        except BaseException as exc:
            results = [exc] * len(jobs)
        if len(jobs) > 1:
            self.batches += 1
            self.batched_steps += len(jobs)
            self.largest_batch = max(self.largest_batch, len(jobs))
        for job, result in zip(jobs, results):
            _resolve(job.future, result)
        self._next()

    # -- prefill pieces ----------------------------------------------------------------------------
    def _piece(self, job: _Job):
        """Run the next piece of a prefill: (finished, record or exception)."""
        try:
            if job.pieces is None:
                job.pieces = self.store.apply_chunked(*job.args, chunk=self.chunk)
            next(job.pieces)
            return False, None
        except StopIteration as stop:
            return True, stop.value
        except Exception as exc:
            return True, exc

    def _piece_done(self, job: _Job, done: asyncio.Future) -> None:
        self.prefill_pieces += 1
        try:
            finished, result = done.result()
        except BaseException as exc:
            finished, result = True, exc
        if finished:
            self.prefills.remove(job)
            _resolve(job.future, result)
        self._next()


def _resolve(future: asyncio.Future, result) -> None:
    if future.done():  # its waiter was cancelled
        return
    if isinstance(result, BaseException):
        future.set_exception(result)
    else:
        future.set_result(result)
