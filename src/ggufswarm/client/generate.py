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

    def summary(self) -> str:
        """One line for stderr."""
        return (f"prompt tokens: {self.prompt_tokens}, completion tokens: {self.completion_tokens}, "
                f"TTFT: {self.ttft_ms:.1f} ms, prefill: {self.prefill_tok_s:.1f} tok/s, "
                f"decode: {self.decode_tok_s:.1f} tok/s, finish: {self.finish_reason}")


def generate(session: RouteSession, tokenizer: Tokenizer, prompt_ids: list[int], max_tokens: int,
             stop: list[str] | None = None, stats: GenerationStats | None = None) -> Iterator[str]:
    """Yield text deltas of the completion of ``prompt_ids`` (stops at EOG tokens, stop strings, max_tokens).

    ``stats`` (if given) is filled in as generation proceeds; ``stats.tokens`` gets every generated id, the one
    that ended the generation (an end-of-generation token, or the one completing a stop string) included, and
    ``stats.completion_tokens`` counts them all (as OpenAI's ``usage.completion_tokens``).
    """
    stats = stats if stats is not None else GenerationStats()
    stats.prompt_tokens = len(prompt_ids)
    stream = TextStream(tokenizer, stop)
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
        token = session.step([token])
    tail = stream.finish("length")
    if tail:
        yield tail
    stats.finish_reason = stream.finish_reason or "length"
    n_decoded = len(stats.tokens) - 1
    if n_decoded > 0:
        stats.decode_tok_s = n_decoded / max(time.perf_counter() - t_first, 1e-9)
