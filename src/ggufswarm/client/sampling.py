"""Token sampling from logits: greedy, temperature, top-k, top-p, min-p, repetition penalty, seeded.

The order follows llama.cpp's default sampler chain (``common/sampling.cpp``): penalties →
top-k → top-p → min-p → temperature → draw.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

import torch


_FLOAT_MAX = torch.finfo(torch.float64).max
_F32_MAX = torch.finfo(torch.float32).max


@dataclass(frozen=True)
class SamplingParams:
    """Sampling settings of one session. ``temperature <= 0`` means greedy (argmax).

    ``top_k = 0``, ``top_p = 1``, ``min_p = 0`` and ``repeat_penalty = 1`` disable those filters;
    ``repeat_last_n`` is the window (tokens) the penalty looks back over (0 = no penalty, as llama.cpp).
    ``seed = None`` draws from a random seed.
    """

    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    seed: int | None = None

    def validate(self) -> "SamplingParams":
        """ValueError naming the first setting of the wrong type or out of range."""
        for name in ("temperature", "top_p", "min_p", "repeat_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
                raise ValueError(f"{name} must be a number, got {value!r}")
            if isinstance(value, int) and abs(value) > _FLOAT_MAX:  # it is used as a float when sampling
                raise ValueError(f"{name} must be within the float range, got an integer of {len(str(value))} digits")
        for name in ("top_k", "repeat_last_n"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**31:
                raise ValueError(f"{name} must be an integer in [0, 2^31), got {value!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not 0 <= self.seed < 2**63):
            raise ValueError(f"seed must be an integer in [0, 2^63), got {self.seed!r}")
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not self.repeat_penalty > 0:
            raise ValueError(f"repeat_penalty must be > 0, got {self.repeat_penalty}")
        return self

    def to_dict(self) -> dict:
        """JSON-ready settings."""
        return asdict(self)


class Sampler:
    """Draws token ids for one session. Each draw's randomness is keyed by (seed, position): the same
    seed gives the same tokens, also after a route repair hands the session to a new head node."""

    def __init__(self, params: SamplingParams):
        """ValueError (from ``SamplingParams.validate``) for settings of the wrong type or out of range."""
        params = params.validate()
        # as floats: torch takes a Python int scalar as int64, and larger ones (temperature 2**64) overflow
        self.params = replace(params, **{name: float(getattr(params, name))
                                         for name in ("temperature", "top_p", "min_p", "repeat_penalty")})
        self.seed = params.seed if params.seed is not None else int(torch.randint(0, 2 ** 62, (1,)))
        self.generator = torch.Generator()

    def sample(self, logits: torch.Tensor, history: list[int] | None = None) -> int:
        """One token id from float32 logits ``[n_vocab]``; ``history`` = previous token ids (for the penalty)."""
        p = self.params
        logits = logits.float()
        if p.repeat_penalty != 1.0 and history and p.repeat_last_n > 0:  # llama.cpp: penalty_last_n 0 = off
            # llama.cpp penalties: positive logits divided, negative multiplied (CTRL paper, arXiv:1909.05858)
            logits = logits.clone()
            ids = torch.tensor(sorted(set(history[-p.repeat_last_n:])), dtype=torch.long)
            vals = logits[ids]
            penalized = torch.where(vals > 0, vals / p.repeat_penalty, vals * p.repeat_penalty)
            # an extreme penalty overflows (x / 1e-300, 0 * inf): keep the logits finite
            logits[ids] = penalized.nan_to_num(nan=0.0, posinf=_F32_MAX, neginf=-_F32_MAX)
        if p.temperature <= 0:
            return int(torch.argmax(logits))
        k = p.top_k if 0 < p.top_k < logits.numel() else logits.numel()
        values, ids = torch.topk(logits, k)  # sorted descending
        probs = torch.softmax(values, dim=-1)
        keep = torch.ones_like(values, dtype=torch.bool)
        if p.top_p < 1.0:
            cum = torch.cumsum(probs, dim=-1)
            keep &= (cum - probs) < p.top_p  # keep the smallest prefix reaching top_p (at least one)
        if p.min_p > 0.0:
            keep &= probs >= p.min_p * probs[0]
        keep[0] = True
        values, ids = values[keep], ids[keep]
        scaled = values / p.temperature
        if not bool(torch.isfinite(scaled).all()):  # a tiny temperature overflows (or rounds to 0 in float32):
            scaled = (values.double() - float(values[0])) / p.temperature  # softmax is shift-invariant
        probs = torch.softmax(scaled, dim=-1)
        position = len(history) if history else 0
        self.generator.manual_seed((self.seed * 1_000_003 + position) % 2 ** 63)
        return int(ids[torch.multinomial(probs, 1, generator=self.generator)])


def top_logprobs(logits: torch.Tensor, n: int) -> list[tuple[int, float]]:
    """The ``n`` most likely token ids with their natural-log probabilities, from logits ``[n_vocab]``."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    values, ids = torch.topk(logp, n)
    return [(int(i), float(v)) for i, v in zip(ids, values)]
