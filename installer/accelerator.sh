# Which accelerator llama.cpp is built for: sourced by installer/install.sh (and by its tests).
#
# choose_accelerator sets
#   ACCEL        cpu | cuda | metal | vulkan | rocm
#   ACCEL_WHY    one line: what was found, or that APPLIANCE_GPU chose it
#   ACCEL_FLAGS  CMake flags added to the CPU ones (-DGGML_CUDA=ON ...)
#   ACCEL_ENV    VAR=value words the build runs with (the compiler CMake should use)
# or sets ACCEL_ERROR to why the requested one cannot be built and returns 1.
#
# Automatic choice, first match: Metal on Apple silicon; CUDA where the toolkit (nvcc) and a
# working NVIDIA driver (nvidia-smi lists a GPU) are both present; ROCm where hipconfig and rocminfo
# find an AMD GPU; Vulkan where glslc and vulkaninfo find a GPU; else the portable CPU build.
# APPLIANCE_GPU=cpu|cuda|metal|vulkan|rocm chooses instead, and needs only the SDK (a build
# machine may have no GPU); it fails, saying what is missing, without it.

ACCELERATORS="cpu cuda metal vulkan rocm"

# On PATH, else where CUDA_HOME (or CUDA_PATH) says, else the toolkit's default place.
_find_nvcc() {
    if command -v nvcc >/dev/null 2>&1; then command -v nvcc; return; fi
    local dir=${CUDA_HOME:-${CUDA_PATH:-/usr/local/cuda}}
    [ -x "$dir/bin/nvcc" ] && echo "$dir/bin/nvcc"
}

_find_rocm_tool() {
    if command -v "$1" >/dev/null 2>&1; then command -v "$1"; return; fi
    if [ -x "${ROCM_PATH:-/opt/rocm}/bin/$1" ]; then echo "${ROCM_PATH:-/opt/rocm}/bin/$1"; return; fi
    return 1
}

# Each _probe_X sets _why/_flags/_env and returns 0, or sets _why to what is missing and returns 1.
# With $1 = asked (APPLIANCE_GPU), the SDK is enough: a build machine may have no GPU of its own.

_probe_cuda() {
    local nvcc smi gpus=0 release caps="" first
    nvcc=$(_find_nvcc) || { _why="no CUDA toolkit (nvcc not on PATH, nor in ${CUDA_HOME:-${CUDA_PATH:-/usr/local/cuda}}/bin)"; return 1; }
    # sed, not head, ends these pipelines: head would close the pipe early and, under pipefail, fail them
    release=$("$nvcc" --version 2>/dev/null | sed -n 's/.*release \([0-9.]*\).*/\1/p' | sed -n 1p)
    _flags="-DGGML_CUDA=ON" _env="CUDACXX=$nvcc" _why="CUDA ${release:-?} at $nvcc"
    if ! smi=$(command -v nvidia-smi 2>/dev/null); then
        [ "${1:-}" = asked ] || { _why="$_why but no NVIDIA driver (nvidia-smi not found)"; return 1; }
        _why="$_why; no driver here, so CUDA's default GPU architectures"
        return 0
    fi
    gpus=$("$smi" -L 2>/dev/null | grep -c '^GPU ' || true)
    if [ "${gpus:-0}" -eq 0 ]; then
        [ "${1:-}" = asked ] || { _why="$_why but nvidia-smi lists no GPU (is the driver loaded?)"; return 1; }
        _why="$_why; nvidia-smi lists no GPU, so CUDA's default GPU architectures"
        return 0
    fi
    # Build for the GPUs present (compute capability 9.0 -> 90): one architecture, not CMake's long list.
    caps=$("$smi" --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | tr -d ' .' | grep -E '^[0-9]+$' | sort -u | paste -sd ';' - || true)
    [ -n "$caps" ] && _flags="$_flags -DCMAKE_CUDA_ARCHITECTURES=$caps"
    first=$("$smi" -L 2>/dev/null | sed -n '1s/ (UUID.*//p' || true)
    _why="$_why; the driver lists $gpus GPU(s): $first${caps:+; compute capability $caps}"
    return 0
}

_probe_rocm() {
    local hipconfig rocminfo targets=""
    hipconfig=$(_find_rocm_tool hipconfig) || { _why="no ROCm/HIP SDK (hipconfig not found)"; return 1; }
    _flags="-DGGML_HIP=ON" _env="HIPCXX=$("$hipconfig" -l)/clang HIP_PATH=$("$hipconfig" -R)" _why="ROCm at $hipconfig"
    if rocminfo=$(_find_rocm_tool rocminfo); then
        targets=$("$rocminfo" 2>/dev/null | sed -n 's/^ *Name: *\(gfx[0-9a-f]*\).*/\1/p' | sort -u | paste -sd ';' - || true)
    fi
    if [ -z "$targets" ]; then
        [ "${1:-}" = asked ] || { _why="$_why but rocminfo lists no AMD GPU (gfx target)"; return 1; }
        _why="$_why; no AMD GPU listed here, so ggml's default GPU targets"
        return 0
    fi
    _flags="$_flags -DGPU_TARGETS=$targets"
    _why="$_why; rocminfo lists GPU target(s) $targets"
    return 0
}

_probe_vulkan() {
    local glslc info=""
    glslc=$(command -v glslc 2>/dev/null) || { _why="no Vulkan SDK (glslc not found)"; return 1; }
    _flags="-DGGML_VULKAN=ON" _env="" _why="Vulkan SDK (glslc at $glslc)"
    if command -v vulkaninfo >/dev/null 2>&1; then
        info=$(vulkaninfo --summary 2>/dev/null | grep -E 'PHYSICAL_DEVICE_TYPE_(DISCRETE|INTEGRATED)_GPU' || true)
    fi
    if [ -z "$info" ]; then
        [ "${1:-}" = asked ] || { _why="$_why but vulkaninfo lists no GPU"; return 1; }
        _why="$_why; vulkaninfo lists no GPU here"
        return 0
    fi
    _why="$_why; vulkaninfo lists a GPU"
    return 0
}

_probe_metal() {
    if [ "$(uname -s)" = Darwin ] && [ "$(uname -m)" = arm64 ]; then
        _flags="-DGGML_METAL=ON" _env="" _why="Apple silicon"
        return 0
    fi
    _why="Metal needs Apple silicon (this is $(uname -s) $(uname -m))"
    return 1
}

choose_accelerator() {
    local requested=${APPLIANCE_GPU:-} _why="" _flags="" _env="" name missing=""
    ACCEL="" ACCEL_WHY="" ACCEL_FLAGS="" ACCEL_ENV="" ACCEL_ERROR=""
    if [ -n "$requested" ]; then
        case " $ACCELERATORS " in
            *" $requested "*) ;;
            *) ACCEL_ERROR="APPLIANCE_GPU=$requested: expected one of: $ACCELERATORS"; return 1 ;;
        esac
        if [ "$requested" = cpu ]; then
            ACCEL=cpu ACCEL_WHY="chosen by APPLIANCE_GPU=cpu"
            # ggml turns Metal on by itself on Apple hardware
            [ "$(uname -s)" = Darwin ] && ACCEL_FLAGS="-DGGML_METAL=OFF"
            return 0
        fi
        if ! "_probe_$requested" asked; then
            ACCEL_ERROR="APPLIANCE_GPU=$requested, but $_why"
            return 1
        fi
        ACCEL=$requested ACCEL_WHY="chosen by APPLIANCE_GPU=$requested: $_why" ACCEL_FLAGS=$_flags ACCEL_ENV=$_env
        return 0
    fi
    for name in metal cuda rocm vulkan; do
        if "_probe_$name"; then
            ACCEL=$name ACCEL_WHY=$_why ACCEL_FLAGS=$_flags ACCEL_ENV=$_env
            return 0
        fi
        [ "$name" = metal ] || missing="$missing${missing:+; }$_why"
    done
    ACCEL=cpu ACCEL_WHY="no GPU toolchain found ($missing); APPLIANCE_GPU=cuda|rocm|vulkan asks for one"
}
