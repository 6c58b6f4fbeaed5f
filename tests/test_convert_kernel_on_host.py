"""The batched-conversion kernel's own source, run on the CPU: tests/host/convert_many_on_host.cc
compiles csrc/kernels/convert_many.cuh with the host C++ compiler (CUDA's built-ins stubbed,
the portable 16-bit conversions), runs every thread of the grid on the tables the GPU handler
builds, and checks every element and the bytes past each output. No GPU needed; the CUDA
conversion instructions themselves are checked against XLA on a GPU (test_convert_many.py)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
HARNESS = ROOT / "tests" / "host" / "convert_many_on_host.cc"


def _compiler() -> str:
    compiler = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if compiler is None or not (ROOT / "csrc" / "kernels" / "convert_many.cuh").exists():
        pytest.skip("needs a host C++ compiler and the source tree")
    return compiler


def test_kernel_source_on_the_host(tmp_path: Path) -> None:
    compiler = _compiler()
    probe = tmp_path / "probe.cc"
    probe.write_text("int main() { _Float16 h = 1.5f; return static_cast<float>(h) != 1.5f; }\n")
    if subprocess.run([compiler, "-std=c++17", str(probe), "-o", str(tmp_path / "probe")],
                      capture_output=True).returncode != 0:
        pytest.skip(f"{compiler} has no _Float16 (GCC >= 12 or Clang >= 15 on x86-64 do)")
    binary = tmp_path / "convert_many_on_host"
    build = subprocess.run([compiler, "-std=c++17", "-O1", f"-I{ROOT / 'csrc'}", str(HARNESS),
                            "-o", str(binary)], capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr
    run = subprocess.run([str(binary)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert ", 0 bad" in run.stdout and "in 1 launches" not in run.stdout, run.stdout
