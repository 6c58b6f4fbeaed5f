"""Property-based tests: any descriptor, convolution geometry, operator chain, dtype and
argument value either gives the float64 reference's result (shape, dtype, values, and NaN/Inf
where the reference has them) or raises jf.FusionError / ValueError / TypeError with a message;
never a crash, a hang or a wrong shape. On the CPU and (marked gpu) on a GPU.

Examples are derandomized so CI never flakes; ``JAXFUSE_HYPOTHESIS=explore`` runs many more,
randomly (what found the bugs these tests now guard).
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cases import (
    FILTER_SHAPES,
    Case,
    assert_matches_with_nonfinite,
    compiler_available,
    run_case,
)
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from jax import lax

import jaxfuse as jf
from jaxfuse._extension import extension
from jaxfuse.activations import ActivationMode
from jaxfuse.reference import reference_float64

EXPLORE = os.environ.get("JAXFUSE_HYPOTHESIS") == "explore"
ALLOWED = (jf.FusionError, ValueError, TypeError)
# Largest output a property test executes (bigger accepted plans are only compiled).
EXECUTE_BUDGET = 4096
DTYPES = ("float32", "float16", "bfloat16")
MODES = tuple(m.value for m in ActivationMode)
# Rejections of a geometry lax accepts are the plan parser's documented limits (sizes and
# padded extents within int32), never anything else: the CPU backend runs every valid plan.
LIMIT_MESSAGE = r"invalid jaxfuse plan"


def _check(device: Any, cpu_examples: int, strategy: Any, body: Any) -> None:
    """Runs `body(example, device)` over `strategy`, with fewer examples on a GPU (each new
    signature there is a runtime-compiler run)."""
    examples = cpu_examples if device.platform == "cpu" else max(cpu_examples // 4, 5)

    @settings(max_examples=examples * (25 if EXPLORE else 1), deadline=None,
              derandomize=not EXPLORE, database=None, print_blob=EXPLORE,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(strategy)
    def run(example: Any) -> None:
        body(example, device)

    run()


def _assert_clear(err: Exception) -> None:
    assert isinstance(err, ALLOWED), f"{type(err).__name__}: {err}"
    assert len(str(err)) > 10, f"unclear message: {err!r}"


# ----- descriptors ------------------------------------------------------------------------------

_DIM = st.one_of(st.integers(-2, 6), st.sampled_from([2**31 - 1, 2**31, 2**40, 2**63, 2**70]),
                 st.sampled_from([1.5, "3", None, np.int64(4), True, np.uint8(2)]))
_DESCRIPTOR = st.tuples(
    st.one_of(st.lists(_DIM, min_size=0, max_size=5).map(tuple), st.just(7), st.just("1,2,3,4")),
    st.sampled_from((*DTYPES, "float64", "int32", "complex64", "bool", None, "nope", object())),
    st.sampled_from(["NCHW", "NHWC", "nhwc", "OIHW", "HWIO", "NCWH", "", None, 4, "NCHWX"]),
)


def _descriptor_body(example: tuple[Any, Any, Any], device: Any) -> None:
    shape, dtype, layout = example
    try:
        plan = jf.FusionPlan(jf.TensorDesc(shape, dtype, layout))
        plan.add_activation_forward("elu")
        plan.compile(device)
    except Exception as err:
        _assert_clear(err)
        return
    desc = plan.input_desc
    assert plan.output_desc == desc
    if math.prod(desc.shape) <= EXECUTE_BUDGET:
        layout = desc.layout
        n, c, h, w = (desc.dim(a) for a in "NCHW")
        run_case(Case(ops="A", activation="elu", dtype=desc.dtype.name, layout=layout,
                      n=n, c=c, h=h, w=w), device)


def test_any_input_descriptor() -> None:
    _check(jax.devices("cpu")[0], 60, _DESCRIPTOR, _descriptor_body)


# ----- convolution geometry ---------------------------------------------------------------------

_SMALL_PAD = st.integers(-2, 4)
_HUGE = [2**30, -(2**30), 2**31 - 1, 2**31, 2**40, -(2**62)]


def _mostly(common: Any, rare: Any, odds: int = 8) -> Any:
    """`common` about `odds` times as often as `rare`."""
    return st.sampled_from([False] * odds + [True]).flatmap(lambda r: rare if r else common)


_PAD = _mostly(_SMALL_PAD, st.one_of(st.integers(-8, 12), st.sampled_from(_HUGE)), 5)
_PADDING = st.one_of(
    st.sampled_from(["SAME", "VALID", "same"]), _PAD, st.tuples(_PAD, _PAD),
    st.tuples(st.tuples(_PAD, _PAD), st.tuples(_PAD, _PAD)))
_SMALL_STEP = st.integers(1, 3)
_STEP = _mostly(_SMALL_STEP, st.sampled_from([0, -1, 7, 2**31 - 1, 2**31, 2**40]), 12)
_WINDOW = _mostly(st.integers(1, 3), st.integers(1, 11), 3)


@dataclasses.dataclass(frozen=True)
class Geometry:
    n: int
    c: int
    h: int
    w: int
    k: int
    ci: int | None  # filter input channels; None: the right number, c // groups
    r: int
    s: int
    strides: tuple[int, int]
    padding: Any
    dilation: tuple[int, int]
    groups: int
    dtype: str
    layout: str
    filter_layout: str
    tail: str  # pointwise operators after the conv
    bn_mode: str
    activation: str

    @property
    def filter_in(self) -> int:
        return self.c // max(self.groups, 1) if self.ci is None else self.ci

    def lax_padding(self) -> Any:
        p = self.padding
        if isinstance(p, str):
            return p.upper()
        if isinstance(p, int):
            return ((p, p), (p, p))
        return tuple((e, e) if isinstance(e, int) else e for e in p)

    def case(self) -> Case:
        return Case(ops="C" + self.tail, dtype=self.dtype, layout=self.layout,
                    filter_layout=self.filter_layout, n=self.n, c=self.c, h=self.h, w=self.w,
                    k=self.k, r=self.r, s=self.s, strides=self.strides, padding=self.padding,
                    dilation=self.dilation, groups=self.groups, bn_mode=self.bn_mode,
                    activation=self.activation)


@st.composite
def _geometries(draw: Any) -> Geometry:
    """Mostly valid geometry (so that most examples run), with every kind of invalid entry
    mixed in: zero or negative sizes, huge padding, windows larger than the input, groups that
    do not divide the channels, filters with the wrong channel count, strides 0 or huge."""
    c = draw(st.integers(1, 8))
    divisors = [d for d in range(1, c + 1) if c % d == 0]
    groups = draw(_mostly(st.sampled_from(divisors), st.integers(0, 9)))
    k_per_group = draw(st.integers(1, 3))
    k = draw(_mostly(st.just(k_per_group * max(groups, 1)), st.integers(1, 8)))
    return Geometry(
        n=draw(_mostly(st.integers(1, 2), st.just(0), 4)), c=c,
        h=draw(st.integers(1, 9)), w=draw(st.integers(1, 9)), k=k,
        ci=draw(_mostly(st.none(), st.integers(1, 6))),
        r=draw(_WINDOW), s=draw(_WINDOW), strides=draw(st.tuples(_STEP, _STEP)),
        padding=draw(_PADDING), dilation=draw(st.tuples(_STEP, _STEP)), groups=groups,
        dtype=draw(st.sampled_from(DTYPES)), layout=draw(st.sampled_from(["NCHW", "NHWC"])),
        filter_layout=draw(st.sampled_from(list(FILTER_SHAPES))),
        tail=draw(st.lists(st.sampled_from("BNSA"), unique=True, max_size=4).map("".join)),
        bn_mode=draw(st.sampled_from(["spatial", "per_activation"])),
        activation=draw(st.sampled_from(MODES)))


def _lax_output_shape(g: Geometry) -> tuple[int, ...] | None:
    """What lax.conv_general_dilated makes of the same geometry (None if it refuses, or if the
    geometry is one lax does not validate: strides or dilation below 1)."""
    if min(*g.strides, *g.dilation) < 1:
        return None
    dt = jnp.dtype(g.dtype)
    x_shape = (g.n, g.c, g.h, g.w) if g.layout == "NCHW" else (g.n, g.h, g.w, g.c)
    w_shape = FILTER_SHAPES[g.filter_layout](g.k, g.filter_in, g.r, g.s)
    try:
        out = jax.eval_shape(
            lambda x, w: lax.conv_general_dilated(
                x, w, g.strides, g.lax_padding(), rhs_dilation=g.dilation,
                dimension_numbers=(g.layout, g.filter_layout, g.layout),
                feature_group_count=g.groups),
            jax.ShapeDtypeStruct(x_shape, dt), jax.ShapeDtypeStruct(w_shape, dt))
    except Exception:
        return None
    return tuple(out.shape)


def _build(g: Geometry, device: Any) -> jf.FusionPlan:
    plan = jf.FusionPlan(jf.TensorDesc(
        (g.n, g.c, g.h, g.w) if g.layout == "NCHW" else (g.n, g.h, g.w, g.c), g.dtype, g.layout))
    plan.add_conv_forward(
        jf.ConvDesc(g.strides, g.padding, g.dilation, g.groups),
        jf.TensorDesc(FILTER_SHAPES[g.filter_layout](g.k, g.filter_in, g.r, g.s), g.dtype,
                      g.filter_layout))
    for letter in g.tail:
        if letter == "B":
            plan.add_bias_forward(jf.TensorDesc((g.k,), g.dtype))
        elif letter == "N":
            plan.add_batchnorm_inference(g.bn_mode)
        elif letter == "S":
            plan.add_side_input_add()
        else:
            plan.add_activation_forward(g.activation)
    return plan.compile(device)


def _geometry_body(g: Geometry, device: Any) -> None:
    expected = _lax_output_shape(g)
    lax_nonempty = expected is not None and min(expected[1:]) > 0
    try:
        plan = _build(g, device)
    except Exception as err:
        _assert_clear(err)
        event(f"refused: {type(err).__name__}")
        if lax_nonempty:  # lax computes something: only a documented limit may refuse it
            assert re.search(LIMIT_MESSAGE, str(err)), f"{g}: {err}"
        return
    assert expected is not None, f"{g}: accepted a geometry lax refuses"
    assert plan.output_desc.shape == expected, (g, plan.output_desc.shape, expected)
    (pt, pb), (pl, pr) = plan.signature.conv.padding
    padded = g.c * (g.h + max(pt, 0) + max(pb, 0)) * (g.w + max(pl, 0) + max(pr, 0))
    if max(g.n, 1) * max(math.prod(expected[1:]), padded) > EXECUTE_BUDGET:
        event("accepted, too large to execute")
    elif g.n == 0:
        event("accepted and executed, empty batch")
        _execute_empty(g.case(), device)
    else:
        event("accepted and executed")
        run_case(g.case(), device)


def _execute_empty(case: Case, device: Any) -> None:
    """A plan on an empty batch runs and returns an empty result of the right type."""
    plan, handles = case.build()
    plan.compile(device)
    x, args, _ = case.random_args(plan, handles, np.random.default_rng(0))
    out = jax.jit(plan.execute)(jax.device_put(x, device), jax.device_put(args, device))
    assert out.shape == plan.output_desc.shape and out.dtype == plan.output_desc.dtype


def test_any_convolution_geometry(device) -> None:
    _check(device, 60, _geometries(), _geometry_body)


# ----- operator chains --------------------------------------------------------------------------

_ADDERS = {
    "C": lambda plan, dt: plan.add_conv_forward(
        jf.ConvDesc(padding="SAME"), jf.TensorDesc((6, 4, 3, 3), dt, "OIHW")),
    "B": lambda plan, dt: plan.add_bias_forward(
        jf.TensorDesc((6 if plan.ops and plan.ops[0].letter == "C" else 4,), dt)),
    "N": lambda plan, dt: plan.add_batchnorm_inference("spatial"),
    "S": lambda plan, dt: plan.add_side_input_add(),
    "A": lambda plan, dt: plan.add_activation_forward("tanh"),
}


def _chain_body(example: tuple[str, str], device: Any) -> None:
    chain, dtype = example
    valid = chain in jf.supported_chains()
    plan = jf.FusionPlan(jf.TensorDesc((2, 4, 5, 6), dtype))
    try:
        for letter in chain:
            _ADDERS[letter](plan, dtype)
        plan.compile(device)
    except jf.UnsupportedFusionError as err:
        assert not valid, f"{chain}: {err}"
        _assert_clear(err)
        return
    assert valid, f"{chain} was accepted"
    run_case(Case(ops=chain, dtype=dtype, n=2, c=4, h=5, w=6, k=6, padding="SAME",
                  activation="tanh"), device)


def test_any_operator_chain(device) -> None:
    chains = st.lists(st.sampled_from("CBNSA"), min_size=0, max_size=6).map("".join)
    _check(device, 40, st.tuples(chains, st.sampled_from(DTYPES)), _chain_body)


@pytest.mark.parametrize("kind, name", [("activation", n) for n in
                                        ("selu", "", "RELU", "Leaky-ReLU", 3, None, "relu6",
                                         "GELU", "Hard-Swish")] +
                         [("batchnorm", n) for n in ("instance", "", 1, None, "Spatial")])
def test_mode_names(kind, name) -> None:
    plan = jf.FusionPlan(jf.TensorDesc((1, 2, 3, 3), "float32"))
    adder = plan.add_activation_forward if kind == "activation" else plan.add_batchnorm_inference
    try:
        adder(name)
    except Exception as err:
        _assert_clear(err)
        return
    # case and spelling variants only
    assert name in ("RELU", "Leaky-ReLU", "Spatial", "GELU", "Hard-Swish")
    run_case(Case(ops="A" if kind == "activation" else "N", c=2, h=3, w=3, n=1,
                  activation=str(name).lower().replace("-", "_"),
                  bn_mode=str(name).lower()), jax.devices("cpu")[0])


# ----- argument values: NaN and Inf propagate as in the reference -------------------------------

_SPECIAL = st.sampled_from([np.nan, np.inf, -np.inf])


@dataclasses.dataclass(frozen=True)
class Values:
    ops: str
    dtype: str
    layout: str
    activation: str
    x_special: tuple[tuple[int, float], ...]  # (flat index, value) poked into x
    param_nan: tuple[int, ...]  # which bias / batch-norm parameter entries become NaN
    scalars: tuple[float, float, float]  # conv alpha, bn epsilon, side alpha


_VALUES = st.builds(
    Values, ops=st.sampled_from(["CBNSA", "CNA", "CA", "NA", "BSA", "CBA", "A"]),
    dtype=st.sampled_from(DTYPES), layout=st.sampled_from(["NCHW", "NHWC"]),
    activation=st.sampled_from(MODES),
    x_special=st.lists(st.tuples(st.integers(0, 2 * 4 * 6 * 7 - 1), _SPECIAL), max_size=6)
    .map(tuple),
    param_nan=st.lists(st.integers(0, 5 * 5), max_size=3).map(tuple),
    scalars=st.tuples(st.sampled_from([1.25, 1.25, np.inf, -np.inf, np.nan]),
                      st.sampled_from([1e-3, 1e-3, np.inf]),  # NaN: refused, below
                      st.sampled_from([0.75, 0.75, np.inf, np.nan])))


def _values_body(v: Values, device: Any) -> None:
    case = Case(ops=v.ops, dtype=v.dtype, layout=v.layout, n=2, c=4, h=6, w=7, k=5,
                activation=v.activation, padding="SAME")
    plan, handles = case.build()
    plan.compile(device)
    x, args, operands = case.random_args(plan, handles, np.random.default_rng(0))
    x = np.asarray(x).copy()
    for index, value in v.x_special:
        x.reshape(-1)[index] = value
    operands[0] = np.asarray(x, np.float64)
    conv_alpha, epsilon, side_alpha = v.scalars
    names = [s.name for s in plan.signature.operands]
    for letter, op in handles.items():
        if letter == "B":
            b = np.asarray(operands[names.index("bias")], np.float32)
            b.reshape(-1)[[i % b.size for i in v.param_nan]] = np.nan
            args.set_bias_forward(op, b)
            operands[names.index("bias")] = b.astype(np.float64)
        elif letter == "N":
            params = [np.asarray(operands[names.index(k)], np.float32)
                      for k in ("scale", "shift", "mean", "var")]
            for i in v.param_nan:
                params[i % 4].reshape(-1)[i % params[0].size] = np.nan
            args.set_batchnorm_inference(op, *params, epsilon=epsilon)
            for k, p in zip(("scale", "shift", "mean", "var"), params):
                operands[names.index(k)] = p.astype(np.float64)
        elif letter == "C":
            args.set_conv_forward(op, np.asarray(operands[names.index("w")], x.dtype),
                                  alpha=conv_alpha)
        elif letter == "S":
            args.set_side_input_add(op, np.asarray(operands[names.index("side")], x.dtype),
                                    alpha=side_alpha)
    scalars = dict(zip(jf.signature.SCALARS, operands[-1]))
    scalars.update(conv_alpha=conv_alpha if "C" in v.ops else 1.0,
                   bn_epsilon=epsilon if "N" in v.ops else 0.0,
                   side_alpha=side_alpha if "S" in v.ops else 1.0)
    operands[-1] = np.asarray([scalars[k] for k in jf.signature.SCALARS], np.float32)
    ref = reference_float64(plan.signature, *operands)
    out = jax.jit(plan.execute)(jax.device_put(jnp.asarray(x), device),
                                jax.device_put(args, device))
    assert_matches_with_nonfinite(out, ref, case.tolerance(device))


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # NaN/Inf inputs
def test_nonfinite_values_propagate(device) -> None:
    _check(device, 40, _VALUES, _values_body)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # NaN/Inf inputs
@pytest.mark.parametrize("mode", MODES)
def test_nan_survives_every_activation(mode, device) -> None:
    case = Case(ops="BA", activation=mode, n=1, c=3, h=2, w=4)
    plan, handles = case.build()
    plan.compile(device)
    x, args, operands = case.random_args(plan, handles, np.random.default_rng(1))
    x = np.asarray(x).copy()
    every_fifth = x.reshape(-1)[::5]
    every_fifth[:] = np.resize(np.asarray([np.nan, np.inf, -np.inf], x.dtype), every_fifth.size)
    operands[0] = x.astype(np.float64)
    ref = reference_float64(plan.signature, *operands)
    out = plan.execute(jax.device_put(jnp.asarray(x), device), jax.device_put(args, device))
    assert_matches_with_nonfinite(out, ref, case.tolerance(device))


# ----- scalar arguments that do not fit the float32 they travel as ------------------------------

@pytest.mark.parametrize("value, exc, match", [
    (1e39, ValueError, "does not fit in float32"),
    (-1e39, ValueError, "does not fit in float32"),
    (2**200, ValueError, "does not fit in float32"),
    (10**400, ValueError, "does not fit in float32"),
    (np.float64(-3.5e38), ValueError, "does not fit in float32"),
    (1 + 2j, TypeError, "real number"),
    (np.complex64(1), TypeError, "real number"),
    ("1.0", TypeError, "real number"),
    ([1.0], TypeError, "real number"),
    (np.ones(2, np.float32), ValueError, "must be a scalar"),
    (jnp.ones((1,)), ValueError, "must be a scalar"),
    (object(), TypeError, "real number"),
])
@pytest.mark.parametrize("setter", ["conv_alpha", "epsilon", "side_alpha", "act_alpha",
                                    "act_gamma"])
def test_scalars_that_do_not_fit_float32(setter, value, exc, match) -> None:
    case = Case(ops="CNSA", activation="power", n=1, c=2, h=3, w=3, k=2)
    _, handles = case.build()
    w = np.ones(case.filter_shape, np.float32)
    ones = np.ones(2, np.float32)
    args = jf.OperatorArgs()
    with pytest.raises(exc, match=match):
        if setter == "conv_alpha":
            args.set_conv_forward(handles["C"], w, alpha=value)
        elif setter == "epsilon":
            args.set_batchnorm_inference(handles["N"], ones, ones, ones, ones, epsilon=value)
        elif setter == "side_alpha":
            args.set_side_input_add(handles["S"], np.ones((1, 2, 3, 3), np.float32), alpha=value)
        elif setter == "act_alpha":
            args.set_activation_forward(handles["A"], alpha=value)
        else:
            args.set_activation_forward(handles["A"], gamma=value)


@pytest.mark.parametrize("value", [True, np.int8(3), np.float16(2.0), jnp.bfloat16(0.5),
                                   jnp.float32(-1.5), np.array(2.0), 1e30, 7])
def test_scalars_that_fit(value) -> None:
    case = Case(ops="CA", activation="leaky_relu", n=1, c=2, h=3, w=3, k=2)
    plan, handles = case.build()
    plan.compile()
    rng = np.random.default_rng(2)
    x = rng.standard_normal(case.input_shape).astype(np.float32)
    w = rng.standard_normal(case.filter_shape).astype(np.float32)
    args = jf.OperatorArgs().set_conv_forward(handles["C"], w, alpha=value)
    args.set_activation_forward(handles["A"], alpha=0.1)
    scalars = dict.fromkeys(jf.signature.SCALARS, 0.0)
    scalars.update(conv_alpha=float(np.asarray(value, np.float32)), side_alpha=1.0,
                   act_alpha=0.1)
    ref = reference_float64(plan.signature, x, w,
                            np.asarray([scalars[k] for k in jf.signature.SCALARS], np.float32))
    assert_matches_with_nonfinite(plan.execute(x, args), ref, case.tolerance(jax.devices()[0]))


def test_nan_epsilon_is_refused() -> None:
    _, handles = Case(ops="NA", c=2).build()
    ones = np.ones(2, np.float32)
    with pytest.raises(ValueError, match="epsilon must be >= 0, got nan"):
        jf.OperatorArgs().set_batchnorm_inference(handles["N"], ones, ones, ones, ones,
                                                  epsilon=float("nan"))


def test_traced_scalars_are_checked_under_jit() -> None:
    case = Case(ops="CA", n=1, c=2, h=3, w=3, k=2)
    plan, handles = case.build()
    plan.compile()
    w = np.ones(case.filter_shape, np.float32)

    def run(x, alpha):
        args = jf.OperatorArgs().set_conv_forward(handles["C"], w, alpha=alpha)
        return plan.execute(x, args)

    x = np.ones(case.input_shape, np.float32)
    assert jax.jit(run)(x, 2.0).shape == plan.output_desc.shape
    with pytest.raises(ValueError, match="alpha must be a scalar"):
        jax.jit(run)(x, np.ones(3, np.float32))
    with pytest.raises(TypeError, match="real number"):
        jax.jit(run)(x, np.complex64(1))


# ----- the functional API -----------------------------------------------------------------------

_DIMENSION_NUMBERS = st.sampled_from([
    None, ("NCHW", "OIHW", "NCHW"), ("NHWC", "HWIO", "NHWC"), ("nhwc", "ohwi", "NHWC"),
    ("NHWC", "HWIO", "NCHW"), ("NCHW", "IOHW", "NCHW"), ("NCHW",), "NCHW", 5,
    ("NCHW", "OIHW", None)])


@dataclasses.dataclass(frozen=True)
class Call:
    dimension_numbers: Any
    strides: Any
    padding: Any
    dilation: Any
    groups: Any
    bias: bool
    activation: Any
    dtype: str
    w_dtype: str


_CALL = st.builds(
    Call, dimension_numbers=_mostly(st.sampled_from([None, ("NHWC", "HWIO", "NHWC")]),
                                    _DIMENSION_NUMBERS, 3),
    strides=_mostly(st.tuples(_SMALL_STEP, _SMALL_STEP),
                    st.sampled_from([2, (1,), (1, 2, 3), "1", (0, 1), None])),
    padding=_mostly(st.sampled_from(["SAME", "VALID", ((1, 1), (0, 2))]),
                    st.sampled_from([3, (1, 2), ((1,), (2,)), "FULL", None, [[1, 1], [1, 1]],
                                     ((1, 2, 3), (0, 0)), ((1.5, 1), (0, 0))])),
    dilation=_mostly(st.tuples(_SMALL_STEP, _SMALL_STEP), st.sampled_from([0, (1,), "x"])),
    groups=_mostly(st.just(1), st.sampled_from([2, 3, 0, -1, 1.0, "1", None])),
    bias=st.booleans(), activation=_mostly(st.sampled_from((*MODES, None)),
                                           st.sampled_from(["gelu", 7, ["relu"]])),
    dtype=st.sampled_from(DTYPES), w_dtype=_mostly(st.none(), st.sampled_from(DTYPES)))


def _call_body(call: Call, device: Any) -> None:
    layouts = (call.dimension_numbers if isinstance(call.dimension_numbers, tuple)
               and len(call.dimension_numbers) == 3 and all(isinstance(s, str) for s in
                                                           call.dimension_numbers)
               else ("NCHW", "OIHW", "NCHW"))
    lhs, rhs = layouts[0].upper(), layouts[1].upper()
    rng = np.random.default_rng(0)
    c, k = 4, 6
    x_shape = {"NCHW": (2, c, 7, 6), "NHWC": (2, 7, 6, c)}.get(lhs, (2, c, 7, 6))
    w_shape = FILTER_SHAPES.get(rhs, FILTER_SHAPES["OIHW"])(k, c, 3, 2)
    x = jax.device_put(jnp.asarray(rng.standard_normal(x_shape), call.dtype), device)
    w = jax.device_put(jnp.asarray(rng.standard_normal(w_shape) / 5, call.w_dtype or call.dtype),
                       device)
    b = rng.standard_normal(k).astype(np.float32) if call.bias else None
    kwargs = dict(window_strides=call.strides, padding=call.padding, rhs_dilation=call.dilation,
                  feature_group_count=call.groups, dimension_numbers=call.dimension_numbers,
                  activation=call.activation)
    try:
        out = jf.conv_bias_activation(x, w, b, **kwargs)
    except Exception as err:
        _assert_clear(err)
        event(f"refused: {type(err).__name__}")
        return
    event("accepted")
    dn = call.dimension_numbers or ("NCHW", "OIHW", "NCHW")
    ref = lax.conv_general_dilated(
        jnp.asarray(x, jnp.float32), jnp.asarray(w, jnp.float32), call.strides,
        jf.ConvDesc(padding=call.padding).padding,  # lax's form of the accepted padding
        rhs_dilation=call.dilation, dimension_numbers=tuple(s.upper() for s in dn),
        feature_group_count=call.groups, precision=lax.Precision.HIGHEST)
    if b is not None:
        ref = ref + (b if dn[0].upper() == "NHWC" else b[:, None, None])
    if call.activation is not None:
        ref = jf.activations.reference_activation(call.activation, ref)
    tol = Case(dtype=call.dtype).tolerance(device)
    assert out.shape == ref.shape and out.dtype == x.dtype
    err = np.linalg.norm(np.asarray(jnp.asarray(out, jnp.float32) - ref)) / max(
        float(np.linalg.norm(np.asarray(ref))), 1e-30)
    assert err <= max(tol, 1e-5), err


def test_functional_api_arguments(device) -> None:
    _check(device, 25, _CALL, _call_body)


# ----- GPU kernels for any accepted geometry compile (NVRTC; no GPU needed) ---------------------

@st.composite
def _tensor_core_geometries(draw: Any) -> Geometry:
    """Geometry the tensor-core solvers take (NHWC, 16-bit, channels in multiples of 8 or 16),
    with the same odd strides, padding, dilation, windows and empty batches as above."""
    g = draw(_geometries())
    c = draw(st.sampled_from([16, 32, 64, 128, 3, 8]))
    groups = draw(_mostly(st.just(1), st.sampled_from([2, c]), 4))
    return dataclasses.replace(
        g, c=c, k=draw(st.sampled_from([8, 16, 24, 64, 128])) * (groups if groups > 1 else 1),
        ci=None, groups=groups, layout="NHWC", dtype=draw(st.sampled_from(["float16",
                                                                            "bfloat16"])),
        filter_layout=draw(st.sampled_from(["HWIO", "OHWI", "OIHW"])),
        # Large outputs too: tile choices depend on how many tiles fill the device.
        w=draw(_mostly(st.integers(1, 20), st.integers(21, 128), 3)),
        h=draw(_mostly(st.integers(1, 20), st.integers(21, 128), 3)),
        n=draw(_mostly(st.just(g.n), st.sampled_from([8, 64]), 3)))


@pytest.mark.skipif(not compiler_available("CUDA"), reason="NVRTC is not installed")
def test_gpu_kernels_compile_for_any_accepted_geometry() -> None:
    ext = extension()

    @settings(max_examples=60 if EXPLORE else 12, deadline=None, derandomize=not EXPLORE,
              database=None, suppress_health_check=[HealthCheck.too_slow])
    @given(st.one_of(_tensor_core_geometries(), _geometries()))
    def run(g: Geometry) -> None:
        plan = jf.FusionPlan(jf.TensorDesc(
            (g.n, g.c, g.h, g.w) if g.layout == "NCHW" else (g.n, g.h, g.w, g.c), g.dtype,
            g.layout))
        try:
            plan.add_conv_forward(
                jf.ConvDesc(g.strides, g.padding, g.dilation, g.groups),
                jf.TensorDesc(FILTER_SHAPES[g.filter_layout](g.k, g.filter_in, g.r, g.s),
                              g.dtype, g.filter_layout))
            plan.add_activation_forward(g.activation)
        except ALLOWED as err:
            _assert_clear(err)
            return
        for arch in ("sm_80", "sm_90"):
            try:
                out = ext.gpu_compile_only("CUDA", plan.signature.encode(), arch)
            except ValueError as err:  # the plan parser's documented limits
                assert re.search(LIMIT_MESSAGE, str(err)), err
                return
            assert out["binary_bytes"] > 0, (g, arch)
            # Every tile variant the solver chooser may time must compile too.
            for variant in range(1, out["variants"]):
                again = ext.gpu_compile_only("CUDA", plan.signature.encode(), arch,
                                             variant=variant)
                assert again["binary_bytes"] > 0, (g, arch, variant)

    run()
