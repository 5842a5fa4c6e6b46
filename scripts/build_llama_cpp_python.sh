#!/usr/bin/env bash
# Build the llama-cpp-python wheel ggufswarm runs on: llama-cpp-python's PyPI source distribution with the
# patch queue of patches/llama.cpp applied to its vendor/llama.cpp, compiled for this machine.
#
# Usage:   scripts/build_llama_cpp_python.sh PIP          (make setup calls it; PIP is the venv's pip)
# Prints:  the path of the wheel (last line of stdout); everything else goes to stderr.
# GPU:     besides the CPU backend (always there, chosen at run time: `ggufswarm node --gpu none`), the wheel holds
#          the GPU backend this machine can build: CUDA when nvcc and an NVIDIA GPU are found, Vulkan when the Vulkan headers, loader and
#          glslc are (Debian: libvulkan-dev glslc spirv-headers), HIP when hipcc is, Metal on macOS; else CPU only.
#          GGUFSWARM_GPU=cuda|vulkan|hip|metal|none overrides (CUDA_ARCHITECTURES, default "native", picks the GPUs
#          a CUDA build targets). `scripts/build_llama_cpp_python.sh backend` prints the choice.
# Cache:   ~/.cache/ggufswarm/wheels/<cpu>-<patches>[-<gpu>]/ — <cpu> hashes this machine's CPU flags (-march=native),
#          <patches> the patch files, <gpu> the GPU backend: a new patch, another CPU kind or another backend gets its
#          own wheel; a fresh clone (CI) of the same
#          queue on the same kind of machine installs the cached wheel in seconds. The patched source
#          (src/) and CMake build tree (build/) stay beside the wheel: `tools` builds llama.cpp's test-llama-archs
#          from them in a minute instead of compiling llama.cpp again.
#          scripts/build_llama_cpp_python.sh tools   builds build/bin/test-llama-archs and prints its path.
# Flags:   -march=native minus AMX (-mno-amx-*): ggml's AMX kernels SIGSEGV in ggml_backend_amx_mul_mat on the
#          virtual machines this project runs on.
# Needs:   a C/C++ compiler, cmake, patch (or git); network access to PyPI for the sdist and scikit-build-core.
set -euo pipefail

VERSION=0.3.36
SDIST_SHA256=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e  # PyPI file, checked
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PATCHES="$ROOT/patches/llama.cpp"
NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
CPU_KEY="$(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null | md5sum | cut -c1-12)"
# the key covers what the patches change (each file from its "---" line on), not the text of their headers
PATCH_KEY="$(for p in "$PATCHES"/*.patch; do sed -n '/^---$/,$p' "$p"; done | sha256sum | cut -c1-12)"

# the GPU backend to build beside the CPU one (none: CPU only, as before)
gpu_backend() {
    local want="${GGUFSWARM_GPU:-auto}"
    case "$want" in
        cuda|vulkan|hip|metal|none) echo "$want"; return ;;
        auto) ;;
        *) printf '[llama-cpp-python] ERROR: GGUFSWARM_GPU=%s: use cuda, vulkan, hip, metal, none or auto\n' "$want" >&2
           exit 2 ;;
    esac
    # nvcc alone is not enough: a CUDA toolkit without an NVIDIA GPU (a build box, a CI image) builds for nothing
    if command -v nvcc >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep '^GPU' >/dev/null; then echo cuda
    elif command -v glslc >/dev/null 2>&1 && [ -f /usr/include/vulkan/vulkan.hpp ] \
        && { "$(command -v ldconfig || echo /sbin/ldconfig)" -p 2>/dev/null | grep 'libvulkan\.so ' >/dev/null; }; then echo vulkan
    elif command -v hipcc >/dev/null 2>&1; then echo hip
    elif [ "$(uname -s)" = Darwin ]; then echo metal
    else echo none
    fi
}
GPU="$(gpu_backend)"
GPU_ARGS=""
case "$GPU" in
    cuda) GPU_ARGS="-DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=${CUDA_ARCHITECTURES:-native}" ;;
    vulkan) GPU_ARGS="-DGGML_VULKAN=ON" ;;
    hip) GPU_ARGS="-DGGML_HIP=ON" ;;
    metal) GPU_ARGS="-DGGML_METAL=ON" ;;
esac
DIR="${GGUFSWARM_WHEELS:-$HOME/.cache/ggufswarm/wheels}/$CPU_KEY-$PATCH_KEY$([ "$GPU" = none ] || echo "-$GPU")"

say() { printf '[llama-cpp-python] %s\n' "$*" >&2; }
die() { printf '[llama-cpp-python] ERROR: %s\n' "$*" >&2; exit 1; }

usage() {
    cat >&2 <<EOF
usage: $0 PIP      build (or find in the cache) the patched llama-cpp-python wheel; PIP is the pip of the venv
                   that will install it (make setup passes .venv/bin/pip); prints the wheel's path
       $0 backend  print the GPU backend a build here gets (cuda, vulkan, hip, metal or none; GGUFSWARM_GPU)
       $0 tools    build llama.cpp's test-llama-archs from the kept build tree; prints its path
       $0 cpu-variant [PYTHON]   llama.cpp's libraries with AVX-only CPU kernels (another CPU kind, ~1 minute);
                   prints the folder to give as LLAMA_CPP_LIB_PATH (PYTHON: the venv's python, default python3)
The wheel cache is ~/.cache/ggufswarm/wheels/<cpu>-<patches>/ (\$GGUFSWARM_WHEELS instead of
~/.cache/ggufswarm/wheels). make setup is the usual way in.
EOF
}
case "${1:-}" in
    -h|--help) usage; exit 0 ;;
    backend) echo "$GPU"; exit 0 ;;
    "") usage; exit 2 ;;
esac

# the patched source in $DIR/src: llama-cpp-python's sdist (sha256 checked) with the patch queue applied to
# vendor/llama.cpp. PIP: a pip to download the sdist with.
prepare_src() {
    local tmp sdist p
    tmp="$(mktemp -d)"
    "$1" download -q --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$tmp" >&2 \
        || die "pip download of llama-cpp-python==$VERSION failed"
    sdist="$tmp/llama_cpp_python-$VERSION.tar.gz"
    [ "$(sha256sum "$sdist" | cut -d' ' -f1)" = "$SDIST_SHA256" ] || die "sha256 of $sdist differs from the pinned one"
    rm -rf "$DIR/src"
    mkdir -p "$DIR/src"
    tar -xzf "$sdist" -C "$DIR/src" --strip-components=1
    rm -rf "$tmp"
    for p in "$PATCHES"/*.patch; do
        say "applying $(basename "$p")"
        if command -v patch >/dev/null 2>&1; then
            patch -p1 --forward --quiet -d "$DIR/src/vendor/llama.cpp" < "$p" >&2 || die "patch $(basename "$p") does not apply"
        else  # git apply works outside a repository too
            git -C "$DIR/src" apply -p1 --directory=vendor/llama.cpp "$p" >&2 || die "patch $(basename "$p") does not apply"
        fi
    done
}

# one build at a time in $DIR: the wheel build configures $DIR/build without llama.cpp's tests and `tools`
# reconfigures it with them, so either one running beside the other breaks it (the wheel's install step fails)
lock_dir() {
    mkdir -p "$DIR"
    command -v flock >/dev/null 2>&1 || return 0
    exec 9>"$DIR/.lock"
    flock -n 9 || { say "waiting for another build in $DIR to finish"; flock 9; }
}

if [ "${1:-}" = cpu-variant ]; then   # the same llama.cpp with another CPU kernel set (a second "CPU kind")
    # Builds only ggml's CPU backend with GGML_NATIVE=OFF and AVX (no AVX2/FMA/AVX-512: a kernel set no x86-64
    # machine this project runs on picks natively), and assembles a library folder: llama-cpp-python's own libraries
    # with that libggml-cpu. A process started with LLAMA_CPP_LIB_PATH=<folder> computes as a node of another CPU
    # kind would (its numerics fingerprint says so): tests/test_verify.py's honest node of another kind. ~1 minute.
    out="$DIR/cpu-avx"
    lock_dir
    if [ ! -f "$out/lib/libggml-cpu.so" ]; then
        py="${2:-python3}"
        [ -f "$DIR/src/vendor/llama.cpp/CMakeLists.txt" ] || prepare_src "$(dirname "$py")/pip"
        say "building ggml's CPU backend with AVX kernels only into $out (about a minute)"
        openmp="$(sed -n 's/^GGML_OPENMP:BOOL=//p' "$DIR/build/CMakeCache.txt" 2>/dev/null || true)"
        cmake -S "$DIR/src/vendor/llama.cpp" -B "$out/build" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON \
            -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=OFF -DGGML_FMA=OFF -DGGML_F16C=ON -DGGML_AVX512=OFF \
            -DGGML_OPENMP="${openmp:-ON}" -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF \
            -DLLAMA_BUILD_SERVER=OFF -DLLAMA_CURL=OFF >/dev/null
        cmake --build "$out/build" --target ggml-cpu -j "${JOBS:-2}" >&2
        pkg="$("$py" -c 'import llama_cpp, os; print(os.path.join(os.path.dirname(llama_cpp.__file__), "lib"))')"
        rm -rf "$out/lib.tmp" && mkdir -p "$out/lib.tmp"
        cp -a "$pkg"/. "$out/lib.tmp/"
        cp -a "$out/build/bin"/libggml-cpu.so* "$out/lib.tmp/"
        rm -rf "$out/lib" && mv "$out/lib.tmp" "$out/lib"
    fi
    echo "$out/lib"
    exit 0
fi

if [ "${1:-}" = tools ]; then   # llama.cpp's test-llama-archs (the architecture zoo's writer), from the kept tree
    lock_dir
    [ -f "$DIR/build/CMakeCache.txt" ] || die "no build tree in $DIR/build: run make setup first"
    if [ ! -x "$DIR/build/bin/test-llama-archs" ]; then
        say "building test-llama-archs in $DIR/build (patched llama.cpp $VERSION)"
        cmake -S "$DIR/src" -B "$DIR/build" -DLLAMA_BUILD_TESTS=ON >/dev/null
        cmake --build "$DIR/build" --target test-llama-archs -j "${JOBS:-2}" >&2
    fi
    echo "$DIR/build/bin/test-llama-archs"
    exit 0
fi

PIP="$1"
[ -x "$PIP" ] || command -v "$PIP" >/dev/null 2>&1 || { usage; die "$PIP is not a pip executable"; }
lock_dir
wheel="$(ls "$DIR"/llama_cpp_python-"$VERSION"-*.whl 2>/dev/null | head -n1 || true)"
if [ -n "$wheel" ]; then
    say "cached wheel: $wheel"
    echo "$wheel"
    exit 0
fi
case "$GPU" in
    none) took="about 7 minutes on 2 cores" ;;
    vulkan) took="CPU and Vulkan backends, about 12 minutes on 2 cores" ;;
    *) took="CPU and $GPU backends" ;;
esac
say "building llama-cpp-python $VERSION with $(ls "$PATCHES"/*.patch | wc -l) llama.cpp patches into $DIR ($took)"
rm -rf "$DIR/build"
prepare_src "$PIP"
CMAKE_ARGS="-DCMAKE_C_FLAGS='$NO_AMX' -DCMAKE_CXX_FLAGS='$NO_AMX' $GPU_ARGS" \
    "$PIP" wheel -q --no-deps --no-cache-dir --config-settings=build-dir="$DIR/build" "$DIR/src" -w "$DIR" >&2 \
    || die "the wheel build failed (see above)"
wheel="$(ls "$DIR"/llama_cpp_python-"$VERSION"-*.whl | head -n1)"
say "built $wheel"
echo "$wheel"
