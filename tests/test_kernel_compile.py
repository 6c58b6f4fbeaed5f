"""Every GPU kernel variant compiles with NVRTC for sm_80 and sm_90, and with hiprtc for AMD
targets — no GPU needed, so a broken kernel source fails CI on machines without one. (CI sets
JAXFUSE_REQUIRE_NVRTC=1, and JAXFUSE_REQUIRE_HIPRTC=1 when it could install Debian's ROCm
runtime, so a missing compiler is a failure there, not a skip.)"""

from __future__ import annotations

import dataclasses
import os

import pytest
from cases import DEPTHWISE_CASES, Case, compiler_available, depthwise_solver

from jaxfuse._extension import extension
from jaxfuse.activations import ActivationMode

if not compiler_available("CUDA"):
    if os.environ.get("JAXFUSE_REQUIRE_NVRTC") == "1":
        raise RuntimeError("JAXFUSE_REQUIRE_NVRTC=1 but NVRTC cannot be loaded")
    pytest.skip("NVRTC is not installed", allow_module_level=True)

ARCHS = ["sm_80", "sm_90"]

VARIANTS = (
    # Every dtype x layout, full chains with and without a convolution.
    [Case(ops=ops, dtype=dt, layout=layout, filter_layout=fl)
     for ops in ("CBNSA", "BNSA")
     for dt in ("float32", "float16", "bfloat16")
     for layout, fl in (("NCHW", "OIHW"), ("NHWC", "HWIO"))]
    # Every activation mode, in both solvers, and in the tensor-core epilogues.
    + [Case(ops=ops, activation=mode.value, dtype="float16")
       for ops in ("CA", "NA") for mode in ActivationMode]
    + [Case(ops="CBNA", activation=mode.value, dtype="bfloat16", layout="NHWC",
            filter_layout="HWIO", c=64, k=64, h=9, w=9) for mode in ActivationMode]
    # Per-activation batch norm, filter layouts, groups, strides and dilation.
    + [Case(ops=ops, bn_mode="per_activation", layout=layout)
       for ops in ("CNA", "NA") for layout in ("NCHW", "NHWC")]
    + [Case(ops="CBA", filter_layout=fl, layout="NHWC") for fl in ("OIHW", "HWIO", "OHWI")]
    + [Case(ops="CBA", groups=8, c=8, k=16, strides=(2, 2), dilation=(2, 1), padding="SAME")]
    + [Case(ops="C"), Case(ops="A"), Case(ops="N"), Case(ops="B"), Case(ops="S")]
    # Tensor-core implicit GEMM: both 16-bit dtypes, both filter layouts it reads, each tile.
    + [Case(ops="CBNSA", dtype=dt, layout="NHWC", filter_layout=fl, c=c, k=k, n=n, h=hw, w=hw)
       for dt in ("float16", "bfloat16") for fl in ("HWIO", "OHWI")
       for c, k, n, hw in ((16, 24, 1, 9), (64, 64, 8, 28), (64, 256, 64, 28), (128, 128, 2, 14),
                           (256, 512, 16, 14), (64, 192, 64, 14))]
    # Depthwise, every dtype; pointwise with too many channels for the shared-memory table.
    + [Case(ops="CBNA", dtype=dt, layout="NHWC", filter_layout="HWIO", groups=32, c=32, k=32)
       for dt in ("float32", "float16", "bfloat16")]
    + [Case(ops="BNA", c=5000, h=2, w=3, layout=layout) for layout in ("NCHW", "NHWC")]
)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("case", VARIANTS, ids=str)
def test_kernel_compiles(case: Case, arch: str) -> None:
    signature = case.build()[0].signature
    out = extension().gpu_compile_only("CUDA", signature.encode(), arch)
    assert out["binary_bytes"] > 0
    assert out["entries"], "no entry points"
    if "C" not in case.ops:
        assert out["solver"] == "pointwise"
    elif case.groups == case.c == case.k and case.layout == "NHWC":
        assert out["solver"] == "conv_depthwise"
    elif case.layout == "NHWC" and case.dtype != "float32" and case.c % 64 == 0 and \
            arch == "sm_90":
        assert out["solver"] == "conv_wgmma"
    elif case.layout == "NHWC" and case.dtype != "float32" and case.c % 16 == 0:
        assert out["solver"] == "conv_igemm"
    else:
        assert out["solver"] == "conv_direct"


def test_compile_error_carries_the_log() -> None:
    signature = Case(ops="CA").build()[0].signature
    with pytest.raises(RuntimeError, match="compiler log"):
        extension().gpu_compile_only("CUDA", signature.encode(), "sm_1")


# Every tile variant autotuning may pick must compile too (sm_90: wgmma tiles; sm_80: mma.sync).
TILED = [Case(ops="CBNSA", dtype="float16", layout="NHWC", filter_layout=fl, c=c, k=k, n=n, h=hw,
              w=hw) for fl, c, k, n, hw in (("HWIO", 64, 256, 64, 28), ("OHWI", 512, 512, 1, 7),
                                            ("HWIO", 3, 64, 8, 56), ("HWIO", 32, 48, 2, 9))]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("case", TILED, ids=str)
def test_every_tile_variant_compiles(case: Case, arch: str) -> None:
    encoded = case.build()[0].signature.encode()
    count = extension().gpu_compile_only("CUDA", encoded, arch)["variants"]
    assert count >= 2, "the tensor-core solvers offer alternatives to tune"
    tiles = set()
    for variant in range(count):
        out = extension().gpu_compile_only("CUDA", encoded, arch, variant=variant)
        assert out["binary_bytes"] > 0 and out["tile"]
        tiles.add(out["tile"])
    assert len(tiles) == count, "variants are distinct tiles"


# Every (geometry, variant) the solver chooser can pick for the benchmark suites' layers (real
# networks: ResNet-50, MobileNetV2, depthwise MobileNet) compiles: a variant that does not is
# dropped at run time, but it should not exist (MobileNetV2's 1x1 16->96 once hit a static
# assertion only large outputs reach).
def _suite_cases() -> list[Case]:
    from jaxfuse.bench.layers import SUITES

    cases = []
    for suite in ("resnet50", "mobilenetv2", "mobilenet"):
        for layer in SUITES[suite]:
            for dtype, n in (("bfloat16", 1), ("bfloat16", 64), ("float16", 8)):
                ops = "CBNA" if layer.activation else "CBN"
                cases.append(Case(ops=ops, dtype=dtype, layout="NHWC", filter_layout="HWIO",
                                  n=n, c=layer.c, k=layer.k, h=layer.hw, w=layer.hw, r=layer.r,
                                  s=layer.r, strides=(layer.stride,) * 2,
                                  padding=((layer.pad, layer.pad),) * 2, groups=layer.groups,
                                  activation=layer.activation or "relu"))
    return cases


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("case", _suite_cases(), ids=str)
def test_every_variant_of_real_layers_compiles(case: Case, arch: str) -> None:
    encoded = case.build()[0].signature.encode()
    count = extension().gpu_compile_only("CUDA", encoded, arch)["variants"]
    for variant in range(1, count):  # variant 0 compiled just above
        assert extension().gpu_compile_only("CUDA", encoded, arch,
                                            variant=variant)["binary_bytes"] > 0


# The depthwise solver: the geometries at its edges in every dtype, and MobileNet's depthwise
# layers (its performance targets) at batch 1 and 64 in fp16 and fp32 (bf16: above); every
# variant compiles, variants are distinct, and filters up to 5x5 take the tiled kernel first.
def _compile_every_variant(case: Case, arch: str) -> list[dict]:
    encoded = case.build()[0].signature.encode()
    first = extension().gpu_compile_only("CUDA", encoded, arch)
    outs = [first] + [extension().gpu_compile_only("CUDA", encoded, arch, variant=v)
                      for v in range(1, first["variants"])]
    for out in outs:
        assert out["binary_bytes"] > 0 and out["solver"] == first["solver"]
    assert len({out["tile"] for out in outs}) == len(outs), "variants are distinct tiles"
    return outs


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("case", DEPTHWISE_CASES, ids=str)
def test_depthwise_edges_compile(case: Case, dtype: str, arch: str) -> None:
    case = dataclasses.replace(case, dtype=dtype)
    outs = _compile_every_variant(case, arch)
    assert outs[0]["solver"] == depthwise_solver(case)
    if outs[0]["solver"] == "conv_depthwise" and case.r * case.s <= 25:
        assert outs[0]["entries"][0]["name"] == "jaxfuse_conv_depthwise", outs[0]["tile"]


def _mobilenet_depthwise_cases() -> list[Case]:
    from jaxfuse.bench.layers import SUITES

    return [Case(ops="CBNA", dtype=dtype, layout="NHWC", filter_layout="HWIO", n=n, c=layer.c,
                 k=layer.k, h=layer.hw, w=layer.hw, r=layer.r, s=layer.r,
                 strides=(layer.stride,) * 2, padding=((layer.pad, layer.pad),) * 2,
                 groups=layer.groups, activation=layer.activation or "relu")
            for suite in ("mobilenet", "mobilenetv2") for layer in SUITES[suite]
            if layer.groups > 1 for dtype in ("float16", "float32") for n in (1, 64)]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("case", _mobilenet_depthwise_cases(), ids=str)
def test_mobilenet_depthwise_layers_compile(case: Case, arch: str) -> None:
    outs = _compile_every_variant(case, arch)
    assert outs[0]["solver"] == "conv_depthwise"
    # The tiled kernel's tilings, then the vector kernel it replaced, for autotuning to time.
    names = [out["entries"][0]["name"] for out in outs]
    assert names[-1] == "jaxfuse_conv_depthwise_vector" and outs[-1]["tile"] == "vector"
    assert set(names[:-1]) == {"jaxfuse_conv_depthwise"}
    if case.n == 64:
        assert len(outs) >= 3, "alternative tilings"


HIPRTC = compiler_available("ROCM")
if not HIPRTC and os.environ.get("JAXFUSE_REQUIRE_HIPRTC") == "1":
    raise RuntimeError("JAXFUSE_REQUIRE_HIPRTC=1 but hiprtc cannot be loaded")

# CDNA2 and RDNA2. (Newer targets such as gfx1100 crash Debian's LLVM-15-based hiprtc.)
AMD_ARCHS = ["gfx90a", "gfx1030"]


@pytest.mark.skipif(not HIPRTC, reason="hiprtc is not installed")
@pytest.mark.parametrize("arch", AMD_ARCHS)
@pytest.mark.parametrize("case", VARIANTS, ids=str)
def test_kernel_compiles_for_amd(case: Case, arch: str) -> None:
    out = extension().gpu_compile_only("ROCM", case.build()[0].signature.encode(), arch)
    assert out["binary_bytes"] > 0
    # The tensor-core solvers are CUDA-only; HIP runs the portable kernels.
    assert out["solver"] in ("pointwise", "conv_direct", "conv_depthwise")


# fp32 through TF32 on the implicit-GEMM kernel (behind JAXFUSE_TF32_KERNELS=1 until it has run
# on a GPU): every filter layout it reads, each tile, strides, dilation, groups.
TF32_CASES = [Case(ops="CBNSA", dtype="float32", layout="NHWC", filter_layout=fl, c=c, k=k,
                   n=n, h=hw, w=hw, strides=st, dilation=dl, groups=gr)
              for fl in ("HWIO", "OHWI")
              for c, k, n, hw, st, dl, gr in ((16, 24, 1, 9, (1, 1), (1, 1), 1),
                                              (64, 64, 8, 28, (2, 2), (1, 1), 1),
                                              (64, 256, 64, 28, (1, 1), (2, 2), 1),
                                              (128, 128, 2, 14, (1, 2), (1, 1), 2))]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("case", TF32_CASES, ids=str)
def test_fp32_plans_compile_on_the_tf32_kernel(case: Case, arch: str, monkeypatch) -> None:
    encoded = case.build()[0].signature.encode()
    assert extension().gpu_compile_only("CUDA", encoded, arch)["solver"] == "conv_direct"
    monkeypatch.setenv("JAXFUSE_TF32_KERNELS", "1")
    out = extension().gpu_compile_only("CUDA", encoded, arch)
    assert out["solver"] == "conv_igemm"
    for variant in range(1, out["variants"]):
        assert extension().gpu_compile_only("CUDA", encoded, arch,
                                            variant=variant)["binary_bytes"] > 0
    exact = dataclasses.replace(case, precision="highest").build()[0].signature.encode()
    assert extension().gpu_compile_only("CUDA", exact, arch)["solver"] == "conv_direct"
