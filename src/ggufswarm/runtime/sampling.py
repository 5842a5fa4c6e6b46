"""Token sampling from logits: greedy, temperature, top-k, top-p, min-p, logit bias, repetition, presence and
frequency penalties, seeded.

The order follows llama.cpp's default sampler chain (``common/sampling.cpp``): logit bias → penalties →
top-k → top-p → min-p → temperature → draw.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

import numpy as np
import torch


_FLOAT_MAX = torch.finfo(torch.float64).max
MAX_GRAMMAR_CHARS = 2 ** 20  # a GBNF grammar of a session (characters)
_F32_MAX = torch.finfo(torch.float32).max


def greedy(logits: torch.Tensor) -> int:
    """The id of the first maximum of ``logits`` ``[n_vocab]`` (any float dtype, CPU), as llama.cpp's greedy
    sampler picks it. Through numpy: ``torch.argmax`` takes ~1 ms over Gemma 3's 262,144 logits on one CPU
    thread, ``numpy.argmax`` ~20 us (measured here), on every decoded token."""
    return int(np.argmax(logits.detach().to(torch.float32).numpy()))


@dataclass(frozen=True)
class SamplingParams:
    """Sampling settings of one session. ``temperature <= 0`` means greedy (argmax).

    ``top_k = 0``, ``top_p = 1``, ``min_p = 0`` and ``repeat_penalty = 1`` disable those filters;
    ``repeat_last_n`` is the window (tokens) the repeat penalty looks back over, prompt included (0 = no
    penalty, as llama.cpp / llama-server). ``seed = None`` draws from a random seed.

    ``presence_penalty`` / ``frequency_penalty`` (finite; 0 = off) are OpenAI's: a token's logit loses
    ``count * frequency_penalty + (count > 0) * presence_penalty``, ``count`` being how often it occurs among
    the tokens from position ``penalize_from`` on (the gateway sets the prompt length there, so only
    generated tokens count, as OpenAI defines them; formula from OpenAI's API reference, "frequency and
    presence penalties"; llama.cpp's penalties sampler applies the same formula).
    ``logit_bias``: ``((token id, bias), ...)`` added to the raw logits before anything else (a JSON list of
    pairs or a ``{"id": bias}`` map is normalized by ``validate``).
    ``grammar``: a GBNF grammar (llama.cpp's format, root rule ``root``) the tokens from ``penalize_from`` on must
    follow: constrained decoding, on a llama.cpp head only (``runtime.llamacpp.sampling``); "" = none.
    """

    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    penalize_from: int = 0
    logit_bias: tuple = ()
    grammar: str = ""

    def validate(self) -> "SamplingParams":
        """These settings with ``logit_bias`` normalized to sorted ``((int id, float bias), ...)`` (a token given twice
        is refused); ValueError naming the first setting of the wrong type or out of range."""
        for name in ("temperature", "top_p", "min_p", "repeat_penalty", "presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
                raise ValueError(f"{name} must be a number, got {value!r}")
            if isinstance(value, int) and abs(value) > _FLOAT_MAX:  # it is used as a float when sampling
                raise ValueError(f"{name} must be within the float range, got an integer of {len(str(value))} digits")
        for name in ("presence_penalty", "frequency_penalty"):
            if not abs(getattr(self, name)) < _F32_MAX:
                raise ValueError(f"{name} must be finite, got {getattr(self, name)!r}")
        for name in ("top_k", "repeat_last_n", "penalize_from"):
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
        if not isinstance(self.grammar, str) or len(self.grammar) > MAX_GRAMMAR_CHARS:
            raise ValueError(f"grammar must be a string of at most {MAX_GRAMMAR_CHARS} characters")
        return replace(self, logit_bias=_logit_bias(self.logit_bias))

    def to_dict(self) -> dict:
        """JSON-ready settings. The settings added after protocol 1's first nodes (penalties, ``penalize_from``,
        ``logit_bias``, ``grammar``) are left out while they change nothing, so such nodes still take sessions that do
        not use them."""
        d = asdict(self)
        if not (self.presence_penalty or self.frequency_penalty):
            del d["presence_penalty"], d["frequency_penalty"]
        if not (self.presence_penalty or self.frequency_penalty or self.grammar):
            del d["penalize_from"]
        if not self.logit_bias:
            del d["logit_bias"]
        if not self.grammar:
            del d["grammar"]
        return d


def _logit_bias(value) -> tuple:
    """``((id, bias), ...)`` sorted by id from a sequence of pairs or a ``{id or "id": bias}`` map; ValueError."""
    if isinstance(value, dict):
        value = list(value.items())
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"logit_bias must be a list of [token id, bias] pairs, got {type(value).__name__}")
    out = {}
    for pair in value:
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise ValueError(f"logit_bias entries must be [token id, bias] pairs, got {pair!r}")
        tok, bias = pair
        if isinstance(tok, str) and tok.isdigit() and tok.isascii():
            tok = int(tok)
        if isinstance(tok, bool) or not isinstance(tok, int) or not 0 <= tok < 2 ** 31:
            raise ValueError(f"logit_bias token ids must be integers in [0, 2^31), got {tok!r}")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not abs(bias) < _F32_MAX:
            raise ValueError(f"logit_bias values must be finite numbers, got {bias!r}")
        if tok in out:
            raise ValueError(f"logit_bias gives token {tok} twice")
        out[tok] = float(bias)
    return tuple(sorted(out.items()))


class Sampler:
    """Draws token ids for one session. Each draw's randomness is keyed by (seed, position): the same
    seed gives the same tokens, also after a route repair hands the session to a new head node."""

    grammar_support = False  # see SamplingParams.grammar

    def __init__(self, params: SamplingParams):
        """ValueError (from ``SamplingParams.validate``) for settings of the wrong type or out of range, and for a
        ``grammar``: only a llama.cpp head (``LlamaCppSampler``) does constrained decoding."""
        params = params.validate()
        if params.grammar and not self.grammar_support:
            raise ValueError("grammar (constrained decoding: response_format json, a forced tool_choice) needs a "
                             "llama.cpp head; this one runs the torch backend")
        # as floats: torch takes a Python int scalar as int64, and larger ones (temperature 2**64) overflow
        self.params = replace(params, **{name: float(getattr(params, name))
                                         for name in ("temperature", "top_p", "min_p", "repeat_penalty",
                                                      "presence_penalty", "frequency_penalty")})
        self.seed = params.seed if params.seed is not None else int(torch.randint(0, 2 ** 62, (1,)))
        self.generator = torch.Generator()

    def bind(self, executor) -> None:
        """Attach the head shard executor this sampler draws for (a llama.cpp head lends its vocabulary to the
        grammar); nothing to do here."""

    def check_vocab(self, n_vocab: int) -> None:
        """ValueError when a ``logit_bias`` token id is outside ``[0, n_vocab)``."""
        bad = [tok for tok, _ in self.params.logit_bias if tok >= n_vocab]
        if bad:
            raise ValueError(f"logit_bias token id {bad[0]} is out of range [0, {n_vocab})")

    def adjust(self, logits: torch.Tensor, history: list[int] | None = None) -> torch.Tensor:
        """The float32 logits ``[n_vocab]`` the draw sees: ``logit_bias`` added, then the repeat penalty over the last
        ``repeat_last_n`` ids of ``history``, then the frequency / presence penalties over ``history[penalize_from:]``
        (llama.cpp's logit-bias and penalties samplers, in its chain's order). ``logits`` is not modified."""
        p = self.params
        logits = logits.float()
        if p.logit_bias:
            self.check_vocab(logits.shape[-1])
            logits = logits.clone()
            ids = torch.tensor([tok for tok, _ in p.logit_bias], dtype=torch.long)
            logits[ids] += torch.tensor([bias for _, bias in p.logit_bias], dtype=torch.float32)
        if p.repeat_penalty != 1.0 and history and p.repeat_last_n > 0:  # llama.cpp: penalty_last_n 0 = off
            # llama.cpp penalties: positive logits divided, negative multiplied (CTRL paper, arXiv:1909.05858)
            logits = logits.clone()
            ids = torch.tensor(sorted(set(history[-p.repeat_last_n:])), dtype=torch.long)
            vals = logits[ids]
            penalized = torch.where(vals > 0, vals / p.repeat_penalty, vals * p.repeat_penalty)
            # an extreme penalty overflows (x / 1e-300, 0 * inf): keep the logits finite
            logits[ids] = penalized.nan_to_num(nan=0.0, posinf=_F32_MAX, neginf=-_F32_MAX)
        generated = history[p.penalize_from:] if history else []
        if (p.presence_penalty or p.frequency_penalty) and generated:
            # OpenAI's frequency / presence penalties, after the repeat penalty (llama.cpp's penalties sampler's order)
            ids, counts = torch.unique(torch.tensor(generated, dtype=torch.long), return_counts=True)
            penalty = counts.float() * p.frequency_penalty + p.presence_penalty
            logits = logits.clone()
            logits[ids] = (logits[ids] - penalty).clamp(-_F32_MAX, _F32_MAX)
        return logits

    def sample(self, logits: torch.Tensor, history: list[int] | None = None) -> int:
        """One token id from float32 logits ``[n_vocab]``; ``history`` = the token ids before it, prompt included
        (its length keys the draw; the penalties look at it). ValueError for a logit_bias id past ``n_vocab``."""
        p = self.params
        logits = self.adjust(logits, history)
        if p.temperature <= 0:
            return greedy(logits)
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
    return token_logprobs(logits, None, n)[1]


def token_logprobs(logits: torch.Tensor, token: int | None, n: int) -> tuple[float | None, list[tuple[int, float]]]:
    """(logprob of ``token``, the ``n`` most likely ``(id, logprob)`` pairs, most likely first) from float logits
    ``[n_vocab]``: natural-log probabilities as ``log_softmax`` of the raw logits, in float32 — the model's own
    distribution, before logit bias, penalties, temperature or truncation (OpenAI reports logprobs of the
    model's distribution the same way). ``token`` None gives None for the first item."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    top = []
    if n > 0:
        values, ids = torch.topk(logp, n)
        top = [(int(i), float(v)) for i, v in zip(ids, values)]
    return (float(logp[token]) if token is not None else None), top
