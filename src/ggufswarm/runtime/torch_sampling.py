"""The torch backend's sampler: llama.cpp's default sampler chain re-implemented in PyTorch, seeded per position.

Temperature, top-k, top-p, min-p, logit bias, repetition, presence and frequency penalties, in the order of
llama.cpp's default chain (``common/sampling.cpp``): logit bias → penalties → top-k → top-p → min-p →
temperature → draw.
"""

from __future__ import annotations

import torch

from .sampling import _F32_MAX, SamplerBase, SamplingParams, greedy


class Sampler(SamplerBase):
    """The torch backend's sampler: draws token ids for one session with PyTorch (see SamplerBase)."""

    def __init__(self, params: SamplingParams):
        super().__init__(params)
        self.generator = torch.Generator()

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
            ids = torch.tensor(sorted(set(history[-p.repeat_last_n :])), dtype=torch.long)
            vals = logits[ids]
            penalized = torch.where(vals > 0, vals / p.repeat_penalty, vals * p.repeat_penalty)
            # an extreme penalty overflows (x / 1e-300, 0 * inf): keep the logits finite
            logits[ids] = penalized.nan_to_num(nan=0.0, posinf=_F32_MAX, neginf=-_F32_MAX)
        generated = history[p.penalize_from :] if history else []
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
        self.generator.manual_seed((self.seed * 1_000_003 + position) % 2**63)
        return int(ids[torch.multinomial(probs, 1, generator=self.generator)])


__all__ = ["Sampler"]
