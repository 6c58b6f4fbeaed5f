"""The functional API takes `lax.conv_general_dilated`'s arguments: what it accepts gives lax's
result (plus the epilogue), against a float64 lax reference; what it cannot fuse is refused by
name, a convolution that is not 2-D before anything else."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cases import FILTER_SHAPES, TOLERANCE, TOLERANCE_EXACT_FP32, relative_error
from jax import lax

import jaxfuse as jf
from jaxfuse.activations import reference_activation
from jaxfuse.primitive import fused_chain_p

P = lax.Precision
NHWC = ("NHWC", "HWIO", "NHWC")

# Accepted argument sets: each is passed as is to jf.conv_* and to lax.conv_general_dilated.
ACCEPTED: dict[str, dict[str, Any]] = {
    "defaults": {},
    "SAME": {"padding": "SAME"},
    "same, lower case": {"padding": "same"},
    "SAME_LOWER, strides": {"padding": "SAME_LOWER", "window_strides": (2, 1)},
    "SAME_LOWER, dilation": {"padding": "SAME_LOWER", "rhs_dilation": (2, 3)},
    "explicit padding": {"padding": ((2, 0), (1, 3)), "window_strides": (1, 2)},
    "negative padding": {"padding": ((-1, 1), (0, -1))},
    "groups": {"padding": "SAME", "feature_group_count": 2},
    "depthwise": {"padding": "VALID", "feature_group_count": 4, "k": 8},
    "NHWC/HWIO": {"padding": "SAME", "dimension_numbers": NHWC},
    "NHWC/OHWI lower case": {"dimension_numbers": ("nhwc", "ohwi", "nhwc")},
    "ConvDimensionNumbers": {"dimension_numbers": lax.ConvDimensionNumbers(
        (0, 3, 1, 2), (3, 2, 0, 1), (0, 3, 1, 2))},
    "lhs_dilation 1, batch_group_count 1": {"lhs_dilation": (1, 1), "batch_group_count": 1,
                                            "rhs_dilation": None},
    "precision pair": {"precision": (P.DEFAULT, P.HIGHEST)},
    "precision names": {"precision": ("bfloat16", "float32")},
    "precision HIGH": {"precision": P.HIGH},
    "preferred_element_type same": {"preferred_element_type": jnp.float32},
    "preferred float32 from bfloat16": {"preferred_element_type": jnp.float32,
                                        "dtype": "bfloat16"},
    "preferred float32 from float16": {"preferred_element_type": "float32", "dtype": "float16",
                                       "padding": "SAME", "dimension_numbers": NHWC},
    "bfloat16": {"dtype": "bfloat16", "padding": "SAME", "dimension_numbers": NHWC},
}


def _strings(dimension_numbers: Any) -> bool:
    return isinstance(dimension_numbers, tuple) and isinstance(dimension_numbers[0], str)


def _operands(dtype: str, dimension_numbers: Any, k: int, groups: int,
              seed: int = 0) -> tuple[jax.Array, ...]:
    rng = np.random.default_rng(seed)
    lhs, rhs = "NCHW", "OIHW"
    if _strings(dimension_numbers):
        lhs, rhs = dimension_numbers[0].upper(), dimension_numbers[1].upper()
    elif dimension_numbers is not None:  # the lax.ConvDimensionNumbers above
        lhs, rhs = "NHWC", "HWIO"
    c, h, w = 4, 9, 8
    x = rng.standard_normal((2, c, h, w) if lhs == "NCHW" else (2, h, w, c))
    filters = rng.standard_normal(FILTER_SHAPES[rhs](k, c // groups, 3, 2)) / 3
    b = rng.standard_normal(k).astype(np.float32)
    bn = (rng.uniform(0.5, 1.5, k), rng.standard_normal(k), 0.3 * rng.standard_normal(k),
          rng.uniform(0.5, 2.0, k))
    return (jnp.asarray(x, dtype), jnp.asarray(filters, dtype), b,
            *(np.asarray(p, np.float32) for p in bn))


def _lax_reference(x: Any, w: Any, conv: dict[str, Any], channel_axis: int, b: Any,
                   bn: tuple[Any, ...] | None, activation: str) -> np.ndarray:
    """lax.conv_general_dilated with the same arguments, in float64, then the epilogue."""
    conv = {k: v for k, v in conv.items() if k not in ("precision", "preferred_element_type")}
    conv.setdefault("window_strides", (1, 1))
    conv.setdefault("padding", "VALID")
    if isinstance(conv["padding"], str):  # jaxfuse also takes lower case names
        conv["padding"] = conv["padding"].upper()
    if _strings(conv.get("dimension_numbers")):
        conv["dimension_numbers"] = tuple(s.upper() for s in conv["dimension_numbers"])
    with jax.enable_x64(True):
        y = np.asarray(lax.conv_general_dilated(jnp.asarray(x, jnp.float64),
                                                jnp.asarray(w, jnp.float64), **conv))
    shape = [1] * 4
    shape[channel_axis] = -1
    y = y + np.asarray(b, np.float64).reshape(shape)
    if bn is not None:
        scale, shift, mean, var = (np.asarray(p, np.float64).reshape(shape) for p in bn)
        y = scale * (y - mean) / np.sqrt(var + 1e-5) + shift
    return np.asarray(reference_activation(activation, y, xp=np))


@pytest.mark.parametrize("with_bn", [False, True], ids=["CBA", "CBNA"])
@pytest.mark.parametrize("name", list(ACCEPTED))
def test_functional_matches_lax(name: str, with_bn: bool, device) -> None:
    conv = dict(ACCEPTED[name])
    dtype, k = conv.pop("dtype", "float32"), conv.pop("k", 6)
    x, w, b, *bn = _operands(dtype, conv.get("dimension_numbers"), k,
                             conv.get("feature_group_count", 1))
    x, w = jax.device_put((x, w), device)
    dn = conv.get("dimension_numbers")
    channel_axis = 1 if dn is None or (_strings(dn) and dn[0].upper() == "NCHW") else 3
    if with_bn:
        got = jf.conv_bias_batchnorm_activation(x, w, b, *bn, activation="elu", **conv)
    else:
        got = jf.conv_bias_activation(x, w, b, activation="elu", **conv)
    want = _lax_reference(x, w, conv, channel_axis, b, bn if with_bn else None, "elu")
    preferred = conv.get("preferred_element_type")
    out_dtype = np.dtype(jnp.dtype(preferred or dtype))
    assert got.dtype == out_dtype and got.shape == want.shape
    exact = device.platform == "cpu" or jf.ConvDesc(precision=conv.get("precision")).precision
    tolerance = TOLERANCE_EXACT_FP32 if out_dtype == np.float32 and exact else \
        TOLERANCE[out_dtype]
    assert relative_error(got, want) <= tolerance


@pytest.mark.parametrize("activation", ["silu", "gelu", "gelu_tanh", "hardswish",
                                        "hardsigmoid", "mish"])
def test_functional_takes_jax_nn_modes(activation: str, device) -> None:
    conv = {"padding": "SAME", "dimension_numbers": NHWC}
    x, w, b, *bn = _operands("float32", NHWC, 6, 1)
    x, w = jax.device_put((x, w), device)
    got = jf.conv_bias_batchnorm_activation(x, w, b, *bn, activation=activation, **conv)
    want = _lax_reference(x, w, conv, 3, b, bn, activation)
    tolerance = TOLERANCE_EXACT_FP32 if device.platform == "cpu" else TOLERANCE[got.dtype]
    assert relative_error(got, want) <= tolerance
    bn = [p[:x.shape[-1]] for p in bn]  # x's channels
    got = jf.batchnorm_activation(x, *bn, layout="NHWC", activation=activation)
    scale, shift, mean, var = (np.asarray(p, np.float64) for p in bn)  # NHWC: channels last
    y = scale * (np.asarray(x, np.float64) - mean) / np.sqrt(var + 1e-5) + shift
    assert relative_error(got, reference_activation(activation, y, xp=np)) <= tolerance


def _fused_signatures(closed_jaxpr: Any) -> list:
    found = []

    def walk(jaxpr: Any) -> None:
        for eqn in jaxpr.eqns:
            if eqn.primitive is fused_chain_p:
                found.append(eqn.params["signature"])
            for value in eqn.params.values():
                sub = getattr(value, "jaxpr", value)
                if hasattr(sub, "eqns"):
                    walk(sub)

    walk(closed_jaxpr.jaxpr)
    return found


@pytest.mark.parametrize("precision,allow_tf32", [
    (None, True), (P.DEFAULT, True), ("fastest", True), ((P.DEFAULT, P.DEFAULT), True),
    (("bfloat16", "default"), True), (P.HIGHEST, False), (P.HIGH, False),
    ((P.DEFAULT, P.HIGHEST), False), ((P.HIGHEST, P.DEFAULT), False), ((P.HIGH, P.DEFAULT),
                                                                       False),
    (("tensorfloat32", "bfloat16"), False), ("float32", False),
    # (lax lowers a convolution's dot algorithm at DEFAULT precision)
    (lax.DotAlgorithmPreset.F32_F32_F32, True),
])
def test_precision_decides_tf32_as_in_fuse(precision: Any, allow_tf32: bool) -> None:
    # A pair follows its stricter member; jaxfuse.fuse reads the same lax call the same way.
    x, w, *_ = _operands("float32", None, 6, 1)
    functional = jax.make_jaxpr(lambda x, w: jf.conv_bias_activation(
        x, w, padding="SAME", precision=precision))(x, w)
    rewritten = jf.fusion_report(lambda x, w: jax.nn.relu(lax.conv_general_dilated(
        x, w, (1, 1), "SAME", precision=precision)), x, w).jaxpr
    for jaxpr in (functional, rewritten):
        (signature,) = _fused_signatures(jaxpr)
        assert signature.conv.allow_tf32 is allow_tf32


@pytest.mark.parametrize("default,allow_tf32", [
    ("highest", False), ("float32", False), ("tensorfloat32", False), ("bfloat16", True),
    ("default", True), ("F32_F32_F32", True), ("BF16_BF16_F32", True),
])
def test_an_unset_precision_follows_jax_default_matmul_precision(default: str,
                                                                 allow_tf32: bool) -> None:
    """As lax does: under ``jax.default_matmul_precision("highest")`` an fp32 convolution
    given no precision is exact, fused or not; a dot algorithm's name leaves it at DEFAULT
    (lax lowers a convolution's so)."""
    x, w, *_ = _operands("float32", None, 6, 1)
    with jax.default_matmul_precision(default):
        functional = jax.make_jaxpr(lambda x, w: jf.conv_bias_activation(
            x, w, padding="SAME"))(x, w)
        rewritten = jf.fusion_report(lambda x, w: jax.nn.relu(lax.conv_general_dilated(
            x, w, (1, 1), "SAME")), x, w).jaxpr
    for jaxpr in (functional, rewritten):
        (signature,) = _fused_signatures(jaxpr)
        assert signature.conv.allow_tf32 is allow_tf32


X2, W2 = (2, 4, 9, 8), (6, 4, 3, 3)


@pytest.mark.parametrize("x_shape,w_shape,kwargs,exc,match", [
    ((2, 4, 9), (6, 4, 3), {"window_strides": (1,), "padding": "SAME",
                            "dimension_numbers": ("NCH", "OIH", "NCH")},
     ValueError, r"only 2-D convolutions .* x has 3 dimensions, as a 1-D convolution's"),
    ((2, 4, 9), (6, 4, 3), {"window_strides": (1,)}, ValueError, "only 2-D convolutions"),
    ((2, 4, 9, 8, 7), (6, 4, 3, 3, 3), {"window_strides": (1, 1, 1), "padding": "SAME"},
     ValueError, r"only 2-D convolutions .* x has 5 dimensions, as a 3-D convolution's"),
    (X2, W2, {"dimension_numbers": ("NCHWD", "OIHWD", "NCHWD")}, ValueError,
     "only 2-D convolutions .* dimension_numbers entry 'NCHWD' has 5 dimensions"),
    (X2, W2, {"lhs_dilation": (2, 2)}, ValueError,
     r"lhs_dilation=\(2, 2\) \(a transposed convolution\) is not supported"),
    (X2, W2, {"batch_group_count": 2}, ValueError, "batch_group_count=2 is not supported"),
    (X2, W2, {"preferred_element_type": jnp.float16}, ValueError,
     "preferred_element_type=float16 is not supported for float32 inputs"),
    (X2, W2, {"preferred_element_type": jnp.int32}, ValueError,
     "preferred_element_type=int32 is not supported"),
    (X2, W2, {"preferred_element_type": "nope"}, TypeError,
     "preferred_element_type='nope' is not a dtype"),
    (X2, W2, {"out_sharding": "x"}, ValueError, "out_sharding is not supported"),
    (X2, W2, {"padding": "CAUSAL"}, ValueError, "padding 'CAUSAL' is not supported"),
    (X2, W2, {"window_strides": 2}, TypeError, "window_strides must be a sequence of 2 ints"),
    (X2, W2, {"rhs_dilation": (1, 1, 1)}, TypeError, "rhs_dilation must be a sequence of 2"),
    (X2, W2, {"precision": (P.HIGH,)}, ValueError, "is not a lax precision"),
    (X2, W2, {"activation": jax.nn.relu}, TypeError,
     "activation must be an activation mode name or a jaxfuse.ActivationMode, got <"),
], ids=["1-D", "1-D, default layouts", "3-D", "3-D layouts", "lhs_dilation",
        "batch_group_count", "preferred float16", "preferred int32", "preferred nonsense",
        "out_sharding", "CAUSAL", "int strides", "3 dilations",
        "1 precision in a tuple", "a jax function as the activation"])
def test_what_does_not_fuse_is_refused_by_name(x_shape, w_shape, kwargs, exc, match) -> None:
    x, w = jnp.ones(x_shape), jnp.ones(w_shape)
    for call in (lambda: jf.conv_bias_activation(x, w, **kwargs),
                 lambda: jf.conv_batchnorm_activation(x, w, *(np.ones(6, np.float32),) * 4,
                                                      **kwargs)):
        with pytest.raises(exc, match=match):
            call()


def test_numpy_float64_follows_jax_dtype_rules(device) -> None:
    """NumPy float64 arrays and lists compute in float32, as lax.conv_general_dilated's do,
    unless jax_enable_x64 is on: then the kernels' missing float64 is refused by name."""
    rng = np.random.default_rng(7)
    x, w = rng.standard_normal((2, 9, 8, 4)), rng.standard_normal((3, 3, 4, 6)) / 3
    b = rng.standard_normal(6)
    bn = (rng.uniform(0.5, 1.5, 6), rng.standard_normal(6), 0.3 * rng.standard_normal(6),
          rng.uniform(0.5, 2.0, 6))
    conv = {"padding": "SAME", "dimension_numbers": ("NHWC", "HWIO", "NHWC")}
    with jax.default_device(device):
        got = jf.conv_bias_batchnorm_activation(x, w, b.tolist(), *bn, activation="elu",
                                                **conv)
    assert got.dtype == np.float32
    tolerance = TOLERANCE_EXACT_FP32 if device.platform == "cpu" else TOLERANCE[got.dtype]
    assert relative_error(got, _lax_reference(x, w, conv, 3, b, bn, "elu")) <= tolerance
    with jax.enable_x64(True), pytest.raises(TypeError, match="x: float64 is not supported"):
        jf.conv_bias_activation(x, w, b, **conv)
