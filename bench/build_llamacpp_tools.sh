#!/usr/bin/env bash
# Build llama.cpp's own command-line tools from the exact llama.cpp that llama-cpp-python 0.3.36
# bundles (vendor/llama.cpp of its PyPI source distribution, ggml-org/llama.cpp@0c1e57098).
#
# Usage:   bash bench/build_llamacpp_tools.sh        (or: make llamacpp-tools)
# Output:  .cache/llamacpp-tools/0.3.36/bin/{rpc-server,llama-bench,llama-perplexity,llama-cli,llama-server}
#          (ggml-rpc-server is a link to rpc-server, llama.cpp's own name for it in this version)
#          .cache/llamacpp-tools/0.3.36/BUILD_INFO.txt records the sdist hash, commit and cmake flags.
# Idempotent: does nothing when all five binaries exist and were built with the current settings
# (.cache/llamacpp-tools/0.3.36/.build-config); FORCE=1 rebuilds (reusing the build tree).
# CPU only, Release, -march=native (GGML_NATIVE=ON) minus AMX (-mno-amx-*, as `make setup` builds the
# llama-cpp-python wheel: ggml's AMX kernels SIGSEGV in ggml_backend_amx_mul_mat on these VMs), GGML_RPC=ON,
# static libraries (the binaries do not need the build tree), no tests/examples, no web UI assets
# (nothing is fetched at build time). A change of these flags triggers a rebuild.
# Environment: PYTHON (default python3, used only for `pip download`), JOBS (default 2),
#   CC/CXX (compilers), KEEP_SRC=0 removes the unpacked source and build tree after a success.
# Needs: a C and C++ compiler, make or ninja, cmake >= 3.18 (installed into a temporary venv with pip,
#   or with apt-get as root, when missing), git (for the commit in --version), network access to PyPI.
set -euo pipefail

LLAMA_CPP_PYTHON_VERSION=0.3.36
SDIST_NAME="llama_cpp_python-${LLAMA_CPP_PYTHON_VERSION}.tar.gz"
SDIST_SHA256=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e  # PyPI file, checked
EXPECTED_COMMIT=0c1e57098            # CHANGELOG of 0.3.36: "update llama.cpp to ggml-org/llama.cpp@0c1e57098"
CMAKE_MIN=3.18                       # llama.cpp needs 3.14; its scripts/ui-assets.cmake needs 3.18
JOBS="${JOBS:-2}"
PYTHON="${PYTHON:-python3}"

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TOOLS="$ROOT/.cache/llamacpp-tools/$LLAMA_CPP_PYTHON_VERSION"
BIN="$TOOLS/bin"
SRC="$TOOLS/src"
BUILD="$TOOLS/build"
SDIST_DIR="$TOOLS/sdist"
# installed name -> cmake target
BINARIES=(rpc-server llama-bench llama-perplexity llama-cli llama-server)
declare -A TARGET_OF=([rpc-server]=ggml-rpc-server [llama-bench]=llama-bench [llama-perplexity]=llama-perplexity
                      [llama-cli]=llama-cli [llama-server]=llama-server)

say() { printf '[llamacpp-tools] %s\n' "$*"; }
die() { printf '[llamacpp-tools] ERROR: %s\n' "$*" >&2; exit 1; }

NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"   # same flags as the Makefile's llama-cpp-python wheel
CONFIG_ID="sdist=$SDIST_SHA256 native=ON no_amx=[$NO_AMX] rpc=ON static=ON"  # what the stamp records

missing=()
for b in "${BINARIES[@]}"; do [ -x "$BIN/$b" ] || missing+=("$b"); done
if [ "${#missing[@]}" -eq 0 ] && [ "${FORCE:-0}" != 1 ]; then
    if [ "$(cat "$TOOLS/.build-config" 2>/dev/null)" = "$CONFIG_ID" ]; then
        say "all binaries present in $BIN, nothing to do (FORCE=1 rebuilds)"
        exit 0
    fi
    say "binaries in $BIN were built with other settings; rebuilding"
fi
say "building ${BINARIES[*]} of llama-cpp-python $LLAMA_CPP_PYTHON_VERSION's llama.cpp into $BIN"

# ---- toolchain checks -------------------------------------------------------------------------
TMPDIR_BUILD="$(mktemp -d)"
trap 'rm -rf "$TMPDIR_BUILD"' EXIT

find_tool() { for t in "$@"; do [ -n "$t" ] && command -v "$t" >/dev/null 2>&1 && { command -v "$t"; return 0; }; done; return 1; }
CC_BIN="$(find_tool "${CC:-}" cc gcc clang)" || die "no C compiler found (cc/gcc/clang); install one, e.g. apt-get install build-essential"
CXX_BIN="$(find_tool "${CXX:-}" c++ g++ clang++)" || die "no C++ compiler found (c++/g++/clang++); install one, e.g. apt-get install build-essential"
printf 'int main(void){return 0;}\n' > "$TMPDIR_BUILD/t.c"
"$CC_BIN" "$TMPDIR_BUILD/t.c" -o "$TMPDIR_BUILD/t" >/dev/null 2>&1 || die "C compiler $CC_BIN cannot build a trivial program"
printf '#include <string>\nint main(){std::string s("x");return (int)s.size()-1;}\n' > "$TMPDIR_BUILD/t.cpp"
"$CXX_BIN" -std=c++17 "$TMPDIR_BUILD/t.cpp" -o "$TMPDIR_BUILD/t" >/dev/null 2>&1 \
    || die "C++ compiler $CXX_BIN cannot build a trivial C++17 program (libstdc++ headers missing?)"
for f in $NO_AMX; do   # gcc < 11 / old clang do not know the AMX flags (and then emit no AMX code anyway)
    "$CC_BIN" "$f" "$TMPDIR_BUILD/t.c" -o "$TMPDIR_BUILD/t" >/dev/null 2>&1 \
        || { say "compiler does not accept $f; building without the -mno-amx-* flags"; NO_AMX=""; break; }
done
say "C compiler: $CC_BIN ($("$CC_BIN" --version | head -n1))"
say "C++ compiler: $CXX_BIN"

if command -v ninja >/dev/null 2>&1; then GENERATOR=Ninja
elif command -v make >/dev/null 2>&1; then GENERATOR="Unix Makefiles"
else die "neither ninja nor make found; install one, e.g. apt-get install make"; fi

cmake_ok() {  # $1: cmake binary; true when it exists and is >= CMAKE_MIN
    local v
    v="$("$1" --version 2>/dev/null | head -n1 | awk '{print $3}')" || return 1
    [ -n "$v" ] && [ "$(printf '%s\n%s\n' "$CMAKE_MIN" "$v" | sort -V | head -n1)" = "$CMAKE_MIN" ]
}
CMAKE="$(command -v cmake || true)"
if [ -z "$CMAKE" ] || ! cmake_ok "$CMAKE"; then
    say "cmake >= $CMAKE_MIN not found (${CMAKE:-none}); installing it into a temporary venv with pip"
    if "$PYTHON" -m venv "$TMPDIR_BUILD/cmake-venv" >/dev/null 2>&1 \
        && "$TMPDIR_BUILD/cmake-venv/bin/pip" install -q "cmake>=$CMAKE_MIN,<4" \
        && cmake_ok "$TMPDIR_BUILD/cmake-venv/bin/cmake"; then
        CMAKE="$TMPDIR_BUILD/cmake-venv/bin/cmake"
    elif command -v apt-get >/dev/null 2>&1 && { [ "$(id -u)" = 0 ] || command -v sudo >/dev/null 2>&1; }; then
        SUDO=$([ "$(id -u)" = 0 ] || echo sudo)
        say "pip could not provide cmake; trying apt-get install cmake"
        $SUDO apt-get update -qq && $SUDO apt-get install -y -qq cmake >/dev/null || true
        CMAKE="$(command -v cmake || true)"
        { [ -n "$CMAKE" ] && cmake_ok "$CMAKE"; } || die "cmake >= $CMAKE_MIN is missing and could not be installed"
    else
        die "cmake >= $CMAKE_MIN is missing and could not be installed (pip install cmake, or apt-get install cmake)"
    fi
fi
say "cmake: $CMAKE ($("$CMAKE" --version | head -n1)), generator: $GENERATOR, jobs: $JOBS"
command -v git >/dev/null 2>&1 || say "warning: git not found; --version will report commit 'unknown'"

# ---- source distribution ----------------------------------------------------------------------
sha_of() { sha256sum "$1" | awk '{print $1}'; }
mkdir -p "$SDIST_DIR"
if [ -f "$SDIST_DIR/$SDIST_NAME" ] && [ "$(sha_of "$SDIST_DIR/$SDIST_NAME")" = "$SDIST_SHA256" ]; then
    say "sdist already downloaded: $SDIST_DIR/$SDIST_NAME"
else
    rm -f "$SDIST_DIR/$SDIST_NAME"
    say "downloading the sdist: $PYTHON -m pip download --no-deps --no-binary :all: llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION"
    "$PYTHON" -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION" -d "$SDIST_DIR" \
        || die "pip download of llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION failed (network? pip?)"
    [ -f "$SDIST_DIR/$SDIST_NAME" ] || die "pip did not produce $SDIST_DIR/$SDIST_NAME"
fi
got="$(sha_of "$SDIST_DIR/$SDIST_NAME")"
[ "$got" = "$SDIST_SHA256" ] || die "sha256 of $SDIST_NAME is $got, expected $SDIST_SHA256"
say "sdist sha256 ok: $got"

LLAMA_SRC="$SRC/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION/vendor/llama.cpp"
if [ -f "$SRC/.unpacked-$SDIST_SHA256" ] && [ -f "$LLAMA_SRC/CMakeLists.txt" ]; then
    say "source already unpacked: $LLAMA_SRC"
else
    say "unpacking into $SRC"
    rm -rf "$SRC"; mkdir -p "$SRC"
    tar -xzf "$SDIST_DIR/$SDIST_NAME" -C "$SRC"
    [ -f "$LLAMA_SRC/CMakeLists.txt" ] || die "the sdist has no vendor/llama.cpp/CMakeLists.txt"
    touch "$SRC/.unpacked-$SDIST_SHA256"
fi
# The sdist carries a shallow git checkout of the submodule: the commit is readable (build number is 1).
COMMIT="$(git -C "$LLAMA_SRC" rev-parse HEAD 2>/dev/null || echo unknown)"
case "$COMMIT" in
    "$EXPECTED_COMMIT"*) say "vendored llama.cpp commit: $COMMIT" ;;
    unknown) say "warning: could not read the vendored llama.cpp commit (expected $EXPECTED_COMMIT)" ;;
    *) die "vendored llama.cpp commit is $COMMIT, expected $EXPECTED_COMMIT" ;;
esac

# ---- configure and build ------------------------------------------------------------------------
CMAKE_FLAGS=(
    -DCMAKE_BUILD_TYPE=Release
    -DBUILD_SHARED_LIBS=OFF
    -DGGML_NATIVE=ON -DGGML_RPC=ON
    -DGGML_CUDA=OFF -DGGML_VULKAN=OFF -DGGML_HIP=OFF -DGGML_SYCL=OFF -DGGML_METAL=OFF -DGGML_BLAS=OFF
    -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON
    -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF
    -DCMAKE_C_COMPILER="$CC_BIN" -DCMAKE_CXX_COMPILER="$CXX_BIN"
    # gcc: an explicit -mno-X wins over the -march=native that ggml-cpu adds after these flags
    "-DCMAKE_C_FLAGS=$NO_AMX" "-DCMAKE_CXX_FLAGS=$NO_AMX"
)
if [ -f "$BUILD/CMakeCache.txt" ] && ! grep -q "^CMAKE_GENERATOR:INTERNAL=$GENERATOR\$" "$BUILD/CMakeCache.txt"; then
    rm -rf "$BUILD"  # a different generator cannot reuse the tree
fi
start=$(date +%s)
say "configuring: cmake -S $LLAMA_SRC -B $BUILD -G '$GENERATOR' $(printf '%q ' "${CMAKE_FLAGS[@]}")"
# SOURCE_DATE_EPOCH would silently turn GGML_NATIVE off; the flag above is explicit anyway.
env -u SOURCE_DATE_EPOCH "$CMAKE" -S "$LLAMA_SRC" -B "$BUILD" -G "$GENERATOR" "${CMAKE_FLAGS[@]}" >"$TOOLS/cmake-configure.log" 2>&1 \
    || { tail -n 40 "$TOOLS/cmake-configure.log" >&2; die "cmake configure failed; log: $TOOLS/cmake-configure.log"; }
targets=(); for b in "${BINARIES[@]}"; do targets+=("${TARGET_OF[$b]}"); done
say "building targets ${targets[*]} with -j$JOBS (log: $TOOLS/cmake-build.log)"
"$CMAKE" --build "$BUILD" --config Release -j "$JOBS" --target "${targets[@]}" >"$TOOLS/cmake-build.log" 2>&1 \
    || { tail -n 40 "$TOOLS/cmake-build.log" >&2; die "build failed; log: $TOOLS/cmake-build.log"; }
elapsed=$(( $(date +%s) - start ))

# ---- install ------------------------------------------------------------------------------------
mkdir -p "$BIN"
for b in "${BINARIES[@]}"; do
    built="$BUILD/bin/${TARGET_OF[$b]}"
    [ -x "$built" ] || die "expected binary missing after the build: $built"
    cp "$built" "$BIN/.$b.tmp" && mv -f "$BIN/.$b.tmp" "$BIN/$b"   # atomic: never a half-copied binary
done
ln -sfn rpc-server "$BIN/ggml-rpc-server"
printf '%s\n' "$CONFIG_ID" > "$TOOLS/.build-config"

VERSION_LINE="$("$BIN/llama-perplexity" --version 2>&1 | grep -m1 '^version' || true)"
{
    echo "llama-cpp-python $LLAMA_CPP_PYTHON_VERSION sdist sha256 $SDIST_SHA256"
    echo "llama.cpp commit $COMMIT"
    echo "$VERSION_LINE"
    "$BIN/llama-perplexity" --version 2>&1 | grep -m1 '^built with' || true
    echo "cmake $("$CMAKE" --version | head -n1 | awk '{print $3}') -G '$GENERATOR' $(printf '%q ' "${CMAKE_FLAGS[@]}")"
    echo "built $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(uname -m) in ${elapsed}s with -j$JOBS"
} > "$TOOLS/BUILD_INFO.txt"

if [ "${KEEP_SRC:-1}" = 0 ]; then say "removing $SRC and $BUILD (KEEP_SRC=0)"; rm -rf "$SRC" "$BUILD"; fi
say "done in ${elapsed}s: $VERSION_LINE"
for b in "${BINARIES[@]}"; do say "  $BIN/$b"; done
