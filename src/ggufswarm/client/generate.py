"""The generation loop over a route session (async at its core, blocking wrapper), and the in-process route.

``agenerate`` runs a generation as a coroutine on the caller's event loop (an AsyncSession: AsyncRouteSession);
``generate`` runs the same loop for a blocking RouteSession (LocalSession, RemoteSession) in the calling thread,
with no event loop. LocalSession chains shards in this process.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field

import numpy as np

from ..runtime.sampling import SamplingParams
from .contract import AsyncSession, Drafter, RouteSession, SessionWrapper
from .tokenizer import TextStream, Tokenizer


class LocalSession:
    """A session on in-process chained shards (``[0,a) + [a,b) + ... + [z,n)``): one KV cache each (any backend)."""

    def __init__(self, shards: list, max_length: int, sampling: SamplingParams):
        self.shards = shards
        self.kvs = [s.new_session(max_length) for s in shards]
        self.sampler = shards[-1].sampler_class(sampling)  # the head backend's sampler
        self.sampler.bind(shards[-1])
        self.history: list[int] = []
        self.last_logprobs = None  # RouteSession members an in-process session does not report
        self.last_token_logprob: float | None = None
        self.last_tokens: list[int] | None = None

    def logits(self, token_ids: list[int], all_positions: bool = False):
        """Run ids ``[T]`` through every shard; float32 logits ``[1 or T, n_vocab]`` (numpy from a llama.cpp head, a
        torch tensor from a torch one)."""
        x = np.asarray(token_ids, dtype=np.int64)
        for shard, kv in zip(self.shards, self.kvs):
            extra = {"token_ids": token_ids} if getattr(shard, "needs_token_ids", False) else {}  # hash routing
            x = shard.forward(kv, x, logits="all" if all_positions else "last", **extra)
        return x

    @property
    def max_length(self) -> int:
        """Tokens the session may hold."""
        return self.kvs[0].max_length

    @property
    def max_verify_tokens(self) -> int:
        """Most tokens of one ``verify`` step (a llama.cpp head returns at most that many rows of logits)."""
        return self.shards[-1].max_outputs or 16

    def verify(self, token_ids: list[int]) -> list[int]:
        """Feed ``token_ids`` as one step and sample after every position (speculative decoding): the token a
        one-token step would sample after each, ``[len(token_ids)]``. ValueError past ``max_verify_tokens``."""
        base = len(self.history)
        self.history.extend(token_ids)
        try:
            logits = self.logits(token_ids, all_positions=True)
        except BaseException:
            del self.history[base:]
            raise
        return [self.sampler.sample(logits[i], self.history[: base + i + 1]) for i in range(len(token_ids))]

    def drop(self, n: int) -> None:
        """Forget the last ``n`` tokens fed (rejected drafts)."""
        self.truncate(len(self.history) - n)

    def step(self, token_ids: list[int]) -> int:
        """See RouteSession.step. A prompt longer than a shard takes in one call (llama.cpp: ``n_batch``) goes
        in chunks of that size, as a route sends it."""
        limit = max(1, min(s.n_batch or len(token_ids) for s in self.shards))
        for i in range(0, len(token_ids), limit):
            chunk = token_ids[i : i + limit]
            self.history.extend(chunk)
            logits = self.logits(chunk)
        return self.sampler.sample(logits[-1], self.history)

    def truncate(self, length: int) -> None:
        """Roll every shard back to ``length`` tokens."""
        for kv in self.kvs:
            kv.truncate(length)
        del self.history[length:]

    def close(self) -> None:
        """Drop the KV caches (a llama.cpp shard frees the session's sequence)."""
        for kv in self.kvs:
            kv.close()
        self.kvs = []


@dataclass
class GenerationStats:
    """Telemetry of one generation: token counts, TTFT (ms) and throughput (tok/s)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    ttft_ms: float = 0.0
    prefill_tok_s: float = 0.0
    decode_tok_s: float = 0.0
    finish_reason: str = "length"
    tokens: list[int] = field(default_factory=list)
    speculative: str = "none"  # drafting method ("ngram") or "none"
    drafted: int = 0  # tokens drafted and sent for verification
    accepted: int = 0  # drafted tokens the head's samples confirmed
    verify_steps: int = 0  # verify steps sent (each also yields the head's own next token)

    def summary(self) -> str:
        """One line for stderr."""
        line = (
            f"prompt tokens: {self.prompt_tokens}, completion tokens: {self.completion_tokens}, "
            f"TTFT: {self.ttft_ms:.1f} ms, prefill: {self.prefill_tok_s:.1f} tok/s, "
            f"decode: {self.decode_tok_s:.1f} tok/s, finish: {self.finish_reason}"
        )
        if self.speculative != "none":
            rate = f" ({100 * self.accepted / self.drafted:.0f}%)" if self.drafted else ""
            line += (
                f", speculative {self.speculative}: drafted {self.drafted}, accepted {self.accepted}{rate} "
                f"in {self.verify_steps} verify steps"
            )
        return line

    def speculative_summary(self) -> dict:
        """The ``speculative`` telemetry object: method, drafted / accepted tokens, verify steps, acceptance."""
        return {
            "method": self.speculative,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "verify_steps": self.verify_steps,
            "acceptance": round(self.accepted / self.drafted, 4) if self.drafted else None,
        }


class _Blocking(SessionWrapper):
    """A blocking RouteSession seen as an AsyncSession whose coroutines never suspend (``generate`` drives them
    without an event loop)."""

    async def step(self, token_ids: list[int]) -> int:
        return self.session.step(token_ids)

    async def verify(self, token_ids: list[int]) -> list[int]:
        return self.session.verify(token_ids)


def _drive(awaitable):
    """Run an awaitable that never suspends to its result, in this thread (StopAsyncIteration at a generator's
    end passes through). RuntimeError when it does suspend (it awaited something outside its session)."""
    try:
        awaitable.send(None)
    except StopIteration as done:
        return done.value
    awaitable.close()
    raise RuntimeError("a blocking generation awaited an event loop")


def generate(session: RouteSession, *args, **kwargs) -> Iterator[str]:
    """``agenerate`` for a blocking ``session`` (LocalSession, RemoteSession), in the calling thread: the same
    arguments after the session (``tokenizer, prompt_ids, max_tokens, stop, stats, drafter, special``), text
    deltas and errors. The drafter runs in this thread too."""
    return _drive_all(agenerate(_Blocking(session), *args, **kwargs))


def _drive_all(deltas: AsyncIterator[str]) -> Iterator[str]:
    """The items of an async generator that never suspends (``_drive``), in this thread; closed with it."""
    try:
        while True:
            try:
                delta = _drive(deltas.__anext__())
            except StopAsyncIteration:
                return
            yield delta
    finally:
        _drive(deltas.aclose())


async def agenerate(
    session: AsyncSession,
    tokenizer: Tokenizer,
    prompt_ids: list[int],
    max_tokens: int,
    stop: list[str] | None = None,
    stats: GenerationStats | None = None,
    drafter: Drafter | None = None,
    special: bool = False,
) -> AsyncIterator[str]:
    """An async iterator of the text deltas of the completion of ``prompt_ids`` on ``session``, on the running
    loop (stops at EOG tokens, stop strings, max_tokens). Control tokens and media markers are no text unless
    ``special`` (``Tokenizer.token_bytes``).

    ``drafter`` (``client.speculative.NgramDrafter`` or ``ModelDrafter``): speculative decoding. Each decode step
    sends the drafted tokens after the last sampled one as one verify step and keeps what the head confirms
    (``speculative.speculate``): the same tokens as without it, fewer trips through the route; ``stats`` counts
    drafted and accepted tokens. A ``blocking`` drafter (a model) drafts in a worker thread (not for
    ``generate``'s sessions, driven with no event loop: nothing may suspend there).

    ``stats`` (if given) is filled in as generation proceeds; ``stats.tokens`` gets every generated id, the one
    that ended the generation (an end-of-generation token, or the one completing a stop string) included, and
    ``stats.completion_tokens`` counts them all (as OpenAI's ``usage.completion_tokens``).

    Raises what the session's ``step``/``verify`` raise. The session stays open: close it (``await
    session.close()`` in a ``finally``, or ``async with``) also when the task iterating is cancelled.
    """
    stats = stats if stats is not None else GenerationStats()
    stats.prompt_tokens = len(prompt_ids)
    if drafter is not None:
        from .speculative import speculate

        stats.speculative = drafter.method
        history = list(prompt_ids)  # what the drafter looks up: the prompt and every token emitted
        pending: list[int] = []  # tokens a verify step confirmed, not yet emitted
        room = min(session.max_verify_tokens, session.max_length) - 1
        offload = drafter.blocking and not isinstance(session, _Blocking)  # generate: no loop to offload from
    stream = TextStream(tokenizer, stop, special)
    t0 = time.perf_counter()
    token = await session.step(prompt_ids) if max_tokens > 0 else None
    t_first = time.perf_counter()
    if token is not None:  # max_tokens 0: nothing ran, no timings to report
        stats.ttft_ms = (t_first - t0) * 1e3
        stats.prefill_tok_s = len(prompt_ids) / max(t_first - t0, 1e-9)
    while token is not None:
        delta = stream.push(token)
        stats.tokens.append(token)
        stats.completion_tokens = len(stats.tokens)
        if stream.stopped:
            if delta:
                yield delta
            break
        if delta:
            yield delta
        if len(stats.tokens) >= max_tokens:
            break
        if drafter is None:
            token = await session.step([token])
            continue
        history.append(token)
        if pending:
            token = pending.pop(0)
            continue
        # drafts: no more than the tokens still wanted need (a verify step yields one more than it drafts), than
        # the head verifies in one step, or than the session holds
        held = len(prompt_ids) + len(stats.tokens) - 1  # tokens the session holds: all but the last sampled
        cap = min(max_tokens - len(stats.tokens) - 1, room, session.max_length - held - 1)
        if cap <= 0:
            drafts = []
        elif offload:
            drafts = await asyncio.to_thread(drafter.draft, history, cap)
        else:
            drafts = drafter.draft(history, cap)
        if not drafts:
            token = await session.step([token])
            continue
        out = await speculate(session, token, drafts)
        stats.verify_steps += 1
        stats.drafted += len(drafts)
        stats.accepted += len(out) - 1
        token, pending = out[0], out[1:]
    tail = stream.finish("length")
    if tail:
        yield tail
    stats.finish_reason = stream.finish_reason or "length"
    n_decoded = len(stats.tokens) - 1
    if n_decoded > 0:
        stats.decode_tok_s = n_decoded / max(time.perf_counter() - t_first, 1e-9)
