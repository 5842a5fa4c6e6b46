"""llama-cpp-python's ctypes bindings of llama.h (its module ``llama_cpp.llama_cpp``), loaded without running its
package's ``__init__``: that imports the high-level ``Llama`` class and, through it, jinja2, diskcache and the rest
of its chat and cache machinery, about 5 MiB of an idle node's RSS (docs/memory.md) that a shard, which calls
llama.h only, never uses. A process that imports ``llama_cpp`` later (the gateway's tokenizer) gets the whole
package, whose ``from .llama_cpp import *`` takes this same module: one loaded libllama either way."""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import sys
from types import ModuleType

PACKAGE = "llama_cpp"
DISTRIBUTION = "llama_cpp_python"


def _load() -> ModuleType:
    if PACKAGE in sys.modules:  # the whole package is imported already
        return importlib.import_module(f"{PACKAGE}.llama_cpp")
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None:
        raise ModuleNotFoundError(f"No module named {PACKAGE!r} (llama-cpp-python; run `make setup`)", name=PACKAGE)
    sys.modules[PACKAGE] = importlib.util.module_from_spec(spec)  # the package, its __init__ not run
    try:
        return importlib.import_module(f"{PACKAGE}.llama_cpp")
    finally:
        # an `import llama_cpp` after this runs the package whole (its submodules loaded here are taken as they are)
        del sys.modules[PACKAGE]


L = _load()


def version() -> str:
    """llama-cpp-python's version (the installed distribution's, as its package's ``__version__``)."""
    return importlib.metadata.version(DISTRIBUTION)


__all__ = ["L", "version"]
