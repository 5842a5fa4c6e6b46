"""Perplexity with the definition of llama.cpp's ``llama-perplexity`` (``tools/perplexity/perplexity.cpp``)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

import numpy as np


def chunk_nll(logits, tokens: list[int]) -> list[float]:
    """Negative log-likelihoods (nats) of one chunk's scored tokens.

    ``logits`` ``[n_ctx, n_vocab]`` (numpy, or a CPU torch tensor) for the chunk's ``n_ctx`` tokens; scores
    tokens ``first+1 .. n_ctx-1`` from the logits one position before, with ``first = n_ctx // 2``; each NLL is
    ``logsumexp(row) - row[target]`` in float64, as llama-perplexity's ``log_softmax``.
    """
    n_ctx = len(tokens)
    first = n_ctx // 2
    rows = np.asarray(logits[first : n_ctx - 1], dtype=np.float64)
    target = np.asarray(tokens[first + 1 : n_ctx], dtype=np.int64)
    peak = rows.max(axis=1, keepdims=True)
    lse = np.log(np.exp(rows - peak).sum(axis=1)) + peak[:, 0]
    return (lse - rows[np.arange(len(target)), target]).tolist()


def perplexity(
    all_logits: Callable[[list[int]], np.ndarray],
    tokens: list[int],
    n_ctx: int,
    bos_id: int | None,
    max_chunks: int | None = None,
) -> Iterator[tuple[int, float]]:
    """Yield ``(chunks_done, running perplexity)`` per chunk, as ``llama-perplexity`` prints them.

    ``tokens``: the whole text tokenized once (BOS included when the model adds it). It is cut into
    ``len(tokens) // n_ctx`` consecutive chunks; each chunk's first token is replaced by BOS (when
    ``bos_id`` is not None) and run in a fresh context by ``all_logits(chunk) -> [n_ctx, n_vocab]``;
    the second half of each chunk is scored; ``max_chunks`` stops early. Raises ValueError when the
    text has fewer than ``2 * n_ctx`` tokens (llama-perplexity's own requirement).
    """
    if n_ctx < 4:
        raise ValueError(f"ctx size must be at least 4 tokens, got {n_ctx}")
    n_chunks = len(tokens) // n_ctx if max_chunks is None else min(max_chunks, len(tokens) // n_ctx)
    if len(tokens) < 2 * n_ctx:
        raise ValueError(f"need at least {2 * n_ctx} tokens for ctx size {n_ctx}, the text has {len(tokens)}")
    nll, count = 0.0, 0
    for i in range(n_chunks):
        chunk = list(tokens[i * n_ctx : (i + 1) * n_ctx])
        if bos_id is not None:
            chunk[0] = bos_id
        scores = chunk_nll(all_logits(chunk), chunk)
        nll += sum(scores)
        count += len(scores)
        yield i + 1, math.exp(nll / count)
