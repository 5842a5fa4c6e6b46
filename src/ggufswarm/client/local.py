"""Load a GGUF model for in-process use: artifact, config, tokenizer and chained shard executors."""

from __future__ import annotations

import os
from dataclasses import dataclass

from ..artifact.default_model import resolve_model
from ..artifact.gguf_file import GGUFModelFile
from ..runtime.backends import DEFAULT_BACKEND, load_shard, model_config
from ..runtime.sampling import SamplingParams
from ..runtime.spec import ShardSpec, split_at
from .generate import LocalSession
from .tokenizer import Tokenizer


@dataclass
class LocalModel:
    """A whole model as in-process chained shards (one shard unless ``split`` points are given)."""

    file: GGUFModelFile
    config: object  # ModelConfig (torch) or ShardModelInfo (llama.cpp): n_layers, n_embd, n_vocab, max_length
    tokenizer: Tokenizer
    shards: list
    backend: str = DEFAULT_BACKEND

    @classmethod
    def load(
        cls,
        path: str | os.PathLike | None = None,
        split: list[int] | None = None,
        dtype: str = "float32",
        backend: str = DEFAULT_BACKEND,
        threads: int | None = None,
        max_length: int = 4096,
        all_logits: bool = False,
        max_sessions: int = 2,
    ) -> LocalModel:
        """Load ``path`` (default: the embedded Gemma 3 270M) cut at ``split`` layer indices, on ``backend``.

        ``max_length``: longest session the llama.cpp backend holds KV for (tokens; the torch
        backend grows its cache as needed); ``max_sessions``: sessions open at once on the llama.cpp
        backend (its KV is allocated up front for all of them); ``all_logits``: sessions will ask
        for every position's logits (perplexity). Raises GGUFError, or ValueError for an unsupported architecture, bad
        split points or dtype.
        """
        file = GGUFModelFile(resolve_model(path))
        config = model_config(file, backend)
        specs = split_at(config.n_layers, split or [])
        shards = [
            load_shard(
                file,
                spec,
                backend,
                config=config,
                dtype=dtype,
                threads=threads,
                max_length=min(max_length, config.max_length),
                max_sessions=max_sessions,
                all_logits=all_logits,
            )
            for spec in specs
        ]
        return cls(file, config, Tokenizer(str(file.path), file.metadata), shards, backend)

    def session(self, max_length: int | None = None, sampling: SamplingParams | None = None) -> LocalSession:
        """A new session over all shards; ``max_length`` defaults to the model's limit (≤ 128K)."""
        return LocalSession(self.shards, max_length or self.config.max_length, sampling or SamplingParams())

    def prompt_ids(self, prompt: str, chat: bool = False) -> list[int]:
        """Token ids of a plain prompt, or of a one-turn chat rendered with the GGUF's template (the prompt's
        text is never read as control tokens there: Tokenizer.encode_chat)."""
        if chat:
            return self.tokenizer.encode_chat([{"role": "user", "content": prompt}])
        return self.tokenizer.encode(prompt)


__all__ = ["LocalModel", "ShardSpec"]
