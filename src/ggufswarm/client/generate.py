"""Generation loop over a route session, and the in-process route (chained shards in one process)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator, Protocol

import numpy as np

from ..runtime.sampling import SamplingParams
from .tokenizer import TextStream, Tokenizer


class RouteSession(Protocol):
    """A session on a route: feeds token ids in, gets the head's sampled token id out."""

    def step(self, token_ids: list[int]) -> int:
        """Prefill (several ids) or decode (one id) through the whole route; returns the next token id."""

    def close(self) -> None:
        """Release the session's KV cache on every shard."""


class LocalSession:
    """A session on in-process chained shards (``[0,a) + [a,b) + ... + [z,n)``): one KV cache each (any backend)."""

    def __init__(self, shards: list, max_length: int, sampling: SamplingParams):
        self.shards = shards
        self.kvs = [s.new_session(max_length) for s in shards]
        self.sampler = shards[-1].sampler_class(sampling)  # the head backend's sampler
        self.sampler.bind(shards[-1])
        self.history: list[int] = []

    def logits(self, token_ids: list[int], all_positions: bool = False):
        """Run ids ``[T]`` through every shard; float32 logits ``[1 or T, n_vocab]`` (numpy from a llama.cpp head, a
        torch tensor from a torch one)."""
        x = np.asarray(token_ids, dtype=np.int64)
        for shard, kv in zip(self.shards, self.kvs):
            x = shard.forward(kv, x, logits="all" if all_positions else "last")
        return x

    @property
    def max_length(self) -> int:
        """Tokens the session may hold."""
        return self.kvs[0].max_length

    @property
    def max_verify_tokens(self) -> int:
        """Most tokens of one ``verify`` step (a llama.cpp head returns at most that many rows of logits)."""
        return getattr(self.shards[-1], "max_outputs", None) or 16

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
        return [self.sampler.sample(logits[i], self.history[:base + i + 1]) for i in range(len(token_ids))]

    def drop(self, n: int) -> None:
        """Forget the last ``n`` tokens fed (rejected drafts)."""
        self.truncate(len(self.history) - n)

    def step(self, token_ids: list[int]) -> int:
        """See RouteSession.step. A prompt longer than a shard takes in one call (llama.cpp: ``n_batch``) goes
        in chunks of that size, as a route sends it."""
        limit = max(1, min(getattr(s, "n_batch", None) or len(token_ids) for s in self.shards))
        for i in range(0, len(token_ids), limit):
            chunk = token_ids[i:i + limit]
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
            if hasattr(kv, "close"):
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
    drafted: int = 0           # tokens drafted and sent for verification
    accepted: int = 0          # drafted tokens the head's samples confirmed
    verify_steps: int = 0      # verify steps sent (each also yields the head's own next token)

    def summary(self) -> str:
        """One line for stderr."""
        line = (f"prompt tokens: {self.prompt_tokens}, completion tokens: {self.completion_tokens}, "
                f"TTFT: {self.ttft_ms:.1f} ms, prefill: {self.prefill_tok_s:.1f} tok/s, "
                f"decode: {self.decode_tok_s:.1f} tok/s, finish: {self.finish_reason}")
        if self.speculative != "none":
            rate = f" ({100 * self.accepted / self.drafted:.0f}%)" if self.drafted else ""
            line += (f", speculative {self.speculative}: drafted {self.drafted}, accepted {self.accepted}{rate} "
                     f"in {self.verify_steps} verify steps")
        return line

    def speculative_summary(self) -> dict:
        """The ``speculative`` telemetry object: method, drafted / accepted tokens, verify steps, acceptance."""
        return {"method": self.speculative, "drafted": self.drafted, "accepted": self.accepted,
                "verify_steps": self.verify_steps,
                "acceptance": round(self.accepted / self.drafted, 4) if self.drafted else None}


def generate(session: RouteSession, tokenizer: Tokenizer, prompt_ids: list[int], max_tokens: int,
             stop: list[str] | None = None, stats: GenerationStats | None = None, drafter=None,
             special: bool = False) -> Iterator[str]:
    """Yield text deltas of the completion of ``prompt_ids`` (stops at EOG tokens, stop strings, max_tokens).
    Control tokens and media markers are no text unless ``special`` (``Tokenizer.token_bytes``).

    ``drafter`` (``client.speculative.NgramDrafter`` or ``ModelDrafter``; the session then needs ``verify``, ``drop`` and
    ``max_verify_tokens``): speculative decoding. Each decode step sends the drafted tokens after the last
    sampled one as one verify step and keeps what the head confirms (``speculative.speculate``): the same tokens
    as without it, fewer trips through the route; ``stats`` counts drafted and accepted tokens.

    ``stats`` (if given) is filled in as generation proceeds; ``stats.tokens`` gets every generated id, the one
    that ended the generation (an end-of-generation token, or the one completing a stop string) included, and
    ``stats.completion_tokens`` counts them all (as OpenAI's ``usage.completion_tokens``).
    """
    stats = stats if stats is not None else GenerationStats()
    stats.prompt_tokens = len(prompt_ids)
    if drafter is not None:
        from .speculative import speculate
        stats.speculative = getattr(drafter, "method", "ngram")
        history = list(prompt_ids)  # what the drafter looks up: the prompt and every token emitted
        pending: list[int] = []     # tokens a verify step confirmed, not yet emitted
        room = min(getattr(session, "max_verify_tokens", 1), getattr(session, "max_length", 1 << 31)) - 1
    stream = TextStream(tokenizer, stop, special)
    t0 = time.perf_counter()
    token = session.step(prompt_ids) if max_tokens > 0 else None
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
            token = session.step([token])
            continue
        history.append(token)
        if pending:
            token = pending.pop(0)
            continue
        # drafts: no more than the tokens still wanted need (a verify step yields one more than it drafts), than
        # the head verifies in one step, or than the session holds
        held = len(prompt_ids) + len(stats.tokens) - 1  # tokens the session holds: all but the last sampled
        cap = min(max_tokens - len(stats.tokens) - 1, room, getattr(session, "max_length", 1 << 31) - held - 1)
        drafts = drafter.draft(history, cap) if cap > 0 else []
        if not drafts:
            token = session.step([token])
            continue
        out = speculate(session, token, drafts)
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
