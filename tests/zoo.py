"""The architecture zoo: every decoder architecture of llama.cpp, run as layer ranges against llama.cpp's whole model.

llama.cpp's ``tests/test-llama-archs.cpp`` builds a tiny random model of nearly every architecture it knows (2 blocks
for most, ``n_embd`` 256 or 128, a 128-token vocabulary) and with ``-o DIR`` writes them as ``<arch>-dense.gguf`` /
``<arch>-moe.gguf``. ``probe`` runs one such file as shard chains of ``LlamaCppShard`` — the middle cut, and with 3+
blocks a 3-shard cut and a cut at every block boundary (one-block shards) — and the same cuts of a copy stretched to 8
blocks (``stretch``: 2 blocks cannot show a range that needs blocks of two kinds, e.g. a sliding-window and a
full-attention one, nor a rule with a period of 4), each against llama.cpp's own whole-model run of the same file
(llama-cpp-python's ``Llama``, same threads, ubatch and flash attention): the logits of every position of a 40-token
prefill and of 20 greedy decode steps must be equal (``np.array_equal``). One verdict per file:

* ``bitwise``: at least one chain ran, and every chain that ran is equal (``detail``: the cuts the backend refused,
  and why: the restrictions of the architecture's layer ranges);
* ``refused: <reason>``: ``LlamaCppShard`` raised UnsupportedShard for every cut (the first message);
* ``wrong: <max |diff|>``: a chain ran and differs (where: prefill or decode step, which cut);
* ``crash: <signal/stderr tail>``: llama.cpp aborted the process (or it hung past the timeout);
* ``error: <exception>``: any other exception (llama.cpp refused a shard file, ...);
* ``not-a-decoder: <why>``: not a causal text decoder by llama.cpp's own flags (``llama_model_has_encoder``,
  ``llama_model_has_decoder``, ``llama_model_is_diffusion``; the GGUF ``attention.causal = false`` the diffusion LMs'
  ``load_arch_hparams`` sets, a pooling type: embedding models), or a speech model whose output head is not a text
  vocabulary (``SPEECH``; llama.cpp has no flag for it).

llama.cpp aborts the process on some graphs, so ``run_zoo`` runs the probes in child processes (``python zoo.py
--worker``): each takes the next file, and one that dies is restarted, so a crash costs one file (a stretched copy whose
own whole-model run llama.cpp aborts on is dropped, and the file probed alone).

    python tests/zoo.py /tmp/zoo                 # the table of a directory of zoo files
    python tests/zoo.py /tmp/zoo/gpt2-dense.gguf # one file, in this process
    python tests/zoo.py --try-defaults /tmp/zoo  # architectures outside ARCH_RULES tried with the default rules
"""

from __future__ import annotations

import hashlib
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

N_PROMPT = 40
N_DECODE = 20
N_CTX = 256  # the zoo's trained context (test-llama-archs: n_ctx 256)
SEED = 1234  # test-llama-archs -s: the random weights (and this harness's prompt)
TIMEOUT_S = 120  # a probe running longer is taken for a hang (the worker is killed)
STRETCHED_REFERENCE = "reference run of the stretched copy"  # the phase a crash of llama.cpp's own run of it names
VERDICTS = ("bitwise", "refused", "wrong", "crash", "error", "not-a-decoder")

# Speech models: causal transformers, but their output is audio, not a text vocabulary (llama.cpp has no flag for it)
SPEECH = {
    "pockettts": "speech backbone: no LM head, the audio latents come from the flow net in the mmproj "
    "(src/models/pockettts.cpp)",
    "qwen3tts": "speech talker: its head predicts 3072 audio codec tokens, not text (src/models/qwen3vl.cpp, "
    "'Qwen3TTS model with codec_head as output')",
    "wavtokenizer-dec": "audio decoder: codec tokens to a spectrogram (src/models/wavtokenizer-dec.cpp)",
}


@dataclass
class Verdict:
    """One zoo file's result: ``kind`` one of VERDICTS, ``detail`` the reason / difference / tail (empty for
    bitwise)."""

    file: str
    arch: str
    variant: str  # "dense" or "moe" (from the file name)
    kind: str
    detail: str = ""
    cuts: list[list[int]] = field(default_factory=list)  # the chains probed: [blocks of the file, *split points]
    results: list[str] = field(default_factory=list)  # each chain's outcome: bitwise, refused: why, wrong: where
    n_layers: int = 0
    seconds: float = 0.0

    def __str__(self) -> str:
        return self.kind if not self.detail else f"{self.kind}: {self.detail}"


def _name_parts(path: Path) -> tuple[str, str]:
    stem = path.name.removesuffix(".gguf")
    for variant in ("dense", "moe"):
        if stem.endswith("-" + variant):
            return stem[: -len(variant) - 1], variant
    return stem, ""


def _phase(name: str) -> None:
    """Mark the phase on stderr: a crash report's tail then says where llama.cpp aborted."""
    sys.stderr.write(f"[zoo] {name}\n")
    sys.stderr.flush()


def decoder_check(path: Path, arch: str, metadata: dict) -> str | None:
    """Why ``path`` is not a causal text decoder (None when it is), by llama.cpp's own flags (module docstring)."""
    if arch in SPEECH:
        return SPEECH[arch]
    if metadata.get(f"{arch}.attention.causal") is False:
        return f"{arch}.attention.causal = false (bidirectional attention)"
    pooling = int(metadata.get(f"{arch}.pooling_type", 0) or 0)
    if 0 < pooling < 0x7FFFFFFF:  # LLAMA_POOLING_TYPE_MEAN, CLS, LAST, RANK (unspecified is -1: 0xFFFFFFFF)
        return f"{arch}.pooling_type = {pooling} (an embedding or reranking model)"
    import llama_cpp as L

    from ggufswarm.runtime.llamacpp.ffi import ensure_backend

    ensure_backend()
    params = L.llama_model_default_params()
    params.vocab_only = True  # hparams and vocabulary only: the flags depend on the architecture
    model = L.llama_model_load_from_file(str(path).encode(), params)
    if not model:
        return None  # let the probe say why llama.cpp refuses it
    try:
        if not L.llama_model_has_decoder(model):
            return "encoder only (llama_model_has_decoder false)"
        if L.llama_model_has_encoder(model):
            return "encoder-decoder or drafter (llama_model_has_encoder true): the decoder needs the encoder's output"
        if L.llama_model_is_diffusion(model):
            return (
                "diffusion LM (llama_model_is_diffusion; its load_arch_hparams sets causal_attn = false): "
                "bidirectional denoising, no causal decoding"
            )
    finally:
        L.llama_model_free(model)
    return None


def whole_model_run(path: Path, ids: list[int], n_decode: int, threads: int, n_ctx: int = N_CTX):
    """llama.cpp's whole model on token ids (llama-cpp-python, flash attention, every sliding-window cell kept as the
    backend keeps them): all prefill logits ``[T, n_vocab]`` float32, then ``n_decode`` greedy steps (their tokens
    and logits ``[n_vocab]``). The reference of the bitwise tests (test_llamacpp_backend.py too)."""
    import llama_cpp

    llm = llama_cpp.Llama(
        str(path),
        n_ctx=n_ctx,
        n_batch=n_ctx,
        n_ubatch=512,
        logits_all=True,
        n_threads=threads,
        n_threads_batch=threads,
        flash_attn=True,
        swa_full=True,
        verbose=False,
    )
    try:
        llm.eval(ids)
        prefill = np.array(llm.scores[: len(ids)])
        tokens, decode = [], []
        for _ in range(n_decode):
            tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
            tokens.append(tok)
            llm.eval([tok])
            decode.append(np.array(llm.scores[llm.n_tokens - 1]))
        return prefill, tokens, decode
    finally:
        llm.close()


def cuts_for(n_layers: int) -> list[list[int]]:
    """Split points probed for a model of ``n_layers`` blocks: the middle cut, a 3-shard cut when there are 3+, and
    a cut at every block boundary (one-block shards) when there are 3+ (with 2 the middle cut is that)."""
    cuts = [[n_layers // 2]] if n_layers >= 2 else []
    if n_layers >= 3:
        a, b = n_layers // 3, (2 * n_layers) // 3
        if 0 < a < b < n_layers and [a, b] != cuts[0]:
            cuts.append([a, b])
        cuts.append(list(range(1, n_layers)))
    return cuts


def _diff(a: np.ndarray, b: np.ndarray) -> str:
    if a.shape != b.shape:
        return f"shape {a.shape} vs {b.shape}"
    d = np.abs(a.astype(np.float64) - b.astype(np.float64))
    return f"{np.nanmax(d):.3g}" if np.isfinite(d).any() else "nan"


STRETCHED_BLOCKS = 8  # blocks of the stretched copy (at least twice the file's): a 4-block period fits twice


def _ffn_part(name: str) -> bool:
    """Whether a block tensor suffix (``ffn_up.weight``) or a per-block metadata key belongs to the feed-forward
    part."""
    return name.startswith(("ffn_", "exp_probs_b")) or any(w in name for w in ("feed_forward", "expert", "swiglu"))


def stretch(model, dest: Path, mix: bool = True, overrides: dict | None = None) -> Path:
    """A copy of zoo model ``model`` (a GGUFModelFile) with ``max(STRETCHED_BLOCKS, 2 n)`` blocks, written to ``dest``.

    test-llama-archs writes 2 blocks for most architectures, where the one middle cut leaves a shard without a
    sliding-window block (or without a recurrent or attention block, in a hybrid model), and no range can show a rule
    with a period of 4 blocks. The copy repeats the blocks in order (``b0 b1 b0 b1 ...``); after leading dense
    blocks (where the architecture's rules read ``leading_dense_block_count``) the repeated blocks take their
    attention part from ``b0, b1, ...`` in turn and their feed-forward part from the non-leading blocks, so the
    kinds still alternate (block 2 of a 2-block file with one leading dense block: ``b0``'s attention, ``b1``'s MoE).
    Every per-block metadata array follows its block's part. ``mix=False``: the non-leading blocks repeated whole
    (``b0 b1 b1 b1 ...``), where a leading block's attention does not fit a later block. ``overrides``: scalar
    metadata keys given another value of their type (kimi-k3's ``attn_res.block_size``). A model llama.cpp runs like
    any other; the reference is llama.cpp's whole-model run of the copy."""
    from gguf import GGUFValueType

    from ggufswarm.runtime.llamacpp.archs import ARCH_RULES
    from ggufswarm.runtime.llamacpp.derive import _write_gguf
    from ggufswarm.runtime.llamacpp.range_checks import n_model_layers

    arch = model.architecture
    n = int(model.metadata[f"{arch}.block_count"])
    if n != n_model_layers(model):
        raise ValueError("a zoo model with MTP blocks")
    rules = ARCH_RULES.get(arch)
    lead = int(model.metadata.get(f"{arch}.leading_dense_block_count", 0) or 0) if rules and rules.leading_dense else 0
    lead = min(lead, n - 1)
    total = max(STRETCHED_BLOCKS, 2 * n)
    # block j of the copy: (source of its attention part, source of its feed-forward part)
    recipe = [
        (j, j) if j < lead else ((j % n) if mix else lead + (j - lead) % (n - lead), lead + (j - lead) % (n - lead))
        for j in range(total)
    ]
    metadata = {}
    for key, value in model.metadata.items():
        vtype, item = model.metadata_types[key]
        if (
            key.startswith(f"{arch}.")
            and isinstance(value, list)
            and len(value) == n
            and not key.endswith(".rope.dimension_sections")
        ):
            value = [value[f if _ffn_part(key) else a] for a, f in recipe]
        metadata[key] = (value, vtype, item)
    metadata[f"{arch}.block_count"] = (total, GGUFValueType.UINT32, None)
    for key, value in (overrides or {}).items():
        metadata[key] = (value, metadata[key][1], None)
    # qwen4exp's n-gram embedding block (ple.layers lists it by index, and llama.cpp builds one): its ple_* tensors
    # stay in that block, not in its copies
    ple_blocks = [int(i) for i in np.atleast_1d(model.metadata.get(f"{arch}.ple.layers", []))]
    tensors = []
    for j, (a, f) in enumerate(recipe):
        for name, info in model.tensors.items():
            suffix = name.split(".", 2)[2] if info.layer is not None else ""
            if ple_blocks and suffix.startswith("ple_") and j not in ple_blocks:
                continue
            if info.layer == (f if _ffn_part(suffix) else a):
                tensors.append((name, f"blk.{j}.{suffix}"))
    tensors += [(name, name) for name, info in model.tensors.items() if info.layer is None]
    return _write_gguf(model, dest, metadata, tensors, [])


def _run_cut(file, points, ids, reference, work_dir, threads) -> tuple[str, str]:
    """One chain of shards cut at ``points`` against ``reference`` (prefill logits, tokens, decode logits):
    ``("bitwise", "")``, ``("refused", reason)`` or ``("wrong", where and by how much)``."""
    from ggufswarm.runtime.llamacpp.backend import LlamaCppShard
    from ggufswarm.runtime.llamacpp.errors import UnsupportedShard
    from ggufswarm.runtime.llamacpp.range_checks import n_model_layers
    from ggufswarm.runtime.spec import split_at

    shards = []
    try:
        try:
            for spec in split_at(n_model_layers(file), points):
                shards.append(
                    LlamaCppShard(
                        file,
                        spec,
                        n_ctx_seq=N_CTX,
                        n_seq_max=1,
                        n_batch=N_CTX,
                        threads=threads,
                        all_logits=True,
                        cache_dir=work_dir,
                    )
                )
        except UnsupportedShard as exc:
            return "refused", str(exc)
        prefill, tokens, decode = reference()
        kvs = [s.new_session(N_CTX) for s in shards]
        out = _chain(shards, kvs, np.asarray(ids), "all")
        if not np.array_equal(out, prefill, equal_nan=True):
            return "wrong", f"prefill max |diff| {_diff(out, prefill)}"
        for i, tok in enumerate(tokens):
            out = _chain(shards, kvs, np.asarray([tok]), "last")[0]
            if not np.array_equal(out, decode[i], equal_nan=True):
                return "wrong", f"decode step {i} max |diff| {_diff(out, decode[i])}"
        return "bitwise", ""
    finally:
        for s in shards:
            s.close()


def probe(
    path: str | os.PathLike,
    work_dir: str | os.PathLike,
    threads: int = 1,
    n_prompt: int = N_PROMPT,
    n_decode: int = N_DECODE,
    try_defaults: bool = False,
    stretched: bool = True,
) -> Verdict:
    """Run one zoo file as shard chains against llama.cpp's whole model, in this process (module docstring).

    The cuts: the middle one (and with 3+ blocks a 3-shard one and one at every boundary) of the file, and with
    ``stretched`` the same of a copy with twice the blocks (``stretch``). The verdict: ``wrong`` if any chain
    differs, else ``bitwise`` if at least one chain ran (every one that ran is then equal; ``detail`` names the cuts
    the backend refused and why), else ``refused`` with the first reason. ``try_defaults``: an architecture outside
    ``ARCH_RULES`` is tried with the default ``ArchRules()`` (in this process only) instead of being refused: how
    the table is grown."""
    from ggufswarm.artifact.gguf_file import GGUFModelFile
    from ggufswarm.runtime.llamacpp.archs import ARCH_RULES, ArchRules
    from ggufswarm.runtime.llamacpp.derive import n_vocab
    from ggufswarm.runtime.llamacpp.range_checks import n_model_layers

    path = Path(path)
    t0 = time.monotonic()
    arch, variant = _name_parts(path)
    verdict = Verdict(path.name, arch, variant, "error")
    try:
        file = GGUFModelFile(path)
        arch = verdict.arch = file.architecture
        why = decoder_check(path, arch, file.metadata)
        if why:
            verdict.kind, verdict.detail = "not-a-decoder", why
            return verdict
        if try_defaults and arch not in ARCH_RULES:
            from ggufswarm.artifact.cut_rules import CUT_RULES, CutRules

            ARCH_RULES[arch] = ArchRules()
            CUT_RULES[arch] = CutRules()
        verdict.n_layers = n_model_layers(file)
        ids = np.random.default_rng(SEED).integers(0, n_vocab(file), n_prompt).tolist()
        files = [file]
        mixed = [False]  # per file: a stretched copy mixing blocks' parts
        notes: list[str] = []
        outcomes: list[tuple[int, list[int], str, str]] = []  # (blocks, points, kind, detail)
        for k, f in enumerate(files):
            n = n_model_layers(f)
            cache: list = []

            def reference(f=f, cache=cache, label=f"{n} blocks", copy=k > 0):
                if not cache:
                    _phase(f"{path.name} ({label}): {STRETCHED_REFERENCE if copy else 'reference'}")
                    cache.append(whole_model_run(f.path, ids, n_decode, threads))
                    _phase(f"{path.name} ({label}): shards")
                return cache[0]

            for points in cuts_for(n):
                _phase(f"{path.name} ({n} blocks): shards {points}")
                verdict.cuts.append([n, *points])
                verdict.results.append("error")
                try:
                    kind, detail = _run_cut(f, points, ids, reference, work_dir, threads)
                except Exception as exc:
                    if k == 0 or cache:
                        raise
                    verdict.cuts.pop()
                    verdict.results.pop()
                    notes.append(
                        f"llama.cpp does not run the {'mixed ' * mixed[k]}stretched copy ({type(exc).__name__}: {exc})"
                    )
                    if mixed[k]:  # the leading dense blocks' attention does not fit the others: repeat blocks
                        files.append(GGUFModelFile(stretch(file, Path(work_dir) / f"repeated-{path.name}", mix=False)))
                        mixed.append(False)
                    break
                outcomes.append((n, points, kind, detail))
                verdict.results[-1] = f"{kind}: {detail}" if detail else kind
                if kind == "wrong":
                    verdict.kind, verdict.detail = "wrong", f"{detail} ({n} blocks cut at {points})"
                    return verdict
            if k == 0 and stretched and n >= 2:
                files.append(GGUFModelFile(stretch(file, Path(work_dir) / f"stretched-{path.name}")))
                mixed.append(True)
        ran = [o for o in outcomes if o[2] == "bitwise"]
        refused = [o for o in outcomes if o[2] == "refused"]
        if ran:
            verdict.kind = "bitwise"
            verdict.detail = "; ".join([f"{n} blocks cut at {p} refused: {d}" for n, p, _, d in refused] + notes)
        elif refused:
            verdict.kind, verdict.detail = "refused", "; ".join(list(dict.fromkeys(d for *_, d in refused)) + notes)
        else:
            verdict.kind, verdict.detail = "refused", f"{verdict.n_layers} block: nothing to cut"
        return verdict
    except Exception as exc:
        verdict.kind, verdict.detail = "error", f"{type(exc).__name__}: {exc}"
        return verdict
    finally:
        verdict.seconds = round(time.monotonic() - t0, 2)


def _chain(shards, kvs, ids: np.ndarray, logits: str) -> np.ndarray:
    """One step through the chain (a shard routing blocks by token id gets the ids with the hidden states)."""
    x = ids
    for shard, kv in zip(shards, kvs):
        x = shard.forward(kv, x, logits=logits, **({"token_ids": ids} if shard.needs_token_ids else {}))
    return x


# -- child processes ---------------------------------------------------------------------------------------------------


def _worker(threads: int, try_defaults: bool = False) -> None:
    """``zoo.py --worker``: read jobs (one JSON object a line: ``path``, ``stretched``) on stdin, answer one JSON
    verdict a line on the original stdout (llama.cpp's own output goes to stderr)."""
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    work = Path(tempfile.mkdtemp(prefix="zoo-worker-"))
    try:
        for line in sys.stdin:
            if not line.strip():
                continue
            req = json.loads(line)
            job = work / "job"
            job.mkdir(exist_ok=True)
            verdict = probe(req["path"], job, threads=threads, try_defaults=try_defaults, stretched=req["stretched"])
            shutil.rmtree(job, ignore_errors=True)
            out.write(json.dumps(asdict(verdict)) + "\n")
    finally:
        shutil.rmtree(work, ignore_errors=True)


class _Child:
    """A worker process, its stderr in a file (the tail of a crash comes from there)."""

    def __init__(self, threads: int, log_dir: Path, n: int, try_defaults: bool = False):
        self.log = log_dir / f"worker-{n}.log"
        self.err = open(self.log, "ab")
        env = dict(os.environ, PYTHONUNBUFFERED="1", GGML_NO_BACKTRACE="1")  # ggml's abort: no gdb backtrace
        self.proc = subprocess.Popen(
            [
                sys.executable,
                str(Path(__file__).resolve()),
                "--worker",
                "--threads",
                str(threads),
                *(["--try-defaults"] if try_defaults else []),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.err,
            env=env,
            text=True,
            bufsize=1,
        )
        self.job: Path | None = None
        self.stretched = True
        self.started = 0.0
        self.log_offset = 0

    def give(self, path: Path, stretched: bool = True) -> None:
        self.job, self.stretched, self.started = path, stretched, time.monotonic()
        self.err.flush()
        self.log_offset = self.log.stat().st_size
        self.proc.stdin.write(json.dumps({"path": str(path), "stretched": stretched}) + "\n")
        self.proc.stdin.flush()

    def _lines(self) -> list[str]:
        with open(self.log, "rb") as f:
            f.seek(self.log_offset)
            text = f.read().decode("utf-8", "replace")
        return [ln.strip() for ln in text.splitlines() if ln.strip()]

    def tail(self, n_lines: int = 4, phases: bool = True) -> str:
        """The last ``n_lines`` lines the current job wrote to stderr (llama.cpp's errors; ``phases``: with the
        ``[zoo]`` phase markers)."""
        lines = [ln for ln in self._lines() if phases or not ln.startswith("[zoo]")]
        return " | ".join(lines[-n_lines:])

    def phase(self) -> str:
        """The last ``[zoo]`` phase marker of the current job (where it was when it died)."""
        return next((ln for ln in reversed(self._lines()) if ln.startswith("[zoo]")), "")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()  # this worker only, by its own handle
        self.proc.wait()
        self.err.close()


def run_zoo(
    files: list[Path],
    workers: int = 2,
    threads: int = 1,
    timeout: float = TIMEOUT_S,
    log_dir: str | os.PathLike | None = None,
    progress=None,
    try_defaults: bool = False,
) -> list[Verdict]:
    """Probe every file in child processes (``workers`` at once, ``threads`` llama.cpp threads each); a worker that
    dies or hangs past ``timeout`` seconds is replaced and its file gets a ``crash`` verdict. Verdicts in file order.
    ``progress``: called with each Verdict as it arrives; ``try_defaults``: as ``probe``."""
    files = [Path(f) for f in files]
    # the big ones first: the workers finish together; (path, stretched)
    queue = [(p, True) for p in sorted(files, key=lambda p: -p.stat().st_size)]
    notes: dict[Path, str] = {}  # file -> why its verdict is from the file alone
    results: dict[Path, Verdict] = {}
    own_logs = log_dir is None
    logs = Path(tempfile.mkdtemp(prefix="zoo-logs-")) if own_logs else Path(log_dir)
    logs.mkdir(parents=True, exist_ok=True)
    children: list[_Child] = []
    n_started = 0

    def spawn() -> _Child:
        nonlocal n_started
        n_started += 1
        return _Child(threads, logs, n_started, try_defaults)

    def done(child: _Child, verdict: Verdict) -> None:
        results[child.job] = verdict
        child.job = None
        if progress:
            progress(verdict)

    try:
        children = [spawn() for _ in range(max(1, min(workers, len(queue))))]
        for c in children:
            if queue:
                c.give(*queue.pop(0))
        while any(c.job for c in children):
            busy = [c for c in children if c.job]
            ready, _, _ = select.select([c.proc.stdout for c in busy], [], [], 1.0)
            for i, c in enumerate(list(children)):
                if c.job is None:
                    continue
                line = c.proc.stdout.readline() if c.proc.stdout in ready else None
                if line:
                    verdict = Verdict(**json.loads(line))
                    if verdict.kind == "error" and "LlamaCppError" in verdict.detail:  # llama.cpp said why on stderr
                        verdict.detail += f" [llama.cpp: {c.tail(phases=False)}]"
                    if c.job in notes:
                        verdict.detail = "; ".join(filter(None, [verdict.detail, notes.pop(c.job)]))
                    done(c, verdict)
                elif line == "" or time.monotonic() - c.started > timeout:  # EOF: it died; or it hangs
                    hung = line is None
                    c.stop()
                    rc = c.proc.returncode
                    arch, variant = _name_parts(c.job)
                    if hung:
                        what = f"hung past {timeout:.0f} s (killed)"
                    elif rc < 0:
                        what = f"{signal.Signals(-rc).name}"
                    else:
                        what = f"exit code {rc}"
                    tail = c.tail()
                    if c.stretched and STRETCHED_REFERENCE in c.phase():
                        # llama.cpp's own run of the stretched copy died: that copy says nothing, probe the file alone
                        notes[c.job] = f"the stretched copy crashes llama.cpp's whole-model run ({what}: {tail})"
                        queue.insert(0, (c.job, False))
                        c.job = None
                    else:
                        done(
                            c,
                            Verdict(
                                c.job.name,
                                arch,
                                variant,
                                "crash",
                                f"{what}: {tail}",
                                seconds=round(time.monotonic() - c.started, 2),
                            ),
                        )
                    c = children[i] = spawn()
                else:
                    continue
                if queue:
                    c.give(*queue.pop(0))
    finally:
        for c in children:
            if c.proc.stdin:
                try:
                    c.proc.stdin.close()
                except OSError:
                    pass
            c.stop()
        if own_logs:
            shutil.rmtree(logs, ignore_errors=True)
    return [results[f] for f in files]


# -- the zoo files -----------------------------------------------------------------------------------------------------


def tool_key(tool: str | os.PathLike) -> str:
    """Cache key of the zoo a test-llama-archs binary writes: the SHA-256 (first 16 hex digits) of the binary and of
    the llama/ggml libraries beside it (what it links: the models it writes depend on both), and the seed."""
    tool = Path(tool).resolve()
    h = hashlib.sha256(tool.read_bytes())
    for lib in sorted(tool.parent.glob("lib*.so*")):
        if lib.is_file() and not lib.is_symlink() and lib.name.startswith(("libllama", "libggml")):
            h.update(lib.name.encode() + lib.read_bytes())
    return f"{h.hexdigest()[:16]}-s{SEED}"


def find_tool(root: str | os.PathLike | None = None) -> tuple[Path | None, str]:
    """llama.cpp's test-llama-archs: ``$GGUFSWARM_TEST_LLAMA_ARCHS``, else the one ``scripts/build_llama_cpp_python.sh
    tools`` builds from the kept wheel build tree; ``(path, "")``, or ``(None, why not)``."""
    env = os.environ.get("GGUFSWARM_TEST_LLAMA_ARCHS")
    if env:
        return (Path(env), "") if Path(env).is_file() else (None, f"GGUFSWARM_TEST_LLAMA_ARCHS={env} is not a file")
    root = Path(root) if root else Path(__file__).resolve().parent.parent
    try:
        proc = subprocess.run(
            ["bash", str(root / "scripts" / "build_llama_cpp_python.sh"), "tools"],
            capture_output=True,
            text=True,
            timeout=1800,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, f"scripts/build_llama_cpp_python.sh tools: {exc}"
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines or not Path(lines[-1]).is_file():
        return None, f"scripts/build_llama_cpp_python.sh tools failed: {proc.stderr.strip()[-300:]}"
    return Path(lines[-1]), ""


def write_zoo(tool: str | os.PathLike, cache_root: str | os.PathLike | None = None) -> Path:
    """The zoo of ``tool`` (llama.cpp's test-llama-archs, ``-o DIR -s SEED``), written once per machine into
    ``~/.cache/ggufswarm/zoo/<tool_key>/`` (``cache_root`` instead of ``~/.cache/ggufswarm/zoo``); its path.
    RuntimeError when the tool fails (e.g. a binary older than the libllama it links: its metadata keys no longer
    match)."""
    root = Path(cache_root) if cache_root else Path.home() / ".cache" / "ggufswarm" / "zoo"
    dest = root / tool_key(tool)
    if (dest / "COMPLETE").exists():
        return dest
    tmp = root / f".{dest.name}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        proc = subprocess.run([str(tool), "-o", str(tmp), "-s", str(SEED)], capture_output=True, text=True, timeout=600)
        if proc.returncode != 0 or not list(tmp.glob("*.gguf")):
            tail = (proc.stdout + proc.stderr).strip().splitlines()[-3:]
            raise RuntimeError(f"{tool} -o failed ({proc.returncode}): {' | '.join(tail)}")
        (tmp / "COMPLETE").write_text(f"{tool}\n")
        shutil.rmtree(dest, ignore_errors=True)
        os.replace(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def zoo_files(directory: str | os.PathLike) -> list[Path]:
    return sorted(Path(directory).glob("*.gguf"))


# -- reports -----------------------------------------------------------------------------------------------------------


def counts(verdicts: list[Verdict]) -> dict:
    """Per-file and per-architecture counts. An architecture counts as bitwise when all its files (dense, moe) are;
    as a decoder when any of its files is one."""
    by_kind = {k: sum(v.kind == k for v in verdicts) for k in VERDICTS}
    archs: dict[str, list[Verdict]] = {}
    for v in verdicts:
        archs.setdefault(v.arch, []).append(v)
    decoders = {a: vs for a, vs in archs.items() if any(v.kind != "not-a-decoder" for v in vs)}
    bitwise = [a for a, vs in decoders.items() if all(v.kind in ("bitwise", "not-a-decoder") for v in vs)]
    return {
        "files": len(verdicts),
        **by_kind,
        "archs": len(archs),
        "decoder_archs": len(decoders),
        "bitwise_archs": len(bitwise),
        "not_decoder_archs": len(archs) - len(decoders),
        "bitwise_share": len(bitwise) / len(decoders) if decoders else 0.0,
    }


def table(verdicts: list[Verdict], width: int = 150) -> str:
    rows = [f"{'file':<28} {'blocks':>6} {'cuts':<16} {'s':>5}  verdict"]
    for v in sorted(verdicts, key=lambda v: v.file):
        text = str(v)
        if len(text) > width:
            text = text[: width - 3] + "..."
        rows.append(
            f"{v.file:<28} {v.n_layers:>6} {' '.join(f'{c[0]}:' + ','.join(map(str, c[1:])) for c in v.cuts):<16} "
            f"{v.seconds:>5.1f}  {text}"
        )
    c = counts(verdicts)
    rows.append(
        f"{c['files']} files: "
        + ", ".join(f"{c[k]} {k}" for k in VERDICTS)
        + f"; {c['bitwise_archs']}/{c['decoder_archs']} decoder architectures bitwise "
        f"({100 * c['bitwise_share']:.1f} %), {c['not_decoder_archs']} not decoders"
    )
    return "\n".join(rows)


def main(argv: list[str]) -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("paths", nargs="*", help="zoo directories or files")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--json", help="write the verdicts here")
    ap.add_argument(
        "--try-defaults",
        action="store_true",
        help="try architectures outside ARCH_RULES with the default rules (to grow the table)",
    )
    args = ap.parse_args(argv)
    if args.worker:
        _worker(args.threads, args.try_defaults)
        return 0
    files = [f for p in args.paths for f in (zoo_files(p) if Path(p).is_dir() else [Path(p)])]
    t0 = time.monotonic()
    if len(files) == 1:  # in this process: a traceback and llama.cpp's messages stay visible
        with tempfile.TemporaryDirectory() as tmp:
            verdicts = [probe(files[0], tmp, threads=args.threads, try_defaults=args.try_defaults)]
    else:
        verdicts = run_zoo(
            files,
            workers=args.workers,
            threads=args.threads,
            try_defaults=args.try_defaults,
            progress=lambda v: print(f"{v.file}: {str(v)[:200]}", file=sys.stderr, flush=True),
        )
    print(table(verdicts))
    print(f"{time.monotonic() - t0:.1f} s", file=sys.stderr)
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(v) for v in verdicts], indent=1))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
    raise SystemExit(main(sys.argv[1:]))
