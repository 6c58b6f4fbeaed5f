"""Every misuse raises a clear Python exception naming the problem; nothing crashes."""

from __future__ import annotations

import copy
import pickle

import jax
import numpy as np
import pytest
from cases import Case
from jax import lax

import jaxfuse as jf


def _plan(shape=(1, 4, 8, 8), dtype="float32", layout="NCHW") -> jf.FusionPlan:
    return jf.FusionPlan(jf.TensorDesc(shape, dtype, layout))


def _conv_plan():
    plan = _plan()
    conv = plan.add_conv_forward(jf.ConvDesc(padding=1), jf.TensorDesc((6, 4, 3, 3), "float32",
                                                                       "OIHW"))
    return plan, conv


def test_error_hierarchy() -> None:
    assert issubclass(jf.FusionError, ValueError)
    assert issubclass(jf.UnsupportedFusionError, jf.FusionError)


@pytest.mark.parametrize("shape, dtype, layout, exc, match", [
    ((1, 4, 8), "float32", None, jf.UnsupportedFusionError, "4-D"),
    ((1, 4, 8, 8), "float64", "NCHW", TypeError, "float64 is not supported"),
    ((1, 4, 8, 8), "int32", "NCHW", TypeError, "int32 is not supported"),
    ((1, 4, 8, 8), "float32", "NCWH", ValueError, "layout"),
    ((2, 8, 8), "float32", "NHWC", ValueError,
     r"shape \(2, 8, 8\) has 3 dimensions; layout 'NHWC' describes 4-D tensors"),
    ((1, 4, 8, 8), "float32", "OIHW", jf.UnsupportedFusionError, "NCHW or NHWC"),
    ((1, 0, 8, 8), "float32", "NCHW", jf.FusionError, "empty"),
    ((1, -4, 8, 8), "float32", "NCHW", ValueError, "negative"),
])
def test_bad_input_descriptors(shape, dtype, layout, exc, match) -> None:
    with pytest.raises(exc, match=match):
        jf.FusionPlan(jf.TensorDesc(shape, dtype, layout))


def test_not_a_descriptor() -> None:
    with pytest.raises(TypeError, match="TensorDesc"):
        jf.FusionPlan((1, 4, 8, 8))


@pytest.mark.parametrize("kwargs, match", [
    ({"strides": 0}, "strides must be >= 1"),
    ({"dilation": (1, 0)}, "dilation"),
    ({"padding": "FULL"}, "SAME"),
    ({"padding": ((1, 2, 3), (1, 1))}, "padding"),
    ({"groups": 0}, "groups"),
    ({"strides": "2"}, "strides"),
])
def test_bad_conv_descriptors(kwargs, match) -> None:
    with pytest.raises((ValueError, TypeError), match=match):
        jf.ConvDesc(**kwargs)


@pytest.mark.parametrize("conv, wshape, wdtype, exc, match", [
    (jf.ConvDesc(), (6, 3, 3, 3), "float32", jf.FusionError, "input channels per group"),
    (jf.ConvDesc(groups=3), (6, 4, 3, 3), "float32", jf.FusionError, "groups=3 must divide"),
    (jf.ConvDesc(), (6, 4, 3, 3), "float16", TypeError, "filter dtype float16"),
    (jf.ConvDesc(), (6, 4, 9, 9), "float32", jf.FusionError, "output would be empty"),
    (jf.ConvDesc(dilation=4), (6, 4, 3, 3), "float32", jf.FusionError, "output would be empty"),
    (jf.ConvDesc(padding=-5), (6, 4, 1, 1), "float32", jf.FusionError, "empty"),
])
def test_bad_convolutions(conv, wshape, wdtype, exc, match) -> None:
    with pytest.raises(exc, match=match):
        _plan().add_conv_forward(conv, jf.TensorDesc(wshape, wdtype, "OIHW"))


def test_unsupported_orders_name_the_operator() -> None:
    plan = _plan()
    plan.add_activation_forward("relu")
    with pytest.raises(jf.UnsupportedFusionError, match="convolution after the activation"):
        plan.add_conv_forward(jf.ConvDesc(), jf.TensorDesc((4, 4, 1, 1), "float32", "OIHW"))
    with pytest.raises(jf.UnsupportedFusionError, match="already has an activation"):
        plan.add_activation_forward("tanh")
    plan2, _ = _conv_plan()
    with pytest.raises(jf.UnsupportedFusionError, match="first operator"):
        plan2.add_conv_forward(jf.ConvDesc(), jf.TensorDesc((6, 6, 1, 1), "float32", "OIHW"))


def test_bias_shape_must_match_channels() -> None:
    plan, _ = _conv_plan()
    with pytest.raises(jf.FusionError, match=r"must be \(6,\)"):
        plan.add_bias_forward(jf.TensorDesc((4,), "float32"))


def test_bad_modes() -> None:
    with pytest.raises(ValueError, match="unknown activation mode 'selu'"):
        _plan().add_activation_forward("selu")
    with pytest.raises(ValueError, match="unknown batch-norm mode"):
        _plan().add_batchnorm_inference("instance")


def test_empty_plan_does_not_compile() -> None:
    with pytest.raises(jf.UnsupportedFusionError, match="no operators"):
        _plan().compile()


def test_compile_takes_a_device_or_a_platform_name() -> None:
    plan = jf.FusionPlan(jf.TensorDesc((2, 8, 8, 4), "float32", layout="NHWC"))
    plan.add_activation_forward("relu")
    assert plan.compile("cpu").kernel_info["solver"]
    with pytest.raises(TypeError, match=r"jax\.Device .* or a platform name.*got int 0"):
        plan.compile(0)
    with pytest.raises(ValueError, match="no 'tpu' device"):
        plan.compile("tpu")


def test_execute_before_compile_and_after_change() -> None:
    plan, conv = _conv_plan()
    args = jf.OperatorArgs().set_conv_forward(conv, np.ones((6, 4, 3, 3), np.float32))
    x = np.ones((1, 4, 8, 8), np.float32)
    with pytest.raises(jf.FusionError, match="not compiled"):
        plan.execute(x, args)
    plan.compile()
    plan.execute(x, args)
    plan.add_activation_forward("relu")
    with pytest.raises(jf.FusionError, match="changed since compile"):
        plan.execute(x, args)
    plan.compile()
    assert plan.execute(x, args).shape == (1, 6, 8, 8)


def _conv_reference(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    with jax.enable_x64(True):
        return np.asarray(lax.conv_general_dilated(x.astype(np.float64), w.astype(np.float64),
                                                   (1, 1), ((1, 1), (1, 1))))


def test_a_jitted_execute_refuses_a_plan_changed_after_tracing() -> None:
    # The check in execute() runs when tracing; the plan's version in the arguments' pytree
    # structure makes the cached trace miss once the plan changed.
    plan, conv = _conv_plan()
    plan.compile()
    rng = np.random.default_rng(3)
    x = rng.standard_normal((1, 4, 8, 8)).astype(np.float32)
    w = rng.standard_normal((6, 4, 3, 3)).astype(np.float32)
    args = jf.OperatorArgs().set_conv_forward(conv, w)
    f = jax.jit(plan.execute)
    np.testing.assert_allclose(f(x, args), _conv_reference(x, w), rtol=1e-5, atol=1e-5)
    plan.add_activation_forward("relu")
    with pytest.raises(jf.FusionError, match="changed since compile"):
        f(x, args)
    plan.compile()
    np.testing.assert_allclose(f(x, args), np.maximum(_conv_reference(x, w), 0), rtol=1e-5,
                               atol=1e-5)


def test_operator_args_pytree_names_the_plan_version() -> None:
    plan, conv = _conv_plan()
    act = plan.add_activation_forward("leaky_relu")
    w = np.ones((6, 4, 3, 3), np.float32)
    args = jf.OperatorArgs().set_conv_forward(conv, w, alpha=2.0).set_activation_forward(
        act, alpha=0.3)
    leaves, tree = jax.tree_util.tree_flatten(args)
    rebuilt = jax.tree_util.tree_unflatten(tree, leaves)
    assert jax.tree_util.tree_structure(rebuilt) == tree
    assert rebuilt.entry(conv).arrays == (w,) and rebuilt.entry(act).arrays == ()
    assert dict(rebuilt.entry(act).scalars)["act_alpha"] == 0.3
    same = jf.OperatorArgs().set_conv_forward(conv, w).set_activation_forward(act)
    assert jax.tree_util.tree_structure(same) == tree
    plan.add_bias_forward(jf.TensorDesc((6,), "float32"))
    changed = jax.tree_util.tree_structure(args)
    assert changed != tree and changed.num_leaves == tree.num_leaves
    assert conv.plan_version == plan.version == 3
    del plan
    assert conv.plan_version is None  # handles do not keep their plan alive
    assert jax.tree_util.tree_structure(args) != changed


def test_operator_args_copy_and_pickle() -> None:
    # Handles hold a weak reference to their plan: copies are the handle itself, and pickles
    # (of args or of a whole plan) leave it out.
    plan, conv = _conv_plan()
    plan.compile()
    w = np.random.default_rng(4).standard_normal((6, 4, 3, 3)).astype(np.float32)
    x = np.ones((1, 4, 8, 8), np.float32)
    args = jf.OperatorArgs().set_conv_forward(conv, w)
    want = np.asarray(plan.execute(x, args))
    assert copy.copy(conv) is conv and copy.deepcopy(conv) is conv
    for other in (copy.deepcopy(args), pickle.loads(pickle.dumps(args))):
        np.testing.assert_array_equal(plan.execute(x, other), want)
    unpickled = pickle.loads(pickle.dumps(plan))
    np.testing.assert_array_equal(unpickled.execute(x, args), want)


def test_missing_and_wrong_arguments() -> None:
    plan, conv = _conv_plan()
    bias = plan.add_bias_forward(jf.TensorDesc((6,), "float32"))
    bn = plan.add_batchnorm_inference("spatial")
    plan.compile()
    x = np.ones((1, 4, 8, 8), np.float32)
    w = np.ones((6, 4, 3, 3), np.float32)
    args = jf.OperatorArgs().set_conv_forward(conv, w)
    with pytest.raises(ValueError, match="no arguments for the bias operator"):
        plan.execute(x, args)
    with pytest.raises(ValueError, match=r"w has shape \(6, 4, 2, 2\), expected \(6, 4, 3, 3\)"):
        args.set_conv_forward(conv, np.ones((6, 4, 2, 2), np.float32))
    with pytest.raises(TypeError, match="w has dtype float16, expected float32"):
        args.set_conv_forward(conv, w.astype(np.float16))
    with pytest.raises(TypeError, match="needs the BiasForwardOp"):
        args.set_bias_forward(conv, np.ones(6, np.float32))
    with pytest.raises(ValueError, match=r"beta=0\.5 is not supported"):
        args.set_conv_forward(conv, w, beta=0.5)
    with pytest.raises(ValueError, match=r"b has shape \(4,\)"):
        args.set_bias_forward(bias, np.ones(4, np.float32))
    args.set_bias_forward(bias, np.ones(6, np.float32))
    args.set_batchnorm_inference(bn, *(np.ones(5, np.float32),) * 4)
    with pytest.raises(ValueError, match=r"scale has shape \(5,\), expected \(6,\)"):
        plan.execute(x, args)
    with pytest.raises(ValueError, match="epsilon must be >= 0"):
        args.set_batchnorm_inference(bn, *(np.ones(6, np.float32),) * 4, epsilon=-1.0)
    with pytest.raises(ValueError, match="variance is missing"):
        args.set_batchnorm_inference(bn, *(np.ones(6, np.float32),) * 3, None)
    args.set_batchnorm_inference(bn, *(np.ones(6, np.float32),) * 4)
    with pytest.raises(ValueError, match=r"x has shape \(1, 4, 8, 9\)"):
        plan.execute(np.ones((1, 4, 8, 9), np.float32), args)
    with pytest.raises(TypeError, match="x has dtype float16"):
        plan.execute(x.astype(np.float16), args)
    with pytest.raises(TypeError, match="x must be an array"):
        plan.execute([[1.0]], args)
    with pytest.raises(TypeError, match="needs an OperatorArgs"):
        plan.execute(x, {"w": w})


def test_args_from_another_plan_are_rejected() -> None:
    _plan_a, conv_a = _conv_plan()
    plan_b, _ = _conv_plan()
    plan_b.compile()
    args = jf.OperatorArgs().set_conv_forward(conv_a, np.ones((6, 4, 3, 3), np.float32))
    with pytest.raises(ValueError, match="no arguments for the convolution"):
        plan_b.execute(np.ones((1, 4, 8, 8), np.float32), args)


@pytest.mark.parametrize("kind", ["C", "B", "A"])
def test_arguments_set_with_another_plans_handle_are_refused(kind: str) -> None:
    # Only a missing activation entry takes the mode's defaults; another plan's entry in its
    # place is a mistake, whatever the operator.
    x = np.random.default_rng(0).standard_normal((1, 4, 8, 8)).astype(np.float32)
    plans = []
    for _ in range(2):
        plan = _plan()
        add = {"C": lambda p: p.add_conv_forward(jf.ConvDesc(padding=1), jf.TensorDesc(
                   (4, 4, 3, 3), "float32")),
               "B": lambda p: p.add_bias_forward(jf.TensorDesc((4,), "float32")),
               "A": lambda p: p.add_activation_forward("clipped_relu")}[kind]
        plans.append((plan, add(plan)))
    (mine, _), (_, theirs) = plans
    mine.compile()
    args = jf.OperatorArgs()
    if kind == "C":
        args.set_conv_forward(theirs, np.ones((4, 4, 3, 3), np.float32))
    elif kind == "B":
        args.set_bias_forward(theirs, np.ones(4, np.float32))
    else:
        args.set_activation_forward(theirs, alpha=1.0)
    setter = {"C": "set_conv_forward", "B": "set_bias_forward",
              "A": "set_activation_forward"}[kind]
    with pytest.raises(ValueError, match=rf"no arguments for the \w+ operator \(operator 0\): "
                       rf"the arguments in its place were set with another plan's \w+ handle; "
                       rf"call args\.{setter}\(\) with this plan's handle"):
        mine.execute(x, args)


def test_a_missing_activation_entry_takes_the_modes_defaults() -> None:
    x = np.random.default_rng(1).uniform(-8, 8, (1, 4, 8, 8)).astype(np.float32)
    plan = _plan()
    plan.add_activation_forward("clipped_relu")
    plan.compile()
    np.testing.assert_array_equal(plan.execute(x, jf.OperatorArgs()), np.clip(x, 0, 6))


def test_a_traced_conv_beta_is_refused() -> None:
    # beta must be 0; under jit its value cannot be checked, so a traced beta is refused rather
    # than silently dropped.
    plan, conv = _conv_plan()
    plan.compile()
    rng = np.random.default_rng(2)
    x = rng.standard_normal((1, 4, 8, 8)).astype(np.float32)
    w = rng.standard_normal((6, 4, 3, 3)).astype(np.float32)

    def run(beta):
        return plan.execute(x, jf.OperatorArgs().set_conv_forward(conv, w, beta=beta))

    for beta in (0.5, 0.0):
        with pytest.raises(TypeError, match=r"beta is a traced value .* must be the concrete "
                                             r"number 0"):
            jax.jit(run)(np.float32(beta))
    with pytest.raises(TypeError, match="beta is a traced value"):
        jax.vmap(run)(np.zeros(2, np.float32))
    with jax.enable_x64(True):
        want = np.asarray(lax.conv_general_dilated(x.astype(np.float64), w.astype(np.float64),
                                                   (1, 1), ((1, 1), (1, 1))))
    got = jax.jit(lambda x: plan.execute(x, jf.OperatorArgs().set_conv_forward(
        conv, w, beta=0.0)))(x)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_malformed_signatures_are_rejected_by_the_extension() -> None:
    from jaxfuse._extension import extension

    ext = extension()
    good = Case().build()[0].signature.encode()
    ext.cpu_prepare(good)
    for bad in ["", "jaxfuse2;dtype=f32", good.replace("dtype=f32", "dtype=f64"),
                good.replace("ops=CBNA", "ops=BCNA"), good.replace("ops=CBNA", "ops=CBBA"),
                good + ";extra=1", good.replace("in=2,", "in=-2,"),
                good.replace("in=2,8", "in=2,99999999999999999999"),
                good.replace(",OIHW,", ",XXXX,"), good.replace("act=3", "act=42")]:
        with pytest.raises(ValueError, match="invalid jaxfuse plan"):
            ext.cpu_prepare(bad)


def test_a_missing_extension_names_the_source_folder_that_shadows_the_install(tmp_path) -> None:
    from jaxfuse._extension import _missing_hint
    (tmp_path / "pyproject.toml").write_text("")
    (tmp_path / "csrc").mkdir()
    hint = _missing_hint(tmp_path / "jaxfuse")  # run from a checkout's root: ./jaxfuse first
    assert f"imported the source folder {tmp_path / 'jaxfuse'}" in hint
    assert "run from another directory" in hint and "pip install -e ." in hint
    assert _missing_hint(tmp_path / "site-packages" / "jaxfuse") == \
        "reinstall with `pip install .` from the source tree"
