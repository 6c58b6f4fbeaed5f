"""Fused plans against the float64 reference: every chain, dtype, layout, geometry, activation
mode and batch-norm mode, on the CPU and (marked gpu) on a GPU."""

from __future__ import annotations

import dataclasses

import jax
import pytest
from cases import (
    DEPTHWISE_CASES,
    PLANAR_DEPTHWISE_CASES,
    Case,
    depthwise_solvers,
    layer_case,
    run_case,
    suite_layers,
)

import jaxfuse as jf
from jaxfuse.activations import ActivationMode

ALL_CHAINS = jf.supported_chains()
# Chains with a conv in every order of the pointwise tail, and the conv-less ones.
CHAIN_CASES = [Case(ops=chain) for chain in ALL_CHAINS]

DTYPE_LAYOUT_CASES = [
    Case(dtype=dt, layout=layout, filter_layout=fl)
    for dt in ("float32", "float16", "bfloat16")
    for layout, fls in (("NCHW", ("OIHW", "HWIO")), ("NHWC", ("HWIO", "OHWI", "OIHW")))
    for fl in fls
]

GEOMETRY_CASES = [
    Case(r=1, s=1, padding="VALID", k=16),                           # 1x1
    Case(strides=(2, 2), padding="SAME"),                            # strided SAME
    Case(strides=(2, 3), padding=((0, 2), (1, 0)), h=11, w=13),      # asymmetric pad/stride
    Case(dilation=(2, 3), padding="SAME", h=12, w=12),               # dilated SAME
    Case(padding=((-1, 0), (2, -1)), h=10, w=10),                    # negative padding crops
    Case(r=7, s=7, strides=(2, 2), padding=((3, 3), (3, 3)), c=3, k=8, h=16, w=16),  # stem
    Case(r=5, s=5, padding=((4, 4), (4, 4)), h=3, w=4),              # filter larger than input
    Case(groups=2, c=8, k=6),                                        # grouped
    Case(groups=4, c=8, k=20, layout="NHWC", filter_layout="HWIO"),  # grouped, NHWC
    Case(groups=8, c=8, k=8),                                        # depthwise
    Case(groups=24, c=24, k=24, layout="NHWC", filter_layout="HWIO", strides=(2, 2)),  # dw NHWC
    Case(groups=8, c=8, k=16),                                       # depthwise multiplier 2
    Case(n=1, c=1, k=1, h=5, w=5),                                   # single channel
    Case(n=3, c=35, k=37, h=6, w=7, layout="NHWC", filter_layout="OHWI"),  # odd channels
    Case(padding=((1, 1), (1, 1)), strides=(1, 1), h=1, w=1),        # 1x1 input
]

ACTIVATION_CASES = [
    Case(ops=ops, activation=mode.value, dtype=dt, layout=layout)
    for mode in ActivationMode
    for dt in ("float32", "float16", "bfloat16")
    for ops, layout in (("CBA", "NCHW"), ("NA", "NHWC"))
]

BN_CASES = [
    Case(ops=ops, bn_mode=mode, layout=layout, filter_layout=fl, dtype=dt)
    for mode in ("spatial", "per_activation")
    for ops in ("CBNA", "NA", "N")
    for layout, fl in (("NCHW", "OIHW"), ("NHWC", "HWIO"))
    for dt in ("float32", "bfloat16")
]


# Shapes the GPU's tensor-core solver takes (NHWC fp16/bf16, channels in multiples of 16):
# partial tiles in both GEMM dimensions, every tile size the heuristic picks, both filter
# layouts it reads, and every geometry it indexes.
NHWC = {"layout": "NHWC", "filter_layout": "HWIO"}
TENSOR_CORE_CASES = [
    Case(c=32, k=24, h=9, w=11, **NHWC),                                # partial M and N tiles
    Case(c=64, k=64, n=3, h=20, w=20, **NHWC),                          # 128x64 tiles
    Case(c=64, k=256, n=4, h=48, w=48, ops="CBNSA", **NHWC),            # 128x128 tiles
    Case(c=16, k=40, r=1, s=1, padding="VALID", layout="NHWC", filter_layout="OHWI"),
    Case(c=48, k=16, r=1, s=1, padding="VALID", layout="NHWC", filter_layout="OIHW"),
    Case(c=32, k=32, r=5, s=3, strides=(2, 1), padding=((2, 1), (0, 3)), h=13, w=10, **NHWC),
    Case(c=32, k=16, dilation=(2, 3), padding="SAME", h=12, w=14, layout="NHWC",
         filter_layout="OHWI"),
    Case(c=64, k=48, groups=2, strides=(2, 2), padding="SAME", h=15, w=15, **NHWC),
    Case(c=32, k=32, ops="CNA", bn_mode="per_activation", h=6, w=7, **NHWC),
    Case(c=32, k=64, r=7, s=7, strides=(2, 2), padding=((3, 3), (3, 3)), h=20, w=20, **NHWC),
    # Few channels (the ResNet stem): the reduction is gathered, not copied in 16-byte runs.
    Case(c=3, k=64, r=7, s=7, strides=(2, 2), padding=((3, 3), (3, 3)), h=23, w=21, **NHWC),
    Case(c=5, k=24, n=3, h=10, w=9, ops="CBNSA", **NHWC),
]


# ... and NCHW, whose tensor-core kernels gather A through registers (kk = (c, r, s) for OIHW
# filters of several taps) and store the output plane by plane: outputs whose P*Q is not a
# multiple of 8 (7x7 among them), strides, padding, dilation, groups, side input,
# per-activation batch norm, every filter layout, on each solver (wgmma where the input
# channels per group are a multiple of 64 on sm_90; mma.sync for 16/32 channels; the gathered
# reduction for 3 and 5, with B gathered too where the filters are OIHW or OHWI).
NCHW = {"layout": "NCHW", "filter_layout": "OIHW"}
NCHW_TENSOR_CORE_CASES = [
    Case(c=64, k=64, n=2, h=9, w=11, **NCHW),                           # P*Q = 99
    Case(c=128, k=192, n=3, h=7, w=7, ops="CBNSA", **NCHW),             # 7x7, side input
    Case(c=512, k=64, n=1, h=7, w=7, **NCHW),                           # long reduction, 49 rows
    Case(c=64, k=128, n=2, h=15, w=15, strides=(2, 2), padding="SAME", layout="NCHW",
         filter_layout="HWIO"),                                         # stride 2, 8x8 outputs
    Case(c=64, k=64, n=4, h=14, w=13, r=1, s=1, padding="VALID", **NCHW),  # OIHW 1x1
    Case(c=128, k=64, groups=2, dilation=(2, 3), padding="SAME", h=12, w=13, layout="NCHW",
         filter_layout="OHWI"),                                         # groups, dilation
    Case(c=64, k=64, ops="CNA", bn_mode="per_activation", h=6, w=7, **NCHW),
    Case(c=64, k=64, ops="CBNSA", bn_mode="per_activation", strides=(2, 1), h=11, w=10,
         padding=((0, 2), (1, 0)), layout="NCHW", filter_layout="HWIO"),
    Case(c=32, k=24, h=9, w=11, **NCHW),                                # partial M and N tiles
    Case(c=16, k=40, r=1, s=1, padding="VALID", layout="NCHW", filter_layout="OHWI"),
    Case(c=32, k=32, r=5, s=3, strides=(2, 1), padding=((2, 1), (0, 3)), h=13, w=10, **NCHW),
    Case(c=48, k=16, dilation=(2, 3), padding="SAME", h=12, w=14, layout="NCHW",
         filter_layout="HWIO"),
    Case(c=3, k=64, r=7, s=7, strides=(2, 2), padding=((3, 3), (3, 3)), h=23, w=21, **NCHW),
    Case(c=3, k=64, r=7, s=7, strides=(2, 2), padding=((3, 3), (3, 3)), h=23, w=21,
         layout="NCHW", filter_layout="HWIO"),
    Case(c=5, k=24, n=3, h=10, w=9, ops="CBNSA", layout="NCHW", filter_layout="OHWI"),
]


@pytest.mark.parametrize("case", TENSOR_CORE_CASES, ids=str)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_tensor_core_shapes(case: Case, dtype: str, device) -> None:
    case = dataclasses.replace(case, dtype=dtype)
    run_case(case, device)
    if device.platform == "gpu":
        plan = case.build()[0].compile(device)
        assert plan.solver in ("conv_igemm", "conv_wgmma"), plan.solver


@pytest.mark.parametrize("case", NCHW_TENSOR_CORE_CASES, ids=str)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_tensor_core_shapes_nchw(case: Case, dtype: str, device) -> None:
    case = dataclasses.replace(case, dtype=dtype)
    run_case(case, device)
    if device.platform == "gpu":
        plan = case.build()[0].compile(device)
        hopper = str(getattr(device, "compute_capability", "")) == "9.0"
        wgmma = hopper and (case.c // case.groups) % 64 == 0
        assert plan.solver == ("conv_wgmma" if wgmma else "conv_igemm"), plan.kernel_info


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_depthwise_and_wide_pointwise(dtype: str, device) -> None:
    depthwise = Case(ops="CBNA", groups=40, c=40, k=40, h=11, w=9, dtype=dtype, strides=(2, 1),
                     padding="SAME", **NHWC)
    run_case(depthwise, device)
    run_case(Case(ops="BNA", c=4104, h=2, w=3, layout="NHWC", dtype=dtype), device)
    if device.platform == "gpu":
        assert depthwise.build()[0].compile(device).solver == "conv_depthwise"


@pytest.mark.parametrize("case", DEPTHWISE_CASES + PLANAR_DEPTHWISE_CASES, ids=str)
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_depthwise_edges(case: Case, dtype: str, device) -> None:
    case = dataclasses.replace(case, dtype=dtype)
    run_case(case, device)
    if device.platform == "gpu":
        assert case.build()[0].compile(device).solver in depthwise_solvers(case)


# MobileNet's depthwise layers at batch 16 (tiles as large as at batch 64), on the GPU only (the
# float64 reference of the 112x112 ones is slow on a CPU): every dtype, the suites' chain, in
# NHWC (the depthwise kernels) and NCHW (the planar one).
def _mobilenet_depthwise(n: int) -> list[Case]:
    return [layer_case(layer, dtype=dtype, layout=layout, n=n)
            for layer in suite_layers("mobilenet", "mobilenetv2", depthwise=True)
            for dtype in ("float32", "float16", "bfloat16") for layout in ("NHWC", "NCHW")]


@pytest.mark.gpu
@pytest.mark.parametrize("case", _mobilenet_depthwise(16), ids=str)
def test_mobilenet_depthwise_layers(case: Case) -> None:
    gpu = jax.devices("gpu")[0]
    assert case.build()[0].compile(gpu).solver in depthwise_solvers(case)
    run_case(case, gpu)


@pytest.mark.parametrize("case", CHAIN_CASES, ids=str)
def test_every_chain(case: Case, device) -> None:
    run_case(case, device)


@pytest.mark.parametrize("case", DTYPE_LAYOUT_CASES, ids=str)
def test_dtypes_and_layouts(case: Case, device) -> None:
    run_case(case, device)


@pytest.mark.parametrize("case", GEOMETRY_CASES, ids=str)
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_conv_geometry(case: Case, dtype: str, device) -> None:
    run_case(dataclasses.replace(case, dtype=dtype), device)


@pytest.mark.parametrize("case", ACTIVATION_CASES, ids=str)
def test_activation_modes(case: Case, device) -> None:
    run_case(case, device)


@pytest.mark.parametrize("case", BN_CASES, ids=str)
def test_batchnorm_modes(case: Case, device) -> None:
    run_case(case, device)


def test_exact_fp32_precision(device) -> None:
    run_case(Case(precision="highest", c=64, k=64), device)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_eager_and_jit_agree(jit: bool, device) -> None:
    run_case(Case(ops="CBNSA", layout="NHWC", filter_layout="HWIO"), device, jit=jit)


def test_larger_layer(device) -> None:
    # Big enough to split across threads / blocks in every direction.
    run_case(Case(n=4, c=64, k=96, h=28, w=28, layout="NHWC", filter_layout="HWIO",
                  dtype="bfloat16"), device)


def test_seeds_differ(device) -> None:
    # The check is on fresh random data each time, not one lucky draw.
    for seed in range(3):
        run_case(Case(ops="CNA", activation="tanh"), device, seed=seed)


def test_functional_matches_plan(device) -> None:
    import numpy as np
    from jax import lax

    rng = np.random.default_rng(1)
    x = jax.device_put(rng.standard_normal((2, 10, 10, 8)).astype(np.float32), device)
    w = jax.device_put(rng.standard_normal((3, 3, 4, 12)).astype(np.float32) / 6, device)
    b = rng.standard_normal(12).astype(np.float32)
    y = jf.conv_bias_activation(x, w, b, window_strides=(1, 2), padding="SAME",
                                feature_group_count=2, dimension_numbers=("NHWC", "HWIO", "NHWC"),
                                activation="leaky_relu", activation_alpha=0.1,
                                precision=lax.Precision.HIGHEST)
    ref = lax.conv_general_dilated(x, w, (1, 2), "SAME", feature_group_count=2,
                                   dimension_numbers=("NHWC", "HWIO", "NHWC"),
                                   precision=lax.Precision.HIGHEST) + b
    ref = jax.nn.leaky_relu(ref, 0.1)
    np.testing.assert_allclose(np.asarray(y), np.asarray(ref), rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("case", [
    Case(ops=ops, dtype="float32", layout="NHWC", filter_layout=fl, c=c, k=k, n=n, h=hw, w=hw,
         strides=st, dilation=dl, groups=gr, padding=pad, activation=act)
    for ops, fl, c, k, n, hw, st, dl, gr, pad, act in (
        ("CBNSA", "HWIO", 16, 24, 1, 9, (1, 1), (1, 1), 1, ((1, 1), (1, 1)), "relu"),
        ("CBNA", "OHWI", 64, 64, 8, 28, (2, 2), (1, 1), 1, "SAME", "clipped_relu"),
        ("CNA", "HWIO", 64, 256, 16, 14, (1, 1), (2, 2), 1, ((2, 2), (2, 2)), "elu"),
        ("CBA", "HWIO", 128, 128, 2, 14, (1, 2), (1, 1), 2, "VALID", "leaky_relu"),
        ("CBNSA", "OHWI", 256, 96, 4, 7, (1, 1), (1, 1), 1, ((0, 1), (1, 0)), "tanh"))
] + [
    Case(ops=ops, dtype="float32", layout="NCHW", filter_layout=fl, c=c, k=k, n=n, h=hw, w=hw,
         r=r, s=r, strides=st, groups=gr, padding=pad, bn_mode=bn)
    for ops, fl, c, k, n, hw, r, st, gr, pad, bn in (
        ("CBNSA", "OIHW", 64, 64, 2, 9, 3, (1, 1), 1, ((1, 1), (1, 1)), "spatial"),
        ("CBNA", "OIHW", 32, 48, 3, 7, 1, (1, 1), 1, "VALID", "per_activation"),
        ("CNA", "HWIO", 64, 128, 2, 15, 3, (2, 2), 2, "SAME", "spatial"))
], ids=str)
def test_fp32_through_tf32_matches_the_reference(case, monkeypatch) -> None:
    """The TF32 tensor-core kernels (on unless JAXFUSE_TF32_KERNELS=0) against float64, within
    fp32's GPU tolerance (which allows TF32), every element written (outputs are poisoned)."""
    monkeypatch.setenv("JAXFUSE_TF32_KERNELS", "1")
    gpu = jax.devices("gpu")[0]
    plan, _ = case.build()
    plan.compile(gpu, solver="fused")
    # Hopper takes NHWC plans with 32k input channels per group on its wgmma kernel; an NCHW
    # plan runs there too where its NHWC form measured faster (the forms are timed against
    # each other at every size: a 2x64x9x9 plan took the form on an H200, 2026-12-07).
    nhwc = case.layout == "NHWC" or plan.kernel_info.get("input_layout", "").startswith("NHWC")
    hopper = (getattr(gpu, "compute_capability", "") == "9.0" and nhwc
              and (case.c // case.groups) % 32 == 0)
    assert plan.solver == ("conv_wgmma" if hopper else "conv_igemm"), plan.kernel_info
    run_case(case, gpu, solver="fused")
