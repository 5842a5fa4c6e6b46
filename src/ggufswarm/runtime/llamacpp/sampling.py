"""Sampling at a llama.cpp head through llama.cpp's own sampler chain (``src/llama-sampling.cpp``).

The chain is the one llama.cpp and llama-cpp-python build by default (``common/sampling.cpp``,
``Llama._init_sampler``), so a draw equals llama.cpp's for the same logits, settings and dist seed. Each draw's seed
comes from the session seed and the position (``draw_seed``), and a grammar's state from the tokens generated, so a
replacement head after a route repair continues with the same tokens. Grammars are applied as llama.cpp's
``common_sampler_sample`` does (docs/protocol.md, "Parameters")."""

from __future__ import annotations

import ctypes

import numpy as np

from ..sampling import SamplerBase, SamplingParams, _as_numpy, greedy
from .bindings import L

_TOKEN_DATA = np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)])
assert _TOKEN_DATA.itemsize == ctypes.sizeof(L.llama_token_data)


def draw_seed(seed: int, position: int) -> int:
    """The 32-bit dist seed (``llama_sampler_init_dist``) of the draw at ``position`` (tokens before it)."""
    return (seed * 1_000_003 + position) % 2**32


class LlamaCppSampler(SamplerBase):
    """A head's sampler drawing with llama.cpp's sampler chain (the torch backend's ``Sampler`` has the same interface).

    ``temperature <= 0`` is greedy (argmax after the penalties, as llama.cpp's greedy sampler).
    Raises ValueError for settings of the wrong type or out of range (``SamplingParams.validate``).
    """

    grammar_support = True

    def __init__(self, params: SamplingParams):
        super().__init__(params)
        self._data: np.ndarray | None = None
        self._vocab = None
        self._grammar = None  # llama.cpp grammar sampler, having accepted the tokens in self._accepted
        self._accepted: list[int] = []

    def bind(self, executor) -> None:
        """Take the vocabulary of the head shard ``executor`` (``LlamaCppShard.vocab``) for the grammar; ValueError
        when the grammar does not parse (llama.cpp's GBNF parser)."""
        if self.params.grammar:
            self._vocab = executor.vocab()
            self._reset_grammar()

    def _reset_grammar(self) -> None:
        if self._grammar is not None:
            L.llama_sampler_free(self._grammar)
            self._grammar = None
        self._accepted = []
        grammar = L.llama_sampler_init_grammar(self._vocab, self.params.grammar.encode(), b"root")
        if not grammar:
            raise ValueError("grammar: llama.cpp could not parse it (GBNF with a rule named root)")
        self._grammar = grammar

    def __del__(self):
        if getattr(self, "_grammar", None) is not None:
            L.llama_sampler_free(self._grammar)
            self._grammar = None

    def _allows(self, token: int) -> bool:
        """Whether the grammar, in its current state, allows ``token`` next."""
        one = np.zeros(1, dtype=_TOKEN_DATA)
        one["id"], one["logit"] = token, 0.0
        arr = L.llama_token_data_array(one.ctypes.data_as(L.llama_token_data_p), 1, -1, False)
        L.llama_sampler_apply(self._grammar, ctypes.byref(arr))
        return bool(np.isfinite(one["logit"][0]))

    def _sync_grammar(self, generated: list[int]) -> None:
        """Bring the grammar to the state after ``generated`` (rebuilt when the session was rolled back). ValueError
        for a token the grammar does not allow (llama.cpp aborts the process when such a token is accepted)."""
        done = len(self._accepted)
        if len(generated) < done or generated[:done] != self._accepted:
            self._reset_grammar()
            done = 0
        for tok in generated[done:]:
            if not self._allows(tok):
                self._reset_grammar()  # the next call starts again from a clean state
                raise ValueError(f"token {tok} does not follow the session's grammar")
            L.llama_sampler_accept(self._grammar, tok)
            self._accepted.append(tok)

    def _chain(self, history: list[int], position: int, n_vocab: int, draw: bool = True):
        p = self.params
        self.check_vocab(n_vocab)
        chain = L.llama_sampler_chain_init(L.llama_sampler_chain_default_params())
        if p.logit_bias:
            biases = (L.llama_logit_bias * len(p.logit_bias))(*[L.llama_logit_bias(t, b) for t, b in p.logit_bias])
            L.llama_sampler_chain_add(chain, L.llama_sampler_init_logit_bias(n_vocab, len(p.logit_bias), biases))
        # Each penalties sampler keeps a ring buffer of penalty_last_n ids: sized to the tokens it is given, never
        # to a client's window (repeat_last_n may be 2^31 - 1).
        window = history[-p.repeat_last_n :] if p.repeat_last_n > 0 else []
        if p.repeat_penalty != 1.0 and window:
            pen = L.llama_sampler_init_penalties(n_vocab, len(window), p.repeat_penalty, 0.0, 0.0)
            for tok in window:
                L.llama_sampler_accept(pen, tok)
            L.llama_sampler_chain_add(chain, pen)
        generated = history[p.penalize_from :]
        if (p.frequency_penalty or p.presence_penalty) and generated:  # OpenAI's: over the generated tokens
            pen = L.llama_sampler_init_penalties(n_vocab, len(generated), 1.0, p.frequency_penalty, p.presence_penalty)
            for tok in generated:
                L.llama_sampler_accept(pen, tok)
            L.llama_sampler_chain_add(chain, pen)
        if not draw:
            return chain
        if p.temperature <= 0:
            L.llama_sampler_chain_add(chain, L.llama_sampler_init_greedy())
            return chain
        L.llama_sampler_chain_add(chain, L.llama_sampler_init_top_k(p.top_k))
        L.llama_sampler_chain_add(chain, L.llama_sampler_init_top_p(p.top_p, 1))
        L.llama_sampler_chain_add(chain, L.llama_sampler_init_min_p(p.min_p, 1))
        L.llama_sampler_chain_add(chain, L.llama_sampler_init_temp(p.temperature))
        L.llama_sampler_chain_add(chain, L.llama_sampler_init_dist(draw_seed(self.seed, position)))
        return chain

    def _array(self, logits):
        """A ``llama_token_data_array`` over this sampler's buffer holding ``logits`` (ids in order), and n_vocab."""
        values = _as_numpy(logits)
        n = values.shape[0]
        if self._data is None or self._data.shape[0] != n:
            self._data = np.zeros(n, dtype=_TOKEN_DATA)
        data = self._data
        data["id"] = np.arange(n, dtype=np.int32)
        data["logit"] = values
        data["p"] = 0.0
        return L.llama_token_data_array(data.ctypes.data_as(L.llama_token_data_p), n, -1, False), n

    def adjust(self, logits, history: list[int] | None = None) -> np.ndarray:
        """``Sampler.adjust`` computed by llama.cpp's own logit-bias and penalties samplers: float32 ``[n_vocab]``
        (numpy) from ``logits`` (numpy or torch)."""
        arr, n = self._array(logits)
        chain = self._chain(history or [], len(history or []), n, draw=False)
        try:
            L.llama_sampler_apply(chain, ctypes.byref(arr))
        finally:
            L.llama_sampler_free(chain)
        data = self._data[: arr.size]
        out = np.empty(n, dtype=np.float32)
        out[data["id"]] = data["logit"]
        return out

    def sample(self, logits, history: list[int] | None = None) -> int:
        """One token id from float32 logits ``[n_vocab]``; ``history`` = the token ids before it (its length is
        the position that keys the draw; its last ``repeat_last_n`` ids get the repeat penalty, those from
        ``penalize_from`` on the frequency and presence penalties and the grammar, which must allow them).
        ValueError for a logit_bias id past ``n_vocab``, or a generated token the grammar does not allow."""
        history = history or []
        p = self.params
        if not p.grammar:
            return self._draw(logits, history, False)
        if self._grammar is None:
            raise ValueError("a grammar needs the head's vocabulary: call bind(executor) first")
        self._sync_grammar(history[p.penalize_from :])
        token = self._draw(logits, history, False)
        return token if self._allows(token) else self._draw(logits, history, True)

    def _draw(self, logits, history: list[int], grammar: bool) -> int:
        p = self.params
        if (
            not grammar
            and p.temperature <= 0
            and (p.repeat_penalty == 1.0 or not history)
            and not p.logit_bias
            and not ((p.frequency_penalty or p.presence_penalty) and history[p.penalize_from :])
        ):
            return greedy(logits)  # what llama.cpp's greedy sampler returns (first maximum)
        arr, n = self._array(logits)
        if grammar:  # tokens the grammar does not allow get -inf
            L.llama_sampler_apply(self._grammar, ctypes.byref(arr))
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
