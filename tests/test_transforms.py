"""JAX transformations of fused plans: grad/jvp/vjp against a jax.nn reference (kinks
included), vmap against a Python loop for any in_axes, and scan, checkpoint, cond, donation,
every dtype, and abstract evaluation without a backend."""

from __future__ import annotations

import dataclasses
import functools
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cases import TOLERANCE, Case
from jax.test_util import check_grads
from transform_cases import build, execute, nn_reference, relative_tree_error

import jaxfuse as jf
from jaxfuse.activations import ActivationMode
from jaxfuse.primitive import fused_chain_p

SMALL = dict(n=2, c=4, h=6, w=7, k=6)

GRAD_CASES = [
    Case(ops="CBNSA", **SMALL),
    Case(ops="CBA", layout="NHWC", filter_layout="HWIO", activation="elu", **SMALL),
    Case(ops="CNA", bn_mode="per_activation", activation="tanh", filter_layout="OHWI",
         layout="NHWC", **SMALL),
    Case(ops="CSBA", strides=(2, 1), padding="SAME", dilation=(1, 2), groups=2,
         activation="leaky_relu", **SMALL),
    Case(ops="NA", bn_mode="per_activation", activation="power", **SMALL),
    Case(ops="BSA", activation="softrelu", layout="NHWC", **SMALL),
    Case(ops="CANB", activation="clipped_relu", **SMALL),
    Case(ops="CSA", activation="logistic", **SMALL),
    # jax.nn's modes: the derivative is jax.nn's function's, through every operand.
    Case(ops="CBNA", activation="silu", layout="NHWC", filter_layout="HWIO", **SMALL),
    Case(ops="CBA", activation="gelu", **SMALL),
    Case(ops="CNSA", activation="gelu_tanh", layout="NHWC", filter_layout="HWIO", **SMALL),
    Case(ops="CBA", activation="hardswish", **SMALL),
    Case(ops="BNA", activation="hardsigmoid", layout="NHWC", **SMALL),
    Case(ops="CSBA", activation="mish", groups=2, **SMALL),
]  # every activation mode, kinks included, is in test_derivatives_at_kinks_follow_jax_nn


def _random(shape, dtype=np.float32, seed=0):
    # NumPy draws: the first jax.random call costs seconds of compilation on CPU.
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), dtype)


def _grads(fn, x, params, cotangent):
    def loss(x, params):
        return jnp.sum(fn(x, params).astype(jnp.float32) * cotangent)
    return jax.grad(loss, argnums=(0, 1))(x, params)


# ----- differentiation ------------------------------------------------------------------------
@pytest.mark.parametrize("case", GRAD_CASES, ids=str)
def test_grad_matches_nn_reference(case: Case, device) -> None:
    # Gradients w.r.t. x, filters, bias, batch-norm parameters, side input and every scalar.
    plan, handles, x, params = build(case)
    x, params = jax.device_put((x, params), device)
    ct = _random(plan.output_desc.shape, seed=1)
    got = jax.jit(lambda x, p: _grads(lambda x, p: execute(plan, handles, x, p), x, p, ct))(
        x, params)
    want = jax.jit(lambda x, p: _grads(lambda x, p: nn_reference(case, x, p), x, p, ct))(
        x, params)
    assert set(got[1]) == set(params)
    assert relative_tree_error(got, want) <= case.tolerance(device)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_grad_in_low_precision(dtype: str, device) -> None:
    case = Case(ops="CBNSA", dtype=dtype, layout="NHWC", filter_layout="HWIO",
                activation="leaky_relu", **SMALL)
    plan, handles, x, params = build(case)
    x, params = jax.device_put((x, params), device)
    ct = _random(plan.output_desc.shape, seed=2)
    gx, gp = jax.jit(lambda x, p: _grads(lambda x, p: execute(plan, handles, x, p), x, p, ct))(
        x, params)
    assert gx.dtype == x.dtype and gp["w"].dtype == params["w"].dtype
    assert gp["bias"].dtype == jnp.float32
    exact = dataclasses.replace(case, dtype="float32")
    want = jax.jit(lambda x, p: _grads(
        lambda x, p: nn_reference(exact, x.astype(jnp.float32), p), x, p, ct))(x, params)
    assert relative_tree_error((gx, gp), want) <= TOLERANCE[np.dtype(dtype)]


def test_jvp_and_vjp(device) -> None:
    case = Case(ops="CBNSA", activation="elu", **SMALL)
    plan, handles, x, params = build(case)
    x, params = jax.device_put((x, params), device)
    primals = (x, params)
    leaves, tree = jax.tree_util.tree_flatten(primals)
    tangents = tree.unflatten([_random(jnp.shape(v), jnp.result_type(v), seed=i)
                               for i, v in enumerate(leaves)])
    ct = _random(plan.output_desc.shape, seed=4)

    @functools.partial(jax.jit, static_argnums=3)
    def jvp_and_vjp(primals, tangents, ct, use_reference):
        fn = (lambda x, p: nn_reference(case, x, p)) if use_reference else \
            (lambda x, p: execute(plan, handles, x, p))
        return jax.jvp(fn, primals, tangents), jax.vjp(fn, *primals)[1](ct)

    got = jvp_and_vjp(primals, tangents, ct, False)
    want = jvp_and_vjp(primals, tangents, ct, True)
    assert relative_tree_error(got, want) <= case.tolerance(device)


def test_derivatives_agree_with_finite_differences() -> None:
    # The fused forward and the unfused derivative describe one function.
    case = Case(ops="CBNSA", activation="tanh", n=1, c=3, h=5, w=5, k=4)
    plan, handles, x, params = build(case)
    check_grads(jax.jit(lambda x, p: execute(plan, handles, x, p)), (x, params), order=1,
                modes=("fwd", "rev"), atol=2e-2, rtol=2e-2)


def test_second_order_derivatives() -> None:
    # The jvp rule's primal is the differentiable fused op itself, so derivatives nest.
    case = Case(ops="CBNA", activation="elu", n=1, c=2, h=4, w=4, k=3)
    plan, handles, x, params = build(case)

    def hessian(fn):
        return jax.jit(jax.hessian(lambda x: jnp.sum(fn(x, params) ** 3)))(x)

    got = hessian(lambda x, p: execute(plan, handles, x, p))
    want = hessian(lambda x, p: nn_reference(case, x, p))
    assert got.shape == 2 * x.shape
    assert relative_tree_error(got, want) <= case.tolerance(jax.devices()[0])


KINKS = {  # activation -> (alpha, beta, gamma), inputs at and around its kinks (or 0)
    "relu": ((0.0, 0.0, 0.0), [0.0, -1.0, 1.0]),
    "leaky_relu": ((0.2, 0.0, 0.0), [0.0, -1.0, 1.0]),
    "elu": ((0.6, 0.0, 0.0), [0.0, -1.0, 1.0]),
    "clipped_relu": ((0.75, 0.0, 0.0), [0.0, 0.75, -1.0, 0.5, 2.0]),
    "abs": ((0.0, 0.0, 0.0), [0.0, -1.0, 1.0]),
    "power": ((0.5, 0.5, 1.5), [-1.0, -2.0, 0.0, 1.0]),  # base 0, base < 0, base > 0
    "softrelu": ((0.0, 0.0, 0.0), [0.0, -1.0, 1.0]),
    "logistic": ((0.0, 0.0, 0.0), [0.0, -1.0, 1.0]),
    "tanh": ((0.8, 1.3, 0.0), [0.0, -1.0, 1.0]),
    "passthru": ((0.0, 0.0, 0.0), [0.0, -1.0, 1.0]),
    "silu": ((0.0, 0.0, 0.0), [0.0, -1.0, 1.0, -30.0, 30.0]),
    "gelu": ((0.0, 0.0, 0.0), [0.0, -1.0, 1.0, -30.0, 30.0]),
    "gelu_tanh": ((0.0, 0.0, 0.0), [0.0, -1.0, 1.0, -30.0, 30.0]),
    "hardswish": ((0.0, 0.0, 0.0), [-3.0, 3.0, -4.0, 0.0, 4.0]),
    "hardsigmoid": ((0.0, 0.0, 0.0), [-3.0, 3.0, -4.0, 0.0, 4.0]),
    "mish": ((0.0, 0.0, 0.0), [0.0, -1.0, 1.0, -30.0, 30.0]),
}
# Slopes jax.nn (or jnp) defines at the first kink input of each mode.
KINK_SLOPES = {"relu": 0.0, "leaky_relu": 1.0, "elu": 0.6, "clipped_relu": 0.0, "abs": 1.0,
               "power": 0.0, "softrelu": 0.5, "logistic": 0.25, "tanh": 0.8 * 1.3,
               "passthru": 1.0, "silu": 0.5, "gelu": 0.5, "gelu_tanh": 0.5,
               "hardswish": 0.0, "hardsigmoid": 0.0, "mish": float(np.tanh(np.log(2.0)))}


def test_kink_table_covers_every_mode() -> None:
    assert set(KINKS) == {mode.value for mode in ActivationMode}


@pytest.mark.parametrize("mode", sorted(KINKS))
def test_derivatives_at_kinks_follow_jax_nn(mode: str, device) -> None:
    (a, b, g), points = KINKS[mode]
    case = Case(ops="A", activation=mode, n=1, c=1, h=1, w=len(points))
    plan, handles = case.build()
    plan.compile()
    x = jax.device_put(jnp.asarray(points, jnp.float32).reshape(1, 1, 1, -1), device)
    params = {"act_alpha": jnp.float32(a), "act_beta": jnp.float32(b),
              "act_gamma": jnp.float32(g)}
    ct = jnp.ones(x.shape, jnp.float32)
    gx, gp = jax.jit(lambda x, p: _grads(lambda x, p: execute(plan, handles, x, p), x, p, ct))(
        x, params)
    rx, rp = jax.jit(lambda x, p: _grads(lambda x, p: nn_reference(case, x, p), x, p, ct))(
        x, params)
    np.testing.assert_array_equal(np.isfinite(gx), True)
    np.testing.assert_allclose(gx, rx, rtol=1e-6, atol=1e-7)
    for name in params:
        np.testing.assert_allclose(gp[name], rp[name], rtol=1e-5, atol=1e-6, err_msg=name)
    assert float(gx.ravel()[0]) == pytest.approx(KINK_SLOPES[mode])
    if mode == "clipped_relu":
        assert float(gx.ravel()[1]) == 0.0  # at the clip, like jax.nn.relu6 at 6
    if mode in ("hardswish", "hardsigmoid"):  # x = 3: relu6(x + 3) at its clip
        assert float(gx.ravel()[1]) == (1.0 if mode == "hardswish" else 0.0)


# ----- vmap -------------------------------------------------------------------------------------
def _loop(fn, in_axes, out_axis, *args):
    """`fn` applied example by example in Python, results stacked on `out_axis`."""
    axes, tree = jax.tree_util.tree_flatten(in_axes, is_leaf=lambda v: v is None)
    leaves = tree.flatten_up_to(args)
    size = next(a.shape[ax] for ax, a in zip(axes, leaves) if ax is not None)
    outs = [fn(*tree.unflatten([a if ax is None else jnp.take(a, i, axis=ax)
                                for ax, a in zip(axes, leaves)])) for i in range(size)]
    return jnp.stack(outs, axis=out_axis)


def _stacked(value, size, axis, rng):
    """`size` random perturbations of `value`, stacked on `axis`."""
    value = jnp.asarray(value)
    scales = rng.uniform(0.5, 1.5, size)
    return jnp.stack([(value * s).astype(value.dtype) for s in scales], axis=axis)


def _fused_calls(closed_jaxpr) -> list:
    """(signature, inside a loop?) of every fused-chain equation in a jaxpr, nested ones too."""
    found = []

    def walk(jaxpr, in_loop):
        for eqn in jaxpr.eqns:
            if eqn.primitive is fused_chain_p:
                found.append((eqn.params["signature"], in_loop))
            loop = in_loop or eqn.primitive.name in ("scan", "while")
            for value in eqn.params.values():
                for sub in value if isinstance(value, (tuple, list)) else (value,):
                    sub = getattr(sub, "jaxpr", sub)  # a ClosedJaxpr's Jaxpr
                    if hasattr(sub, "eqns"):
                        walk(sub, loop)

    walk(closed_jaxpr.jaxpr, False)
    return found


VMAP_CASES = [  # (case, batched operands with their axes, out_axes, expected strategy)
    (Case(ops="CBNA", **SMALL), {"x": 0}, 0, "batch"),
    (Case(ops="CBNSA", layout="NHWC", filter_layout="HWIO", **SMALL), {"x": 2, "side": 1}, 1,
     "batch"),
    (Case(ops="CBSA", **SMALL), {"side": 3}, 0, "batch"),
    (Case(ops="CBNA", activation="elu", **SMALL), {"w": 0}, 0, "channels"),
    (Case(ops="CBA", layout="NHWC", filter_layout="OHWI", groups=2, **SMALL),
     {"x": 1, "w": 3, "bias": 0}, 2, "channels"),
    (Case(ops="CNA", layout="NHWC", bn_mode="per_activation", **SMALL),
     {"scale": 0, "var": 2}, 0, "channels"),
    (Case(ops="NA", bn_mode="per_activation", activation="tanh", **SMALL),
     {"x": 0, "mean": 1}, 0, "channels"),
    (Case(ops="BA", layout="NHWC", **SMALL), {"bias": 0}, 4, "channels"),
    (Case(ops="CSBA", activation="abs", **SMALL), {"w": 1, "side": 0}, 0, "channels"),
    (Case(ops="CBA", activation="leaky_relu", **SMALL), {"act_alpha": 0}, 0, "loop"),
    (Case(ops="CBNSA", activation="power", **SMALL),
     {"x": 0, "w": 0, "epsilon": 0, "side_alpha": 0}, 0, "loop"),
]


@pytest.mark.parametrize("case,axes,out_axes,strategy", VMAP_CASES,
                         ids=[f"{c}-{sorted(a)}" for c, a, _, _ in VMAP_CASES])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_vmap_matches_python_loop(case: Case, axes: dict, out_axes: int, strategy: str,
                                  dtype: str, device) -> None:
    case = dataclasses.replace(case, dtype=dtype)
    plan, handles, x, params = build(case)
    rng = np.random.default_rng(5)
    size = 3
    operands = {"x": x, **params}
    for name, axis in axes.items():
        operands[name] = _stacked(operands[name], size, axis, rng)
    operands = jax.device_put(operands, device)
    x_in, p_in = operands.pop("x"), operands
    in_axes = (axes.get("x"), {name: axes.get(name) for name in p_in})

    def fn(x, p):
        return execute(plan, handles, x, p)

    got = jax.vmap(fn, in_axes=in_axes, out_axes=out_axes)(x_in, p_in)
    want = _loop(fn, in_axes, out_axes, x_in, p_in)
    assert got.shape == want.shape and got.dtype == want.dtype
    assert relative_tree_error(got, want) <= case.tolerance(device)

    calls = _fused_calls(jax.make_jaxpr(jax.vmap(fn, in_axes=in_axes, out_axes=out_axes))(
        x_in, p_in))
    assert len(calls) == 1
    (sig, in_loop), = calls
    assert in_loop == (strategy == "loop")
    if strategy == "batch":
        assert sig.batch == size * case.n
    elif strategy == "channels":
        assert sig.channels == size * plan.signature.channels


@pytest.mark.parametrize("case,axes,out_axes,strategy", VMAP_CASES,
                         ids=[f"{c}-{sorted(a)}" for c, a, _, _ in VMAP_CASES])
def test_vmap_over_an_empty_axis_gives_the_empty_result(case: Case, axes: dict, out_axes: int,
                                                        strategy: str, device) -> None:
    # Folding a size-0 axis into the channels once made a plan with 0 groups.
    plan, handles, x, params = build(case)
    operands = {"x": x, **params}
    for name, axis in axes.items():
        operands[name] = jnp.moveaxis(jnp.asarray(operands[name])[None][:0], 0, axis)
    x_in, p_in = operands.pop("x"), operands
    in_axes = (axes.get("x"), {name: axes.get(name) for name in p_in})
    got = jax.vmap(lambda x, p: execute(plan, handles, x, p), in_axes=in_axes,
                   out_axes=out_axes)(x_in, p_in)
    want = jax.eval_shape(jax.vmap(lambda x, p: nn_reference(case, x, p), in_axes=in_axes,
                                   out_axes=out_axes), x_in, p_in)
    assert got.shape == want.shape and got.dtype == want.dtype


def test_functional_vmap_over_empty_filters_matches_lax() -> None:
    x = _random((2, 4, 6, 6))
    ws = jnp.zeros((0, 8, 4, 3, 3))
    want = jax.vmap(lambda w: jax.nn.relu(jax.lax.conv_general_dilated(x, w, (1, 1), "SAME")))(ws)
    got = jax.vmap(lambda w: jf.conv_bias_activation(x, w, None, padding="SAME"))(ws)
    assert got.shape == want.shape == (0, 2, 8, 6, 6) and got.dtype == want.dtype


def test_nested_vmap_and_grad_of_vmap(device) -> None:
    case = Case(ops="CBA", activation="elu", **SMALL)
    plan, handles, x, params = build(case)
    xs = jax.device_put(_stacked(_stacked(x, 2, 0, np.random.default_rng(0)), 3, 0,
                                 np.random.default_rng(1)), device)

    def fn(x, p):
        return execute(plan, handles, x, p)

    got = jax.jit(jax.vmap(jax.vmap(fn, in_axes=(0, None)), in_axes=(0, None)))(xs, params)
    run = jax.jit(fn)
    want = jnp.stack([jnp.stack([run(xi, params) for xi in row]) for row in xs])
    assert relative_tree_error(got, want) <= case.tolerance(device)

    def grad_of_vmap(fn):
        loss = lambda x, p: jnp.sum(jax.vmap(fn, in_axes=(0, None))(x, p) ** 2)  # noqa: E731
        return jax.jit(jax.grad(loss, argnums=(0, 1)))(xs[0], params)

    assert relative_tree_error(grad_of_vmap(fn),
                               grad_of_vmap(lambda x, p: nn_reference(case, x, p))) \
        <= case.tolerance(device)


# ----- control flow, remat, donation, dtypes ---------------------------------------------------
@pytest.fixture(scope="module")
def layer():
    case = Case(ops="CBNA", padding="SAME", c=6, k=6, n=2, h=6, w=6, activation="elu")
    plan, handles, x, params = build(case)
    return case, (lambda x, p: execute(plan, handles, x, p)), x, params


def test_inside_scan(layer) -> None:
    case, fn, x, params = layer

    def body(carry, scale):
        return fn(carry * scale, params), jnp.sum(carry)

    scales = jnp.asarray([1.0, 0.5, 2.0], jnp.float32)
    out, sums = jax.jit(lambda x: jax.lax.scan(body, x, scales))(x)
    step = jax.jit(lambda y, s: nn_reference(case, y * s, params))
    want = x
    for s in scales:
        want = step(want, s)
    assert relative_tree_error(out, want) <= case.tolerance(jax.devices()[0])
    assert sums.shape == (3,)


def test_inside_checkpoint(layer) -> None:
    case, fn, x, params = layer

    def loss(fn):
        return lambda x, p: jnp.sum(fn(jax.checkpoint(fn)(x, p), p) ** 2)

    got = jax.jit(jax.grad(loss(fn), argnums=(0, 1)))(x, params)
    ref = loss(lambda x, p: nn_reference(case, x, p))
    want = jax.jit(jax.grad(ref, argnums=(0, 1)))(x, params)
    assert relative_tree_error(got, want) <= case.tolerance(jax.devices()[0])


def test_inside_cond(layer) -> None:
    case, fn, x, params = layer

    def loss(x, p, flag):
        y = jax.lax.cond(flag, lambda y: fn(y, p), lambda y: y * 2.0, fn(x, p))
        return jnp.sum(y ** 2)

    def ref_loss(x, p, flag):  # Python control flow (flag static) instead of lax.cond
        y = nn_reference(case, x, p)
        return jnp.sum((nn_reference(case, y, p) if flag else y * 2.0) ** 2)

    grad = jax.jit(jax.grad(loss, argnums=(0, 1)))  # one compilation: the flag is traced
    ref_grad = jax.jit(jax.grad(ref_loss, argnums=(0, 1)), static_argnums=2)
    for flag in (True, False):
        got, want = grad(x, params, flag), ref_grad(x, params, flag)
        assert relative_tree_error(got, want) <= case.tolerance(jax.devices()[0])


def test_donated_input(layer) -> None:
    _, fn, x, params = layer
    want = np.asarray(fn(x, params))
    donated = jnp.array(x, copy=True)
    out = jax.jit(fn, donate_argnums=0)(donated, params)
    np.testing.assert_array_equal(np.asarray(out), want)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_every_dtype_through_jit_grad_vmap(dtype: str) -> None:
    case = Case(ops="CBNSA", dtype=dtype, **SMALL)
    plan, handles, x, params = build(case)

    def fn(x, p):
        return execute(plan, handles, x, p)

    xs = jnp.stack([x, -x])
    got = jax.jit(jax.vmap(fn, in_axes=(0, None)))(xs, params)
    assert got.dtype == np.dtype(dtype)
    assert relative_tree_error(got, jnp.stack([fn(x, params), fn(-x, params)])) <= \
        case.tolerance(jax.devices()[0])
    gx = jax.jit(jax.grad(lambda x: jnp.sum(fn(x, params).astype(jnp.float32))))(x)
    assert gx.dtype == np.dtype(dtype) and bool(jnp.all(jnp.isfinite(gx)))


# ----- abstract evaluation ---------------------------------------------------------------------
def test_eval_shape_compiles_nothing(layer) -> None:
    case, fn, x, params = layer
    compiles: list[str] = []  # lowering or XLA compilation events (tracing is fine)

    def listener(event: str, *args, **kwargs) -> None:
        if "backend_compile" in event or "mlir" in event:
            compiles.append(event)

    before = jf.cache_info()
    spec = jax.ShapeDtypeStruct(x.shape, x.dtype)
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        out = jax.eval_shape(fn, spec, params)
        grads = jax.eval_shape(jax.grad(lambda x, p: jnp.sum(fn(x, p)), argnums=(0, 1)), spec,
                               params)
        batched = jax.eval_shape(jax.vmap(fn, in_axes=(0, None)),
                                 jax.ShapeDtypeStruct((5, *x.shape), x.dtype), params)
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert out.shape == (case.n, case.k, case.h, case.w)
    assert grads[0].shape == x.shape and batched.shape == (5, *out.shape)
    assert jf.cache_info() == before
    assert compiles == []


def test_eval_shape_needs_no_backend() -> None:
    # A process whose jax has no usable platform at all still traces, differentiates and
    # batches fused plans abstractly.
    script = textwrap.dedent("""
        import jax, jax.numpy as jnp
        import jaxfuse as jf
        from jaxfuse.primitive import fused_chain
        plan = jf.FusionPlan(jf.TensorDesc((2, 6, 6, 4), "bfloat16", "NHWC"))
        plan.add_conv_forward(jf.ConvDesc(padding="SAME"), jf.TensorDesc((3, 3, 4, 8),
                              "bfloat16", "HWIO"))
        plan.add_batchnorm_inference()
        plan.add_activation_forward("relu")
        sig = plan.signature
        specs = [jax.ShapeDtypeStruct(s.shape, s.dtype) for s in sig.operands]
        f = lambda *ops: fused_chain(sig, *ops)
        out = jax.eval_shape(f, *specs)
        grads = jax.eval_shape(jax.grad(lambda *o: jnp.sum(f(*o).astype(jnp.float32)),
                                        argnums=tuple(range(len(specs)))), *specs)
        batched = jax.eval_shape(jax.vmap(f, in_axes=(0,) + (None,) * (len(specs) - 1)),
                                 jax.ShapeDtypeStruct((3,) + specs[0].shape, specs[0].dtype),
                                 *specs[1:])
        try:
            jax.devices()
        except RuntimeError:
            print("no backend", out.shape, len(grads), batched.shape)
    """)
    env = {**os.environ, "JAX_PLATFORMS": "no_such_platform"}
    result = subprocess.run([sys.executable, "-P", "-c", script], capture_output=True, text=True,
                            env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "no backend (2, 6, 6, 8) 7 (3, 2, 6, 6, 8)"
