"""The devices the installed llama.cpp can run on, with their memory, asked of ggml itself.

llama-cpp-python does not wrap ggml's device API, but its own libggml exports it
(ggml_backend_dev_count/get/name/description/type/memory); the signatures are declared here.
Where a build lacks those symbols, NVIDIA GPUs are listed through nvidia-smi instead. A build
without GPU offload (the CPU build) has no GPU devices, whatever the machine holds.
"""

from __future__ import annotations

import ctypes
import functools
import shutil
import subprocess
from dataclasses import dataclass

# enum ggml_backend_dev_type
_KINDS = {0: "cpu", 1: "gpu", 2: "igpu", 3: "accel"}
OFFLOAD_KINDS = ("gpu", "igpu")


@dataclass(frozen=True)
class Device:
    name: str  # ggml's name: "CPU", "CUDA0", "Metal", "Vulkan0", "ROCm0"
    description: str  # the hardware: "NVIDIA H100 80GB HBM3"
    kind: str  # "cpu", "gpu", "igpu" (shares host memory), "accel"
    free: int  # bytes
    total: int


@functools.cache
def _ggml() -> ctypes.CDLL | None:
    """libggml with the device API's signatures, or None when this build does not export it."""
    from llama_cpp._ggml import libggml as lib

    from engines.llamacpp.runtime import init_backend

    try:
        lib.ggml_backend_dev_count.restype = ctypes.c_size_t
        lib.ggml_backend_dev_get.argtypes = [ctypes.c_size_t]
        lib.ggml_backend_dev_get.restype = ctypes.c_void_p
        for name in ("ggml_backend_dev_name", "ggml_backend_dev_description"):
            getattr(lib, name).argtypes = [ctypes.c_void_p]
            getattr(lib, name).restype = ctypes.c_char_p
        lib.ggml_backend_dev_type.argtypes = [ctypes.c_void_p]
        lib.ggml_backend_dev_type.restype = ctypes.c_int
        lib.ggml_backend_dev_memory.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(ctypes.c_size_t)]
        lib.ggml_backend_dev_memory.restype = None
        lib.ggml_backend_reg_count.restype = ctypes.c_size_t
        lib.ggml_backend_reg_get.argtypes = [ctypes.c_size_t]
        lib.ggml_backend_reg_get.restype = ctypes.c_void_p
        lib.ggml_backend_reg_name.argtypes = [ctypes.c_void_p]
        lib.ggml_backend_reg_name.restype = ctypes.c_char_p
    except AttributeError:
        return None
    init_backend()  # backends register (and CUDA initialises) before the first question
    return lib


def _text(value: bytes | None) -> str:
    return (value or b"").decode("utf-8", errors="replace")


def ggml_devices() -> tuple[Device, ...] | None:
    """Every device ggml registered, free memory as of now; None when the build cannot say."""
    lib = _ggml()
    if lib is None:
        return None
    out = []
    for i in range(lib.ggml_backend_dev_count()):
        dev = lib.ggml_backend_dev_get(i)
        free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
        lib.ggml_backend_dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
        kind = _KINDS.get(lib.ggml_backend_dev_type(dev), "other")
        out.append(Device(_text(lib.ggml_backend_dev_name(dev)), _text(lib.ggml_backend_dev_description(dev)), kind, free.value, total.value))
    return tuple(out)


def backends() -> tuple[str, ...]:
    """The ggml backends compiled into (or loaded by) this llama.cpp build: ("CUDA", "CPU"), ..."""
    lib = _ggml()
    if lib is None:
        return ()
    return tuple(_text(lib.ggml_backend_reg_name(lib.ggml_backend_reg_get(i))) for i in range(lib.ggml_backend_reg_count()))


def supports_offload() -> bool:
    import llama_cpp

    from engines.llamacpp.runtime import init_backend

    init_backend()
    return bool(llama_cpp.llama_supports_gpu_offload())


def parse_nvidia_smi(text: str) -> tuple[Device, ...]:
    """Rows of `nvidia-smi --query-gpu=index,name,memory.free,memory.total --format=csv,noheader,nounits`
    (memory in MiB)."""
    out = []
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 4 or not parts[0].isdigit():
            continue
        try:
            free, total = int(float(parts[2])) << 20, int(float(parts[3])) << 20
        except ValueError:
            continue  # "[N/A]" on some boards
        out.append(Device(f"CUDA{parts[0]}", parts[1], "gpu", free, total))
    return tuple(out)


def nvidia_smi_devices(timeout_s: float = 10.0) -> tuple[Device, ...]:
    """NVIDIA GPUs as the driver sees them, whatever llama.cpp was built for; () without a driver."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return ()
    try:
        done = subprocess.run([exe, "--query-gpu=index,name,memory.free,memory.total", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, timeout=timeout_s, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return ()
    return parse_nvidia_smi(done.stdout) if done.returncode == 0 else ()


def gpu_devices() -> tuple[Device, ...]:
    """The devices llama.cpp can offload layers to: none on a build without GPU offload."""
    if not supports_offload():
        return ()
    found = ggml_devices()
    if found is None:
        return nvidia_smi_devices()
    return tuple(d for d in found if d.kind in OFFLOAD_KINDS)
