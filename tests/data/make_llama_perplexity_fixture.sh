#!/usr/bin/env bash
# Regenerate tests/data/llama_perplexity_gemma.json: llama.cpp's own perplexity (llama-perplexity, built by
# `make llamacpp-tools` from the llama.cpp that llama-cpp-python 0.3.36 bundles) of the default model
# (Gemma 3 270M Q4_K_M) on tests/data/gpl-3.0-excerpt.txt, at -c 256 and -c 512 with -t 2, all other
# llama-perplexity options at their defaults (-b 2048: several chunks decoded side by side as sequences).
#
# Usage:  bash tests/data/make_llama_perplexity_fixture.sh
# Env:    PYTHON (default .venv/bin/python; finds the default model and counts tokens),
#         MODEL (a GGUF path instead of the default model), LLAMA_PERPLEXITY (the binary).
# The raw logs go to .cache/llamacpp-tools/perplexity-c{256,512}.log (not committed).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
PYTHON="${PYTHON:-$ROOT/.venv/bin/python}"
PPL_BIN="${LLAMA_PERPLEXITY:-.cache/llamacpp-tools/0.3.36/bin/llama-perplexity}"
TEXT=tests/data/gpl-3.0-excerpt.txt
OUT=tests/data/llama_perplexity_gemma.json
LOGDIR=.cache/llamacpp-tools
CTX_SIZES=(256 512)
THREADS=2

[ -x "$PPL_BIN" ] || { echo "missing $PPL_BIN: run 'make llamacpp-tools' first" >&2; exit 1; }
[ -x "$PYTHON" ] || { echo "missing $PYTHON: run 'make setup' first (or set PYTHON)" >&2; exit 1; }
MODEL="${MODEL:-$("$PYTHON" -c 'from ggufswarm.artifact.default_model import default_model_path; print(default_model_path())')}"
[ -f "$MODEL" ] || { echo "model not found: $MODEL" >&2; exit 1; }
mkdir -p "$LOGDIR"

"$PPL_BIN" --version > "$LOGDIR/perplexity-version.txt" 2>&1
for c in "${CTX_SIZES[@]}"; do
    cmd=("$PPL_BIN" -m "$MODEL" -f "$TEXT" -c "$c" -t "$THREADS")
    echo "running: ${cmd[*]}" >&2
    printf '%s\n' "${cmd[*]}" > "$LOGDIR/perplexity-c$c.cmd"
    "${cmd[@]}" > "$LOGDIR/perplexity-c$c.log" 2>&1 \
        || { tail -n 30 "$LOGDIR/perplexity-c$c.log" >&2; echo "llama-perplexity failed (ctx $c)" >&2; exit 1; }
done

"$PYTHON" - "$MODEL" "$TEXT" "$OUT" "$LOGDIR" "${CTX_SIZES[@]}" <<'EOF'
import hashlib, json, re, sys
from pathlib import Path

model, text_path, out, logdir, *ctxs = sys.argv[1:]
logdir = Path(logdir)

def sha256(p):
    h = hashlib.sha256()
    with open(p, "rb") as f:
        for b in iter(lambda: f.read(1 << 20), b""):
            h.update(b)
    return h.hexdigest()

version_txt = (logdir / "perplexity-version.txt").read_text()
# "version: 0.5.0-dev (build 1, commit 0c1e570)" (build 1: the sdist ships a shallow clone)
m = re.search(r"^version: (\S+) \(build (\d+), commit (\w+)\)", version_txt, re.M)
built = re.search(r"^built with (.*)$", version_txt, re.M)

# Token count as llama-perplexity tokenizes: file minus one trailing '\n', BOS added, special tokens
# not parsed (common_tokenize(ctx, prompt, true)), with the llama.cpp llama-cpp-python bundles.
text = Path(text_path).read_bytes()
if text.endswith(b"\n"):
    text = text[:-1]
try:
    import os
    import llama_cpp
    saved = os.dup(2)  # a vocab-only load warns about n_ctx_train on fd 2; keep the output clean
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            llm = llama_cpp.Llama(model, vocab_only=True, verbose=False)
    finally:
        os.dup2(saved, 2)
        os.close(saved)
    n_tokens = len(llm.tokenize(text, add_bos=True, special=False))
except Exception as exc:  # the count is informative only
    print(f"could not count tokens: {exc}", file=sys.stderr)
    n_tokens = None

runs = []
for c in ctxs:
    log = (logdir / f"perplexity-c{c}.log").read_text(errors="replace")
    cmd = (logdir / f"perplexity-c{c}.cmd").read_text().strip()
    calc = re.search(r"calculating perplexity over (\d+) chunks, n_ctx=(\d+), batch_size=(\d+), n_seq=(\d+)", log)
    final = re.search(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)", log)
    if not (calc and final):
        sys.exit(f"could not parse {logdir}/perplexity-c{c}.log")
    running = [float(v) for _, v in re.findall(r"\[(\d+)\]([0-9.]+|nan|inf),", log)]
    sysinfo = re.search(r"system_info: (.*)$", log, re.M)  # lines carry a timestamp prefix
    runs.append({
        "ctx_size": int(c),
        "command": cmd,
        "n_chunks": int(calc.group(1)),
        "n_ctx": int(calc.group(2)),
        "batch_size": int(calc.group(3)),
        "n_seq": int(calc.group(4)),
        "ppl": float(final.group(1)),
        "ppl_stderr": float(final.group(2)),
        "final_line": final.group(0),
        "running_ppl": running,
        "system_info": sysinfo.group(1).strip() if sysinfo else None,
    })
    assert len(running) == runs[-1]["n_chunks"], (c, running)

doc = {
    "description": "llama.cpp llama-perplexity of the default model on tests/data/gpl-3.0-excerpt.txt; "
                   "regenerate with tests/data/make_llama_perplexity_fixture.sh",
    "llama_cpp_version": m.group(1) if m else None,
    "llama_cpp_build_number": int(m.group(2)) if m else None,
    "llama_cpp_commit": m.group(3) if m else None,
    "llama_cpp_version_output": version_txt.strip(),
    "llama_cpp_built_with": built.group(1) if built else None,
    "llama_cpp_python_version": "0.3.36",
    "model_file": Path(model).name,
    "model_sha256": sha256(model),
    "text_file": text_path,
    "text_sha256": sha256(text_path),
    "n_tokens": n_tokens,
    "n_tokens_note": "llama.cpp tokenization of the file minus one trailing newline, BOS added, specials not parsed",
    "runs": runs,
}
Path(out).write_text(json.dumps(doc, indent=2) + "\n")
for r in runs:
    print(f"ctx {r['ctx_size']}: {r['n_chunks']} chunks, {r['final_line']}")
print(f"wrote {out}")
EOF
