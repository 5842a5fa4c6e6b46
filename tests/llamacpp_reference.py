"""llama.cpp's own answers, computed on the machine that runs the tests, and cached there keyed by that machine.

llama.cpp's numbers depend on the CPU kind: its kernels differ between instruction sets (AVX2 vs AVX-512 round
differently; Gemma 3 270M has near-ties, so even greedy tokens differ between kinds). A reference made on another
machine therefore stands for nothing here. ``cached`` stores a computed reference under a key of this machine
(``machine_key``: the CPU's flags and model, llama.cpp's system info and the libllama build's SHA-256) and refuses
(``ForeignReference``, then recomputes) a file whose key differs: one copied from elsewhere is never used.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import json
import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

CACHE_DIR = Path(
    os.environ.get("GGUFSWARM_REFERENCE_CACHE", Path.home() / ".cache" / "ggufswarm" / "llamacpp-references")
)


class ForeignReference(Exception):
    """A cached reference made on another machine kind or llama.cpp build than this one."""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


@functools.lru_cache(maxsize=1)
def machine_key() -> dict:
    """What determines llama.cpp's bits here: ``cpu_flags`` (``/proc/cpuinfo``'s flags, sorted), ``cpu_model``,
    ``llama_system_info`` (the kernels llama.cpp uses, e.g. ``AVX512 = 1``), ``build_sha256`` (the libllama and
    ggml libraries of the build, with its compile flags) and ``llama_cpp_python`` (the package version)."""
    import llama_cpp

    flags, model = "", ""
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        name, _, value = line.partition(":")
        if name.strip() == "flags" and not flags:
            flags = " ".join(sorted(value.split()))
        elif name.strip() == "model name" and not model:
            model = value.strip()
    libs = sorted(p for p in (Path(llama_cpp.__file__).parent / "lib").glob("*.so*") if not p.is_symlink())
    return {
        "cpu_model": model,
        "cpu_flags": flags,
        "llama_system_info": llama_cpp.llama_print_system_info().decode().strip(),
        "build_sha256": {p.name: _sha256(p) for p in libs},
        "llama_cpp_python": llama_cpp.__version__,
    }


def load(path: Path, key: dict | None = None) -> Any:
    """The value stored at ``path``. Raises ForeignReference when it was made under another ``machine_key``."""
    key = key or machine_key()
    doc = json.loads(path.read_text())
    made = doc.get("machine", {})
    if made != key:
        diff = sorted(k for k in set(made) | set(key) if made.get(k) != key.get(k))
        raise ForeignReference(
            f"{path} was made on another machine or llama.cpp build (differs in {', '.join(diff)}: "
            f"made on {made.get('cpu_model')!r}, this is {key['cpu_model']!r})"
        )
    return doc["value"]


def cached(name: str, inputs: dict, compute: Callable[[], Any], cache_dir: Path | None = None) -> Any:
    """``compute()`` (a JSON value), or the value stored by an earlier call with the same ``name`` and ``inputs`` on
    this machine. A stored file from another machine is refused (a warning) and computed anew."""
    key = machine_key()
    digest = hashlib.sha256(json.dumps([name, inputs, key], sort_keys=True).encode()).hexdigest()[:16]
    path = (cache_dir or CACHE_DIR) / f"{name}-{digest}.json"
    if path.exists():
        try:
            return load(path, key)
        except ForeignReference as exc:
            warnings.warn(f"{exc}; computing it here", stacklevel=2)
    value = compute()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"name": name, "inputs": inputs, "machine": key, "value": value}))
    tmp.replace(path)
    return value


def llama_perplexity(model: Path, text_file: Path, n_ctx: int, threads: int = 2, n_batch: int = 2048) -> dict:
    """What ``llama-perplexity -m MODEL -f TEXT -c N_CTX -t THREADS`` computes (tools/perplexity/perplexity.cpp of the
    llama.cpp llama-cpp-python bundles, its default path), through the same libllama, on this machine; cached.

    As the tool: the file minus one trailing newline, tokenized with BOS and without parsing special tokens; chunks of
    ``n_ctx`` tokens, each starting with BOS; ``n_batch // n_ctx`` chunks decoded side by side as sequences of one
    batch (a context of that many sequences, one KV stream each, ``n_ubatch`` 512, flash attention auto, f16 KV); the
    second half of each chunk scored with a log-softmax in double precision. Returns ``{"ppl", "running", "n_tokens",
    "n_chunks"}`` (``running``: the running perplexity after each chunk, as the tool prints it).
    """
    inputs = {
        "model_sha256": _sha256(model),
        "text_sha256": _sha256(text_file),
        "n_ctx": n_ctx,
        "threads": threads,
        "n_batch": n_batch,
    }
    return cached("llama-perplexity", inputs, lambda: _llama_perplexity(model, text_file, n_ctx, threads, n_batch))


def _llama_perplexity(model_path: Path, text_file: Path, n_ctx: int, threads: int, n_batch: int) -> dict:
    import llama_cpp as L

    text = text_file.read_bytes()
    text = text[:-1] if text.endswith(b"\n") else text
    n_seq = max(1, n_batch // n_ctx)
    mparams = L.llama_model_default_params()
    model = L.llama_model_load_from_file(str(model_path).encode(), mparams)
    assert model, f"llama.cpp could not load {model_path}"
    cparams = L.llama_context_default_params()
    cparams.n_ctx = n_seq * n_ctx
    cparams.n_batch = min(n_batch, cparams.n_ctx)
    cparams.n_ubatch = 512
    cparams.n_seq_max = n_seq
    cparams.n_threads = cparams.n_threads_batch = threads
    cparams.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_AUTO
    cparams.kv_unified = False
    ctx = L.llama_init_from_model(model, cparams)
    batch = L.llama_batch_init(cparams.n_batch, 0, 1)
    try:
        vocab = L.llama_model_get_vocab(model)
        n_vocab = L.llama_vocab_n_tokens(vocab)
        buf = (L.llama_token * (len(text) + 8))()
        n = L.llama_tokenize(vocab, text, len(text), buf, len(buf), True, False)
        assert n > 0, n
        tokens = list(buf[:n])
        bos = L.llama_vocab_bos(vocab) if L.llama_vocab_get_add_bos(vocab) else None
        n_chunk = len(tokens) // n_ctx
        first = n_ctx // 2
        assert len(tokens) >= 2 * n_ctx and cparams.n_batch % n_ctx == 0
        nll, count, running = 0.0, 0, []
        for i in range(0, n_chunk, n_seq):
            n_seq_batch = min(n_seq, n_chunk - i)
            L.llama_memory_clear(L.llama_get_memory(ctx), True)
            batch.n_tokens = 0
            for seq in range(n_seq_batch):
                start = (i + seq) * n_ctx
                for k in range(n_ctx):
                    j = batch.n_tokens
                    batch.token[j] = bos if (k == 0 and bos is not None) else tokens[start + k]
                    batch.pos[j] = k
                    batch.n_seq_id[j] = 1
                    batch.seq_id[j][0] = seq
                    batch.logits[j] = k >= first
                    batch.n_tokens += 1
            rc = L.llama_decode(ctx, batch)
            assert rc == 0, f"llama_decode failed ({rc})"
            for seq in range(n_seq_batch):
                ptr = L.llama_get_logits_ith(ctx, seq * n_ctx + first)
                rows = np.ctypeslib.as_array(
                    ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)), shape=((n_ctx - first) * n_vocab,)
                ).reshape(n_ctx - first, n_vocab)
                rows = rows[: n_ctx - 1 - first].astype(np.float64)
                target = np.asarray(tokens[(i + seq) * n_ctx + first + 1 : (i + seq + 1) * n_ctx])
                peak = rows.max(axis=1)
                lse = np.log(np.exp(rows - peak[:, None]).sum(axis=1)) + peak
                nll += float((lse - rows[np.arange(len(target)), target]).sum())
                count += len(target)
                running.append(float(np.exp(nll / count)))
        return {"ppl": running[-1], "running": running, "n_tokens": len(tokens), "n_chunks": n_chunk}
    finally:
        L.llama_batch_free(batch)
        L.llama_free(ctx)
        L.llama_model_free(model)
