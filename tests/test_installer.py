"""installer/install.sh's choice of accelerator, through its --dry-run (which changes nothing).

No test machine has every GPU, so the toolchains are stand-ins: a PATH holding the real coreutils
the installer needs plus small scripts named nvcc, nvidia-smi, hipconfig, rocminfo, glslc,
vulkaninfo or uname that answer as those tools do. The CPU choice is also checked against the
build this environment was installed with: the change must not rebuild it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TOOLS = ("bash", "sed", "grep", "head", "cat", "cut", "tr", "sort", "paste", "sha256sum", "dirname", "uname")

NVCC = 'echo "Cuda compilation tools, release 12.4, V12.4.131"'
NVIDIA_SMI = """case "$*" in
  -L) echo "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-1234)"; echo "GPU 1: NVIDIA H100 80GB HBM3 (UUID: GPU-5678)" ;;
  *compute_cap*) printf '9.0\\n9.0\\n' ;;
esac"""


def dry_run(tmp_path: Path, stubs: dict[str, str], **env: str) -> subprocess.CompletedProcess[str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    for tool in TOOLS:
        if tool not in stubs and not (bin_dir / tool).exists():
            real = shutil.which(tool)
            assert real, f"{tool} is needed to run the installer"
            (bin_dir / tool).symlink_to(real)
    for name, body in stubs.items():
        script = bin_dir / name
        script.write_text(f"#!{shutil.which('bash')}\n{body}\n")
        script.chmod(0o755)
    empty = tmp_path / "nothing-here"
    empty.mkdir(exist_ok=True)
    base = {"PATH": str(bin_dir), "HOME": str(tmp_path), "CUDA_HOME": str(empty), "ROCM_PATH": str(empty),
            "APPLIANCE_CACHE": str(tmp_path / "cache")}
    return subprocess.run([shutil.which("bash"), str(ROOT / "installer" / "install.sh"), "--dry-run"], env={**base, **env},
                          capture_output=True, text=True, timeout=60)


def fields(done: subprocess.CompletedProcess[str]) -> dict[str, str]:
    assert done.returncode == 0, done.stderr
    return dict(line.split("=", 1) for line in done.stdout.splitlines() if "=" in line and not line.startswith("\x1b"))


def test_no_toolchain_is_the_cpu_build(tmp_path: Path) -> None:
    out = fields(dry_run(tmp_path, {}))
    assert out["accelerator"] == "cpu"
    assert "no CUDA toolkit" in out["why"] and "no ROCm" in out["why"] and "no Vulkan" in out["why"]
    assert "GGML_CUDA" not in out["flags"] and "-DGGML_LLAMAFILE=OFF" in out["flags"]
    assert "/wheels/llama-cpp-python-cpu-" in out["wheels"]
    assert "llama.cpp for: cpu" in dry_run(tmp_path, {}).stdout  # said to the operator too


def test_cuda_needs_the_toolkit_and_a_driver(tmp_path: Path) -> None:
    out = fields(dry_run(tmp_path, {"nvcc": NVCC, "nvidia-smi": NVIDIA_SMI}))
    assert out["accelerator"] == "cuda"
    assert "-DGGML_CUDA=ON" in out["flags"] and "-DCMAKE_CUDA_ARCHITECTURES=90" in out["flags"].split()
    assert "CUDA 12.4" in out["why"] and "2 GPU(s): GPU 0: NVIDIA H100 80GB HBM3" in out["why"]
    assert out["build_env"] == f"CUDACXX={tmp_path / 'bin' / 'nvcc'}"
    cpu = fields(dry_run(tmp_path / "cpu", {}))
    assert out["wheels"] != cpu["wheels"] and "/llama-cpp-python-cuda-" in out["wheels"]
    assert out["flags"].startswith(cpu["flags"])  # the CPU backend inside a CUDA build keeps the portable flags


def test_nvcc_from_cuda_home(tmp_path: Path) -> None:
    toolkit = tmp_path / "cuda"
    (toolkit / "bin").mkdir(parents=True)
    (toolkit / "bin" / "nvcc").write_text(f"#!{shutil.which('bash')}\n{NVCC}\n")
    (toolkit / "bin" / "nvcc").chmod(0o755)
    out = fields(dry_run(tmp_path, {"nvidia-smi": NVIDIA_SMI}, CUDA_HOME=str(toolkit)))
    assert out["accelerator"] == "cuda" and out["build_env"] == f"CUDACXX={toolkit / 'bin' / 'nvcc'}"


@pytest.mark.parametrize(("smi", "reason"), [
    (None, "no NVIDIA driver"),
    ("echo 'NVIDIA-SMI has failed because it could not communicate with the NVIDIA driver.' >&2; exit 9", "lists no GPU"),
])
def test_toolkit_without_a_working_driver_is_cpu(tmp_path: Path, smi: str | None, reason: str) -> None:
    stubs = {"nvcc": NVCC} | ({"nvidia-smi": smi} if smi else {})
    out = fields(dry_run(tmp_path, stubs))
    assert out["accelerator"] == "cpu" and reason in out["why"]


def test_asking_for_cpu_wins(tmp_path: Path) -> None:
    out = fields(dry_run(tmp_path, {"nvcc": NVCC, "nvidia-smi": NVIDIA_SMI}, APPLIANCE_GPU="cpu"))
    assert out["accelerator"] == "cpu" and out["why"] == "chosen by APPLIANCE_GPU=cpu"
    assert "GGML_CUDA" not in out["flags"]


def test_asking_for_cuda_builds_without_a_driver(tmp_path: Path) -> None:
    """A build machine has the toolkit and no GPU: CUDA's default architectures."""
    out = fields(dry_run(tmp_path, {"nvcc": NVCC}, APPLIANCE_GPU="cuda"))
    assert out["accelerator"] == "cuda" and "CMAKE_CUDA_ARCHITECTURES" not in out["flags"]
    assert "chosen by APPLIANCE_GPU=cuda" in out["why"] and "default GPU architectures" in out["why"]


@pytest.mark.parametrize(("asked", "message"), [
    ("cuda", "APPLIANCE_GPU=cuda, but no CUDA toolkit"),
    ("rocm", "APPLIANCE_GPU=rocm, but no ROCm/HIP SDK"),
    ("vulkan", "APPLIANCE_GPU=vulkan, but no Vulkan SDK"),
    ("metal", "APPLIANCE_GPU=metal, but Metal needs Apple silicon"),
    ("tpu", "APPLIANCE_GPU=tpu: expected one of: cpu cuda metal vulkan rocm"),
])
def test_asking_for_what_is_not_here_fails_saying_why(tmp_path: Path, asked: str, message: str) -> None:
    done = dry_run(tmp_path, {"uname": 'case "$1" in -s) echo Linux ;; -m) echo x86_64 ;; esac'}, APPLIANCE_GPU=asked)
    assert done.returncode == 1
    assert message in done.stderr


def test_metal_on_apple_silicon(tmp_path: Path) -> None:
    mac = {"uname": 'case "$1" in -s) echo Darwin ;; -m) echo arm64 ;; esac'}
    out = fields(dry_run(tmp_path, mac))
    assert out["accelerator"] == "metal" and out["flags"] == "-DGGML_LLAMAFILE=OFF -DGGML_METAL=ON"  # as before this change
    assert fields(dry_run(tmp_path, mac, APPLIANCE_GPU="cpu"))["flags"] == "-DGGML_LLAMAFILE=OFF -DGGML_METAL=OFF"


def test_rocm(tmp_path: Path) -> None:
    stubs = {
        "hipconfig": 'case "$1" in -l) echo /opt/rocm/llvm/bin ;; -R) echo /opt/rocm ;; esac',
        "rocminfo": 'printf "  Name:                    AMD EPYC 7763\\n  Name:                    gfx90a\\n  Name:                    gfx90a\\n"',
    }
    out = fields(dry_run(tmp_path, stubs))
    assert out["accelerator"] == "rocm" and "-DGGML_HIP=ON -DGPU_TARGETS=gfx90a" in out["flags"]
    assert out["build_env"] == "HIPCXX=/opt/rocm/llvm/bin/clang HIP_PATH=/opt/rocm"


def test_vulkan_needs_a_gpu_not_a_software_renderer(tmp_path: Path) -> None:
    llvmpipe = 'echo "deviceType = PHYSICAL_DEVICE_TYPE_CPU"; echo "deviceName = llvmpipe"'
    assert fields(dry_run(tmp_path, {"glslc": "true", "vulkaninfo": llvmpipe}))["accelerator"] == "cpu"
    gpu = 'echo "deviceType = PHYSICAL_DEVICE_TYPE_DISCRETE_GPU"'
    out = fields(dry_run(tmp_path / "gpu", {"glslc": "true", "vulkaninfo": gpu}))
    assert out["accelerator"] == "vulkan" and out["flags"].endswith("-DGGML_VULKAN=ON")


def test_cpu_choice_keeps_the_installed_build(tmp_path: Path) -> None:
    """The flags of the CPU build this environment runs are what the installer would build now, so
    an existing install is not rebuilt (and the wheel keeps its key)."""
    stamp = Path(sys.prefix) / "appliance-llama-build.txt"
    if not stamp.is_file():
        pytest.skip("this environment was not installed by installer/install.sh")
    installed = stamp.read_text().strip()
    if any(f"-DGGML_{gpu}=ON" in installed for gpu in ("CUDA", "HIP", "VULKAN")):
        pytest.skip("this environment runs a GPU build")
    done = subprocess.run(["bash", str(ROOT / "installer" / "install.sh"), "--dry-run"], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "APPLIANCE_GPU": "cpu", "APPLIANCE_CACHE": str(tmp_path)})
    assert fields(done)["build_id"] == installed
