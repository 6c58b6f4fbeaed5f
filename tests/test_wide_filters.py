"""float32 filters of float16/bfloat16 plans (a model that keeps its parameters in float32).

A plan may take its filters in float32 while it computes in a 16-bit dtype; every kernel
rounds them to the plan's dtype as it loads them, so the result is bit-identical to the same
plan given the filters converted first. ``jaxfuse.fuse`` hands such filters to the kernels
that read them (rewrite/filters.py) and drops the conversions: checked here on every device by
widening every qualifying chain, and against the program with the conversions kept.
"""

from __future__ import annotations

import importlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jaxfuse as jf
from jaxfuse._extension import extension

filters_module = importlib.import_module("jaxfuse.rewrite.filters")


def _filters(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """float32 filters with values that test the rounding: ties (to even), values just below a
    tie, and values that round up a binade."""
    w = (rng.standard_normal(shape) / np.sqrt(np.prod(shape) / shape[-1])).astype(np.float32)
    flat = w.reshape(-1).view(np.uint32)
    flat[::7] = (flat[::7] & 0xFFFF0000) | 0x8000
    flat[3::11] = (flat[3::11] & 0xFFFF0000) | 0x7FFF
    flat[9::17] = 0x3F7FFFFF
    return w


def _bits(a: Any) -> np.ndarray:
    a = np.asarray(a)
    return a.view({2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


def _plan(x_shape, layout, w_shape, filter_layout, dtype, filter_dtype, solver, device):
    plan = jf.FusionPlan(jf.TensorDesc(x_shape, dtype, layout))
    conv = plan.add_conv_forward(jf.ConvDesc(padding="SAME"),
                                 jf.TensorDesc(w_shape, filter_dtype, filter_layout))
    bias = plan.add_bias_forward(jf.TensorDesc((w_shape[filter_layout.index("O")],), "float32"))
    act = plan.add_activation_forward("relu")
    plan.compile(device, solver=solver)
    return plan, (conv, bias, act)


def _tile_arithmetic(plan: jf.FusionPlan) -> tuple[Any, ...]:
    """What decides a kernel's order of accumulation: its solver, tile and split-K (not the
    CTAs per multiprocessor, which the wider stages of float32 filters change)."""
    info = plan.kernel_info
    tile = str(info.get("tile") or "").split()
    return info.get("solver"), tile[:1], [t for t in tile if t.startswith("k/")]


# ----- plans ------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("layout, filter_layout", [("NHWC", "HWIO"), ("NHWC", "OHWI"),
                                                   ("NCHW", "OIHW")])
@pytest.mark.parametrize("solver", ["fused", "xla"])
def test_float32_filters_compute_as_converted_ones(device, dtype, layout, filter_layout,
                                                   solver) -> None:
    rng = np.random.default_rng(0)
    n, c, h, w, k = 1, 64, 7, 9, 72
    x_shape = (n, h, w, c) if layout == "NHWC" else (n, c, h, w)
    w_shape = {"HWIO": (3, 3, c, k), "OHWI": (k, 3, 3, c), "OIHW": (k, c, 3, 3)}[filter_layout]
    wide, handles = _plan(x_shape, layout, w_shape, filter_layout, dtype, "float32", solver,
                          device)
    narrow, narrow_handles = _plan(x_shape, layout, w_shape, filter_layout, dtype, dtype,
                                   solver, device)
    assert wide.signature.filter_dtype == np.float32
    assert "wdtype=f32" in wide.signature.encode() and "w:float32" in wide.signature.describe()
    x = jax.device_put(jnp.asarray(rng.standard_normal(x_shape), dtype), device)
    w32 = jax.device_put(jnp.asarray(_filters(rng, w_shape)), device)
    bias = jax.device_put(jnp.asarray(rng.standard_normal(k), jnp.float32), device)

    def run(plan, handles, filters):
        conv, b, act = handles
        args = jf.OperatorArgs().set_conv_forward(conv, filters).set_bias_forward(b, bias)
        return jax.jit(plan.execute)(x, args.set_activation_forward(act))

    got = run(wide, handles, w32)
    want = run(narrow, narrow_handles, w32.astype(dtype))
    assert got.dtype == np.dtype(jnp.dtype(dtype)) and got.shape == want.shape
    if _tile_arithmetic(wide) == _tile_arithmetic(narrow):
        np.testing.assert_array_equal(_bits(got), _bits(want))
    else:  # another order of accumulation: apart by rounding only
        diff = np.asarray(got, np.float64) - np.asarray(want, np.float64)
        assert np.linalg.norm(diff) <= 2.5e-2 * np.linalg.norm(np.asarray(want, np.float64))


def test_filter_dtypes_a_plan_accepts() -> None:
    def conv(x_dtype: str, w_dtype: str) -> jf.FusionPlan:
        plan = jf.FusionPlan(jf.TensorDesc((1, 4, 5, 5), x_dtype, "NCHW"))
        plan.add_conv_forward(jf.ConvDesc(), jf.TensorDesc((8, 4, 3, 3), w_dtype, "OIHW"))
        return plan

    assert conv("bfloat16", "float32").signature.filter_dtype == np.float32
    assert conv("float16", "float32").signature.filter_dtype == np.float32
    assert conv("float32", "float32").signature.conv.filter_dtype is None
    assert "wdtype" not in conv("float32", "float32").signature.encode()
    for x_dtype, w_dtype in [("bfloat16", "float16"), ("float16", "bfloat16"),
                             ("float32", "bfloat16")]:
        with pytest.raises(TypeError, match=f"filter dtype {w_dtype}"):
            conv(x_dtype, w_dtype)


def test_the_plan_text_names_filter_dtypes_strictly() -> None:
    ext = extension()
    base = "jaxfuse1;dtype=bf16;layout=NHWC;in=1,8,5,5;ops=C;conv=8,3,3,1,1,1,1,1,1,1,1,1,HWIO,1"
    assert ext.plan_canonical(base + ";wdtype=f32").endswith(";wdtype=f32")
    assert ext.plan_canonical(base + ";wdtype=bf16") == ext.plan_canonical(base)
    for bad, why in [(base + ";wdtype=f16", "wdtype"), (base + ";wdtype=f32;wdtype=f32",
                                                        "repeated"),
                     ("jaxfuse1;dtype=bf16;layout=NHWC;in=1,8,5,5;ops=A;act=1;wdtype=f32",
                      "no convolution")]:
        with pytest.raises(ValueError, match=why):
            ext.plan_canonical(bad)


def test_arguments_name_a_wrong_filter_dtype() -> None:
    _, (conv, _, _) = _plan((1, 5, 5, 8), "NHWC", (3, 3, 8, 8), "HWIO", "bfloat16",
                            "float32", "fused", jax.devices("cpu")[0])
    with pytest.raises(TypeError, match="w has dtype bfloat16, expected float32"):
        jf.OperatorArgs().set_conv_forward(conv, jnp.ones((3, 3, 8, 8), jnp.bfloat16))


# ----- the rewrite ------------------------------------------------------------------------------
class _Everything:
    def __contains__(self, item: object) -> bool:
        return True


def _widen_everywhere(monkeypatch: pytest.MonkeyPatch) -> None:
    """The rewrite on (JAXFUSE_WIDE_FILTERS=1), widening every qualifying chain whatever its
    kernel (this test's devices may have no Hopper kernel)."""
    monkeypatch.setenv("JAXFUSE_WIDE_FILTERS", "1")
    monkeypatch.setattr(filters_module, "_HOPPER_KERNELS", _Everything())


BF16 = jnp.bfloat16
HWIO = ("NHWC", "HWIO", "NHWC")


def _apply(params: dict[str, Any], x: jax.Array) -> jax.Array:
    for w, b in zip(params["w"], params["b"]):
        y = lax.conv_general_dilated(x, w.astype(BF16), (1, 1), "SAME", dimension_numbers=HWIO)
        x = jax.nn.relu(y + b)
    return x


def _args(device: Any, seed: int = 0) -> tuple[Any, ...]:
    rng = np.random.default_rng(seed)
    shapes = [(3, 3, 8, 16), (1, 1, 16, 16), (3, 3, 16, 16)]
    params = {"w": [jnp.asarray(_filters(rng, s)) for s in shapes],
              "b": [jnp.asarray(rng.standard_normal(16), BF16) for _ in shapes]}
    x = jnp.asarray(rng.standard_normal((1, 9, 9, 8)), BF16)
    return jax.device_put((params, x), device)


def _filter_converts(closed: Any) -> int:
    return sum(e.primitive.name == "convert_element_type" and e.invars[0].aval.ndim == 4
               and e.invars[0].aval.dtype == jnp.float32 for e in closed.jaxpr.eqns)


def test_fused_calls_read_float32_filters_and_drop_the_conversions(device,
                                                                   monkeypatch) -> None:
    args = _args(device)
    with jax.default_device(device):
        kept = jax.jit(jf.fuse(_apply, solver="fused"))(*args)
        _widen_everywhere(monkeypatch)
        report = jf.fusion_report(jf.fuse(_apply, solver="fused"), *args)
        assert report.fused_calls == 3 and report.converts_batched == 0
        assert _filter_converts(report.jaxpr) == 0
        assert "jaxfuse_convert_many" not in str(report.jaxpr)
        assert str(report.jaxpr).count("filter_dtype=dtype('float32')") == 3
        got = jax.jit(jf.fuse(_apply, solver="fused"))(*args)
    np.testing.assert_array_equal(_bits(got), _bits(kept))


def test_gradients_reach_the_float32_filters(device, monkeypatch) -> None:
    args = _args(device, seed=1)
    _widen_everywhere(monkeypatch)

    def loss(fn):
        return lambda p, x: jnp.sum(fn(p, x).astype(jnp.float32) ** 2)

    with jax.default_device(device):
        got = jax.jit(jax.grad(loss(jf.fuse(_apply, solver="fused"))))(*args)
        want = jax.jit(jax.grad(loss(_apply)))(*args)
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        assert g.dtype == w.dtype and g.shape == w.shape
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        assert np.linalg.norm(g - w) <= 5e-2 * np.linalg.norm(w)


def test_a_conversion_needed_elsewhere_stays(device, monkeypatch) -> None:
    _widen_everywhere(monkeypatch)

    def apply(params: dict[str, Any], x: jax.Array) -> tuple[jax.Array, jax.Array]:
        w = params["w"][0].astype(BF16)
        y = lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=HWIO)
        return jax.nn.relu(y + params["b"][0]), jnp.sum(w)  # the converted copy is used again

    args = _args(device, seed=2)
    report = jf.fusion_report(jf.fuse(apply, solver="fused"), *args)
    assert report.fused_calls == 1 and _filter_converts(report.jaxpr) == 1
    assert "filter_dtype=dtype('float32')" not in str(report.jaxpr)


def test_the_rule_keeps_large_outputs_and_other_kernels_16_bit(monkeypatch) -> None:
    args = _args(jax.devices("cpu")[0], seed=3)
    monkeypatch.setattr(filters_module, "_HOPPER_KERNELS", _Everything())
    report = jf.fusion_report(jf.fuse(_apply, solver="fused"), *args)  # off by default
    assert "filter_dtype=dtype('float32')" not in str(report.jaxpr)
    monkeypatch.setenv("JAXFUSE_WIDE_FILTERS", "1")
    monkeypatch.setattr(filters_module, "_HOPPER_KERNELS", ("conv_wgmma", "conv_tma"))
    report = jf.fusion_report(jf.fuse(_apply, solver="fused"), *args)  # the CPU kernel
    assert "filter_dtype=dtype('float32')" not in str(report.jaxpr)
    _widen_everywhere(monkeypatch)
    monkeypatch.setattr(filters_module, "WIDE_FILTER_MAX_PIXELS", 80)  # the outputs have 81
    report = jf.fusion_report(jf.fuse(_apply, solver="fused"), *args)
    assert "filter_dtype=dtype('float32')" not in str(report.jaxpr)


def test_a_wide_plan_that_fails_keeps_the_conversion(device, monkeypatch) -> None:
    _widen_everywhere(monkeypatch)
    compile_plan = jf.FusionPlan.compile

    def refuse_wide(plan: jf.FusionPlan, *args: Any, **kwargs: Any) -> jf.FusionPlan:
        if plan.signature.filter_dtype == np.float32:
            raise jf.FusionError("refused for this test")
        return compile_plan(plan, *args, **kwargs)

    monkeypatch.setattr(jf.FusionPlan, "compile", refuse_wide)
    args = _args(device, seed=4)
    with jax.default_device(device):
        report = jf.fusion_report(jf.fuse(_apply, solver="fused"), *args)
        got = jax.jit(jf.fuse(_apply, solver="fused"))(*args)
    assert report.fused_calls == 3 and report.converts_batched == 3
    assert "filter_dtype=dtype('float32')" not in str(report.jaxpr)
    want = jax.jit(_apply)(*args)
    diff = np.asarray(got, np.float64) - np.asarray(want, np.float64)
    assert np.linalg.norm(diff) <= 2.5e-2 * np.linalg.norm(np.asarray(want, np.float64))
