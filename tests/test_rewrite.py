"""jaxfuse.fuse: every recognized form is fused into one call and matches the original program;
chains that cannot be fused are left alone with a reason. Flax forms are in test_rewrite_flax."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cases import TOLERANCE, TOLERANCE_EXACT_FP32, relative_error
from jax import lax

import jaxfuse as jf
from jaxfuse.rewrite import count_fused_calls

DTYPES = ["float32", "float16", "bfloat16"]
DIMENSION_NUMBERS = {"NCHW": ("NCHW", "OIHW", "NCHW"), "NHWC": ("NHWC", "HWIO", "NHWC")}


def tolerance(dtype: Any) -> float:
    dtype = np.dtype(jnp.dtype(dtype))
    if dtype == np.float32 and jax.default_backend() == "cpu":
        return TOLERANCE_EXACT_FP32
    return TOLERANCE[dtype]


class Layer:
    """Random operands of one convolution layer in a layout and dtype."""

    def __init__(self, layout: str = "NHWC", dtype: str = "float32", seed: int = 0,
                 n: int = 2, c: int = 5, hw: int = 9, k: int = 6):
        rng = np.random.default_rng(seed)
        self.layout, self.dtype, self.k = layout, jnp.dtype(dtype), k
        x_shape = (n, c, hw, hw) if layout == "NCHW" else (n, hw, hw, c)
        w_shape = (k, c, 3, 3) if layout == "NCHW" else (3, 3, c, k)
        self.x = jnp.asarray(rng.standard_normal(x_shape), dtype)
        self.w = jnp.asarray(rng.standard_normal(w_shape) / np.sqrt(9 * c), dtype)
        self.b = jnp.asarray(rng.standard_normal(k), dtype)
        self.mean = (0.3 * rng.standard_normal(k)).astype(np.float32)
        self.var = rng.uniform(0.5, 2.0, k).astype(np.float32)
        self.scale = rng.uniform(0.5, 1.5, k).astype(np.float32)
        self.shift = rng.standard_normal(k).astype(np.float32)
        out_shape = (n, k, hw, hw) if layout == "NCHW" else (n, hw, hw, k)
        self.z = jnp.asarray(rng.standard_normal(out_shape), dtype)

    def conv(self, x: jax.Array, w: jax.Array, strides: tuple[int, int] = (1, 1)) -> jax.Array:
        return lax.conv_general_dilated(x, w, strides, "SAME",
                                        dimension_numbers=DIMENSION_NUMBERS[self.layout])

    def channel(self, v: Any) -> Any:
        """A per-channel vector broadcastable against this layout."""
        v = jnp.asarray(v)
        return v[None, :, None, None] if self.layout == "NCHW" else v


def check(fn: Callable[..., Any], *args: Any, plans: list[str], dtype: Any,
          jit: bool = True) -> jf.FusionReport:
    """fuse(fn) matches fn within the dtype's tolerance and makes one call per plan."""
    report = jf.fusion_report(fn, *args)
    assert [g.plan for g in report.fused] == plans, report
    assert count_fused_calls(report.jaxpr) == len(plans)
    fused = jf.fuse(fn)
    out = (jax.jit(fused) if jit else fused)(*args)
    ref = fn(*args)
    for o, r in zip(jax.tree_util.tree_leaves(out), jax.tree_util.tree_leaves(ref)):
        assert o.dtype == r.dtype and o.shape == r.shape
        err = relative_error(o, np.asarray(jnp.asarray(r, jnp.float32), np.float64))
        assert err <= tolerance(dtype), f"relative error {err:.3g}\n{report}"
    return report


# ----- activations ------------------------------------------------------------------------------
ACTIVATIONS: dict[str, tuple[Callable[[jax.Array], jax.Array], str]] = {
    "jax.nn.relu": (jax.nn.relu, "relu"),
    "jax.nn.relu6": (jax.nn.relu6, "clipped_relu"),
    "jax.nn.leaky_relu(0.2)": (lambda y: jax.nn.leaky_relu(y, 0.2), "leaky_relu"),
    "jax.nn.leaky_relu": (jax.nn.leaky_relu, "leaky_relu"),
    "jax.nn.elu": (jax.nn.elu, "elu"),
    "jax.nn.elu(0.5)": (lambda y: jax.nn.elu(y, 0.5), "elu"),
    "jax.nn.sigmoid": (jax.nn.sigmoid, "logistic"),
    "jnp.tanh": (jnp.tanh, "tanh"),
    "jax.nn.softplus": (jax.nn.softplus, "softrelu"),
    "jnp.abs": (jnp.abs, "abs"),
    "maximum(y, 0)": (lambda y: jnp.maximum(y, 0), "relu"),
    "maximum(0, y)": (lambda y: jnp.maximum(0.0, y), "relu"),
    "clip(y, 0, 6)": (lambda y: jnp.clip(y, 0, 6), "clipped_relu"),
    "clip(y, 0.0, 0.75)": (lambda y: jnp.clip(y, 0.0, 0.75), "clipped_relu"),
    "clip(y, min=0)": (lambda y: jnp.clip(y, min=0.0), "relu"),
    "minimum(relu(y), 3)": (lambda y: jnp.minimum(jax.nn.relu(y), 3.0), "clipped_relu"),
    "where(y > 0, y, 0.1 y)": (lambda y: jnp.where(y > 0, y, 0.1 * y), "leaky_relu"),
    "where(y < 0, 0, y)": (lambda y: jnp.where(y < 0, 0.0, y), "relu"),
    "maximum(y, 0.1 y)": (lambda y: jnp.maximum(y, 0.1 * y), "leaky_relu"),
    "1 / (1 + exp(-y))": (lambda y: 1 / (1 + jnp.exp(-y)), "logistic"),
    # jax.nn's activations beyond MIOpen's, and the forms people write them in.
    "jax.nn.silu": (jax.nn.silu, "silu"),
    "y * sigmoid(y)": (lambda y: y * jax.nn.sigmoid(y), "silu"),
    "y / (1 + exp(-y))": (lambda y: y / (1 + jnp.exp(-y)), "silu"),
    "jax.nn.gelu": (jax.nn.gelu, "gelu_tanh"),  # approximate=True, jax.nn.gelu's default
    "jax.nn.gelu(approximate=False)": (lambda y: jax.nn.gelu(y, approximate=False), "gelu"),
    "0.5 y (1 + erf(y / sqrt 2))": (lambda y: 0.5 * y * (1 + lax.erf(y / math.sqrt(2))),
                                    "gelu"),
    "0.5 y (1 + tanh(c (y + 0.044715 y y y)))": (lambda y: 0.5 * y * (1 + jnp.tanh(
        math.sqrt(2 / math.pi) * (y + 0.044715 * (y * y * y)))), "gelu_tanh"),
    "jax.nn.hard_swish": (jax.nn.hard_swish, "hardswish"),
    "y * relu6(y + 3) / 6": (lambda y: y * jax.nn.relu6(y + 3) / 6, "hardswish"),
    "jax.nn.hard_sigmoid": (jax.nn.hard_sigmoid, "hardsigmoid"),
    "clip(y + 3, 0, 6) / 6": (lambda y: jnp.clip(y + 3, 0, 6) / 6, "hardsigmoid"),
    "jax.nn.mish": (jax.nn.mish, "mish"),
    "y * tanh(log1p(exp(y)))": (lambda y: y * jnp.tanh(jnp.log1p(jnp.exp(y))), "mish"),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(ACTIVATIONS))
def test_activation_forms(name: str, dtype: str) -> None:
    act, mode = ACTIVATIONS[name]
    layer = Layer("NHWC", dtype)
    report = check(lambda x, w, b: act(layer.conv(x, w) + b), layer.x, layer.w, layer.b,
                   plans=["CBA"], dtype=dtype)
    assert report.fused[0].ops == ("conv", "bias add", mode)


@pytest.mark.parametrize("name", list(ACTIVATIONS))
def test_activation_forms_nchw(name: str) -> None:
    act, mode = ACTIVATIONS[name]
    layer = Layer("NCHW", "float32", seed=1)
    report = check(lambda x, w, b: act(layer.conv(x, w) + layer.channel(b)),
                   layer.x, layer.w, layer.b, plans=["CBA"], dtype="float32")
    assert report.fused[0].ops[-1] == mode


# Forms whose NaN differs from the plan's activation (which keeps NaN, as jax.nn does): fusing
# them would change the result, so they are left alone.
NAN_TO_ZERO_FORMS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "where(y > 0, y, 0)": lambda y: jnp.where(y > 0, y, 0.0),
    "where(y >= 0, y, 0)": lambda y: jnp.where(y >= 0, y, 0.0),
    "where(0 < y, y, 0)": lambda y: jnp.where(jnp.less(0.0, y), y, 0.0),
    "elu with where(y < 0, y, 0) inside": lambda y: jnp.where(
        y > 0, y, 0.5 * jnp.expm1(jnp.where(y < 0, y, 0.0))),
}
NAN_KEEPING_FORMS: dict[str, tuple[Callable[[jax.Array], jax.Array], str]] = {
    **ACTIVATIONS,
    "where(y <= 0, 0, y)": (lambda y: jnp.where(y <= 0, 0.0, y), "relu"),
    "where(y < 0, 0.1 y, y)": (lambda y: jnp.where(y < 0, 0.1 * y, y), "leaky_relu"),
    "elu as where(y < 0, expm1(where(y < 0, y, 0)), y)": (lambda y: jnp.where(
        y < 0, jnp.expm1(jnp.where(y < 0, y, 0.0)), y), "elu"),
    "lax.clamp(0, y, 6)": (lambda y: lax.clamp(0.0, y, 6.0), "clipped_relu"),
}


# softplus written as log(1 + exp(y)): exp overflows to +inf where softrelu gives y, so it is
# left alone; inside mish, tanh takes that +inf to 1 as the epilogue does, so mish fuses.
OVERFLOWING_SOFTPLUS_FORMS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "log1p(exp(y))": lambda y: jnp.log1p(jnp.exp(y)),
    "log(1 + exp(y))": lambda y: jnp.log(1 + jnp.exp(y)),
    "log(exp(y) + 1)": lambda y: jnp.log(jnp.exp(y) + 1),
}


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("name", list(OVERFLOWING_SOFTPLUS_FORMS))
def test_softplus_forms_that_overflow_are_left_alone(name: str, dtype: str) -> None:
    act = OVERFLOWING_SOFTPLUS_FORMS[name]
    layer = Layer("NHWC", dtype, seed=4)
    big = layer.b.at[0].set(100.0)  # channel 0: exp(y) is +inf in every dtype
    fn = lambda x, w, b: act(layer.conv(x, w) + b)  # noqa: E731
    report = jf.fusion_report(fn, layer.x, layer.w, big)
    assert report.fused[0].ops == ("conv", "bias add"), report
    assert "overflows" in report.fused[0].stopped, report
    want = np.asarray(jnp.asarray(fn(layer.x, layer.w, big), jnp.float32))
    got = np.asarray(jnp.asarray(jax.jit(jf.fuse(fn))(layer.x, layer.w, big), jnp.float32))
    assert np.isinf(want[..., 0]).all()
    np.testing.assert_array_equal(np.isinf(got), np.isinf(want))


def _nan_inf_operands(layer: Layer) -> tuple[jax.Array, ...]:
    """x with a NaN, and a bias that makes whole channels NaN, +inf and -inf."""
    x = layer.x.at[0, 2, 3, 1].set(jnp.nan)
    b = layer.b.at[0].set(jnp.nan).at[1].set(jnp.inf).at[2].set(-jnp.inf)
    return x, layer.w, b


@pytest.mark.parametrize("name", list(NAN_KEEPING_FORMS) + list(NAN_TO_ZERO_FORMS))
def test_fused_activations_give_nan_and_inf_what_fn_gives(name: str) -> None:
    act, mode = NAN_KEEPING_FORMS.get(name) or (NAN_TO_ZERO_FORMS[name], None)
    layer = Layer("NHWC", "float32", seed=3)
    fn = lambda x, w, b: act(layer.conv(x, w) + b)  # noqa: E731
    args = _nan_inf_operands(layer)
    report = jf.fusion_report(fn, *args)
    assert report.fused[0].ops == (("conv", "bias add", mode) if mode else ("conv", "bias add"))
    if mode is None:
        assert "NaN" in report.fused[0].stopped or "elu" in name, report
    want, got = np.asarray(fn(*args)), np.asarray(jax.jit(jf.fuse(fn))(*args))
    assert np.isnan(want).any() or mode is None
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)  # infinities equal too


# ----- bias and batch norm ----------------------------------------------------------------------
BIAS_FORMS: dict[str, Callable[[Layer, jax.Array, jax.Array], jax.Array]] = {
    "y + b[None, :, None, None] / y + b": lambda L, y, b: y + L.channel(b),
    "b + y": lambda L, y, b: L.channel(b) + y,
    "y + b.reshape(...)": lambda L, y, b: y + b.reshape(
        (1, -1, 1, 1) if L.layout == "NCHW" else (1, 1, 1, -1)),
    "y + broadcast_to(b, y.shape)": lambda L, y, b: y + jnp.broadcast_to(L.channel(b), y.shape),
    "y - b": lambda L, y, b: y - L.channel(b),
    "y + 0.5": lambda L, y, b: y + 0.5,
}


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("name", list(BIAS_FORMS))
def test_bias_forms(name: str, layout: str) -> None:
    layer = Layer(layout, "float32", seed=2)
    form = BIAS_FORMS[name]
    check(lambda x, w, b: jax.nn.relu(form(layer, layer.conv(x, w), b)),
          layer.x, layer.w, layer.b, plans=["CBA"], dtype="float32")


def _bn_by_hand(L: Layer, y: jax.Array) -> jax.Array:
    c = L.channel
    return (y - c(L.mean)) * lax.rsqrt(c(L.var) + 1e-5) * c(L.scale) + c(L.shift)


def _bn_div_sqrt(L: Layer, y: jax.Array) -> jax.Array:
    c = L.channel
    return (y - c(L.mean)) / jnp.sqrt(c(L.var) + 1e-3) * c(L.scale) + c(L.shift)


def _bn_prefolded(L: Layer, y: jax.Array) -> jax.Array:
    a = L.scale / np.sqrt(L.var + 1e-5)
    return y * L.channel(a) + L.channel(L.shift - L.mean * a)


def _bn_in_dtype(L: Layer, y: jax.Array) -> jax.Array:
    # Parameters cast to the activations' dtype, so nothing widens to float32.
    c = lambda v: L.channel(jnp.asarray(v, y.dtype))  # noqa: E731
    return (y - c(L.mean)) * lax.rsqrt(c(L.var) + 1e-5) * c(L.scale) + c(L.shift)


BN_FORMS = {"(y - mean) * rsqrt(var + eps) * scale + shift": _bn_by_hand,
            "(y - mean) / sqrt(var + eps) * scale + shift": _bn_div_sqrt,
            "y * a + c": _bn_prefolded,
            "in the activation dtype": _bn_in_dtype}


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(BN_FORMS))
def test_batchnorm_forms(name: str, dtype: str, layout: str) -> None:
    layer = Layer(layout, dtype, seed=3)
    bn = BN_FORMS[name]
    report = check(lambda x, w: jax.nn.relu(bn(layer, layer.conv(x, w))), layer.x, layer.w,
                   plans=["CNA"], dtype=dtype)
    assert report.fused[0].ops[1] in ("batch norm", "scale/shift")


@pytest.mark.parametrize("dtype", DTYPES)
def test_conv_bias_batchnorm_activation(dtype: str) -> None:
    layer = Layer("NHWC", dtype, seed=4)
    report = check(lambda x, w, b: jax.nn.relu6(_bn_by_hand(layer, layer.conv(x, w) + b)),
                   layer.x, layer.w, layer.b, plans=["CBNA"], dtype=dtype)
    assert report.fused[0].ops == ("conv", "bias add", "batch norm", "clipped_relu")


# ----- residual add ----------------------------------------------------------------------------
RESIDUAL_FORMS: dict[str, tuple[Callable[..., jax.Array], str]] = {
    "relu(bn(conv(x)) + z)": (lambda L, y, z: jax.nn.relu(_bn_by_hand(L, y) + z), "CNSA"),
    "relu(z + bn(conv(x)))": (lambda L, y, z: jax.nn.relu(z + _bn_by_hand(L, y)), "CNSA"),
    "bn(conv(x)) + z": (lambda L, y, z: _bn_by_hand(L, y) + z, "CNS"),
    "tanh(conv(x) - z)": (lambda L, y, z: jnp.tanh(y - z), "CSA"),
    "elu(z - conv(x))": (lambda L, y, z: jax.nn.elu(z - y), "CNSA"),
}


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(RESIDUAL_FORMS))
def test_residual_add(name: str, dtype: str, layout: str) -> None:
    layer = Layer(layout, dtype, seed=5)
    form, plan = RESIDUAL_FORMS[name]
    check(lambda x, w, z: form(layer, layer.conv(x, w), z), layer.x, layer.w, layer.z,
          plans=[plan], dtype=dtype)


def test_residual_in_float32_after_widening_uses_the_narrow_operand() -> None:
    # The chain widens to float32 for batch norm; the shortcut is widened from bfloat16 too, so
    # it enters the plan as the original bfloat16 array without rounding.
    layer = Layer("NHWC", "bfloat16", seed=6)

    def block(x: jax.Array, w: jax.Array, z: jax.Array) -> jax.Array:
        y = _bn_by_hand(layer, layer.conv(x, w))  # float32 (parameters are float32)
        return jax.nn.relu(y + z.astype(jnp.float32))

    check(block, layer.x, layer.w, layer.z, plans=["CNSA"], dtype="bfloat16")


# ----- what stays unfused -----------------------------------------------------------------------
def test_conv_output_used_elsewhere_is_left_alone() -> None:
    layer = Layer(seed=7)

    def f(x: jax.Array, w: jax.Array, b: jax.Array) -> tuple[jax.Array, jax.Array]:
        y = layer.conv(x, w)
        return jax.nn.relu(y + b), jnp.sum(y * y)

    report = check(f, layer.x, layer.w, layer.b, plans=[], dtype="float32")
    (left,) = report.left_alone
    assert "used by 2 operations" in left.reason, left.reason
    assert any(e.primitive.name == "conv_general_dilated" for e in report.jaxpr.jaxpr.eqns)


def test_intermediate_used_elsewhere_stops_the_chain() -> None:
    layer = Layer(seed=8)

    def f(x: jax.Array, w: jax.Array, b: jax.Array) -> jax.Array:
        y = layer.conv(x, w) + b
        return jnp.tanh(y) + y  # y is needed as is: tanh cannot fuse into its chain

    report = check(f, layer.x, layer.w, layer.b, plans=["CB"], dtype="float32")
    assert report.fused[0].ops == ("conv", "bias add")
    assert "must stay materialized" in report.fused[0].stopped
    assert any(e.primitive.name == "tanh" for e in report.jaxpr.jaxpr.eqns)


def test_intermediate_inside_activation_used_elsewhere() -> None:
    layer = Layer(seed=9)

    def f(x: jax.Array, w: jax.Array) -> tuple[jax.Array, jax.Array]:
        y = layer.conv(x, w)
        positive = y > 0
        return jnp.where(positive, y, 0.1 * y), positive  # the mask escapes

    report = check(f, layer.x, layer.w, plans=[], dtype="float32")
    assert len(report.left_alone) == 1


UNFUSABLE: dict[str, tuple[Callable[[Layer, jax.Array, jax.Array], Any], str]] = {
    "transposed conv": (lambda L, x, w: jax.nn.relu(lax.conv_general_dilated(
        x, w, (1, 1), ((1, 1), (1, 1)), lhs_dilation=(2, 2),
        dimension_numbers=DIMENSION_NUMBERS[L.layout])), "lhs_dilation"),
    "per-pixel scale": (lambda L, x, w: L.conv(x, w) * jnp.arange(9.0)[:, None], "varies"),
    "y * sin(y)": (lambda L, x, w: (lambda y: y * jnp.sin(y))(L.conv(x, w)),
                   "used by 2 operations"),
    "celu": (lambda L, x, w: jax.nn.celu(L.conv(x, w)), "`jit(celu)`, which is not"),
    "reshape": (lambda L, x, w: jax.nn.relu(L.conv(x, w).reshape(2, -1)), "changes the shape"),
    "transposing split": (lambda L, x, w: jax.nn.relu(lax.reshape(
        L.conv(x, w), (1, 2, 6, 9, 9), dimensions=(0, 1, 3, 2))), "changes the shape"),
    "3-D conv": (lambda L, x, w: jax.nn.relu(lax.conv_general_dilated(
        x[..., None], w[..., None], (1, 1, 1), "SAME")), "2-D"),
}


@pytest.mark.parametrize("name", list(UNFUSABLE))
def test_unfusable_chains_are_left_alone_with_a_reason(name: str) -> None:
    layer = Layer("NCHW", "float32", seed=10)
    form, words = UNFUSABLE[name]
    report = check(lambda x, w: form(layer, x, w), layer.x, layer.w, plans=[], dtype="float32")
    (left,) = report.left_alone
    assert words in left.reason, left.reason


# ----- around and inside transformations --------------------------------------------------------
def _block(layer: Layer) -> Callable[[jax.Array], jax.Array]:
    return lambda x: jax.nn.relu(layer.conv(x, layer.w) + layer.b)


@jax.custom_jvp
def _custom_jvp_block(x: jax.Array) -> jax.Array:
    return _block(_NESTED)(x)


_custom_jvp_block.defjvp(lambda primals, tangents: (_custom_jvp_block(*primals), tangents[0]))


@jax.custom_vjp
def _custom_vjp_block(x: jax.Array) -> jax.Array:
    return _block(_NESTED)(x)


_custom_vjp_block.defvjp(lambda x: (_custom_vjp_block(x), None), lambda _, g: (g,))

_NESTED = Layer("NHWC", "float32", seed=11, k=5)
NESTED: dict[str, tuple[Callable[[jax.Array], Any], str]] = {
    "jit(f)": (jax.jit(_block(_NESTED)), "jit("),
    "jit inside jit": (jax.jit(lambda x: jax.jit(_block(_NESTED))(x) * 2.0), "jit("),
    "scan": (lambda x: lax.scan(lambda c, _: (_block(_NESTED)(c), None), x, None,
                                length=3)[0], "scan"),
    "cond": (lambda x: lax.cond(jnp.sum(x) > 0, _block(_NESTED), lambda v: v, x), "cond"),
    "while": (lambda x: lax.while_loop(lambda c: jnp.sum(c[0]) < 1e4,
                                       lambda c: (_block(_NESTED)(c[0]), c[1] + 1), (x, 0))[0],
              "while"),
    "remat": (jax.checkpoint(_block(_NESTED)), "checkpoint"),
    "custom_jvp": (_custom_jvp_block, "custom_jvp_call"),
    "custom_vjp": (_custom_vjp_block, "custom_vjp_call"),
}


@pytest.mark.parametrize("name", list(NESTED))
def test_nested_jaxprs(name: str) -> None:
    fn, scope = NESTED[name]
    report = check(fn, _NESTED.x, plans=["CBA"], dtype="float32")
    assert scope in report.fused[0].scope


# ----- fuse of vmap: the batch folded into the convolution's, then split off ---------------------
def _stacked(a: jax.Array, copies: int, seed: int) -> jax.Array:
    """`copies` different random arrays of `a`'s shape and dtype, stacked on a new axis 0."""
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.standard_normal((copies, *a.shape)), a.dtype)


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_fuse_of_vmap_fuses_the_chain_on_the_split_batch(dtype: str, layout: str) -> None:
    layer = Layer(layout, dtype, seed=30)

    def block(x: jax.Array, w: jax.Array, b: jax.Array, z: jax.Array) -> jax.Array:
        y = layer.conv(x, w) + layer.channel(b)
        return jax.nn.relu(_bn_by_hand(layer, y) + z)

    xs, zs = _stacked(layer.x, 3, 31), _stacked(layer.z, 3, 32)
    batched = jax.vmap(block, in_axes=(0, None, None, 0))
    check(batched, xs, layer.w, layer.b, zs, plans=["CBNSA"], dtype=dtype)


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_fuse_of_vmap_over_other_axes_and_of_nested_vmaps(layout: str) -> None:
    layer = Layer(layout, "bfloat16", seed=33)
    block = lambda x, w, b: jax.nn.relu6(layer.conv(x, w) + layer.channel(b))  # noqa: E731
    xs = _stacked(layer.x, 3, 34)
    # Mapped over axis 1 and returned on axis 2: transposes around the split batch.
    moved = jax.vmap(block, in_axes=(1, None, None), out_axes=2)
    check(moved, jnp.moveaxis(xs, 0, 1), layer.w, layer.b, plans=["CBA"], dtype="bfloat16")
    twice = jax.vmap(jax.vmap(block, in_axes=(0, None, None)), in_axes=(0, None, None))
    check(twice, _stacked(xs, 2, 35), layer.w, layer.b, plans=["CBA"], dtype="bfloat16")
    # A bias mapped too varies beyond the channel axis: it is added as a full-size input.
    per_example = jax.vmap(block, in_axes=(0, None, 0))
    check(per_example, xs, layer.w, _stacked(layer.b, 3, 36), plans=["CSA"], dtype="bfloat16")


def _left_alone_because(fn: Callable[..., Any], *args: Any) -> str:
    report = check(fn, *args, plans=[], dtype="float32")
    (left,) = report.left_alone
    return left.reason


def test_fuse_of_vmap_leaves_what_vmap_did_not_fold_into_the_batch() -> None:
    layer = Layer("NCHW", "float32", seed=37)
    block = lambda x, w, b: jax.nn.relu(layer.conv(x, w) + layer.channel(b))  # noqa: E731
    xs, ws, bs = (_stacked(a, 3, 38) for a in (layer.x, layer.w, layer.b))
    # Mapped filters: vmap merges the copies' output channels into one convolution.
    reason = _left_alone_because(jax.vmap(block, in_axes=(0, 0, None)), xs, ws, layer.b)
    assert "changes the shape" in reason, reason
    reason = _left_alone_because(jax.vmap(block, in_axes=(None, 0, None)), layer.x, ws, layer.b)
    assert "changes the shape" in reason, reason
    # Only the bias mapped: vmap broadcasts the convolution's output to the copies.
    reason = _left_alone_because(jax.vmap(block, in_axes=(None, None, 0)), layer.x, layer.w, bs)
    assert "broadcast_in_dim" in reason, reason
    # A batch-norm scale mapped with the input: a scale per copy is no per-channel scale.
    scaled = jax.vmap(lambda x, w, s: jax.nn.relu(layer.conv(x, w) * layer.channel(s)),
                      in_axes=(0, None, 0))
    reason = _left_alone_because(scaled, xs, layer.w, bs)
    assert "only per-channel scales fuse" in reason, reason


def test_gradients_through_fuse_of_vmap() -> None:
    layer = Layer("NHWC", "float32", seed=39)

    def loss(fn: Callable[..., Any]) -> Callable[..., jax.Array]:
        return lambda x, w, b: jnp.sum(fn(x, w, b) ** 2)

    block = jax.vmap(lambda x, w, b: jax.nn.relu(layer.conv(x, w) + b), in_axes=(0, None, None))
    xs = _stacked(layer.x, 3, 40)
    got = jax.jit(jax.grad(loss(jf.fuse(block)), argnums=(0, 1, 2)))(xs, layer.w, layer.b)
    want = jax.grad(loss(block), argnums=(0, 1, 2))(xs, layer.w, layer.b)
    for g, r in zip(got, want):
        assert relative_error(g, np.asarray(r, np.float64)) <= tolerance("float32")


@pytest.mark.skipif(not hasattr(jax, "shard_map"), reason="needs jax.shard_map")
def test_bodies_that_are_not_searched_are_reported() -> None:
    mesh = jax.make_mesh((1,), ("d",))
    spec = jax.sharding.PartitionSpec()
    sharded = jax.shard_map(_block(_NESTED), mesh=mesh, in_specs=spec, out_specs=spec)
    for fn in (jax.jit(sharded), sharded):
        report = check(fn, _NESTED.x, plans=[], dtype="float32")
        (left,) = report.left_alone
        assert left.op == "shard_map" and "not searched" in left.reason
        # Wrapped whole, the shard_map has no line of the user's: none of jaxfuse's is named.
        assert "fuse.py" not in left.where, left.where


def test_around_jit_eager_and_decorator() -> None:
    layer = Layer(seed=12)
    block = lambda x, w, b: jax.nn.relu(layer.conv(x, w) + b)  # noqa: E731
    ref = block(layer.x, layer.w, layer.b)
    for fn in (jf.fuse(block), jax.jit(jf.fuse(block)), jf.fuse(jax.jit(block)),
               jf.fuse()(block)):
        out = fn(layer.x, layer.w, layer.b)
        assert relative_error(out, np.asarray(ref, np.float64)) <= tolerance("float32")


def test_pytrees_kwargs_and_static_arguments() -> None:
    layer = Layer(seed=13)

    def f(params: dict[str, jax.Array], x: jax.Array, act: str, *, scale: float = 1.0) -> Any:
        y = layer.conv(x, params["w"]) * scale + params["b"]
        return {"y": getattr(jax.nn, act)(y), "n": 3}

    fused = jf.fuse(f, static_argnums=2, static_argnames="scale")
    params = {"w": layer.w, "b": layer.b}
    out = jax.jit(fused, static_argnums=2, static_argnames="scale")(params, layer.x, "elu",
                                                                     scale=0.5)
    ref = f(params, layer.x, "elu", scale=0.5)
    assert out["n"] == 3
    assert relative_error(out["y"], np.asarray(ref["y"], np.float64)) <= tolerance("float32")
    report = jf.fusion_report(fused, params, layer.x, "elu", scale=0.5)
    assert [g.plan for g in report] == ["CNA"]


def test_static_names_cover_positions_and_positions_names() -> None:
    layer = Layer(seed=15)

    def f(x: jax.Array, w: jax.Array, use_act: bool, scale: float = 1.0) -> jax.Array:
        y = layer.conv(x, w)
        return jax.nn.relu(y) * scale if use_act else y

    ref = f(layer.x, layer.w, True, 0.5)
    by_name = jf.fuse(f, static_argnames=("use_act", "scale"))
    by_position = jf.fuse(f, static_argnums=(2, 3))
    for out in (by_name(layer.x, layer.w, True, 0.5),  # names given, passed by position
                by_position(layer.x, layer.w, use_act=True, scale=0.5),  # and the reverse
                jax.jit(by_name, static_argnames=("use_act", "scale"))(layer.x, layer.w,
                                                                       True, 0.5)):
        assert relative_error(out, np.asarray(ref, np.float64)) <= tolerance("float32")


def test_jit_s_static_arguments_need_no_declaring_to_fuse() -> None:
    """jax.jit(fuse(f), static_argnums=...) works where jax.jit(f, static_argnums=...) does:
    values that are not arrays reach f as they are."""
    layer = Layer(seed=16)

    def f(x: jax.Array, w: jax.Array, act: str, repeats: int) -> jax.Array:
        y = layer.conv(x, w)
        for _ in range(repeats):
            y = getattr(jax.nn, act)(y)
        return y

    out = jax.jit(jf.fuse(f), static_argnums=(2, 3))(layer.x, layer.w, "relu", 2)
    ref = jax.jit(f, static_argnums=(2, 3))(layer.x, layer.w, "relu", 2)
    assert relative_error(out, np.asarray(ref, np.float64)) <= tolerance("float32")
    assert [g.plan for g in jf.fusion_report(f, layer.x, layer.w, "relu", 2)] == ["CA"]


def test_a_report_of_fuse_of_fuse_reports_the_inner_fusion() -> None:
    layer = Layer(seed=17)
    block = lambda x, w, b: jax.nn.relu(layer.conv(x, w) + b)  # noqa: E731
    for fn in (jf.fuse(block), jf.fuse(jf.fuse(block)), jax.jit(jf.fuse(block))):
        assert [g.plan for g in jf.fusion_report(fn, layer.x, layer.w, layer.b)] == ["CBA"]


def test_dynamic_activation_parameter() -> None:
    layer = Layer(seed=14)
    f = lambda x, w, slope: jax.nn.leaky_relu(layer.conv(x, w), slope)  # noqa: E731
    check(f, layer.x, layer.w, jnp.float32(0.3), plans=["CA"], dtype="float32")


def test_filter_layouts_and_geometry() -> None:
    rng = np.random.default_rng(15)
    x = jnp.asarray(rng.standard_normal((1, 11, 12, 8)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((4, 3, 3, 8)) / 5, jnp.float32)  # OHWI, grouped below
    b = jnp.asarray(rng.standard_normal(8), jnp.float32)

    def f(x: jax.Array, w: jax.Array, b: jax.Array) -> jax.Array:
        y = lax.conv_general_dilated(x, w, (2, 1), ((1, 2), (0, 1)), rhs_dilation=(1, 2),
                                     feature_group_count=2,
                                     dimension_numbers=("NHWC", "IHWO", "NHWC"))
        return jax.nn.sigmoid(y + b)

    check(f, x, w, b, plans=["CBA"], dtype="float32")


def test_report_text() -> None:
    layer = Layer(seed=16)
    report = jf.fusion_report(lambda x, w, b: jax.nn.relu(layer.conv(x, w) + b),
                              layer.x, layer.w, layer.b)
    text = str(report)
    assert "1 chain(s) fused, 0 left alone" in text
    assert "conv -> bias add -> relu" in text
    assert "test_rewrite.py" in report.fused[0].where
    assert "1 x CBA" in report.summary()


def test_rounding_midway_is_not_skipped() -> None:
    # float32 conv, rounded to bfloat16 before the activation: fusing would compute the relu in
    # float32 and lose that rounding, so the chain is left alone; rounding at the end is kept.
    layer = Layer(seed=17)

    def midway(x: jax.Array, w: jax.Array) -> jax.Array:
        return jax.nn.relu(layer.conv(x, w).astype(jnp.bfloat16)).astype(jnp.float32)

    report = check(midway, layer.x, layer.w, plans=[], dtype="float32")
    assert "midway" in report.left_alone[0].reason
    at_end = lambda x, w: jax.nn.relu(layer.conv(x, w)).astype(jnp.bfloat16)  # noqa: E731
    check(at_end, layer.x, layer.w, plans=["CA"], dtype="bfloat16")
