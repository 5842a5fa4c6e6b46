"""Sampling at a llama.cpp head through llama.cpp's own sampler chain (``src/llama-sampling.cpp``).

The chain is the one llama.cpp and llama-cpp-python build by default (``common/sampling.cpp``,
``Llama._init_sampler``): penalties → top-k → top-p → min-p → temperature → dist. So a draw equals
llama.cpp's draw for the same logits, settings and dist seed. The dist seed of each draw is
derived from the session seed and the position (``draw_seed``), not from a running RNG, so a
route repair that hands the session to a new head continues with the same tokens.
"""

from __future__ import annotations

import ctypes

import numpy as np
import torch

import llama_cpp as L

from ...client.sampling import Sampler, SamplingParams

_TOKEN_DATA = np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)])
assert _TOKEN_DATA.itemsize == ctypes.sizeof(L.llama_token_data)


def draw_seed(seed: int, position: int) -> int:
    """The 32-bit dist seed (``llama_sampler_init_dist``) of the draw at ``position`` (tokens before it)."""
    return (seed * 1_000_003 + position) % 2 ** 32


class LlamaCppSampler(Sampler):
    """``client.sampling.Sampler``'s interface, drawing with llama.cpp's sampler chain.

    ``temperature <= 0`` is greedy (argmax after the penalties, as llama.cpp's greedy sampler).
    Raises ValueError for settings of the wrong type or out of range (``SamplingParams.validate``).
    """

    def __init__(self, params: SamplingParams):
        super().__init__(params)
        self._data: np.ndarray | None = None

    def _chain(self, history: list[int], position: int, n_vocab: int):
        p = self.params
        chain = L.llama_sampler_chain_init(L.llama_sampler_chain_default_params())
        if p.repeat_penalty != 1.0 and p.repeat_last_n > 0 and history:
            pen = L.llama_sampler_init_penalties(n_vocab, p.repeat_last_n, p.repeat_penalty, 0.0, 0.0)
            for tok in history[-p.repeat_last_n:]:
                L.llama_sampler_accept(pen, tok)
            L.llama_sampler_chain_add(chain, pen)
        if p.temperature <= 0:
            L.llama_sampler_chain_add(chain, L.llama_sampler_init_greedy())
            return chain
        L.llama_sampler_chain_add(chain, L.llama_sampler_init_top_k(p.top_k))
        L.llama_sampler_chain_add(chain, L.llama_sampler_init_top_p(p.top_p, 1))
        L.llama_sampler_chain_add(chain, L.llama_sampler_init_min_p(p.min_p, 1))
        L.llama_sampler_chain_add(chain, L.llama_sampler_init_temp(p.temperature))
        L.llama_sampler_chain_add(chain, L.llama_sampler_init_dist(draw_seed(self.seed, position)))
        return chain

    def sample(self, logits: torch.Tensor, history: list[int] | None = None) -> int:
        """One token id from float32 logits ``[n_vocab]``; ``history`` = the token ids before it (its length is
        the position that keys the draw; its last ``repeat_last_n`` ids are penalized)."""
        history = history or []
        p = self.params
        if p.temperature <= 0 and (p.repeat_penalty == 1.0 or not history):
            return int(torch.argmax(logits))  # what llama.cpp's greedy sampler returns (first maximum)
        values = np.ascontiguousarray(logits.float().numpy(), dtype=np.float32)
        n = values.shape[0]
        if self._data is None or self._data.shape[0] != n:
            self._data = np.zeros(n, dtype=_TOKEN_DATA)
        data = self._data
        data["id"] = np.arange(n, dtype=np.int32)
        data["logit"] = values
        data["p"] = 0.0
        arr = L.llama_token_data_array(data.ctypes.data_as(L.llama_token_data_p), n, -1, False)
        chain = self._chain(history, len(history), n)
        try:
            L.llama_sampler_apply(chain, ctypes.byref(arr))
            if not 0 <= arr.selected < arr.size:
                raise RuntimeError("llama.cpp's sampler chain selected no token")
            chosen = ctypes.cast(arr.data, ctypes.POINTER(L.llama_token_data))[arr.selected]
            return int(chosen.id)
        finally:
            L.llama_sampler_free(chain)


__all__ = ["LlamaCppSampler", "draw_seed"]
