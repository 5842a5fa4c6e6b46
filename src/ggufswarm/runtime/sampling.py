"""Sampling settings and the backend-neutral pieces of sampling (numpy only, no torch): greedy, logprobs.

The samplers themselves belong to the backends: a llama.cpp head draws with llama.cpp's sampler chain
(``runtime/llamacpp/sampling.py``), a torch head with its PyTorch re-implementation of that chain
(``runtime/torch_sampling.py``, ``Sampler``).
"""

from __future__ import annotations

import secrets
from dataclasses import asdict, dataclass, replace

import numpy as np

_FLOAT_MAX = float(np.finfo(np.float64).max)
MAX_GRAMMAR_CHARS = 2**20  # a GBNF grammar of a session (characters)
_F32_MAX = float(np.finfo(np.float32).max)


def _as_numpy(logits) -> np.ndarray:
    """float32 numpy view of logits: a numpy array as it is, a (CPU) torch tensor through ``.numpy()``."""
    if isinstance(logits, np.ndarray):
        return logits if logits.dtype == np.float32 else logits.astype(np.float32)
    return logits.detach().float().numpy()  # a torch tensor (torch backend): no torch import needed here


def greedy(logits) -> int:
    """The id of the first maximum of ``logits`` ``[n_vocab]`` (numpy array or CPU torch tensor, any float dtype),
    as llama.cpp's greedy sampler picks it. Through numpy, on every decoded token: over a vocabulary-wide row on one
    CPU thread ``numpy.argmax`` is much cheaper than ``torch.argmax``."""
    return int(np.argmax(_as_numpy(logits)))


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

    def validate(self) -> SamplingParams:
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
        if self.seed is not None and (
            isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < 2**63
        ):
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
        if isinstance(tok, bool) or not isinstance(tok, int) or not 0 <= tok < 2**31:
            raise ValueError(f"logit_bias token ids must be integers in [0, 2^31), got {tok!r}")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not abs(bias) < _F32_MAX:
            raise ValueError(f"logit_bias values must be finite numbers, got {bias!r}")
        if tok in out:
            raise ValueError(f"logit_bias gives token {tok} twice")
        out[tok] = float(bias)
    return tuple(sorted(out.items()))


class SamplerBase:
    """What every head's sampler shares (no torch): validated settings, the session seed, ``bind`` and
    ``check_vocab``. Each draw's randomness is keyed by (seed, position): the same seed gives the same tokens,
    also after a route repair hands the session to a new head node. Subclasses: ``torch_sampling.Sampler`` (the
    torch backend) and ``llamacpp.sampling.LlamaCppSampler``; both have ``sample(logits, history) -> int`` and
    ``adjust(logits, history)``."""

    grammar_support = False  # see SamplingParams.grammar

    def __init__(self, params: SamplingParams):
        """ValueError (from ``SamplingParams.validate``) for settings of the wrong type or out of range, and for a
        ``grammar``: only a llama.cpp head (``LlamaCppSampler``) does constrained decoding."""
        params = params.validate()
        if params.grammar and not self.grammar_support:
            raise ValueError(
                "grammar (constrained decoding: response_format json, a forced tool_choice) needs a "
                "llama.cpp head; this one runs the torch backend"
            )
        # as floats: torch takes a Python int scalar as int64, and larger ones (temperature 2**64) overflow
        self.params = replace(
            params,
            **{
                name: float(getattr(params, name))
                for name in ("temperature", "top_p", "min_p", "repeat_penalty", "presence_penalty", "frequency_penalty")
            },
        )
        self.seed = params.seed if params.seed is not None else secrets.randbelow(2**62)

    def bind(self, executor) -> None:
        """Attach the head shard executor this sampler draws for (a llama.cpp head lends its vocabulary to the
        grammar); nothing to do here."""

    def check_vocab(self, n_vocab: int) -> None:
        """ValueError when a ``logit_bias`` token id is outside ``[0, n_vocab)``."""
        bad = [tok for tok, _ in self.params.logit_bias if tok >= n_vocab]
        if bad:
            raise ValueError(f"logit_bias token id {bad[0]} is out of range [0, {n_vocab})")


def top_logprobs(logits, n: int) -> list[tuple[int, float]]:
    """The ``n`` most likely token ids with their natural-log probabilities, from logits ``[n_vocab]``."""
    return token_logprobs(logits, None, n)[1]


def token_logprobs(logits, token: int | None, n: int) -> tuple[float | None, list[tuple[int, float]]]:
    """(logprob of ``token``, the ``n`` most likely ``(id, logprob)`` pairs, most likely first, ties by lower id)
    from float logits ``[n_vocab]`` (numpy or torch): natural-log probabilities as ``log_softmax`` of the raw
    logits, in float32 — the model's own distribution, before logit bias, penalties, temperature or truncation
    (OpenAI reports logprobs of the model's distribution the same way). ``token`` None gives None for the first
    item."""
    x = _as_numpy(logits)
    shifted = x - x.max()
    logp = shifted - np.log(np.exp(shifted).sum(dtype=np.float32), dtype=np.float32)
    top = []
    if n > 0:
        n = min(n, logp.shape[-1])
        ids = np.argpartition(-logp, n - 1)[:n]
        ids = ids[np.lexsort((ids, -logp[ids]))]
        top = [(int(i), float(logp[i])) for i in ids]
    return (float(logp[token]) if token is not None else None), top
