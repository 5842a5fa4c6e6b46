"""Speculative decoding's draft model: a small GGUF model of the served model's vocabulary, run in this process,
drafting greedy continuations for the route to verify (client/speculative.py)."""

from __future__ import annotations

from ..runtime.sampling import SamplingParams
from .local import LocalModel
from .speculative import MAX_DRAFT, check_draft_max, same_vocabulary


class DraftModel:
    """A small GGUF model drafting for a bigger one of the same vocabulary, in this process (llama.cpp, one shard,
    greedy). ``path``: the draft GGUF; ``target_metadata``: the served model's GGUF metadata, whose vocabulary it
    must share (ValueError otherwise, naming both sizes); ``max_length``: KV cells per drafting session (tokens);
    ``sessions``: drafting sessions at once (each request holds one; when all are taken a request decodes without
    drafts); ``threads``: llama.cpp threads. Raises what ``LocalModel.load`` raises."""

    def __init__(
        self, path: str, target_metadata: dict, max_length: int = 4096, sessions: int = 4, threads: int | None = 1
    ):
        from ..artifact.default_model import resolve_model
        from ..artifact.gguf_file import GGUFModelFile

        meta = GGUFModelFile(resolve_model(path)).metadata
        if not same_vocabulary(meta, target_metadata):
            raise ValueError(
                f"draft model {path}: its vocabulary ({len(meta.get('tokenizer.ggml.tokens') or [])} "
                f"tokens) is not the served model's "
                f"({len(target_metadata.get('tokenizer.ggml.tokens') or [])} tokens); a draft model "
                f"must share the tokenizer"
            )
        self.model = LocalModel.load(path, threads=threads, max_length=max_length, max_sessions=sessions)
        self.max_length = min(max_length, self.model.config.max_length)

    def drafter(self, k: int, length: int) -> ModelDrafter | None:
        """A drafter for one generation of at most ``length`` tokens, or None when none fits now (no free session,
        or longer than this model's sessions)."""
        if length + MAX_DRAFT + 1 > self.max_length:
            return None
        try:
            session = self.model.session(length + MAX_DRAFT + 1, SamplingParams(temperature=0))
        except RuntimeError:  # llama.cpp: every session slot taken
            return None
        return ModelDrafter(session, k)


class ModelDrafter:
    """Drafts with a model session (``LocalSession``, greedy): its KV follows the generation's history (the
    common prefix is kept, the rest fed), then it decodes up to ``k`` tokens one at a time. ``close`` frees it."""

    method = "draft"
    blocking = True  # runs the draft model: drafted in a worker thread off the event loop

    def __init__(self, session, k: int):
        self.session, self.k = session, check_draft_max(k)
        self.fed: list[int] = []  # tokens in the draft session's KV

    def draft(self, history: list[int], cap: int | None = None) -> list[int]:
        """Up to ``min(k, cap)`` greedy continuations of ``history`` by the draft model."""
        limit = self.k if cap is None else min(self.k, cap)
        if limit <= 0 or not history:
            return []
        n = 0
        for a, b in zip(self.fed, history):
            if a != b:
                break
            n += 1
        n = min(n, len(history) - 1)  # at least one token is fed: its logits give the first draft
        if n < len(self.fed):
            self.session.truncate(n)
            del self.fed[n:]
        out = [self.session.step(history[n:])]
        self.fed.extend(history[n:])
        while len(out) < limit:
            self.fed.append(out[-1])
            out.append(self.session.step([out[-1]]))
        return out

    def close(self) -> None:
        self.session.close()


__all__ = ["DraftModel", "ModelDrafter"]
