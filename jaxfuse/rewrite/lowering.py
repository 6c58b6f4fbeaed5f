"""Turns a matched group into a fusion plan and emits the one fused call that replaces it.

Each run of per-channel affine steps is folded, in float32, into the parameters of one plan
operator: pure adds into a bias; anything with a multiply into batch-norm parameters with unit
variance and zero epsilon, so ``scale * (y - mean) / sqrt(1 + 0) + shift`` is exactly the folded
``(y - mean) * scale + shift``. The kernel applies every step in float32 and rounds once, where
the unfused program may round after each step: results differ by rounding only.
"""

from __future__ import annotations

import concurrent.futures
import functools
import os
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..activations import ActivationMode
from ..args import OperatorArgs
from ..descriptors import ConvDesc, TensorDesc
from ..plan import FusionPlan
from .graph import Graph, Value
from .matcher import ConvInfo, Group, PlanOp
from .patterns import Step

__all__ = ["build_plan", "compile_each", "compile_plans", "emit", "plan_of"]

Reader = Callable[[Value], Any]


@functools.lru_cache(maxsize=1024)
def _built_plan(x_desc: TensorDesc, w_desc: TensorDesc, conv: ConvDesc, letters: str,
                activation: ActivationMode | None,
                solver: str | None) -> tuple[FusionPlan, tuple[Any, ...]]:
    del solver  # one plan object per solver mode: the program's choice may differ (choice.py)
    plan = FusionPlan(x_desc)
    handles: list[Any] = [plan.add_conv_forward(conv, w_desc)]
    channels = plan.output_desc.dim("C")
    for letter in letters:
        if letter == "B":
            handles.append(plan.add_bias_forward(TensorDesc((channels,), np.float32)))
        elif letter == "N":
            handles.append(plan.add_batchnorm_inference("spatial"))
        elif letter == "S":
            handles.append(plan.add_side_input_add())
        elif letter == "A":
            handles.append(plan.add_activation_forward(activation))
    plan.signature  # noqa: B018 - validates the whole chain (raises UnsupportedFusionError)
    return plan, tuple(handles)


def build_plan(info: ConvInfo, plan_ops: tuple[PlanOp, ...],
               solver: str | None = None) -> tuple[FusionPlan, tuple[Any, ...]]:
    """The validated plan (memoized; compiled by :func:`compile_plans`) and its operator
    handles, conv first. `solver` None: the plan compiled with the rewrite's solver mode;
    ``"fused"``: a separate plan object that forces the fused kernel."""
    letters = "".join(op.letter for op in plan_ops)
    activation = next((op.steps[0].mode for op in plan_ops if op.letter == "A"), None)
    return _built_plan(info.x_desc, info.w_desc, info.conv, letters, activation, solver)


def plan_of(group: Group, solver: str | None = None) -> FusionPlan:
    """The group's plan (as built by :func:`build_plan`)."""
    return build_plan(group.info, group.plan_ops, solver)[0]


def compile_plans(groups: list[Group], solver: str | None = None) -> None:
    """Compiles the groups' plans with solver mode `solver` (see :func:`compile_each`); raises
    the first plan's error."""
    plans = {id(p): p for p in map(plan_of, groups)}
    for error in compile_each(list(plans.values()), solver):
        if error is not None:
            raise error


def compile_each(plans: list[FusionPlan], solver: str | None = None
                 ) -> list[Exception | None]:
    """Compiles `plans` with solver mode `solver`, concurrently: on GPUs each is a
    runtime-compiler run, and a network has dozens (the extension releases the GIL while
    compiling; measurements take turns). Each plan's error, or None."""

    def compile_one(plan: FusionPlan) -> Exception | None:
        try:
            plan.compile(solver=solver)
        except Exception as err:  # handed to the caller, which decides
            return err
        return None

    if len(plans) <= 1:
        return [compile_one(plan) for plan in plans]
    with concurrent.futures.ThreadPoolExecutor(min(len(plans), os.cpu_count() or 1)) as pool:
        return list(pool.map(compile_one, plans))


def emit(group: Group, read: Reader, g: Graph, solver: str | None = None) -> jax.Array:
    """The fused call for `group`; `read` gives the current value of any operand. `solver`
    as for :func:`build_plan` (that plan compiled)."""
    info = group.info
    plan, handles = build_plan(info, group.plan_ops, solver)
    if solver is not None and not plan.is_compiled:  # evicted from the memo since the choice
        plan.compile(solver=solver)
    x = jnp.asarray(read(group.conv.inputs[0])).astype(info.dtype)
    w = jnp.asarray(read(group.filter_value))
    if info.filter_perm is not None:
        w = jnp.transpose(w, info.filter_perm)
    w = w.astype(info.w_desc.dtype)
    args = OperatorArgs().set_conv_forward(handles[0], w)
    out_desc = plan.output_desc
    channels = out_desc.dim("C")
    for op, handle in zip(group.plan_ops, handles[1:]):
        if op.letter == "B":
            pre, _, _ = _fold(op.steps, read, channels)
            args.set_bias_forward(handle, pre)
        elif op.letter == "N":
            pre, scale, post = _fold(op.steps, read, channels)
            # NumPy constants become literals of the program; jnp ones would be a kernel.
            zeros, ones = np.zeros(channels, np.float32), np.ones(channels, np.float32)
            mean = zeros if pre is None else -pre
            shift = zeros if post is None else post
            statistics = _batchnorm_statistics(op.steps, g)
            if statistics is not None:
                # The raw statistics: the kernel folds them itself, so no per-channel vector
                # is computed in a kernel of its own on every call (the folded one is dead).
                bn_scale, variance, epsilon = statistics
                bn_scale = ones if bn_scale is None else _vector(read(bn_scale), channels)
                args.set_batchnorm_inference(handle, bn_scale, shift, mean,
                                             _vector(read(variance), channels), epsilon)
            else:
                args.set_batchnorm_inference(handle, ones if scale is None else scale, shift,
                                             mean, ones, epsilon=0.0)
        elif op.letter == "S":
            step = op.steps[0]
            # (the chain's shape at this step, which a batch split may have reshaped)
            z = jnp.broadcast_to(jnp.asarray(read(step.operand.value)), step.out.shape)
            z = z.reshape(out_desc.shape)
            args.set_side_input_add(handle, z.astype(info.dtype),
                                    alpha=-1.0 if step.op == "sub" else 1.0)
        elif op.letter == "A":
            alpha, beta, gamma = (_scalar(p, read, g) for p in op.steps[0].act_params)
            args.set_activation_forward(handle, alpha, beta, gamma)
    y = plan.execute(x, args).reshape(group.out.shape)  # (as a batch split left it)
    return y if y.dtype == group.out.dtype else y.astype(group.out.dtype)


def _vector(value: Any, channels: int) -> jax.Array:
    v = jnp.asarray(value, jnp.float32).reshape(-1)
    return jnp.broadcast_to(v, (channels,)) if v.shape[0] == 1 else v


def _fold(steps: tuple[Step, ...], read: Reader, channels: int) -> tuple[Any, Any, Any]:
    """Folds affine steps into ``y -> (y + pre) * scale + post`` (None where absent)."""
    pre = scale = post = None

    def add(term: Any) -> None:
        nonlocal pre, post
        if scale is None:
            pre = term if pre is None else pre + term
        else:
            post = term if post is None else post + term

    def mul(factor: Any) -> None:
        nonlocal scale, post
        scale = factor if scale is None else scale * factor
        post = None if post is None else post * factor

    for step in steps:
        v = None if step.operand is None else _vector(read(step.operand.value), channels)
        if step.op == "add":
            add(v)
        elif step.op == "sub":
            add(-v)
        elif step.op == "rsub":  # v - y
            mul(jnp.full((channels,), -1.0, jnp.float32))
            add(v)
        elif step.op == "neg":
            mul(jnp.full((channels,), -1.0, jnp.float32))
        elif step.op == "mul":
            mul(v)
        elif step.op == "div":
            mul(1.0 / v)
        else:
            raise AssertionError(step.op)
    return pre, scale, post


# Ops that only reshape, broadcast or widen a per-channel vector.
_PASSTHROUGH = {"reshape", "broadcast_in_dim", "squeeze", "expand_dims", "copy",
                "convert_element_type"}


def _strip(value: Value) -> Value:
    """`value` before any reshapes, broadcasts and conversions to float32."""
    while value.producer is not None and value.producer.name in _PASSTHROUGH:
        node = value.producer
        if node.name == "convert_element_type" and value.dtype != np.float32:
            break
        value = node.inputs[0]
    return value


def _inverse_root(value: Value, g: Graph, op: str) -> tuple[Value, float] | None:
    """(var, eps) when `value` is ``op(var + eps)`` (op "rsqrt" or "sqrt") with a constant
    eps, else None."""
    node = _strip(value).producer
    if node is None or node.name != op:
        return None
    total = _strip(node.inputs[0]).producer
    if total is None or total.name != "add":
        return None
    for var, eps in (total.inputs, reversed(total.inputs)):
        constant = g.uniform_constant(eps)
        if constant is not None and g.constant(var) is None:
            return _strip(var), constant
    return None


def _batchnorm_statistics(steps: tuple[Step, ...],
                          g: Graph) -> tuple[Value | None, Value, float] | None:
    """(scale or None, var, eps) when the multiplicative steps are batch norm's
    ``scale * rsqrt(var + eps)`` (flax's form, as one factor) or ``scale / sqrt(var + eps)``
    (written out), so the kernel can take the statistics themselves; else None."""
    factors = [s for s in steps if s.op in ("mul", "div", "rsub", "neg")]
    if not factors or any(s.op in ("rsub", "neg") for s in factors) or \
            any(s.operand is None or s.operand.kind == "full" for s in factors):
        return None
    if len(factors) == 1 and factors[0].op == "mul":
        product = _strip(factors[0].operand.value)
        root = _inverse_root(product, g, "rsqrt")
        if root is not None:
            return None, *root
        node = product.producer
        if node is None or node.name != "mul":
            return None
        for scale, other in (node.inputs, reversed(node.inputs)):
            root = _inverse_root(other, g, "rsqrt")
            if root is not None and g.constant(scale) is None:
                return _strip(scale), *root
        return None
    if len(factors) == 2 and {s.op for s in factors} == {"mul", "div"}:
        scale = next(s for s in factors if s.op == "mul").operand.value
        root = _inverse_root(next(s for s in factors if s.op == "div").operand.value, g, "sqrt")
        if root is not None and g.constant(scale) is None:
            return _strip(scale), *root
    return None


def _scalar(p: Value | float | None, read: Reader, g: Graph) -> Any:
    if p is None or isinstance(p, float):
        return p
    constant = g.uniform_constant(p)
    if constant is not None:
        return constant
    return jnp.asarray(read(p), jnp.float32).reshape(())
