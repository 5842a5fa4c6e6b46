"""Load a GGUF model for in-process use: artifact, config, tokenizer and chained shard executors."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from ..artifact.default_model import resolve_model
from ..artifact.gguf_file import GGUFModelFile
from ..model import ModelConfig, load_config
from ..runtime.shard import ShardExecutor, ShardSpec, split_at
from .generate import LocalSession
from .sampling import SamplingParams
from .tokenizer import Tokenizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class LocalModel:
    """A whole model as in-process chained shards (one shard unless ``split`` points are given)."""

    file: GGUFModelFile
    config: ModelConfig
    tokenizer: Tokenizer
    shards: list[ShardExecutor]

    @classmethod
    def load(cls, path: str | os.PathLike | None = None, split: list[int] | None = None,
             dtype: str = "float32") -> "LocalModel":
        """Load ``path`` (default: the embedded Gemma 3 270M) cut at ``split`` layer indices.

        Raises GGUFError, UnsupportedArchitecture, or ValueError for bad split points / dtype.
        """
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
        file = GGUFModelFile(resolve_model(path))
        config = load_config(file)
        specs = split_at(config.n_layers, split or [])
        shards = [ShardExecutor(file, spec, DTYPES[dtype], config) for spec in specs]
        return cls(file, config, Tokenizer(str(file.path), file.metadata), shards)

    def session(self, max_length: int | None = None, sampling: SamplingParams | None = None) -> LocalSession:
        """A new session over all shards; ``max_length`` defaults to the model's limit (≤ 128K)."""
        return LocalSession(self.shards, max_length or self.config.max_length, sampling or SamplingParams())

    def prompt_ids(self, prompt: str, chat: bool = False) -> list[int]:
        """Token ids of a plain prompt, or of a one-turn chat rendered with the GGUF's template."""
        if chat:
            prompt = self.tokenizer.render_chat([{"role": "user", "content": prompt}])
        return self.tokenizer.encode(prompt)


__all__ = ["LocalModel", "ShardSpec"]
