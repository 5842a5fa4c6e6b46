"""llama-server's ``timings`` object of a generation, from the gateway's own clock: prompt time is the time to the
first token (route session open to first sample: prefill and the first draw), predicted time runs from the first
token to the latest one, and, as llama-server, the first token is counted in ``predicted_n`` but not in the rates
(it comes from the prompt's last batch)."""

from __future__ import annotations

import time

from ..client.generate import GenerationStats


class Clock:
    """Reads a running generation's ``timings`` (its GenerationStats, filled in as it goes)."""

    def __init__(self, stats: GenerationStats):
        self.stats = stats
        self._first: float | None = None  # time.perf_counter() when the first token was seen

    def seen(self) -> float:
        """Note the time of the first token once it is there (call at each token); ``time.perf_counter()`` now."""
        now = time.perf_counter()
        if self._first is None and self.stats.completion_tokens:
            self._first = now
        return now

    def read(self) -> dict:
        """``{"prompt_n", "prompt_ms", "prompt_per_token_ms", "prompt_per_second", "predicted_n", "predicted_ms",
        "predicted_per_token_ms", "predicted_per_second"}`` now (ms, tokens per second; a rate whose divisor is
        not known yet is 0, as llama-server)."""
        now = self.seen()
        n = self.stats.completion_tokens
        predicted_ms = (now - self._first) * 1e3 if self._first is not None else 0.0
        prompt_n, prompt_ms = self.stats.prompt_tokens, self.stats.ttft_ms
        steps = max(n - 1, 0)  # decode steps after the first token
        return {
            "prompt_n": prompt_n,
            "prompt_ms": prompt_ms,
            "prompt_per_token_ms": prompt_ms / prompt_n if prompt_n else 0.0,
            "prompt_per_second": prompt_n * 1e3 / prompt_ms if prompt_ms > 0 else 0.0,
            "predicted_n": n,
            "predicted_ms": predicted_ms,
            "predicted_per_token_ms": predicted_ms / steps if steps else 0.0,
            "predicted_per_second": steps * 1e3 / predicted_ms if predicted_ms > 0 else 0.0,
        }


def combined(timings: list[dict]) -> dict:
    """The ``timings`` of a body of several choices (n > 1): the prompt's (read once, choice 0's), ``predicted_n``
    summed over the choices, ``predicted_ms`` the longest choice's (they run at once), rates over those."""
    if len(timings) == 1:
        return timings[0]
    n = sum(t["predicted_n"] for t in timings)
    ms = max(t["predicted_ms"] for t in timings)
    steps = sum(max(t["predicted_n"] - 1, 0) for t in timings)
    return {
        **timings[0],
        "predicted_n": n,
        "predicted_ms": ms,
        "predicted_per_token_ms": ms / steps if steps else 0.0,
        "predicted_per_second": steps * 1e3 / ms if ms > 0 else 0.0,
    }


__all__ = ["Clock", "combined"]
