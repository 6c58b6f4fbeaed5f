"""Every activation mode, value by value, against the float64 reference: large |x| (finite
results, never NaN from an overflow inside the formula), values near 0 and at the kinks, in
every dtype and layout, on each CPU code path an activation takes (the pointwise kernels of a
plan without convolution; a convolution's epilogue, whose NHWC float32 register-tile store
applies the branch-free modes on vectors) and (marked gpu) on a GPU. Mode names parse."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cases import ELEMENT_TOLERANCE, Case

import jaxfuse
from jaxfuse.activations import (
    ActivationMode,
    activation_mode,
    jax_activation,
    reference_activation,
)
from jaxfuse.reference import reference_float64
from jaxfuse.signature import SCALARS

# logistic(-1e30) and power(1e30) overflow in the float64 reference (to 0 and inf, correctly).
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")

# Magnitudes every mode meets: 0, tiny, near 0, at and around the kinks (0, 3), where
# exp(x) overflows float32 (88.7), where x^3 does (1e13), and beyond.
MAGNITUDES = [0.0, 1e-30, 1e-7, 1e-3, 0.5, 1.0, 2.999, 3.0, 3.001, 5.0, 10.0, 13.0, 30.0, 88.7,
              100.0, 1e4, 1e13, 1e30]


def _inputs(shape: tuple[int, ...], dtype: Any, seed: int) -> np.ndarray:
    """Uniform values in [-40, 40], with every +-magnitude the dtype can hold among them."""
    rng = np.random.default_rng(seed)
    special = np.asarray(MAGNITUDES + [-m for m in MAGNITUDES])
    special = special[np.abs(special) <= float(jnp.finfo(dtype).max)]
    x = rng.uniform(-40.0, 40.0, int(np.prod(shape)))
    x[rng.permutation(x.size)[:special.size]] = special
    return x.reshape(shape).astype(jnp.dtype(dtype))


def _identity_filter(case: Case) -> np.ndarray:
    """A 3x3 filter whose centre tap copies each channel: the convolution's output is x."""
    oihw = np.zeros((case.k, case.c, 3, 3))
    oihw[np.arange(case.k), np.arange(case.c), 1, 1] = 1.0
    return oihw if case.filter_layout == "OIHW" else oihw.transpose(2, 3, 1, 0)


def _assert_elementwise(out: Any, ref: np.ndarray, x: np.ndarray, dtype: Any) -> None:
    """`out` equals the reference rounded to `dtype`: the same infinities, no NaN, finite
    values within ELEMENT_TOLERANCE (relative) or |x| times the dtype's smallest normal
    (absolute: the CPU flushes subnormals to zero, as XLA's does, so x * f(x) is 0 where f(x)
    is subnormal; jax.nn.mish(-88.7) is -0.0 in float32 too)."""
    dtype = np.dtype(jnp.dtype(dtype))
    want = ref.astype(dtype).astype(np.float64)
    got = np.asarray(jnp.asarray(out, jnp.float32), np.float64)
    assert got.shape == want.shape
    assert not np.isnan(want).any(), "the reference has NaN for finite inputs"
    assert not np.isnan(got).any(), f"NaN for x = {np.unique(x[np.isnan(got)])}"
    inf = np.isinf(want)
    np.testing.assert_array_equal(got[inf], want[inf], "infinities differ")
    tiny = float(jnp.finfo(dtype).tiny) * np.maximum(1.0, np.abs(x.astype(np.float64)))
    with np.errstate(invalid="ignore"):  # inf - inf, where the infinities already agree
        bad = ~inf & (np.abs(got - want) > ELEMENT_TOLERANCE[dtype] * np.abs(want) + tiny)
    assert not bad.any(), "\n".join(
        f"x = {xi!r}: got {g!r}, want {w!r}" for xi, g, w in
        zip(x[bad][:8].astype(np.float64), got[bad][:8], want[bad][:8]))


@pytest.mark.parametrize("chain", ["A", "CA"])
@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("mode", [m.value for m in ActivationMode])
def test_activation_values(mode: str, dtype: str, layout: str, chain: str, device) -> None:
    # 16 channels: whole vectors of channels for every CPU vector width (NHWC float32 tiles).
    case = Case(ops=chain, dtype=dtype, layout=layout, activation=mode, n=1, c=16, k=16, h=3,
                w=5, filter_layout="HWIO" if layout == "NHWC" else "OIHW",
                precision="highest")  # an exact identity convolution on GPUs too (no TF32)
    plan, handles = case.build()
    plan.compile(device)
    _, args, operands = case.random_args(plan, handles, np.random.default_rng(0))
    x = _inputs(case.input_shape, dtype, seed=len(mode))
    operands[0] = x.astype(np.float64)
    if "C" in chain:
        w = _identity_filter(case)
        args.set_conv_forward(handles["C"], w.astype(jnp.dtype(dtype)), alpha=1.0)
        operands[1] = w
        operands[-1] = operands[-1].copy()
        operands[-1][SCALARS.index("conv_alpha")] = 1.0
    ref = reference_float64(plan.signature, *operands)
    out = jax.jit(plan.execute)(jax.device_put(jnp.asarray(x), device),
                                jax.device_put(args, device))
    _assert_elementwise(out, ref, x, dtype)


@pytest.mark.parametrize("mode", [m for m in ActivationMode if m.code >= 10])
def test_reference_has_no_overflow_and_matches_jax_nn(mode: ActivationMode) -> None:
    # The float64 reference of jax.nn's modes: no overflow for any float32 x, and jax.nn's
    # values (in float64, where its formulas are exact enough: |x| <= 5).
    x = np.linspace(-5.0, 5.0, 101)
    with np.errstate(over="raise", invalid="raise", divide="raise"):  # underflow to 0 is fine
        big = reference_activation(mode, np.asarray([-3e38, -1e30, -800.0, 800.0, 3e38]), xp=np)
        want = reference_activation(mode, x, xp=np)
    assert np.isfinite(big).all()
    with jax.enable_x64(True):
        got = np.asarray(jax_activation(mode, jnp.asarray(x), 0.0, 0.0, 0.0))
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name,mode", [
    ("silu", ActivationMode.SILU), ("swish", ActivationMode.SILU),
    ("gelu", ActivationMode.GELU), ("GELU", ActivationMode.GELU),
    ("gelu_tanh", ActivationMode.GELU_TANH), ("gelu-tanh", ActivationMode.GELU_TANH),
    ("hardswish", ActivationMode.HARDSWISH), ("hard_swish", ActivationMode.HARDSWISH),
    ("Hard-Swish", ActivationMode.HARDSWISH), ("hard_silu", ActivationMode.HARDSWISH),
    ("hardsigmoid", ActivationMode.HARDSIGMOID), ("hard_sigmoid", ActivationMode.HARDSIGMOID),
    ("mish", ActivationMode.MISH),
])
def test_mode_names_and_aliases(name: str, mode: ActivationMode) -> None:
    assert activation_mode(name) is mode


def test_codes_keep_miopen_numbering() -> None:
    # miopenActivationMode_t's ten first, then jax.nn's appended (csrc/kernels/epilogue.h).
    miopen = ["passthru", "logistic", "tanh", "relu", "softrelu", "abs", "power",
              "clipped_relu", "leaky_relu", "elu"]
    assert [m.value for m in ActivationMode][:10] == miopen
    assert [m.code for m in ActivationMode] == list(range(len(ActivationMode)))


def test_clipped_relu_lowers_as_relu6_does() -> None:
    # XLA's composition (the find step's candidate, and what runs when XLA wins) must reach
    # XLA in jax.nn.relu6's form (one clamp): a where/isnan form made XLA materialize the
    # condition beside NCHW transposes (H100: 216 against 116 us of kernels for a depthwise
    # chain). Its values and its slopes at the kinks are tested above and in test_transforms.
    x = jnp.linspace(-2.0, 8.0, 11, dtype=jnp.float32)

    def ops(fn: Any) -> set[str]:
        text = jax.jit(fn).lower(x).compile().as_text()
        return {op for op in ("select", "compare", "clamp", "minimum", "maximum")
                if f" {op}(" in text}

    ours = ops(lambda v: jax_activation("clipped_relu", v, jnp.float32(6.0), 0.0, 0.0))
    assert ours == ops(jax.nn.relu6) == {"clamp"}
    np.testing.assert_array_equal(
        np.asarray(jax_activation("clipped_relu", x, 6.0, 0.0, 0.0)), np.asarray(jax.nn.relu6(x)))


@pytest.mark.parametrize("alpha", [6, np.int32(6), 6.0], ids=["int", "int32", "float"])
def test_clipped_relu_differentiates_with_any_clip_type(alpha: Any) -> None:
    # jax.nn.relu6's slopes (0 at 0 and at the clip) whatever type the clip comes as; values
    # keep x's dtype as jnp.where's promotion did.
    x = jnp.asarray([-1.0, 0.0, 3.0, 6.0, 7.0], jnp.bfloat16)
    grad = jax.grad(lambda v: jax_activation("clipped_relu", v, alpha, 0.0, 0.0)
                    .astype(jnp.float32).sum())(x)
    np.testing.assert_array_equal(np.asarray(grad, np.float32), [0.0, 0.0, 1.0, 0.0, 0.0])
    assert jax_activation("clipped_relu", x, alpha, 0.0, 0.0).dtype == jnp.bfloat16


@pytest.mark.filterwarnings("ignore:invalid value encountered in multiply:RuntimeWarning")  # inf*0
@pytest.mark.parametrize("alpha", [0.1, float("nan"), float("inf"), -float("inf"), 2],
                         ids=["0.1", "nan", "inf", "-inf", "int"])
def test_leaky_relu_at_zero_is_the_kernels_formula(alpha: Any) -> None:
    # XLA's composition and the fused kernels compute x if x > 0 else alpha * x, so a non-finite
    # alpha gives NaN at 0 from either (jax.nn.leaky_relu's x >= 0 gave 0 there: which one a
    # plan got depended on the find step's timing). A plan on each solver agrees with the
    # reference; the composition keeps jax.nn.leaky_relu's operations and slopes.
    x = np.asarray([-2.0, -0.5, 0.0, 0.5, 2.0, 8.0], np.float32)
    with np.errstate(invalid="ignore"):
        want = reference_activation("leaky_relu", x.astype(np.float64), alpha, 0.0, 0.0, xp=np)
    np.testing.assert_allclose(  # (NaN and infinities where the reference has them)
        np.asarray(jax_activation("leaky_relu", jnp.asarray(x), alpha, 0.0, 0.0)), want,
        rtol=1e-6)
    desc = jaxfuse.TensorDesc((1, 1, 1, 6), "float32", layout="NHWC")
    for solver in ("fused", "xla"):
        plan = jaxfuse.FusionPlan(desc)
        act = plan.add_activation_forward("leaky_relu")
        plan.compile(jax.devices("cpu")[0], solver=solver)
        args = jaxfuse.OperatorArgs().set_activation_forward(act, alpha=alpha)
        np.testing.assert_allclose(np.asarray(plan.execute(x.reshape(1, 1, 1, 6), args)).ravel(),
                                   want, rtol=1e-6, err_msg=solver)


def test_leaky_relu_lowers_and_differentiates_as_jax_nn_does() -> None:
    x = jnp.linspace(-2.0, 2.0, 9, dtype=jnp.float32)  # (0 among them: the kink)

    def ops(fn: Any) -> list[str]:
        text = jax.jit(fn).lower(x).compile().as_text()
        return sorted(op for op in ("select", "compare", "multiply", "maximum", "minimum")
                      if f" {op}(" in text)

    assert ops(lambda v: jax_activation("leaky_relu", v, 0.1, 0.0, 0.0)) == ops(
        lambda v: jax.nn.leaky_relu(v, 0.1))
    for wrt in (0, 1):
        ours = jax.grad(lambda v, a: jax_activation("leaky_relu", v, a, 0.0, 0.0).sum(),
                        argnums=wrt)(x, 0.1)
        theirs = jax.grad(lambda v, a: jax.nn.leaky_relu(v, a).sum(), argnums=wrt)(x, 0.1)
        np.testing.assert_allclose(np.asarray(ours), np.asarray(theirs), rtol=1e-6)
