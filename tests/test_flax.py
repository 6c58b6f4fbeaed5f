"""The Flax layers (jaxfuse.flax) against the flax compositions they replace, on the same
variables: outputs, gradients and updated batch statistics, inference and training modes,
linen and NNX, float32 and bfloat16, across conv geometries and activations."""

from __future__ import annotations

import functools
import subprocess
import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cases import Case, relative_error

pytest.importorskip("flax")
import flax.linen as nn
import flax.serialization
import optax
from flax import nnx

from jaxfuse.activations import ActivationMode
from jaxfuse.flax import Activation, resolve_activation
from jaxfuse.flax import linen as fl
from jaxfuse.flax import nnx as fx
from jaxfuse.rewrite import count_fused_calls

N, C, H, W, K = 2, 6, 9, 9, 12
DEVICE = jax.devices()[0]



def _power(y: jax.Array) -> jax.Array:
    base = 0.5 + 0.7 * y
    positive = base > 0
    return jnp.where(positive, jnp.where(positive, base, 1.0) ** 1.7, 0.0)


# (the layer's `activation`, the same function written with jax ops for the reference).
ACTIVATIONS = [
    ("relu", jax.nn.relu),
    (jax.nn.relu6, jax.nn.relu6),
    (functools.partial(jax.nn.leaky_relu, negative_slope=0.2),
     functools.partial(jax.nn.leaky_relu, negative_slope=0.2)),
    (jax.nn.elu, jax.nn.elu),
    ("logistic", jax.nn.sigmoid),
    (jnp.tanh, jnp.tanh),
    (jax.nn.softplus, jax.nn.softplus),
    ("abs", jnp.abs),
    (None, lambda y: y),
    (Activation("clipped_relu", alpha=1.5), lambda y: jnp.clip(y, 0.0, 1.5)),
    (Activation("power", alpha=0.5, beta=0.7, gamma=1.7), _power),
    (jax.nn.leaky_relu, jax.nn.leaky_relu),
    (jax.nn.silu, jax.nn.silu),
    (jax.nn.gelu, jax.nn.gelu),
    (functools.partial(jax.nn.gelu, approximate=False),
     functools.partial(jax.nn.gelu, approximate=False)),
    (jax.nn.hard_swish, jax.nn.hard_swish),
    ("hardsigmoid", jax.nn.hard_sigmoid),
    (jax.nn.mish, jax.nn.mish),
]
ACT_IDS = ["relu", "relu6", "leaky0.2", "elu", "logistic", "tanh", "softplus", "abs", "none",
           "clipped1.5", "power", "leaky", "silu", "gelu", "gelu-exact", "hard_swish",
           "hardsigmoid", "mish"]

GEOMETRIES = {
    "3x3-same": dict(kernel_size=(3, 3), padding="SAME"),
    "1x1-s2-valid": dict(kernel_size=(1, 1), strides=2, padding="VALID"),
    "3x3-s2-pad1": dict(kernel_size=(3, 3), strides=2, padding=1),
    "3x3-dil2-asym": dict(kernel_size=(3, 3), padding=((1, 2), (0, 1)), kernel_dilation=2),
    "3x3-groups3": dict(kernel_size=(3, 3), padding="SAME", feature_group_count=3),
    "3x3-depthwise-circular": dict(kernel_size=(3, 3), padding="CIRCULAR",
                                   feature_group_count=C),
    "5x3-s21-reflect-nobias": dict(kernel_size=(5, 3), strides=(2, 1), padding="REFLECT",
                                   use_bias=False),
}
# Each geometry runs with a different activation, so the ConvBNAct tests cover both.
GEOMETRY_ACTIVATION = {name: ACTIVATIONS[i % len(ACTIVATIONS)]
                       for i, name in enumerate(GEOMETRIES)}
DTYPES = ["float32", "bfloat16"]


def _conv_bn_cases(train_fp32: list[str], train_bf16: list[str]) -> list[Any]:
    """Every geometry in fp32 and bf16 at inference (the fused path), two in fp16; training
    runs flax's own layers, so a few geometries suffice there."""
    cases = [(g, dt, "eval") for g in GEOMETRIES for dt in DTYPES]
    cases += [(g, "float16", "eval") for g in ("3x3-s2-pad1", "3x3-groups3")]
    cases += [(g, "float32", "train") for g in train_fp32]
    cases += [(g, "bfloat16", "train") for g in train_bf16]
    return [pytest.param(*case, id="-".join(case)) for case in cases]


LINEN_CONV_BN_CASES = _conv_bn_cases(list(GEOMETRIES), ["3x3-s2-pad1", "3x3-depthwise-circular"])
NNX_CONV_BN_CASES = _conv_bn_cases(["1x1-s2-valid", "3x3-dil2-asym", "3x3-groups3"],
                                   ["5x3-s21-reflect-nobias"])


# ----- helpers ----------------------------------------------------------------------------------
def _tolerance(dtype: Any) -> float:
    # fp32 layers run with precision="highest" (exact fp32 on any device).
    name = jnp.dtype(dtype).name
    return Case(dtype=name, precision="highest" if name == "float32" else None).tolerance(DEVICE)


def _precision(dtype: str) -> Any:
    return jax.lax.Precision.HIGHEST if dtype == "float32" else None


def _flat(tree: Any) -> dict[str, Any]:
    """{'a/b': leaf} with path keys as plain names (linen dicts and nnx states alike)."""
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        names = [str(getattr(k, "key", getattr(k, "name", k))) for k in path]
        out["/".join(n for n in names if n != "value")] = leaf
    return out


def _assert_close(got: Any, want: Any, dtype: Any, what: str) -> None:
    got, want = _flat(got), _flat(want)
    assert got.keys() == want.keys(), f"{what}: {sorted(got)} != {sorted(want)}"
    tol = _tolerance(dtype)
    for key in got:
        ref = np.asarray(jnp.asarray(want[key], jnp.float32), np.float64)
        err = relative_error(got[key], ref)
        assert err <= tol, f"{what} {key}: relative error {err:.3g} > {tol:.3g}"


def _without_conv_bias(grads: Any, dtype: Any) -> dict[str, Any]:
    """The gradients less the conv bias's, after checking it is ~0 as it must be: batch norm in
    training mode removes any per-channel constant, so only rounding noise is left there."""
    flat = _flat(grads)
    for key in [k for k in flat if k.endswith("conv/bias")]:
        noise = np.linalg.norm(np.asarray(flat.pop(key), np.float32))
        scale = np.linalg.norm(np.asarray(flat[key.replace("conv/bias", "bn/bias")], np.float32))
        assert noise <= 10 * _tolerance(dtype) * scale, f"{key}: gradient {noise} is not ~0"
    return flat


def _random_like(name: str, leaf: jax.Array, rng: np.random.Generator) -> jax.Array:
    """Random variables with realistic ranges (never the init's zeros and ones)."""
    shape = leaf.shape
    if name == "kernel":
        value = rng.standard_normal(shape) / np.sqrt(np.prod(shape[:-1]))
    elif name in ("scale", "var"):
        value = rng.uniform(0.5, 1.5 if name == "scale" else 2.0, shape)
    elif name == "mean":
        value = 0.3 * rng.standard_normal(shape)
    else:
        value = 0.5 * rng.standard_normal(shape)
    return jnp.asarray(value, leaf.dtype)


def _randomized(tree: Any, seed: int = 0) -> Any:
    rng = np.random.default_rng(seed)

    def fill(path: Any, leaf: jax.Array) -> jax.Array:
        names = [getattr(k, "key", None) for k in path]
        return _random_like(next(n for n in reversed(names) if n is not None), leaf, rng)

    return jax.tree_util.tree_map_with_path(fill, tree)


def _init(model: nn.Module, x: jax.Array, seed: int = 0, **kwargs: Any) -> Any:
    """model.init under jit (eager init compiles every op separately, slowly)."""
    return jax.jit(functools.partial(model.init, **kwargs))(jax.random.key(seed), x)


def _variables(model: nn.Module, x: jax.Array, seed: int = 0, **kwargs: Any) -> Any:
    """Random variables in the layout model.init gives (without running the initializers)."""
    shapes = jax.eval_shape(functools.partial(model.init, **kwargs), jax.random.key(0), x)
    return _randomized(shapes, seed)


def _layout(tree: Any) -> Any:
    return jax.tree.map(lambda a: (a.shape, jnp.dtype(a.dtype)), tree)


def _apply(model: nn.Module, variables: Any, x: jax.Array, **kwargs: Any) -> Any:
    return jax.jit(functools.partial(model.apply, **kwargs))(variables, x)


def _input(shape: tuple[int, ...], dtype: Any, seed: int = 1) -> jax.Array:
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), dtype)


# ----- linen ------------------------------------------------------------------------------------
class LinenConvBN(nn.Module):
    """The unfused composition: nn.Conv named conv, nn.BatchNorm named bn, an activation."""

    conv: Any
    bn: Any
    act: Any

    @nn.compact
    def __call__(self, x: jax.Array, use_running_average: bool) -> jax.Array:
        y = nn.Conv(name="conv", **self.conv)(x)
        return self.act(nn.BatchNorm(name="bn", **self.bn)(y, use_running_average))


def _linen_layers(geometry: dict, activation: Any, reference_act: Any, dtype: str,
                  param_dtype: Any = jnp.float32) -> tuple[nn.Module, nn.Module]:
    common = dict(dtype=jnp.dtype(dtype), param_dtype=param_dtype)
    conv = dict(features=K, precision=_precision(dtype), **geometry, **common)
    bn = dict(momentum=0.9, epsilon=1e-3, **common)
    fused = fl.ConvBNAct(**conv, momentum=0.9, epsilon=1e-3, activation=activation)
    return fused, LinenConvBN(conv, bn, reference_act)


def _linen_run(model: nn.Module, variables: dict, x: jax.Array, ct: jax.Array,
               use_running_average: bool) -> tuple[Any, Any, Any]:
    """Output, updated batch stats, and gradients of <output, ct> w.r.t. params and x."""

    def loss(params: Any, x: jax.Array) -> tuple[jax.Array, Any]:
        v = {"params": params, "batch_stats": variables["batch_stats"]}
        y, updates = model.apply(v, x, use_running_average=use_running_average,
                                 mutable=["batch_stats"])
        return jnp.sum(y.astype(jnp.float32) * ct), (y, updates["batch_stats"])

    grad = jax.jit(jax.grad(loss, argnums=(0, 1), has_aux=True))
    grads, (y, stats) = grad(variables["params"], x)
    return y, stats, grads


def _linen_forward(model: nn.Module, variables: dict, x: jax.Array,
                   use_running_average: bool) -> tuple[jax.Array, Any]:
    run = jax.jit(lambda v, x: model.apply(v, x, use_running_average=use_running_average,
                                           mutable=["batch_stats"]))
    y, updates = run(variables, x)
    return y, updates["batch_stats"]


@pytest.mark.parametrize("geometry,dtype,mode", LINEN_CONV_BN_CASES)
def test_linen_conv_bn_act(geometry: str, dtype: str, mode: str) -> None:
    activation, reference_act = GEOMETRY_ACTIVATION[geometry]
    fused, reference = _linen_layers(GEOMETRIES[geometry], activation, reference_act, dtype)
    x = _input((N, H, W, C), dtype)
    variables = _variables(fused, x, use_running_average=True)
    # The unfused composition's names, shapes and dtypes (values: test_init_matches_flax).
    assert _layout(variables) == _layout(_variables(reference, x, use_running_average=True))
    ura = mode == "eval"

    y, stats = _linen_forward(fused, variables, x, ura)
    y_ref, stats_ref = _linen_forward(reference, variables, x, ura)
    assert y.shape == y_ref.shape and y.dtype == y_ref.dtype
    _assert_close(y, y_ref, dtype, "output")
    _assert_close(stats, stats_ref, dtype, "batch_stats")
    if mode == "train":  # inference-mode gradients: test_eval_gradients
        ct = _input(y.shape, jnp.float32, seed=2)
        _, _, grads = _linen_run(fused, variables, x, ct, False)
        _, _, grads_ref = _linen_run(reference, variables, x, ct, False)
        _assert_close(_without_conv_bias(grads, dtype), _without_conv_bias(grads_ref, dtype),
                      dtype, "gradient")


def test_linen_conv_bn_act_inference_is_one_fused_op() -> None:
    fused, _ = _linen_layers(GEOMETRIES["3x3-same"], "relu", jax.nn.relu, "float32")
    x = _input((N, H, W, C), jnp.float32)
    variables = _variables(fused, x, use_running_average=True)
    jaxpr = jax.make_jaxpr(lambda v, x: fused.apply(v, x, use_running_average=True))(
        variables, x)
    assert count_fused_calls(jaxpr) == 1
    assert "conv_general_dilated" not in [eqn.primitive.name for eqn in jaxpr.eqns]


def test_init_matches_flax() -> None:
    """The same key initializes the same values as the unfused flax layers (linen and NNX)."""
    x = _input((N, H, W, C), jnp.float32)
    fused, reference = _linen_layers(GEOMETRIES["3x3-groups3"], "relu", jax.nn.relu, "float32")

    @jax.jit
    def init(key: jax.Array) -> Any:  # one compilation for all four
        return (fused.init(key, x, use_running_average=True),
                reference.init(key, x, use_running_average=True),
                fl.ConvAct(K, (3, 3)).init(key, x), nn.Conv(K, (3, 3)).init(key, x))

    got, want, got_conv, want_conv = init(jax.random.key(0))
    _assert_close(got, want, jnp.float32, "ConvBNAct init")
    _assert_close(got_conv, want_conv, jnp.float32, "ConvAct init")
    fused, reference = _nnx_layers(GEOMETRIES["3x3-groups3"], "relu", jax.nn.relu, "float32")
    _assert_close(nnx.state(fused), nnx.state(reference), jnp.float32, "nnx ConvBNAct init")


@pytest.mark.parametrize("geometry", ["3x3-s2-pad1", "3x3-groups3", "5x3-s21-reflect-nobias"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_linen_conv_act(geometry: str, dtype: str) -> None:
    activation, reference_act = GEOMETRY_ACTIVATION[geometry]
    kwargs = dict(features=K, precision=_precision(dtype), dtype=jnp.dtype(dtype),
                  **GEOMETRIES[geometry])
    x = _input((N, H, W, C), dtype)
    variables = _variables(fl.ConvAct(**kwargs, activation=activation), x)
    y = jax.jit(fl.ConvAct(**kwargs, activation=activation).apply)(variables, x)
    y_ref = reference_act(_apply(nn.Conv(**kwargs), variables, x))
    _assert_close(y, y_ref, dtype, "output")


BN_SHAPES = {"nhwc": ((N, 5, 7, C), -1), "nchw": ((N, C, 5, 7), 1), "nc": ((8, C), -1),
             "nthwc": ((N, 3, 4, 5, C), -1)}


@pytest.mark.parametrize("mode", ["eval", "train"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", list(BN_SHAPES))
def test_linen_bn_act(shape: str, dtype: str, mode: str) -> None:
    x_shape, axis = BN_SHAPES[shape]
    activation, reference_act = ACTIVATIONS[list(BN_SHAPES).index(shape) + 3]
    kwargs = dict(axis=axis, momentum=0.8, epsilon=1e-4, dtype=jnp.dtype(dtype))
    fused = fl.BNAct(**kwargs, activation=activation)
    reference = nn.Sequential([nn.BatchNorm(**kwargs), reference_act])
    x = _input(x_shape, dtype)
    variables = _variables(fused, x, use_running_average=True)
    ura = mode == "eval"
    y, stats = _linen_forward(fused, variables, x, ura)
    # nn.Sequential nests the batch norm's variables under layers_0.
    nest = {c: {"layers_0": v} for c, v in variables.items()}
    y_ref, stats_ref = _linen_forward(reference, nest, x, ura)
    assert y.dtype == y_ref.dtype
    _assert_close(y, y_ref, dtype, "output")
    _assert_close(stats, stats_ref["layers_0"], dtype, "batch_stats")


@pytest.mark.parametrize("activation,reference_act", ACTIVATIONS, ids=ACT_IDS)
def test_every_activation_fuses_like_its_function(activation: Any, reference_act: Any) -> None:
    layer = fl.BNAct(activation=activation)
    x = _input((N, 4, 4, C), jnp.float32)
    variables = _variables(layer, x, use_running_average=True)
    y = _apply(layer, variables, x, use_running_average=True)
    y_ref = reference_act(_apply(nn.BatchNorm(), variables, x, use_running_average=True))
    _assert_close(y, y_ref, jnp.float32, "output")


# ----- NNX --------------------------------------------------------------------------------------
class NnxConvBN(nnx.Module):
    """The unfused composition: nnx.Conv at conv, nnx.BatchNorm at bn, an activation."""

    def __init__(self, conv: dict, bn: dict, act: Any, *, rngs: nnx.Rngs):
        self.conv = nnx.Conv(C, K, rngs=rngs, **conv)
        self.bn = nnx.BatchNorm(K, rngs=rngs, **bn)
        self.act = act

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.act(self.bn(self.conv(x)))


def _nnx_layers(geometry: dict, activation: Any, reference_act: Any, dtype: str,
                param_dtype: Any = jnp.float32) -> tuple[nnx.Module, nnx.Module]:
    common = dict(dtype=jnp.dtype(dtype), param_dtype=param_dtype)
    conv = dict(precision=_precision(dtype), **geometry, **common)
    bn = dict(momentum=0.9, epsilon=1e-3, **common)
    fused = fx.ConvBNAct(C, K, **conv, momentum=0.9, epsilon=1e-3, activation=activation,
                         rngs=nnx.Rngs(0))
    reference = NnxConvBN(conv, bn, reference_act, rngs=nnx.Rngs(0))
    return fused, reference


def _nnx_grads(model: nnx.Module, x: jax.Array, ct: jax.Array) -> Any:
    def loss(model: nnx.Module, x: jax.Array) -> jax.Array:
        return jnp.sum(model(x).astype(jnp.float32) * ct)

    return nnx.grad(loss, argnums=(0, 1))(model, x)


@pytest.mark.parametrize("geometry,dtype,mode", NNX_CONV_BN_CASES)
def test_nnx_conv_bn_act(geometry: str, dtype: str, mode: str) -> None:
    activation, reference_act = GEOMETRY_ACTIVATION[geometry]
    fused, reference = _nnx_layers(GEOMETRIES[geometry], activation, reference_act, dtype)
    assert _layout(nnx.state(fused)) == _layout(nnx.state(reference))
    state = _randomized(nnx.state(reference))
    nnx.update(fused, state)
    nnx.update(reference, state)
    if mode == "eval":
        fused.eval()
        reference.eval()
    x = _input((N, H, W, C), dtype)
    y, y_ref = fused(x), reference(x)
    assert y.shape == y_ref.shape and y.dtype == y_ref.dtype
    _assert_close(y, y_ref, dtype, "output")
    _assert_close(nnx.state(fused, nnx.BatchStat), nnx.state(reference, nnx.BatchStat), dtype,
                  "batch stats")
    if mode == "train":
        ct = _input(y.shape, jnp.float32, seed=2)
        grads = _without_conv_bias(_nnx_grads(fused, x, ct), dtype)
        _assert_close(grads, _without_conv_bias(_nnx_grads(reference, x, ct), dtype), dtype,
                      "gradient")


def test_nnx_inference_modes() -> None:
    """model.eval(), nnx.view and the call argument all select the fused kernel."""
    fused, _ = _nnx_layers(GEOMETRIES["3x3-same"], "relu", jax.nn.relu, "float32")
    x = _input((N, H, W, C), jnp.float32)

    def is_fused(call: Any) -> bool:
        graphdef, state = nnx.split(fused)  # trace a pure function of the state
        jaxpr = jax.make_jaxpr(lambda state, x: call(nnx.merge(graphdef, state), x))(state, x)
        return count_fused_calls(jaxpr) > 0

    assert not is_fused(lambda m, x: m(x))
    assert is_fused(lambda m, x: m(x, use_running_average=True))
    if hasattr(nnx, "view"):
        assert is_fused(lambda m, x: nnx.view(m, use_running_average=True)(x))
    fused.eval()
    assert is_fused(lambda m, x: m(x))
    fused.train()
    assert not is_fused(lambda m, x: m(x))


@pytest.mark.parametrize("dtype", DTYPES)
def test_nnx_conv_act_and_bn_act(dtype: str) -> None:
    geometry = GEOMETRIES["3x3-dil2-asym"]
    conv = fx.ConvAct(C, K, **geometry, precision=_precision(dtype), dtype=jnp.dtype(dtype),
                      activation=jax.nn.elu, rngs=nnx.Rngs(0))
    conv_ref = nnx.Conv(C, K, **geometry, precision=_precision(dtype), dtype=jnp.dtype(dtype),
                        rngs=nnx.Rngs(0))
    nnx.update(conv_ref, _randomized(nnx.state(conv_ref)))
    nnx.update(conv, nnx.state(conv_ref))
    x = _input((N, H, W, C), dtype)
    _assert_close(conv(x), jax.nn.elu(conv_ref(x)), dtype, "ConvAct output")

    for mode in ("eval", "train"):
        bn = fx.BNAct(C, axis=1, dtype=jnp.dtype(dtype), activation="tanh", rngs=nnx.Rngs(0))
        bn_ref = nnx.BatchNorm(C, axis=1, dtype=jnp.dtype(dtype), rngs=nnx.Rngs(0))
        nnx.update(bn_ref, _randomized(nnx.state(bn_ref)))
        nnx.update(bn, nnx.state(bn_ref))
        if mode == "eval":
            bn.eval()
            bn_ref.eval()
        x = _input((N, C, 5, 7), dtype)
        y, y_ref = bn(x), jnp.tanh(bn_ref(x))
        assert y.dtype == y_ref.dtype
        _assert_close(y, y_ref, dtype, f"BNAct {mode} output")
        _assert_close(nnx.state(bn, nnx.BatchStat), nnx.state(bn_ref, nnx.BatchStat), dtype,
                      f"BNAct {mode} batch stats")


# ----- gradients through the fused op (inference mode) -----------------------------------------
def test_eval_gradients_linen_conv_bn_act() -> None:
    fused, reference = _linen_layers(GEOMETRIES["3x3-s2-pad1"], "elu", jax.nn.elu, "float32")
    x = _input((N, H, W, C), jnp.float32)
    variables = _variables(fused, x, use_running_average=True)
    ct = _input((N, 5, 5, K), jnp.float32, seed=2)
    _, _, grads = _linen_run(fused, variables, x, ct, True)
    _, _, grads_ref = _linen_run(reference, variables, x, ct, True)
    _assert_close(grads, grads_ref, jnp.float32, "gradient")


def test_eval_gradients_nnx_conv_bn_act() -> None:
    fused, reference = _nnx_layers(GEOMETRIES["3x3-groups3"], "relu", jax.nn.relu, "float32")
    state = _randomized(nnx.state(reference))
    nnx.update(fused, state)
    nnx.update(reference, state)
    fused.eval()
    reference.eval()
    x = _input((N, H, W, C), jnp.float32)
    ct = _input((N, H, W, K), jnp.float32, seed=2)
    _assert_close(_nnx_grads(fused, x, ct), _nnx_grads(reference, x, ct), jnp.float32,
                  "gradient")


def test_eval_gradients_conv_act_and_bn_act() -> None:
    x = _input((N, H, W, C), jnp.float32)
    ct = _input((N, H, W, K), jnp.float32, seed=2)
    kwargs = dict(features=K, kernel_size=(3, 3), precision=_precision("float32"))
    variables = _variables(fl.ConvAct(**kwargs), x)

    def conv_loss(model: nn.Module, act: Any) -> Any:
        return jax.grad(lambda p, x: jnp.sum(act(model.apply({"params": p}, x)) * ct),
                        argnums=(0, 1))(variables["params"], x)

    _assert_close(conv_loss(fl.ConvAct(**kwargs), lambda y: y),
                  conv_loss(nn.Conv(**kwargs), jax.nn.relu), jnp.float32, "ConvAct gradient")
    bn_vars = _variables(nn.BatchNorm(), x, use_running_average=True)
    ct = _input(x.shape, jnp.float32, seed=3)

    def bn_loss(model: nn.Module, act: Any) -> Any:
        def loss(p: Any, x: jax.Array) -> jax.Array:
            v = {"params": p, "batch_stats": bn_vars["batch_stats"]}
            return jnp.sum(act(model.apply(v, x, use_running_average=True)) * ct)
        return jax.grad(loss, argnums=(0, 1))(bn_vars["params"], x)

    _assert_close(bn_loss(fl.BNAct(), lambda y: y), bn_loss(nn.BatchNorm(), jax.nn.relu),
                  jnp.float32, "BNAct gradient")


# ----- checkpoints ------------------------------------------------------------------------------
class UnfusedNet(nn.Module):
    """A typical unfused model: auto-named Conv_0/BatchNorm_0 siblings, then a head."""

    @nn.compact
    def __call__(self, x: jax.Array, train: bool) -> jax.Array:
        x = nn.Conv(8, (3, 3), strides=2, use_bias=False)(x)
        x = nn.relu(nn.BatchNorm(use_running_average=not train)(x))
        x = nn.Conv(8, (3, 3))(x)
        x = nn.relu(nn.BatchNorm(use_running_average=not train)(x))
        return nn.Dense(3)(x.mean(axis=(1, 2)))


class FusedNet(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array, train: bool) -> jax.Array:
        x = fl.ConvBNAct(8, (3, 3), strides=2, use_bias=False,
                         use_running_average=not train, name="block1")(x)
        x = fl.ConvBNAct(8, (3, 3), use_running_average=not train, name="block2")(x)
        return nn.Dense(3, name="Dense_0")(x.mean(axis=(1, 2)))


def test_linen_checkpoint_converts_both_ways() -> None:
    x = _input((N, H, W, C), jnp.float32)
    unfused = _variables(UnfusedNet(), x, train=False)
    pairs = {"block1": ("Conv_0", "BatchNorm_0"), "block2": ("Conv_1", "BatchNorm_1")}
    fused = fl.fuse_conv_bn_variables(unfused, pairs)
    template = _variables(FusedNet(), x, 1, train=False)
    assert jax.tree.structure(fused) == jax.tree.structure(jax.tree.map(lambda a: a, template))
    y = _apply(FusedNet(), fused, x, train=False)
    _assert_close(y, _apply(UnfusedNet(), unfused, x, train=False), jnp.float32, "output")

    # One pair at a time, and back.
    block = fl.conv_bn_variables(unfused, conv="Conv_1", bn="BatchNorm_1")
    assert block["params"]["conv"]["kernel"] is unfused["params"]["Conv_1"]["kernel"]
    back = fl.split_conv_bn_variables(block, conv="Conv_1", bn="BatchNorm_1")
    assert _flat(back).keys() == {k for k in _flat(unfused) if "_1/" in k}
    with pytest.raises(KeyError, match="Conv_7"):
        fl.conv_bn_variables(unfused, conv="Conv_7", bn="BatchNorm_0")
    with pytest.raises(KeyError, match=r"not an nn\.Conv"):
        fl.conv_bn_variables(unfused, conv="BatchNorm_0", bn="BatchNorm_1")


def test_linen_serialized_checkpoint_loads_without_conversion() -> None:
    """Bytes saved from the unfused conv/bn composition restore into ConvBNAct, and back."""
    fused, reference = _linen_layers(GEOMETRIES["3x3-same"], "relu", jax.nn.relu, "float32")
    x = _input((N, H, W, C), jnp.float32)
    saved = _variables(reference, x, 3, use_running_average=True)
    template = _variables(fused, x, 4, use_running_average=True)
    restored = flax.serialization.from_bytes(template, flax.serialization.to_bytes(saved))
    y = _apply(fused, restored, x, use_running_average=True)
    _assert_close(y, _apply(reference, saved, x, use_running_average=True), jnp.float32,
                  "output")
    again = flax.serialization.from_bytes(saved, flax.serialization.to_bytes(restored))
    _assert_close(again, saved, jnp.float32, "round trip")


def test_nnx_state_moves_both_ways_and_from_layers() -> None:
    fused, reference = _nnx_layers(GEOMETRIES["3x3-s2-pad1"], "relu", jax.nn.relu, "float32")
    nnx.update(reference, _randomized(nnx.state(reference)))
    nnx.update(fused, nnx.state(reference))          # unfused -> fused
    fused.eval()
    reference.eval()
    x = _input((N, H, W, C), jnp.float32)
    _assert_close(fused(x), reference(x), jnp.float32, "output")
    other = NnxConvBN(dict(kernel_size=(3, 3), strides=2, padding=1),
                      dict(momentum=0.9, epsilon=1e-3), jax.nn.relu, rngs=nnx.Rngs(5))
    nnx.update(other, nnx.state(fused))              # fused -> unfused
    other.eval()
    _assert_close(other(x), reference(x), jnp.float32, "output")

    # Differently named layers: wrap them.
    wrapped = fx.ConvBNAct.from_layers(reference.conv, reference.bn, activation=jax.nn.relu)
    _assert_close(wrapped(x), reference(x), jnp.float32, "output")
    assert wrapped.conv is reference.conv


# ----- training with optax ----------------------------------------------------------------------
def test_linen_trains_with_optax_like_flax() -> None:
    x = _input((N, H, W, C), jnp.float32)
    labels = jnp.arange(N) % 3
    unfused = _variables(UnfusedNet(), x, train=False)
    fused = fl.fuse_conv_bn_variables(
        unfused, {"block1": ("Conv_0", "BatchNorm_0"), "block2": ("Conv_1", "BatchNorm_1")})
    tx = optax.adam(1e-2)

    def train(model: nn.Module, variables: dict) -> tuple[dict, list[float]]:
        @jax.jit
        def step(params: Any, stats: Any, opt_state: Any) -> Any:
            def loss(params: Any) -> Any:
                logits, upd = model.apply({"params": params, "batch_stats": stats}, x, True,
                                          mutable=["batch_stats"])
                ce = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
                return ce, upd["batch_stats"]
            (value, stats), grads = jax.value_and_grad(loss, has_aux=True)(params)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), stats, opt_state, value

        params, stats = variables["params"], variables["batch_stats"]
        opt_state, losses = tx.init(params), []
        for _ in range(3):
            params, stats, opt_state, value = step(params, stats, opt_state)
            losses.append(float(value))
        return {"params": params, "batch_stats": stats}, losses

    trained, losses = train(FusedNet(), fused)
    assert losses[-1] < losses[0]
    # The same steps on the unfused model, starting from the same variables.
    trained_ref, losses_ref = train(UnfusedNet(), unfused)
    np.testing.assert_allclose(losses, losses_ref, rtol=1e-5)
    y = _apply(FusedNet(), trained, x, train=False)
    y_ref = _apply(UnfusedNet(), trained_ref, x, train=False)
    _assert_close(y, y_ref, jnp.float32, "output after training")


# ----- shapes, dtypes, errors -------------------------------------------------------------------
def test_batch_dimensions_like_flax() -> None:
    layer = fl.ConvBNAct(K, (3, 3), strides=2, precision=_precision("float32"))
    reference = LinenConvBN(dict(features=K, kernel_size=(3, 3), strides=2,
                                 precision=_precision("float32")), {}, jax.nn.relu)
    for shape in ((H, W, C), (2, 3, H, W, C)):
        x = _input(shape, jnp.float32)
        variables = _variables(layer, x, use_running_average=True)
        y = _apply(layer, variables, x, use_running_average=True)
        _assert_close(y, _apply(reference, variables, x, use_running_average=True),
                      jnp.float32, f"{shape}")
    conv = fx.ConvAct(C, K, (1, 1), rngs=nnx.Rngs(0))
    assert conv(_input((H, W, C), jnp.float32)).shape == (H, W, K)


def test_without_scale_and_biases() -> None:
    geometry = dict(GEOMETRIES["3x3-same"], use_bias=False)
    fused, _ = _linen_layers(geometry, "relu", jax.nn.relu, "float32")
    fused = fused.clone(use_scale=False, bn_use_bias=False)
    reference = LinenConvBN(dict(features=K, precision=_precision("float32"), **geometry),
                            dict(momentum=0.9, epsilon=1e-3, use_scale=False, use_bias=False),
                            jax.nn.relu)
    x = _input((N, H, W, C), jnp.float32)
    variables = _variables(fused, x, use_running_average=True)
    assert _layout(variables) == _layout(_variables(reference, x, use_running_average=True))
    assert "bn" not in variables["params"] and "bias" not in variables["params"]["conv"]
    y, _ = _linen_forward(fused, variables, x, True)
    _assert_close(y, _linen_forward(reference, variables, x, True)[0], jnp.float32, "ConvBNAct")
    bn = fx.BNAct(C, use_scale=False, use_bias=False, activation=None, rngs=nnx.Rngs(0))
    bn_ref = nnx.BatchNorm(C, use_scale=False, use_bias=False, rngs=nnx.Rngs(0))
    nnx.update(bn_ref, _randomized(nnx.state(bn_ref)))
    nnx.update(bn, nnx.state(bn_ref))
    _assert_close(bn(x, use_running_average=True), bn_ref(x, use_running_average=True),
                  jnp.float32, "BNAct")


def test_axis_name_averages_statistics_across_devices() -> None:
    """Training with axis_name under a mapped axis: flax's cross-device mean of the stats."""
    x = _input((4, 2, H, W, C), jnp.float32)  # 4 "devices" with 2 examples each
    fused, reference = _linen_layers(GEOMETRIES["3x3-s2-pad1"], "relu", jax.nn.relu, "float32")
    fused = fused.clone(axis_name="devices")
    variables = _variables(fused, x[0], use_running_average=True)

    def stats(model: nn.Module, x: jax.Array, **kwargs: Any) -> Any:
        _, updates = model.apply(variables, x, mutable=["batch_stats"], **kwargs)
        return updates["batch_stats"]

    mapped = jax.jit(jax.vmap(functools.partial(stats, fused, use_running_average=False),
                              axis_name="devices"))(x)
    whole = stats(reference, x.reshape(8, H, W, C), use_running_average=False)
    # Every device holds the statistics of the whole batch.
    _assert_close(jax.tree.map(lambda a: a[0], mapped), whole, jnp.float32, "batch_stats")
    _assert_close(jax.tree.map(lambda a: a[3], mapped), whole, jnp.float32, "batch_stats")


@pytest.mark.parametrize("dtype,param_dtype", [("bfloat16", "bfloat16"), (None, "bfloat16"),
                                               (None, "float32")])
def test_dtype_promotion_like_flax(dtype: str | None, param_dtype: str) -> None:
    """bf16 inputs; the computation and result dtypes follow each framework's rule (NNX's
    batch norm also promotes with its float32 statistics)."""
    x = _input((N, H, W, C), jnp.bfloat16)
    kwargs = dict(dtype=dtype, param_dtype=param_dtype)
    fused = fl.ConvBNAct(K, (3, 3), **kwargs)
    reference = LinenConvBN(dict(features=K, kernel_size=(3, 3), **kwargs), kwargs, jax.nn.relu)
    variables = _variables(fused, x, use_running_average=True)
    y, _ = _linen_forward(fused, variables, x, True)
    y_ref, _ = _linen_forward(reference, variables, x, True)
    assert y.dtype == y_ref.dtype
    _assert_close(y, y_ref, jnp.bfloat16, "linen output")

    fused = fx.ConvBNAct(C, K, (3, 3), **kwargs, rngs=nnx.Rngs(0))
    reference = NnxConvBN(dict(kernel_size=(3, 3), **kwargs), kwargs, jax.nn.relu,
                          rngs=nnx.Rngs(0))
    nnx.update(reference, _randomized(nnx.state(reference)))
    nnx.update(fused, nnx.state(reference))
    y, y_ref = fused(x, use_running_average=True), reference.act(
        reference.bn(reference.conv(x), use_running_average=True))
    assert y.dtype == y_ref.dtype
    _assert_close(y, y_ref, jnp.bfloat16, "nnx output")


def test_import_jaxfuse_does_not_import_flax() -> None:
    code = "import sys, jaxfuse; assert 'flax' not in sys.modules; import jaxfuse.flax; " \
           "assert 'flax' in sys.modules"
    subprocess.run([sys.executable, "-P", "-c", code], check=True)


@pytest.mark.parametrize("spec,mode,alpha", [
    ("relu", ActivationMode.RELU, None),
    (jax.nn.relu6, ActivationMode.CLIPPED_RELU, 6.0),
    (jax.nn.leaky_relu, ActivationMode.LEAKY_RELU, 0.01),
    (functools.partial(jax.nn.leaky_relu, negative_slope=0.3), ActivationMode.LEAKY_RELU, 0.3),
    (functools.partial(jax.nn.elu, alpha=2.0), ActivationMode.ELU, 2.0),
    (nn.sigmoid, ActivationMode.LOGISTIC, None),
    (nnx.tanh, ActivationMode.TANH, None),
    (jax.nn.softplus, ActivationMode.SOFTRELU, None),
    (jnp.abs, ActivationMode.ABS, None),
    ("clipped_relu", ActivationMode.CLIPPED_RELU, None),
    (jax.nn.silu, ActivationMode.SILU, None),
    (nn.swish, ActivationMode.SILU, None),
    ("swish", ActivationMode.SILU, None),
    (jax.nn.gelu, ActivationMode.GELU_TANH, None),  # jax.nn.gelu's default: approximate=True
    (functools.partial(nnx.gelu, approximate=True), ActivationMode.GELU_TANH, None),
    (functools.partial(jax.nn.gelu, approximate=False), ActivationMode.GELU, None),
    (jax.nn.hard_swish, ActivationMode.HARDSWISH, None),
    (nnx.hard_silu, ActivationMode.HARDSWISH, None),
    (jax.nn.hard_sigmoid, ActivationMode.HARDSIGMOID, None),
    (jax.nn.mish, ActivationMode.MISH, None),
])
def test_activation_mapping(spec: Any, mode: ActivationMode, alpha: float | None) -> None:
    resolved = resolve_activation(spec)
    assert (resolved.mode, resolved.alpha) == (mode, alpha)


def test_activation_errors() -> None:
    with pytest.raises(ValueError, match="no fused equivalent"):
        resolve_activation(jax.nn.selu)
    with pytest.raises(ValueError, match="approximate"):
        resolve_activation(functools.partial(jax.nn.elu, approximate=True))
    with pytest.raises(ValueError, match="must be True or False"):
        resolve_activation(functools.partial(jax.nn.gelu, approximate="tanh"))
    with pytest.raises(ValueError, match="only approximate picks a mode"):
        resolve_activation(functools.partial(jax.nn.gelu, beta=2.0))
    with pytest.raises(ValueError, match="positional"):
        resolve_activation(functools.partial(jax.nn.gelu, False))
    with pytest.raises(ValueError, match="unknown activation mode"):
        resolve_activation("selu")
    with pytest.raises(TypeError, match="activation"):
        resolve_activation(3)
    x = _input((N, H, W, C), jnp.float32)
    with pytest.raises(ValueError, match="no fused equivalent"):
        fl.ConvAct(K, (3, 3), activation=jax.nn.celu).init(jax.random.key(0), x)
    with pytest.raises(ValueError, match="no fused equivalent"):
        fx.ConvBNAct(C, K, (3, 3), activation=jax.nn.squareplus, rngs=nnx.Rngs(0))


# jax.nn's activations beyond MIOpen's, fused into the conv layers (inference, both dtypes) and
# called as the user's function in training (the unfused path), linen and NNX.
NN_ACTIVATIONS = {"silu": jax.nn.silu, "gelu": jax.nn.gelu,
                  "gelu-exact": functools.partial(jax.nn.gelu, approximate=False),
                  "hard_swish": jax.nn.hard_swish, "hard_sigmoid": jax.nn.hard_sigmoid,
                  "mish": jax.nn.mish}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(NN_ACTIVATIONS))
def test_conv_layers_fuse_jax_nn_activations(name: str, dtype: str) -> None:
    act = NN_ACTIVATIONS[name]
    fused, reference = _linen_layers(GEOMETRIES["3x3-same"], act, act, dtype)
    x = _input((N, H, W, C), dtype)
    variables = _variables(fused, x, use_running_average=True)
    jaxpr = jax.make_jaxpr(lambda v, x: fused.apply(v, x, use_running_average=True))(
        variables, x)
    assert count_fused_calls(jaxpr) == 1
    for ura in (True, False):
        y, _ = _linen_forward(fused, variables, x, ura)
        y_ref, _ = _linen_forward(reference, variables, x, ura)
        _assert_close(y, y_ref, dtype, f"linen output (use_running_average={ura})")

    conv = fx.ConvAct(C, K, (3, 3), precision=_precision(dtype), dtype=jnp.dtype(dtype),
                      activation=act, rngs=nnx.Rngs(0))
    conv_ref = nnx.Conv(C, K, (3, 3), precision=_precision(dtype), dtype=jnp.dtype(dtype),
                        rngs=nnx.Rngs(0))
    nnx.update(conv_ref, _randomized(nnx.state(conv_ref)))
    nnx.update(conv, nnx.state(conv_ref))
    _assert_close(conv(x), act(conv_ref(x)), dtype, "nnx ConvAct output")


def test_unfusable_arguments_raise() -> None:
    x = _input((N, H, W, C), jnp.float32)
    key = jax.random.key(0)
    with pytest.raises(ValueError, match="2-D"):
        fl.ConvBNAct(K, (3,)).init(key, x[:, 0], use_running_average=True)
    with pytest.raises(ValueError, match="input_dilation"):
        fl.ConvAct(K, (3, 3), input_dilation=2).init(key, x)
    with pytest.raises(ValueError, match="padding"):
        fl.ConvBNAct(K, (3, 3), padding="CAUSAL").init(key, x, use_running_average=True)
    with pytest.raises(ValueError, match="one feature axis"):
        fl.BNAct(axis=(1, 2)).init(key, x, use_running_average=True)
    with pytest.raises(ValueError, match="mask"):
        fx.ConvAct(C, K, (3, 3), mask=jnp.ones((3, 3, C, K)), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="input_dilation"):
        fx.ConvBNAct.from_layers(nnx.Conv(C, K, (3, 3), input_dilation=2, rngs=nnx.Rngs(0)),
                                 nnx.BatchNorm(K, rngs=nnx.Rngs(0)))
    with pytest.raises(ValueError, match="use_running_average"):
        fx.ConvBNAct(C, K, (3, 3), use_running_average=None, rngs=nnx.Rngs(0))(x)
    layer = fl.ConvBNAct(K, (3, 3))
    variables = layer.init(key, x, use_running_average=True)
    del variables["batch_stats"]
    with pytest.raises(ValueError, match="batch_stats/bn/mean"):
        layer.apply(variables, x, use_running_average=True)


def test_unsupported_dtype_raises() -> None:
    with jax.enable_x64(True):
        x = _input((N, H, W, C), jnp.float64)
        layer = fl.ConvAct(K, (3, 3), dtype=jnp.float64, param_dtype=jnp.float64)
        variables = jax.eval_shape(layer.init, jax.random.key(0), x)
        with pytest.raises(TypeError, match="float64"):
            jax.eval_shape(layer.apply, variables, x)


@pytest.mark.parametrize("module", ["linen", "nnx", "variables", "_activation"])
def test_docstring_examples(module: str) -> None:
    import doctest
    import importlib

    result = doctest.testmod(importlib.import_module(f"jaxfuse.flax.{module}"))
    assert result.failed == 0 and result.attempted > 0


def test_train_then_serve_example_runs(capsys) -> None:
    import pathlib
    import runpy

    example = pathlib.Path(__file__).parent.parent / "examples" / "train_then_serve.py"
    if not example.exists():
        pytest.skip("examples/ is not next to the tests")
    namespace = runpy.run_path(str(example), run_name="__main__")
    # (The tests force the fused kernels, conftest.py: every block runs on one. In auto mode a
    # block may run as XLA's ops, and the example must pass either way.)
    blocks = len(namespace["BLOCKS"])
    assert f"served a batch with {blocks} of {blocks} blocks on fused kernels" in (
        capsys.readouterr().out)
