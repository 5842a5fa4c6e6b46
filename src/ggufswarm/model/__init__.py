"""Model architectures: one module per family, each a GGUF-metadata → ModelConfig mapping and a block recipe."""

from __future__ import annotations

from types import ModuleType

from . import deepseek2, gemma3, llama, qwen, qwenmoe
from .config import MAX_CONTEXT, MLAConfig, ModelConfig, MoEConfig, UnsupportedArchitecture

FAMILIES: dict[str, ModuleType] = {
    arch: fam for fam in (deepseek2, gemma3, llama, qwen, qwenmoe) for arch in fam.ARCHITECTURES
}
SUPPORTED = tuple(sorted(FAMILIES))


def family(arch: str) -> ModuleType:
    """The family module for GGUF architecture ``arch``; UnsupportedArchitecture if there is none."""
    try:
        return FAMILIES[arch]
    except KeyError:
        raise UnsupportedArchitecture(
            f"unsupported architecture '{arch}' for the torch backend (supported: {', '.join(SUPPORTED)}); "
            f"the llama.cpp backend (the default) runs more"
        ) from None


def load_config(model_file) -> ModelConfig:
    """ModelConfig of a GGUFModelFile; n_vocab from ``token_embd.weight``'s rows."""
    arch = model_file.architecture
    fam = family(arch)
    n_vocab = model_file.tensors["token_embd.weight"].shape[0]
    return fam.config(model_file.metadata, arch, n_vocab)


__all__ = [
    "FAMILIES",
    "SUPPORTED",
    "MAX_CONTEXT",
    "MLAConfig",
    "ModelConfig",
    "MoEConfig",
    "UnsupportedArchitecture",
    "family",
    "load_config",
]
