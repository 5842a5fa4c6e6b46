"""Torch shard executor: load one layer range of a GGUF model and run it against a session's KV cache."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch

from ..artifact.gguf_file import GGUFModelFile
from ..model import ModelConfig, family, load_config
from ..model.blocks import linear, rms_norm, rope_inv_freq, rope_tables, yarn_inv_freq
from .kv import ContextOverflow, TokenOutOfRange
from .spec import ShardSpec, even_split, split_at
from .torch_kv import SessionKV
from .torch_sampling import Sampler

NUMERICS = ("llama.cpp", "exact")
# ggml-cpu.c type_traits_cpu[...].vec_dot_type: activations are quantized to this before the dot product
VEC_DOT_ACTIVATION = {
    **{t: "q8_0" for t in ("Q4_0", "Q5_0", "Q8_0", "IQ4_NL", "MXFP4")},
    **{
        t: "q8_k"
        for t in (
            "Q2_K",
            "Q3_K",
            "Q4_K",
            "Q5_K",
            "Q6_K",
            "IQ2_XXS",
            "IQ2_XS",
            "IQ2_S",
            "IQ3_XXS",
            "IQ3_S",
            "IQ1_S",
            "IQ1_M",
            "IQ4_XS",
        )
    },
}


class ShardExecutor:
    """Runs blocks ``[spec.start, spec.end)`` of a GGUF model (plus embedding / head stages) in PyTorch.

    Weights are read from the GGUF (only this shard's tensors), dequantized to ``dtype``
    (float32 default, bfloat16 option). State lives in SessionKV objects made by ``new_session``;
    the executor itself is stateless between calls, so sessions are isolated.

    ``numerics="exact"`` multiplies by the exactly dequantized weights; ``"llama.cpp"`` first rounds
    activations as ggml's CPU kernels do for quantized weights (Q8_0/Q8_K, ``VEC_DOT_ACTIVATION``)
    and uses ggml's f16 GELU table, to compare with llama.cpp tightly. Raises GGUFError,
    UnsupportedArchitecture, or ValueError for a bad spec or numerics.
    """

    def __init__(
        self,
        model: GGUFModelFile,
        spec: ShardSpec,
        dtype: torch.dtype = torch.float32,
        config: ModelConfig | None = None,
        numerics: str = "exact",
    ):
        self.model = model
        self.cfg = config or load_config(model)
        spec.validate(self.cfg.n_layers)
        self.spec = spec
        self.dtype = dtype
        if numerics not in NUMERICS:
            raise ValueError(f"numerics must be one of {', '.join(NUMERICS)}, got {numerics!r}")
        self.numerics = numerics
        if numerics == "llama.cpp" and self.cfg.ffn_act == "gelu_tanh":
            self.cfg = replace(self.cfg, ffn_act="gelu_tanh_f16")
        self._block = family(self.cfg.arch).block
        self.layers = {il: self._load_layer(il) for il in spec.layers}
        self.rope_freqs = self._tensor("rope_freqs.weight") if model.has("rope_freqs.weight") else None
        self._inv_freq: dict[float, torch.Tensor] = {}  # RoPE base -> rope_inv_freq (float64), computed once
        self.token_embd = self._tensor("token_embd.weight") if spec.embed else None
        if spec.head:
            self.output_norm = self._tensor("output_norm.weight")
            out_name = "output.weight" if model.has("output.weight") else "token_embd.weight"  # else tied
            if out_name == "token_embd.weight" and self.token_embd is not None:
                self.output = self.token_embd
            else:
                self.output = self._tensor(out_name)
            self.head_weights = {"output": self.output}
            act = self._activation_format(out_name)
            if act:
                self.head_weights["output.act"] = act

    def _tensor(self, name: str) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(self.model.read_tensor(name))).to(self.dtype)

    def _load_layer(self, il: int) -> dict[str, torch.Tensor]:
        prefix = f"blk.{il}."
        weights = {}
        for name in self.model.tensors:
            if name.startswith(prefix):
                key = name[len(prefix) :]
                key = key[: -len(".weight")] if key.endswith(".weight") else key
                weights[key] = self._tensor(name)
                act = self._activation_format(name)
                if act:
                    weights[key + ".act"] = act
        return weights

    def _activation_format(self, name: str) -> str | None:
        """The activation format llama.cpp's CPU backend pairs with this weight, in "llama.cpp" numerics."""
        if self.numerics != "llama.cpp" or self.dtype != torch.float32:
            return None
        return VEC_DOT_ACTIVATION.get(self.model.tensors[name].ggml_type.name)

    # ShardBackend capabilities (runtime/backends.py): no limits of its own, one step at a time on a worker thread
    backend = "torch"
    n_ctx_seq = n_batch = n_ubatch = n_seq_max = max_outputs = None
    step_lock = None
    supports_batch = False
    exact_states_only = False
    needs_token_ids = False
    step_grouping_matters = False
    state_snapshots = False
    sampler_class = Sampler  # the head draws with the PyTorch sampler (llama.cpp's chain, re-implemented)

    def close(self) -> None:
        """Nothing to free by hand: the weights go with the object (ShardBackend.close)."""

    def kv_bytes_per_token(self) -> int:
        """KV bytes one token costs on this shard (all its layers, keys and values, in ``dtype``; for MLA the
        latent, ``kv_lora_rank + rope_dim`` values per layer)."""
        n_kv, k_dim, v_dim = self.cfg.cache_dims
        return len(self.spec.layers) * n_kv * (k_dim + v_dim) * self.dtype.itemsize

    def new_session(self, max_length: int) -> SessionKV:
        """An empty KV cache for this shard's layers; ContextOverflow when max_length is over the cap."""
        n_kv, k_dim, v_dim = self.cfg.cache_dims
        return SessionKV(len(self.spec.layers), n_kv, k_dim, max_length, self.dtype, v_dim=v_dim)

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Token ids ``[T]`` (int64) → scaled embeddings ``[T, n_embd]``; ValueError for an id out of vocab."""
        if token_ids.numel() and (int(token_ids.min()) < 0 or int(token_ids.max()) >= self.cfg.n_vocab):
            raise TokenOutOfRange(f"token id out of range [0, {self.cfg.n_vocab})")
        x = self.token_embd[token_ids]
        return x * self.cfg.embed_scale if self.cfg.embed_scale != 1.0 else x

    def forward(self, kv: SessionKV, inputs: torch.Tensor, logits: str = "last") -> torch.Tensor:
        """Run one prefill (T > 1) or decode (T = 1) step for a session.

        ``inputs``: token ids ``[T]`` int64 when the shard has the embedding stage, else hidden
        states ``[T, n_embd]`` (a torch tensor or a numpy array, as a decoded frame carries them).
        Positions continue from ``kv.length``. Returns (torch) hidden states
        ``[T, n_embd]`` (``dtype``), or with the head stage float32 logits ``[1, n_vocab]``
        (``logits="last"``) or ``[T, n_vocab]`` (``logits="all"``).

        Raises ContextOverflow past ``max_length`` and ValueError for wrong shapes; on any error
        the KV cache is left exactly as before the call.
        """
        if isinstance(inputs, np.ndarray):
            inputs = torch.from_numpy(inputs)
        n_tokens = inputs.shape[0]
        if n_tokens == 0:
            raise ValueError("a step needs at least one token")
        kv.reserve(n_tokens)
        start = kv.length
        positions = torch.arange(start, start + n_tokens)
        try:
            if self.spec.embed:
                if inputs.dim() != 1:
                    raise ValueError(f"the first shard takes token ids [n_tokens], got shape {tuple(inputs.shape)}")
                x = self.embed(inputs.long())
            else:
                if inputs.dim() != 2 or inputs.shape[1] != self.cfg.n_embd:
                    raise ValueError(f"expected hidden states [n_tokens, {self.cfg.n_embd}], got {tuple(inputs.shape)}")
                x = inputs.to(self.dtype)
            tables = {}  # per RoPE (base, scale): this step's cos/sin and masks, shared by the layers using it
            for il in self.spec.layers:
                key = (self.cfg.rope_base[il], self.cfg.rope_scale[il])
                if key not in tables:
                    inv_freq = self._inv_freq.get(key[0])
                    if inv_freq is None:
                        inv_freq = rope_inv_freq(self.cfg.n_rot, key[0], self.rope_freqs)
                        if self.cfg.yarn is not None:
                            inv_freq = yarn_inv_freq(inv_freq, self.cfg.n_rot, key[0], self.cfg.yarn)
                        self._inv_freq[key[0]] = inv_freq
                    tables[key] = rope_tables(
                        positions,
                        inv_freq,
                        key[1],
                        self.dtype,
                        self.cfg.yarn.magnitude if self.cfg.yarn is not None else 1.0,
                    )
                x = self._block(
                    self.cfg, il, x, self.layers[il], kv.layers[il - self.spec.start], positions, tables[key]
                )
        except BaseException:
            kv.truncate(start)
            raise
        kv.length = start + n_tokens
        if not self.spec.head:
            return x
        return self.head(x if logits == "all" else x[-1:])

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """Output norm + LM head: hidden ``[T, n_embd]`` → float32 logits ``[T, n_vocab]`` (softcapped if the model
        says)."""
        out = linear(rms_norm(x, self.output_norm, self.cfg.rms_eps), self.head_weights, "output").float()
        cap = self.cfg.final_logit_softcap
        return torch.tanh(out / cap) * cap if cap else out


__all__ = ["ShardSpec", "ShardExecutor", "ContextOverflow", "even_split", "split_at"]
