"""Every GPU kernel variant compiles with NVRTC for sm_80 and sm_90, and with hiprtc for AMD
targets — no GPU needed, so a broken kernel source fails CI on machines without one. (CI sets
JAXFUSE_REQUIRE_NVRTC=1, and JAXFUSE_REQUIRE_HIPRTC=1 when it could install Debian's ROCm
runtime, so a missing compiler is a failure there, not a skip.)"""

from __future__ import annotations

import dataclasses
import os
import re

import jax.numpy as jnp
import pytest
from cases import (
    DEPTHWISE_CASES,
    PLANAR_DEPTHWISE_CASES,
    WALKING_DEPTHWISE_CASES,
    Case,
    compiler_available,
    depthwise_solver,
    layer_case,
    suite_layers,
)

from jaxfuse._extension import extension
from jaxfuse.activations import ActivationMode

if not compiler_available("CUDA"):
    if os.environ.get("JAXFUSE_REQUIRE_NVRTC") == "1":
        raise RuntimeError("JAXFUSE_REQUIRE_NVRTC=1 but NVRTC cannot be loaded")
    pytest.skip("NVRTC is not installed", allow_module_level=True)

ARCHS = ["sm_80", "sm_90"]


def expected_solver(case: Case, arch: str, tf32: bool = True) -> str:
    """The solver csrc/gpu/codegen.cc picks for `case` on a CUDA device of `arch` (TF32
    kernels on, as by default)."""
    if "C" not in case.ops:
        return "pointwise"
    cg, kg, taps = case.c // case.groups, case.k // case.groups, case.r * case.s
    fl = case.filter_layout
    if case.layout == "NHWC":
        filter_ok = fl in ("HWIO", "OHWI") or taps == 1
        channels_ok = cg % (4 if case.dtype == "float32" else 8) == 0 or fl == "HWIO"
    else:  # NCHW: A gathered; OIHW of several taps reduces over (c, r, s), a 32-bit tap mask
        filter_ok = fl in ("HWIO", "OHWI") or taps == 1 or taps <= 32 or cg % 16 != 0
        channels_ok = True
    dtype_ok = case.dtype != "float32" or (tf32 and case.precision != "highest" and
                                           kg % 4 == 0)
    if dtype_ok and filter_ok and channels_ok and kg % 8 == 0:
        if arch == "sm_90" and (cg % 64 == 0 if case.dtype != "float32" else
                                (cg % 32 == 0 and case.layout == "NHWC")):
            return "conv_wgmma"
        return "conv_igemm"
    if case.groups == case.c == case.k and case.layout == "NHWC" and fl == "HWIO":
        return "conv_depthwise"
    if case.groups == case.c == case.k and case.layout == "NCHW" and taps <= 81:
        return "conv_planes"
    if (case.layout == "NHWC" and case.dtype != "float32" and case.groups == 1
            and tuple(case.dilation) == (1, 1) and case.c <= 4 and case.k % 8 == 0
            and case.k <= 128 and (case.w * case.c) % 2 == 0):
        return "conv_stem"  # (filters up to 16x16, strides along W up to 8)
    return "conv_direct"


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
    # ... and NCHW (A gathered through registers; OIHW reduces over (c, r, s)): every filter
    # layout, 1x1 and 3x3, 7x7 outputs, few channels (the stem), strides, dilation, groups.
    + [Case(ops="CBNSA", dtype=dt, layout="NCHW", filter_layout=fl, c=c, k=k, n=n, h=hw, w=hw,
            r=r, s=r, padding=((r // 2, r // 2),) * 2)
       for dt in ("float16", "bfloat16") for fl in ("OIHW", "HWIO", "OHWI")
       for c, k, n, hw, r in ((16, 24, 1, 9, 3), (64, 64, 8, 28, 3), (64, 256, 4, 28, 1),
                              (512, 512, 2, 7, 3), (32, 48, 2, 9, 5))]
    + [Case(ops="CBNSA", dtype=dt, layout="NCHW", filter_layout=fl, c=3, k=64, n=2, h=23,
            w=21, r=7, s=7, strides=(2, 2), padding=((3, 3), (3, 3)))
       for dt in ("float16", "float32") for fl in ("OIHW", "HWIO")]
    # fp32 (TF32) few-channel plans in NHWC: the gathered stem, MobileNet's 24-channel 1x1.
    + [Case(ops="CBNA", dtype="float32", layout="NHWC", filter_layout="HWIO", c=c, k=k, n=n,
            h=hw, w=hw, r=r, s=r, strides=(st, st), padding=((p, p), (p, p)))
       for c, k, n, hw, r, st, p in ((3, 64, 64, 224, 7, 2, 3), (24, 144, 64, 56, 1, 1, 0),
                                     (3, 32, 8, 224, 3, 2, 1))]
    # NHWC taps of whole 16-byte chunks but not whole k-tiles (copied chunk by chunk): every
    # dtype, 1x1 and 3x3, HWIO and K-major filters.
    + [Case(ops="CBNSA", dtype=dt, layout="NHWC", filter_layout=fl, c=c, k=48, n=2, h=11, w=9,
            r=r, s=r, padding=((r // 2, r // 2),) * 2)
       for dt, c in (("bfloat16", 24), ("float16", 8), ("float16", 40), ("float32", 12))
       for fl in ("HWIO", "OHWI") for r in (1, 3)]
    + [Case(ops="CNA", dtype="bfloat16", layout="NCHW", filter_layout="OIHW", c=128, k=64,
            groups=2, h=15, w=13, strides=(2, 1), dilation=(1, 2), padding="SAME",
            bn_mode="per_activation")]
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
    assert out["solver"] == expected_solver(case, arch)


def test_compile_error_carries_the_log() -> None:
    signature = Case(ops="CA").build()[0].signature
    with pytest.raises(RuntimeError, match="compiler log"):
        extension().gpu_compile_only("CUDA", signature.encode(), "sm_1")


@pytest.mark.parametrize("arch", ARCHS)
def test_convert_kernel_compiles(arch: str) -> None:
    """The batched conversion's fixed kernel (jaxfuse_convert_many): its parameter block, a
    table of segments passed by value, stays within the 4 KB every CUDA launch takes."""
    out = extension().gpu_compile_convert("CUDA", arch)
    assert out["binary_bytes"] > 0
    assert out["table_bytes"] <= 4096 and out["max_segments"] >= 64


# Every tile variant autotuning may pick must compile too (sm_90: wgmma tiles; sm_80: mma.sync).
TILED = [Case(ops="CBNSA", dtype="float16", layout=layout, filter_layout=fl, c=c, k=k, n=n, h=hw,
              w=hw) for layout, fl, c, k, n, hw in (
                  ("NHWC", "HWIO", 64, 256, 64, 28), ("NHWC", "OHWI", 512, 512, 1, 7),
                  ("NHWC", "HWIO", 3, 64, 8, 56), ("NHWC", "HWIO", 32, 48, 2, 9),
                  ("NCHW", "OIHW", 512, 512, 1, 7), ("NCHW", "OIHW", 3, 64, 8, 56))] + [
    Case(ops="CBNSA", dtype="float32", layout=layout, filter_layout=fl, c=3, k=64, n=8, h=56,
         w=56, r=7, s=7, strides=(2, 2), padding=((3, 3), (3, 3)))
    for layout, fl in (("NHWC", "HWIO"), ("NCHW", "OIHW"))]


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


# Split-K tiles (batch 1, 7x7 planes: clusters of 8 CTAs) reserve the receive area of their
# partial sums (64 rows x (BN + 8) floats) beside the pipeline's stages, since the other CTAs'
# sums arrive while a CTA may still be multiplying; unsplit tiles stage the epilogue's tile in
# the stages themselves. NHWC and NCHW (A gathered) alike.
@pytest.mark.parametrize("layout", ["NHWC", "NCHW"])
def test_split_k_tiles_reserve_their_receive_area(layout: str) -> None:
    case = Case(ops="CBNSA", dtype="bfloat16", layout=layout,
                filter_layout="HWIO" if layout == "NHWC" else "OIHW", c=512, k=512, n=1, h=7,
                w=7)
    encoded = case.build()[0].signature.encode()
    count = extension().gpu_compile_only("CUDA", encoded, "sm_90")["variants"]
    split = 0
    for variant in range(count):
        out = extension().gpu_compile_only("CUDA", encoded, "sm_90", variant=variant)
        tile = re.fullmatch(r"(\d+)x(\d+) s(\d+) b\d+(?: k/(\d+))?", out["tile"])
        if out["solver"] != "conv_wgmma" or not tile:
            continue
        bm, bn, stages, splits = (int(g or 1) for g in tile.groups())
        staged, receive = stages * (bm + bn) * 128, bm * (bn + 8) * 4
        shared = out["entries"][0]["shared_bytes"]
        if splits > 1:
            split += 1
            assert bm == 64 and shared == staged + receive + 1024
        else:
            assert shared == max(staged, receive) + 1024
    assert split >= 2, "batch 1 on 7x7 planes offers split-K tiles"


# The few-channel stem kernel (conv_stem.cuh) at its edges: 1 to 4 channels, 8 to 128 output
# channels, each filter layout, filters narrower and wider than a k-step's 4 columns, strides
# along W of 1 to 4; offered beside the mma.sync tiles, never where it does not apply.
STEMS = [Case(ops=ops, dtype=dt, layout="NHWC", filter_layout=fl, c=c, k=k, n=2, h=hw, w=hw,
              r=r, s=s, strides=st, padding="SAME")
         for ops, dt, fl, c, k, hw, r, s, st in (
             ("CBNA", "bfloat16", "HWIO", 3, 64, 224, 7, 7, (2, 2)),
             ("CBNSA", "float16", "OHWI", 1, 8, 28, 3, 3, (1, 1)),
             ("CNA", "bfloat16", "OIHW", 2, 128, 31, 5, 2, (1, 3)),
             ("CBA", "float16", "HWIO", 4, 24, 40, 1, 9, (2, 4)))]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("case", STEMS, ids=str)
def test_stem_kernel_variants_compile(case: Case, arch: str) -> None:
    encoded = case.build()[0].signature.encode()
    count = extension().gpu_compile_only("CUDA", encoded, arch)["variants"]
    outs = [extension().gpu_compile_only("CUDA", encoded, arch, variant=v) for v in range(count)]
    assert all(out["binary_bytes"] > 0 for out in outs)
    n_tiles = (case.k + 7) // 8
    assert [out["tile"] for out in outs if out["solver"] == "conv_stem"] == [
        f"{bm}x{n_tiles * 8} w{warps} b{blocks}{suffix}"
        for bm, warps, blocks, suffix in ((128, 8, 2, ""), (128, 4, 2, ""), (64, 2, 3, ""),
                                          (128, 4, 3, " r"), (64, 2, 5, " r"))
        if warps * 32 // bm == 1 or n_tiles % 2 == 0]
    odd_rows = dataclasses.replace(case, w=case.w + 1 if case.c % 2 else case.w, c=3)
    if (odd_rows.w * odd_rows.c) % 2:  # a word would straddle two image rows
        encoded = odd_rows.build()[0].signature.encode()
        count = extension().gpu_compile_only("CUDA", encoded, arch)["variants"]
        assert all(extension().gpu_compile_only("CUDA", encoded, arch, variant=v)["solver"]
                   != "conv_stem" for v in range(count))


# A stem-shaped plan whose filter fragments would not fit shared memory (16x16 taps, 128 output
# channels) and that the mma.sync kernel does not take (OHWI filters of 3 channels): the direct
# kernel, not a stem variant that is not there.
@pytest.mark.parametrize("arch", ARCHS)
def test_a_stem_too_large_for_shared_memory_takes_the_direct_kernel(arch: str) -> None:
    case = Case(ops="CBNA", dtype="float16", layout="NHWC", filter_layout="OHWI", c=3, k=128,
                n=1, h=40, w=40, r=16, s=16, padding="SAME")
    encoded = case.build()[0].signature.encode()
    out = extension().gpu_compile_only("CUDA", encoded, arch)
    assert out["solver"] == "conv_direct" and out["variants"] == 1 and out["binary_bytes"] > 0


# The stem's tiles count its static table of epilogue terms (20 bytes a channel) against the
# H100's opt-in shared memory (232448 bytes) too: this plan's two widest tiles once asked for
# all of it in dynamic bytes alone, and could not have loaded.
def test_stem_tiles_fit_shared_memory_with_their_static_table() -> None:
    case = Case(ops="CBNA", dtype="float16", layout="NHWC", filter_layout="OHWI", c=1, k=64,
                n=1, h=40, w=2000, r=16, s=13, strides=(1, 8), padding="SAME")
    encoded = case.build()[0].signature.encode()
    count = extension().gpu_compile_only("CUDA", encoded, "sm_90")["variants"]
    outs = [extension().gpu_compile_only("CUDA", encoded, "sm_90", variant=v)
            for v in range(count)]
    stems = [out for out in outs if out["solver"] == "conv_stem"]
    assert stems and all(out["entries"][0]["shared_bytes"] + 64 * 20 <= 232448 for out in stems)


# Every (geometry, variant) the solver chooser can pick for the benchmark suites' layers (real
# networks: ResNet-50, MobileNetV2, depthwise MobileNet) compiles: a variant that does not is
# dropped at run time, but it should not exist (MobileNetV2's 1x1 16->96 once hit a static
# assertion only large outputs reach).
def _suite_cases() -> list[Case]:
    cases = []
    for suite in ("resnet50", "mobilenetv2", "mobilenet"):
        # NHWC for every layer; NCHW (as the benchmarks run them) in fp16 and bf16 for ResNet-50
        # (and fp32 through TF32: test_fp32_plans_compile_on_the_tf32_kernel), in fp16 for the
        # MobileNets (the planar depthwise kernel).
        runs = [("NHWC", dtype, n) for dtype, n in (("bfloat16", 1), ("bfloat16", 64),
                                                    ("float16", 8))]
        if suite == "resnet50":
            runs += [("NCHW", dtype, n) for dtype in ("float16", "bfloat16") for n in (1, 64)]
        else:
            runs += [("NCHW", "float16", n) for n in (1, 64)]
        if suite == "mobilenetv2":  # fp32 (TF32): few-channel layers gather their reduction
            runs += [("NHWC", "float32", 64)]
        cases += [layer_case(layer, dtype=dtype, layout=layout, n=n)
                  for layer in suite_layers(suite) for layout, dtype, n in runs]
    return cases


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("case", _suite_cases(), ids=str)
def test_every_variant_of_real_layers_compiles(case: Case, arch: str) -> None:
    encoded = case.build()[0].signature.encode()
    out = extension().gpu_compile_only("CUDA", encoded, arch)
    assert out["solver"] == expected_solver(case, arch)
    count = out["variants"]
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


# The planar depthwise kernel (NCHW): the same edges in every dtype, each filter layout; its
# variants are its tilings (4 rows a thread; the same with registers capped for a whole
# multiprocessor of threads, up to 3x3 filters; 8 rows a thread where the planes are taller
# than one tile), then conv_direct.
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("case", PLANAR_DEPTHWISE_CASES, ids=str)
def test_planar_depthwise_edges_compile(case: Case, dtype: str, arch: str) -> None:
    case = dataclasses.replace(case, dtype=dtype)
    encoded = case.build()[0].signature.encode()
    count = extension().gpu_compile_only("CUDA", encoded, arch)["variants"]
    outs = [extension().gpu_compile_only("CUDA", encoded, arch, variant=v) for v in range(count)]
    assert all(out["binary_bytes"] > 0 for out in outs)
    assert outs[0]["solver"] == depthwise_solver(case)
    if outs[0]["solver"] == "conv_planes":
        assert [out["solver"] for out in outs] == ["conv_planes"] * (count - 1) + ["conv_direct"]
        assert {out["entries"][0]["name"] for out in outs[:-1]} == {"jaxfuse_conv_planes"}
        tiles = [out["tile"] for out in outs[:-1]]
        assert len(set(tiles)) == len(tiles), tiles
        assert (f"{tiles[0]} o" in " ".join(tiles)) == (case.r * case.s <= 9), tiles
        # Two columns a thread move pairs of values: such an entry runs on pair-aligned buffers
        # only (conv_direct, the entry after it, on any).
        pair = 2 * jnp.dtype(dtype).itemsize
        for out in outs[:-1]:
            assert out["entries"][0]["alignment"] == (pair if " c2" in out["tile"] else 1), out
            assert out["entries"][-1]["name"] == "jaxfuse_conv_direct"


# The pointwise kernel's variants (tensors without a convolution): at batch 1 one vector a
# thread, in 16-byte vectors and, for 16-bit data, 8-byte ones, each with a block table of
# channel terms and (channels in whole vectors, per-channel parameters) terms of its own; at
# batch 64 the streaming kernel alone.
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("n", [1, 64])
def test_pointwise_variants_compile(dtype: str, n: int) -> None:
    case = Case(ops="BNA", dtype=dtype, layout="NHWC", n=n, c=256, h=56, w=56)
    outs = _compile_every_variant(case, "sm_90")
    tiles = [out["tile"] for out in outs]
    if n == 64:
        assert tiles == [""]
    elif dtype == "float32":
        assert tiles == ["", "vector terms"]
    else:
        assert tiles == ["", "vector terms", "8B", "8B vector terms"]
        assert [out["entries"][0]["alignment"] for out in outs] == [16, 16, 8, 8]
    no_terms = Case(ops="A", dtype=dtype, layout="NHWC", n=1, c=256, h=56, w=56)
    assert "vector terms" not in {out["tile"] for out in _compile_every_variant(no_terms, "sm_90")}
    if dtype != "float32":  # 12 channels: whole 8-byte vectors (own terms), not 16-byte ones
        twelve = Case(ops="BNA", dtype=dtype, layout="NHWC", n=1, c=12, h=7, w=5)
        assert [out["tile"] for out in _compile_every_variant(twelve, "sm_90")] == [
            "", "8B", "8B vector terms"]


# NCHW at batch 1: terms of its own where a plane is whole vectors (one channel a vector).
@pytest.mark.parametrize("dtype, hw, tiles", [
    ("bfloat16", (14, 14), ["", "8B", "8B vector terms"]),  # 196 values: 4-lane vectors only
    ("float16", (8, 8), ["", "vector terms", "8B", "8B vector terms"]),
    ("float32", (14, 14), ["", "vector terms"]),
    ("bfloat16", (5, 7), ["", "8B"]),  # planes of no whole vector: the table alone
])
def test_nchw_pointwise_variants_compile(dtype: str, hw: tuple[int, int],
                                         tiles: list[str]) -> None:
    case = Case(ops="BNA", dtype=dtype, layout="NCHW", n=1, c=1024, h=hw[0], w=hw[1])
    assert [out["tile"] for out in _compile_every_variant(case, "sm_90")] == tiles


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("case", WALKING_DEPTHWISE_CASES, ids=str)
def test_walking_depthwise_variants_compile(case: Case, arch: str) -> None:
    tiles = [out["tile"] for out in _compile_every_variant(case, arch)]
    assert [t for t in tiles if "walk" in t] == [f"{tiles[0]} walk2", f"{tiles[0]} walk4"]


def _mobilenet_depthwise_cases() -> list[Case]:
    return [layer_case(layer, dtype=dtype, layout="NHWC", n=n)
            for layer in suite_layers("mobilenet", "mobilenetv2", depthwise=True)
            for dtype in ("float16", "float32") for n in (1, 64)]


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


@pytest.mark.skipif(not HIPRTC, reason="hiprtc is not installed")
@pytest.mark.parametrize("arch", AMD_ARCHS)
@pytest.mark.parametrize("case", PLANAR_DEPTHWISE_CASES, ids=str)
def test_planar_depthwise_compiles_for_amd(case: Case, arch: str) -> None:
    out = extension().gpu_compile_only("ROCM", case.build()[0].signature.encode(), arch)
    assert out["binary_bytes"] > 0 and out["solver"] == depthwise_solver(case)


@pytest.mark.skipif(not HIPRTC, reason="hiprtc is not installed")
@pytest.mark.parametrize("arch", AMD_ARCHS)
def test_convert_kernel_compiles_for_amd(arch: str) -> None:
    assert extension().gpu_compile_convert("ROCM", arch)["binary_bytes"] > 0


def _resnet50() -> list:
    from jaxfuse.bench.layers import SUITES

    return SUITES["resnet50"]


# fp32 through TF32 on the implicit-GEMM kernels (JAXFUSE_TF32_KERNELS=0 turns them off): every
# filter layout they read, each tile, strides, dilation, groups. On sm_90, NHWC plans with 32k
# input channels per group take the wgmma kernel (HWIO filters transposed as they load).
TF32_CASES = [Case(ops="CBNSA", dtype="float32", layout=layout, filter_layout=fl, c=c, k=k,
                   n=n, h=hw, w=hw, strides=st, dilation=dl, groups=gr)
              for layout, fl in (("NHWC", "HWIO"), ("NHWC", "OHWI"), ("NCHW", "OIHW"),
                                 ("NCHW", "HWIO"))
              for c, k, n, hw, st, dl, gr in ((16, 24, 1, 9, (1, 1), (1, 1), 1),
                                              (64, 64, 8, 28, (2, 2), (1, 1), 1),
                                              (64, 256, 64, 28, (1, 1), (2, 2), 1),
                                              (128, 128, 2, 14, (1, 2), (1, 1), 2))]
# ResNet-50's layers in NCHW with OIHW filters, batch 1 and 64, through TF32.
TF32_CASES += [Case(ops="CBNA", dtype="float32", layout="NCHW", filter_layout="OIHW", n=n,
                    c=layer.c, k=layer.k, h=layer.hw, w=layer.hw, r=layer.r, s=layer.r,
                    strides=(layer.stride,) * 2, padding=((layer.pad, layer.pad),) * 2)
               for layer in _resnet50() for n in (1, 64)]
# ... and in NHWC at batch 64 with HWIO filters and OHWI ones, the layout Hopper's fp32 plans
# transpose their filters into (jaxfuse.solvers.kernel_filters): every conv_tma tile too.
TF32_CASES += [Case(ops="CBNA", dtype="float32", layout="NHWC", filter_layout=fl, n=64,
                    c=layer.c, k=layer.k, h=layer.hw, w=layer.hw, r=layer.r, s=layer.r,
                    strides=(layer.stride,) * 2, padding=((layer.pad, layer.pad),) * 2)
               for layer in _resnet50() for fl in ("HWIO", "OHWI")
               if fl == "HWIO" or layer.c % 16 == 0]  # NHWC gathers only HWIO rows


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("case", TF32_CASES, ids=str)
def test_fp32_plans_compile_on_the_tf32_kernel(case: Case, arch: str, monkeypatch) -> None:
    encoded = case.build()[0].signature.encode()
    monkeypatch.setenv("JAXFUSE_TF32_KERNELS", "0")
    assert extension().gpu_compile_only("CUDA", encoded, arch)["solver"] == "conv_direct"
    monkeypatch.delenv("JAXFUSE_TF32_KERNELS")
    out = extension().gpu_compile_only("CUDA", encoded, arch)
    hopper = arch == "sm_90" and case.layout == "NHWC" and (case.c // case.groups) % 32 == 0
    assert out["solver"] == ("conv_wgmma" if hopper else "conv_igemm")
    for variant in range(1, out["variants"]):
        assert extension().gpu_compile_only("CUDA", encoded, arch,
                                            variant=variant)["binary_bytes"] > 0
    exact = dataclasses.replace(case, precision="highest").build()[0].signature.encode()
    assert extension().gpu_compile_only("CUDA", exact, arch)["solver"] == "conv_direct"


# conv_tma's ping-pong schedule: a copy of every one-block tile up to 128 wide, each compiling;
# none with JAXFUSE_TMA_PINGPONG=0.
PINGPONG = [Case(ops=ops, dtype=dt, layout="NHWC", filter_layout=fl, c=c, k=k, n=n, h=hw, w=hw,
                 r=r, s=r, padding=((r // 2, r // 2),) * 2)
            for ops, dt, fl, c, k, n, hw, r in (
                ("CBNA", "bfloat16", "HWIO", 64, 128, 16, 56, 3),
                ("CBNSA", "float16", "OHWI", 256, 96, 12, 27, 1),
                ("CBNA", "float32", "HWIO", 64, 64, 16, 28, 3),
                ("CBNSA", "float32", "OHWI", 64, 128, 8, 28, 1))]


def _sm90_variants(encoded: str) -> list[dict]:
    """Every variant of the plan `encoded` compiled for sm_90 (each must produce a binary)."""
    count = extension().gpu_compile_only("CUDA", encoded, "sm_90")["variants"]
    outs = [extension().gpu_compile_only("CUDA", encoded, "sm_90", variant=v)
            for v in range(count)]
    assert all(out["binary_bytes"] > 0 for out in outs)
    return outs


# conv_tma's tiles with the operands swapped: offered (256 and 128 pixels, ping-pong) for
# 16-bit plans whose groups have 64 output channels and [kk][k] filters, never otherwise, and
# not with JAXFUSE_TMA_SWAP=0 (or without ping-pong).
SWAP = [(Case(ops=ops, dtype=dt, layout="NHWC", filter_layout=fl, c=c, k=k, n=n, h=hw, w=hw,
              r=r, s=r, padding=((r // 2, r // 2),) * 2, groups=g), offered)
        for ops, dt, fl, c, k, g, n, hw, r, offered in (
            ("CBNA", "bfloat16", "HWIO", 64, 64, 1, 16, 56, 3, True),
            ("CBNSA", "float16", "HWIO", 128, 128, 2, 4, 17, 3, True),
            ("CBNA", "float16", "HWIO", 256, 64, 1, 8, 28, 1, True),
            ("CBNA", "bfloat16", "OHWI", 64, 64, 1, 16, 56, 3, False),
            ("CBNA", "bfloat16", "HWIO", 64, 128, 1, 16, 56, 3, False),
            ("CBNA", "float32", "HWIO", 64, 64, 1, 16, 28, 3, False))]


@pytest.mark.parametrize("case, offered", SWAP, ids=str)
def test_swapped_tiles_are_offered_where_they_apply(case: Case, offered: bool,
                                                    monkeypatch) -> None:
    encoded = case.build()[0].signature.encode()

    def tiles() -> list[str]:
        return [out["tile"] for out in _sm90_variants(encoded)]

    swapped = [t for t in tiles() if t.endswith(" sw")]
    assert swapped == (["256x64 s4 e64 b1 pp sw", "128x64 s7 e64 b1 pp sw"] if offered else [])
    for switch in ("JAXFUSE_TMA_SWAP", "JAXFUSE_TMA_PINGPONG"):
        monkeypatch.setenv(switch, "0")
        assert not any(t.endswith(" sw") for t in tiles())
        monkeypatch.delenv(switch)


# conv_tma's halo tiles: offered for 16-bit, stride-1, undilated layers of one group with 64
# input and 64 output channels, HWIO filters and 2-9 taps, never otherwise, and not with
# JAXFUSE_TMA_HALO=0.
HALO = [(Case(ops="CBNA", dtype=dt, layout="NHWC", filter_layout=fl, c=c, k=k, n=4, h=28, w=28,
              r=r, s=r, strides=(st, st), dilation=(d, d), padding="SAME"), offered)
        for dt, fl, c, k, r, st, d, offered in (
            ("bfloat16", "HWIO", 64, 64, 3, 1, 1, True),
            ("float16", "HWIO", 64, 64, 3, 1, 1, True),
            ("bfloat16", "HWIO", 64, 64, 3, 2, 1, False),
            ("bfloat16", "HWIO", 64, 64, 3, 1, 2, False),
            ("bfloat16", "HWIO", 128, 64, 3, 1, 1, False),
            ("bfloat16", "HWIO", 64, 64, 1, 1, 1, False),
            ("bfloat16", "HWIO", 64, 64, 5, 1, 1, False),
            ("bfloat16", "OHWI", 64, 64, 3, 1, 1, False))]


@pytest.mark.parametrize("case, offered", HALO, ids=str)
def test_halo_tiles_are_offered_where_they_apply(case: Case, offered: bool,
                                                 monkeypatch) -> None:
    encoded = case.build()[0].signature.encode()

    def halo() -> list[str]:
        return [out["tile"] for out in _sm90_variants(encoded) if out["tile"].endswith(" halo")]

    assert halo() == (["256x64 s2 e64 b1 pp sw halo"] if offered else [])
    monkeypatch.setenv("JAXFUSE_TMA_HALO", "0")
    assert halo() == []


@pytest.mark.parametrize("case", PINGPONG, ids=str)
def test_ping_pong_tiles_compile_unless_withdrawn(case: Case, monkeypatch) -> None:
    encoded = case.build()[0].signature.encode()

    def tiles() -> list[str]:
        return [out["tile"] for out in _sm90_variants(encoded) if out["solver"] == "conv_tma"]

    monkeypatch.setenv("JAXFUSE_TMA_PINGPONG", "0")
    plain = tiles()
    assert plain and not any(t.endswith(" pp") for t in plain)
    monkeypatch.delenv("JAXFUSE_TMA_PINGPONG")
    both = tiles()
    expected = [t + " pp" for t in plain if " b1" in t and int(t.split()[0][4:]) <= 128]
    assert expected and [t for t in both if t.endswith(" pp")] == expected



# float32 filters of 16-bit plans (a model's parameters, rewrite/filters.py): on sm_90
# conv_wgmma rounds them as they load, in every tile it offers (with stages that fit the
# larger stages in shared memory), among them every ResNet-50 layer the rewrite hands them to
# at batch 1; NCHW, OIHW filters and other GPUs take the direct kernel.
WIDE = [Case(ops=ops, dtype=dt, layout=layout, filter_layout=fl, c=c, k=k, n=n, h=hw, w=hw,
             r=r, s=r, padding="SAME", filter_dtype="float32")
        for ops, dt, layout, fl, c, k, n, hw, r in (
            ("CBNA", "bfloat16", "NHWC", "HWIO", 512, 512, 1, 7, 3),
            ("CBNSA", "float16", "NHWC", "OHWI", 128, 200, 4, 9, 3),
            ("CBA", "bfloat16", "NHWC", "HWIO", 64, 72, 8, 28, 1),
            ("CBNA", "float16", "NCHW", "OIHW", 64, 64, 1, 14, 3),
            ("CBNA", "bfloat16", "NHWC", "OIHW", 64, 64, 1, 14, 1))] + [
    dataclasses.replace(case, filter_dtype="float32") for case in _suite_cases()
    if case.layout == "NHWC" and case.n == 1 and case.c % 64 == 0 and case.groups == 1]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("case", WIDE, ids=str)
def test_float32_filters_compile(case: Case, arch: str) -> None:
    outs = _compile_every_variant(case, arch)
    converts = arch == "sm_90" and case.layout == "NHWC" and case.filter_layout != "OIHW"
    assert outs[0]["solver"] == ("conv_wgmma" if converts else "conv_direct")
    for out in outs:  # dynamic shared memory and the static table of terms (20 bytes each)
        bn = int(out["tile"].split()[0].split("x")[1]) if converts else 0
        assert out["entries"][0]["shared_bytes"] + 20 * bn <= 227 * 1024, out["tile"]


# The NHWC form of NCHW plans (input NHWC, output NCHW: jaxfuse.solvers.kernel_forms): every
# sm_90 variant compiles, and only kernels that write NCHW from NHWC input are offered.
@pytest.mark.parametrize("case", [
    Case(ops="CBNSA", dtype="float16", layout="NCHW", filter_layout="OIHW", c=64, k=64, n=8,
         h=56, w=56, bn_mode="per_activation"),
    Case(ops="CBNA", dtype="bfloat16", layout="NCHW", filter_layout="OIHW", c=256, k=256, n=8,
         h=14, w=14),
    Case(ops="CBNSA", dtype="float16", layout="NCHW", filter_layout="OIHW", c=512, k=2048, n=4,
         h=7, w=7, r=1, s=1, padding="VALID"),
    Case(ops="CBNA", dtype="bfloat16", layout="NCHW", filter_layout="OIHW", c=3, k=64, n=8,
         h=224, w=224, r=7, s=7, strides=(2, 2), padding=((3, 3), (3, 3))),
], ids=str)
def test_the_nhwc_form_compiles_every_variant(case: Case) -> None:
    from jaxfuse.solvers import kernel_signature
    encoded = kernel_signature(case.build()[0].signature, "HWIO", "NHWC").encode()
    solvers = {out["solver"] for out in _sm90_variants(encoded)}
    assert solvers and solvers <= {"conv_tma", "conv_wgmma", "conv_stem"}, solvers


# ... and of fp32 NCHW plans through TF32 (kernel_forms' default): K-major
# filters, OHWI (or a 1x1 layer's own OIHW); every sm_90 variant compiles, all of them kernels
# that write NCHW from NHWC input. (Spills: scripts/kernel_report.py --form, with nvcc.)
@pytest.mark.parametrize("case, filters", [
    (Case(ops="CBNA", dtype="float32", layout="NCHW", filter_layout="OIHW", c=256, k=256, n=8,
          h=14, w=14), "OHWI"),
    (Case(ops="CBNA", dtype="float32", layout="NCHW", filter_layout="OIHW", c=128, k=128, n=8,
          h=56, w=56, strides=(2, 2), padding=((1, 1), (1, 1))), "OHWI"),
    (Case(ops="CBNSA", dtype="float32", layout="NCHW", filter_layout="OIHW", c=512, k=2048, n=4,
          h=7, w=7, r=1, s=1, padding="VALID"), "OIHW"),
    (Case(ops="CBN", dtype="float32", layout="NCHW", filter_layout="OIHW", c=64, k=256, n=1,
          h=56, w=56, r=1, s=1, padding="VALID", bn_mode="per_activation"), "OIHW"),
    # batch 1 (below 2048 output pixels): the split-K variants' NCHW stores from a cluster's
    # reduction
    (Case(ops="CBNA", dtype="float32", layout="NCHW", filter_layout="OIHW", c=256, k=256, n=1,
          h=14, w=14), "OHWI"),
    (Case(ops="CBNA", dtype="float32", layout="NCHW", filter_layout="OIHW", c=512, k=512, n=1,
          h=14, w=14, strides=(2, 2), padding=((1, 1), (1, 1))), "OHWI"),
], ids=str)
def test_the_tf32_nhwc_form_compiles_every_variant(case: Case, filters: str) -> None:
    from jaxfuse.solvers import kernel_signature
    encoded = kernel_signature(case.build()[0].signature, filters, "NHWC").encode()
    outs = _sm90_variants(encoded)
    assert {out["solver"] for out in outs} <= {"conv_tma", "conv_wgmma"}
    assert len(outs) > 1
    if case.n * case.h * case.w < 2048:  # (the batch-1 cases: split-K variants among them)
        assert any("k/" in out["tile"] for out in outs), [out["tile"] for out in outs]
