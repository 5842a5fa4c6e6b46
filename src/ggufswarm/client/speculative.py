"""Speculative decoding across a route: draft tokens on the client, verify them in one step through the route.

The last sampled token and ``k`` drafts go as one ``(k + 1)``-token verify step (``FLAG_VERIFY``); the head samples
after every position as one-token steps would, the client keeps the drafts the head's samples agree with, and the
next step drops the rest (``FLAG_REWIND``). The output is plain decoding's, token for token, while the verify step
computes the rows bitwise (hence the default ``draft_max`` of 2). Drafting is prompt lookup (``NgramDrafter``) or a
small model of the same vocabulary (client/draft_model.py). Why, and what was measured: docs/protocol.md,
"Speculative decoding"."""

from __future__ import annotations

MAX_DRAFT = 15  # most drafted tokens per verify step (a llama.cpp head returns at most 16 rows of logits per step)
DEFAULT_DRAFT_MAX = 2  # k + 1 = 3 tokens per verify step: bitwise one-token numerics on llama.cpp (see above)
METHODS = ("none", "ngram", "draft")


def check_draft_max(k: int) -> int:
    """``k`` when it is an int in 1..MAX_DRAFT; ValueError naming the range otherwise."""
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_DRAFT:
        raise ValueError(f"draft_max must be an integer in 1..{MAX_DRAFT} (tokens drafted per verify step), got {k!r}")
    return k


class NgramDrafter:
    """Prompt-lookup drafting over a growing token history.

    ``draft(history, cap)`` matches the last ``n`` tokens of ``history`` (``n`` from ``max_ngram`` down to
    ``min_ngram``) against their most recent earlier occurrence and proposes the up to ``min(k, cap)`` tokens
    that followed it; ``[]`` when nothing matches. ``history`` must only grow between calls (it is indexed
    incrementally: O(new tokens x max_ngram) per call). Raises ValueError for ``k`` outside 1..MAX_DRAFT.
    """

    method = "ngram"
    blocking = False  # a dict lookup per call: drafted on the event loop

    def __init__(self, k: int = DEFAULT_DRAFT_MAX, max_ngram: int = 3, min_ngram: int = 1):
        self.k = check_draft_max(k)
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self._index: dict[tuple[int, ...], int] = {}  # n-gram -> position of the token that last followed it
        self._done = 0  # positions indexed: every n-gram ending before this position

    def draft(self, history: list[int], cap: int | None = None) -> list[int]:
        """Up to ``min(k, cap)`` drafted continuations of ``history`` (token ids)."""
        limit = self.k if cap is None else min(self.k, cap)
        if limit <= 0:
            return []
        end = len(history)
        if end < self._done:
            raise ValueError("the history shrank: a drafter serves one growing sequence")
        for pos in range(max(self._done, 1), end):  # the n-grams ending just before pos, followed by history[pos]
            for n in range(self.min_ngram, min(self.max_ngram, pos) + 1):
                self._index[tuple(history[pos - n : pos])] = pos
        self._done = max(self._done, end)
        for n in range(min(self.max_ngram, end), self.min_ngram - 1, -1):
            at = self._index.get(tuple(history[end - n :]))
            if at is not None:
                return list(history[at : at + limit])
        return []


def same_vocabulary(a: dict, b: dict) -> bool:
    """Whether two GGUF metadata dicts hold the same vocabulary (``tokenizer.ggml.tokens``, in order)."""
    ta, tb = a.get("tokenizer.ggml.tokens"), b.get("tokenizer.ggml.tokens")
    return bool(ta) and list(ta) == list(tb or [])


async def speculate(session, token: int, drafts: list[int]) -> list[int]:
    """Verify ``drafts`` after ``token`` (the last sampled token, not yet fed) in one step of ``session`` (an
    AsyncSession, client/contract.py: ``verify`` and ``drop``): the accepted drafts and the head's next token,
    ``1..len(drafts) + 1`` ids, each one the token a one-token step would have sampled there. The rejected
    drafts are dropped from the session (``drop``)."""
    samples = await session.verify([token] + drafts)
    n = 0
    while n < len(drafts) and drafts[n] == samples[n]:
        n += 1
    if n < len(drafts):
        session.drop(len(drafts) - n)
    return samples[: n + 1]


__all__ = [
    "DEFAULT_DRAFT_MAX",
    "MAX_DRAFT",
    "METHODS",
    "NgramDrafter",
    "check_draft_max",
    "same_vocabulary",
    "speculate",
]
