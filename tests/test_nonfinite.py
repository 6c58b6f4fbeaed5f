"""NaN and infinity in the shared epilogue (csrc/kernels/epilogue.h, CPU and GPU) follow the
formulas of the float64 reference: clipped_relu's alpha = NaN gives NaN (as jnp.minimum does),
NaN inputs pass relu and clipped_relu on every code path, and batch norm with var + eps == 0
gives +-inf (NaN only where the value equals the mean), including through jaxfuse.fuse, which
turns `y / s` into batch-norm parameters."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cases import Case, assert_matches_with_nonfinite, relative_error
from jax import lax

import jaxfuse as jf
from jaxfuse.reference import reference_float64
from jaxfuse.signature import SCALARS

pytestmark = pytest.mark.filterwarnings(
    "ignore:(invalid value|divide by zero) encountered:RuntimeWarning")  # the reference's inf/NaN

DTYPES = ["float32", "float16", "bfloat16"]
LAYOUTS = ["NCHW", "NHWC"]


def _run(case: Case, device: Any, seed: int, edit: Any) -> None:
    """Runs `case` with random operands that `edit(x, args, handles, operands, rng)` changes
    (keeping the float64 operands in step), and compares with the reference, NaN and inf
    included."""
    rng = np.random.default_rng(seed)
    plan, handles = case.build()
    plan.compile(device)
    x, args, operands = case.random_args(plan, handles, rng)
    x = np.asarray(x).copy()
    edit(x, args, handles, operands, rng)
    operands[0] = np.asarray(x, np.float64)
    ref = reference_float64(plan.signature, *operands)
    out = jax.jit(plan.execute)(jax.device_put(jnp.asarray(x), device),
                                jax.device_put(args, device))
    assert_matches_with_nonfinite(out, ref, case.tolerance(device))


def _set_scalar(operands: list[np.ndarray], name: str, value: float) -> None:
    operands[-1] = operands[-1].copy()
    operands[-1][SCALARS.index(name)] = np.float32(value)


def _poke(x: np.ndarray, rng: np.random.Generator, values: list[float], count: int) -> None:
    flat = x.reshape(-1)
    flat[rng.choice(flat.size, count, replace=False)] = np.resize(values, count)


# ----- activations ------------------------------------------------------------------------------

# Without a convolution (pointwise kernels) and with one (the CPU's register-tile store for
# NHWC float32 applies the branch-free modes on vectors, the other paths one value at a time).
CHAINS = ["A", "BA", "CA", "CBNA", "CNSA"]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("ops", CHAINS)
def test_clipped_relu_with_nan_alpha_is_nan(ops: str, dtype: str, layout: str, device) -> None:
    def edit(x, args, handles, operands, rng):
        args.set_activation_forward(handles["A"], alpha=float("nan"))
        _set_scalar(operands, "act_alpha", np.nan)

    case = Case(ops=ops, dtype=dtype, layout=layout, activation="clipped_relu", k=16, c=8)
    _run(case, device, seed=len(ops), edit=edit)


@pytest.mark.parametrize("alpha", [0.7, -0.4, np.inf])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("ops", CHAINS)
@pytest.mark.parametrize("mode", ["relu", "clipped_relu", "leaky_relu", "hardswish",
                                  "hardsigmoid"])
def test_nan_and_inf_inputs_pass_the_activation(mode: str, ops: str, layout: str, alpha: float,
                                                device) -> None:
    def edit(x, args, handles, operands, rng):
        _poke(x, rng, [np.nan, np.inf, -np.inf], count=5)
        args.set_activation_forward(handles["A"], alpha=alpha)
        _set_scalar(operands, "act_alpha", alpha)

    # k = 16 and 32: whole vector blocks of channels for every CPU vector width.
    for k in (16, 32):
        case = Case(ops=ops, layout=layout, filter_layout="HWIO" if layout == "NHWC" else "OIHW",
                    activation=mode, k=k, c=8, n=1)
        _run(case, device, seed=k, edit=edit)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("ops", ["BA", "NSA", "CBNA"])
@pytest.mark.parametrize("mode", ["relu", "clipped_relu", "leaky_relu", "hardswish",
                                  "hardsigmoid"])
def test_nan_and_inf_inputs_in_16_bit_vectors(mode: str, ops: str, dtype: str, layout: str,
                                              device) -> None:
    # 40 channels: whole 16-bit vectors and a partial one per NHWC pixel (the CPU's
    # pass16 converts in registers); NCHW planes of 35 values, also a partial vector.
    def edit(x, args, handles, operands, rng):
        _poke(x, rng, [np.nan, np.inf, -np.inf], count=7)
        args.set_activation_forward(handles["A"], alpha=np.inf if mode == "clipped_relu"
                                    else -0.4)
        _set_scalar(operands, "act_alpha", np.inf if mode == "clipped_relu" else -0.4)

    case = Case(ops=ops, layout=layout, filter_layout="HWIO" if layout == "NHWC" else "OIHW",
                dtype=dtype, activation=mode, k=40, c=40, n=1, h=5, w=7)
    _run(case, device, seed=len(ops), edit=edit)


# ----- batch norm with zero variance ------------------------------------------------------------

@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bn_mode", ["spatial", "per_activation"])
@pytest.mark.parametrize("ops", ["N", "NA", "BN", "BNSA", "NB", "CNA", "CBNSA", "CNBA"])
def test_batchnorm_with_zero_variance_is_infinite(ops: str, bn_mode: str, dtype: str,
                                                  layout: str, device) -> None:
    """var + eps == 0 in some channels (some with scale 0, infinite scale or shift too), other
    channels ordinary: the ordinary ones keep their values, the others are +-inf, NaN where
    the formula has 0 * inf or inf - inf."""
    case = Case(ops=ops, dtype=dtype, layout=layout, bn_mode=bn_mode, n=2, c=6, k=6, h=5, w=4)
    _run(case, device, seed=len(ops) + len(bn_mode),
         edit=_zero_variance(case, bn_mode, layout))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("ops", ["CNA", "CBNA", "CNBA"])
def test_depthwise_batchnorm_with_zero_variance_is_infinite(ops: str, dtype: str,
                                                            device) -> None:
    """The depthwise kernel folds bias and batch norm into its taps where a channel's batch
    norm is a plain multiply-add, and runs the whole chain for the others (two 16-bit
    channels share a thread: an ordinary one beside a zero-variance one takes the exact form
    too)."""
    case = Case(ops=ops, dtype=dtype, layout="NHWC", filter_layout="HWIO", n=2, c=16, k=16,
                h=6, w=5, groups=16, padding="SAME")
    _run(case, device, seed=len(ops), edit=_zero_variance(case, "spatial", "NHWC"))
    if device.platform == "gpu":
        assert case.build()[0].compile(device).solver == "conv_depthwise"


def _zero_variance(case: Case, bn_mode: str, layout: str) -> Any:
    """An edit for _run: zero variance (and eps) in a third of `case`'s batch-norm channels."""
    plan_signature = case.build()[0].signature

    def edit(x, args, handles, operands, rng):
        names = [s.name for s in plan_signature.operands]
        params = [operands[names.index(k)].astype(np.float32).copy()
                  for k in ("scale", "shift", "mean", "var")]
        scale, shift, mean, var = (p.reshape(-1) for p in params)
        zero = rng.choice(var.size, max(1, var.size // 3), replace=False)
        var[zero] = 0.0
        # Among them: scale 0 (0 * inf), an infinite shift (inf - inf on half the values).
        scale[zero[:1]] = 0.0
        shift[zero[1:2]] = -np.inf
        # And channels with finite variance but an infinite scale.
        scale[rng.choice(var.size, 1)] = np.inf
        if case.ops.startswith("N"):  # x == mean exactly somewhere in a zero-variance channel
            _put_mean_into_x(x, mean, zero[-1], bn_mode, layout)
        args.set_batchnorm_inference(handles["N"], *params, epsilon=0.0)
        for k, p in zip(("scale", "shift", "mean", "var"), params):
            operands[names.index(k)] = p.astype(np.float64)
        _set_scalar(operands, "bn_epsilon", 0.0)

    return edit


def _put_mean_into_x(x: np.ndarray, mean: np.ndarray, index: int, bn_mode: str,
                     layout: str) -> None:
    """Sets elements of x (whose shape is the output's: no convolution) to the mean of
    parameter element `index`."""
    if bn_mode == "spatial":
        (x[:, index] if layout == "NCHW" else x[..., index])[...] = mean[index]
    else:
        x.reshape(x.shape[0], -1)[:, index] = mean[index]


# ----- through jaxfuse.fuse: y / s with zeros in s ----------------------------------------------

FORMS = {
    "relu((y + b) / s)": (lambda y, b, s, t: jax.nn.relu((y + b) / s), "CBNA"),
    "(y - b) / s * t": (lambda y, b, s, t: (y - b) / s * t, "CN"),
    "elu(y / s + t)": (lambda y, b, s, t: jax.nn.elu(y / s + t), "CNA"),
}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", list(FORMS))
def test_fused_division_by_zero_matches_the_original(name: str, layout: str) -> None:
    form, plan = FORMS[name]
    rng = np.random.default_rng(len(name))
    k = 7
    dn = ("NCHW", "OIHW", "NCHW") if layout == "NCHW" else ("NHWC", "HWIO", "NHWC")
    x = jnp.asarray(rng.standard_normal((2, 4, 6, 5) if layout == "NCHW" else (2, 6, 5, 4)),
                    jnp.float32)
    w = jnp.asarray(rng.standard_normal((k, 4, 3, 3) if layout == "NCHW" else (3, 3, 4, k)) / 6,
                    jnp.float32)
    channel = (lambda v: v[:, None, None]) if layout == "NCHW" else (lambda v: v)
    s = rng.uniform(0.5, 2.0, k).astype(np.float32)
    s[[0, 3]] = 0.0
    s[5] = -0.0
    b, t = rng.standard_normal(k).astype(np.float32), rng.standard_normal(k).astype(np.float32)

    def fn(x, w, b, s, t):
        y = lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=dn)
        return form(y, channel(b), channel(s), channel(t))

    args = (x, w, jnp.asarray(b), jnp.asarray(s), jnp.asarray(t))
    report = jf.fusion_report(fn, *args)
    assert [g.plan for g in report.fused] == [plan], report
    want = np.asarray(fn(*args), np.float64)
    got = np.asarray(jax.jit(jf.fuse(fn))(*args), np.float64)
    assert np.isinf(want).any()
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want), "NaN positions differ")
    np.testing.assert_array_equal(got[np.isinf(want)], want[np.isinf(want)])
    finite = np.isfinite(want)
    assert relative_error(got[finite], want[finite]) <= 1e-5
