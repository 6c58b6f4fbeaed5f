"""The planar depthwise kernel (csrc/kernels/conv_planes.cuh) run on the CPU: the code
generator's translation unit for each case is compiled by the host C++ compiler into
tests/host/kernel_on_host.cc, which launches it one host thread per GPU thread, and every
output element is checked against the float64 reference (poisoned beforehand, so an element
never written fails). Its tiling, halos, padding, strides, dilation, filter layouts and
epilogue are tested without a GPU; test_gpu_runtime runs the same cases on one."""

from __future__ import annotations

import dataclasses
import shutil
import subprocess
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from cases import PLANAR_DEPTHWISE_CASES, TOLERANCE, Case, relative_error

from jaxfuse._extension import extension
from jaxfuse.reference import reference_float64

ROOT = Path(__file__).resolve().parent.parent
HARNESS = ROOT / "tests" / "host" / "kernel_on_host.cc"
DTYPES = ("float32", "float16", "bfloat16")

# Every edge geometry, each in one dtype (in turns), and layers that take the tiling's other
# branches: whole small planes several to a CTA, the last CTA's group short (802 planes of
# 7x7 in threes); tiles along both axes of a wide plane; a window too large for shared memory
# at the first tiling (stride 4 over 40-column tiles: its rows halved).
CASES = [dataclasses.replace(case, dtype=DTYPES[i % 3])
         for i, case in enumerate(PLANAR_DEPTHWISE_CASES) if case.r * case.s <= 81] + [
    Case(ops="CBNA", dtype="bfloat16", layout="NCHW", filter_layout="OIHW", n=2, c=401, k=401,
         groups=401, h=7, w=7, padding=((1, 1), (1, 1)), activation="clipped_relu"),
    Case(ops="CBNSA", dtype="float16", layout="NCHW", filter_layout="OIHW", n=1, c=3, k=3,
         groups=3, h=61, w=117, strides=(2, 1), padding=((1, 1), (1, 1))),
    Case(ops="CBNA", dtype="float32", layout="NCHW", filter_layout="OIHW", n=1, c=2, k=2,
         groups=2, h=100, w=280, strides=(4, 4), padding=((1, 1), (1, 1))),
    # Two columns a thread where the window's first column is odd through a negative padding.
    Case(ops="CBNA", dtype="float16", layout="NCHW", filter_layout="OIHW", n=2, c=5, k=5,
         groups=5, h=12, w=14, padding=((1, 1), (-1, 1)), activation="clipped_relu"),
]
# The tilings those three take (PlanesTileFor), so that they keep testing what they are for.
BRANCH_TILES = ["8x7 p3 b4", "24x40 p1 b4", "12x40 p1 b4"]
BRANCH_CASES = CASES[-4:-1]


def _compiler() -> str:
    compiler = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if compiler is None or not HARNESS.exists():
        pytest.skip("needs a host C++ compiler and the source tree")
    return compiler


def _host_arrays(case: Case, operands: list[np.ndarray], signature) -> dict[str, np.ndarray]:
    """The kernel's buffers from the reference's float64 operands (each exactly a value of its
    buffer's dtype): the data and side input in the plan's dtype, the filters in theirs, the
    parameters and scalars float32."""
    dtype = np.dtype(jnp.dtype(case.dtype))
    filter_dtype = np.dtype(jnp.dtype(case.filter_dtype or case.dtype))
    names = [spec.name for spec in signature.operands]
    as_dtype = {"x": dtype, "side": dtype, "w": filter_dtype}
    return {name: np.asarray(value).astype(as_dtype.get(name, np.float32))
            for name, value in zip(names, operands)}


# The tilings tested, by how their names end (codegen.cc: PlanesTile::Name): the default (4 rows
# a thread), 8 rows, and 4 and 8 rows of two columns a thread.
TILINGS = {"default": None, "tall": " b8", "pairs": " b4 c2", "tall pairs": " b8 c2"}


def _tiling(encoded: str, which: str) -> dict:
    """The planar kernel's variant of the tiling named `which` (variant 0 for the default)."""
    first = extension().gpu_compile_only("CUDA", encoded, "sm_90")
    assert first["solver"] == "conv_planes", first["solver"]
    if TILINGS[which] is None:
        return first
    for variant in range(1, first["variants"]):
        out = extension().gpu_compile_only("CUDA", encoded, "sm_90", variant=variant)
        if out["solver"] == "conv_planes" and out["tile"].endswith(TILINGS[which]):
            return out
    pytest.skip(f"no {which} tiling for these planes")


@pytest.mark.parametrize("tiling", list(TILINGS))
@pytest.mark.parametrize("case", CASES, ids=str)
def test_planar_depthwise_kernel_on_the_host(case: Case, tiling: str, tmp_path: Path) -> None:
    compiler = _compiler()
    plan, handles = case.build()
    signature = plan.signature
    out = _tiling(signature.encode(), tiling)
    if tiling == "default" and case in BRANCH_CASES:
        assert out["tile"] == BRANCH_TILES[BRANCH_CASES.index(case)], out["tile"]
    entry = out["entries"][0]
    source = tmp_path / "kernel.inc"
    source.write_text(out["source"])
    binary = tmp_path / "kernel_on_host"
    build = subprocess.run(
        [compiler, "-std=c++20", "-O1", "-pthread", "-Wno-unknown-pragmas",
         f"-I{ROOT / 'csrc' / 'kernels'}", f'-DKERNEL_SOURCE="{source}"', str(HARNESS),
         "-o", str(binary)], capture_output=True, text=True, timeout=300)
    if build.returncode != 0 and "_Float16" in build.stderr:
        pytest.skip(f"{compiler} has no _Float16 (GCC >= 12 or Clang >= 15 on x86-64 do)")
    assert build.returncode == 0, build.stderr[-4000:]

    rng = np.random.default_rng(7)
    _, _, operands = case.random_args(plan, handles, rng)
    arrays = _host_arrays(case, operands, signature)
    for name, array in arrays.items():  # (the harness's file names are the operands' names)
        (tmp_path / f"{name}.bin").write_bytes(np.ascontiguousarray(array).tobytes())
    run = subprocess.run([str(binary), str(tmp_path), entry["name"], str(entry["grid"]),
                          str(entry["block"])], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-4000:]

    dtype = jnp.dtype(case.dtype)
    y = np.frombuffer((tmp_path / "y.bin").read_bytes(), dtype).reshape(signature.output_shape)
    ref = reference_float64(signature, *operands)
    err = relative_error(y, ref)  # (asserts no NaN: the poison where nothing was written)
    assert err <= TOLERANCE[np.dtype(dtype)], f"relative error {err:.3g}"
