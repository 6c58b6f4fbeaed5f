"""Builds a standalone CUDA probe (one .cu source that includes csrc/kernels/) with nvcc for
sm_90a and runs it, for the scripts that check wgmma conventions on a Hopper GPU
(wgmma_probe.py, halo_probe.py)."""

import os
import subprocess
import tempfile

KERNELS = os.path.join(os.path.dirname(__file__), "..", "csrc", "kernels")


def build_and_run(source: str) -> int:
    """Compiles `source`, runs it, prints its output; the exit status (1 if it did not build)."""
    with tempfile.TemporaryDirectory() as tmp:
        cu, exe = os.path.join(tmp, "probe.cu"), os.path.join(tmp, "probe")
        with open(cu, "w") as f:
            f.write(source)
        build = subprocess.run(
            ["nvcc", "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a", "-I", KERNELS,
             "-o", exe, cu], capture_output=True, text=True)
        if build.returncode:
            print(build.stderr[-3000:])
            return 1
        run = subprocess.run([exe], capture_output=True, text=True, timeout=60)
        print(run.stdout, run.stderr, end="")
        return run.returncode
