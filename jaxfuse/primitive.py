"""The fused-chain JAX primitive: shape rule, lowering to the XLA FFI handler, eager impl.

One primitive serves every plan; its single parameter is the hashable :class:`PlanSignature`,
which fixes the operands (``signature.operands``) and the result shape. Transformation rules
(batching, differentiation, partitioning) live in :mod:`jaxfuse.transforms` and are installed
here.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import mlir

from ._compat import ShapedArray
from ._extension import FFI_TARGET, pdl_wanted, record_target
from .signature import PlanSignature
from .transforms import install_rules, typed_output_sharding, with_unfused_derivative

__all__ = ["checked_operands", "fused_chain", "fused_chain_p"]

fused_chain_p = Primitive("jaxfuse_fused_chain")


def _bind(signature: PlanSignature, *operands: Any) -> jax.Array:
    return fused_chain_p.bind(*operands, signature=signature)


# The fused forward with the unfused composition's derivative (jvp, vjp, grad).
_differentiable = with_unfused_derivative(_bind)


def fused_chain(signature: PlanSignature, x: Any, *params: Any) -> jax.Array:
    """Runs the fused chain described by `signature` with jaxfuse's kernel.

    `params` are the operands after `x` in ``signature.operands`` order (filters, bias, batch-norm
    scale/shift/mean/var, side input, scalars). Per-channel parameters may be any float dtype;
    they are applied in float32.
    """
    return _differentiable(signature, *checked_operands(signature, x, *params))


def checked_operands(signature: PlanSignature, x: Any, *params: Any) -> list[Any]:
    """`x` and `params` checked against ``signature.operands`` (count, shapes, dtypes), with
    per-channel parameters converted to float32; raises naming the operand that is wrong."""
    specs = signature.operands
    if len(params) != len(specs) - 1:
        raise TypeError(f"fused chain {signature.ops} takes {len(specs)} operands "
                        f"({', '.join(s.name for s in specs)}), got {len(params) + 1}")
    return [_checked_operand(spec.name, spec.shape, spec.dtype, value)
            for spec, value in zip(specs, (x, *params))]


def _checked_operand(name: str, shape: tuple[int, ...], dtype: np.dtype, value: Any) -> Any:
    if not hasattr(value, "shape") or not hasattr(value, "dtype"):
        value = np.asarray(value)
    if tuple(value.shape) != shape:
        raise ValueError(f"{name} has shape {tuple(value.shape)}, expected {shape}")
    if not jnp.issubdtype(value.dtype, jnp.floating):
        raise TypeError(f"{name} has dtype {np.dtype(value.dtype).name}, expected a float dtype")
    if np.dtype(value.dtype) != dtype:
        if dtype != np.float32:
            raise TypeError(f"{name} has dtype {np.dtype(value.dtype).name}, expected "
                            f"{dtype.name} (the plan's dtype)")
        value = jnp.asarray(value, jnp.float32)  # per-channel parameters run in float32
    return value


@fused_chain_p.def_abstract_eval
def _abstract_eval(*avals: Any, signature: PlanSignature) -> ShapedArray:
    _check_avals(signature, avals)
    return ShapedArray(signature.output_shape, signature.dtype,
                       sharding=typed_output_sharding(signature, avals))


def _check_avals(signature: Any, avals: Sequence[Any]) -> None:
    """Refuses a direct bind whose operands contradict the signature, naming the operand (the
    FFI handler checks again, for programs that never pass through here)."""
    if not isinstance(signature, PlanSignature):
        raise TypeError(f"fused_chain_p needs a PlanSignature, got {type(signature).__name__}")
    specs = signature.operands
    if len(avals) != len(specs):
        raise TypeError(f"fused chain {signature.ops} takes {len(specs)} operands "
                        f"({', '.join(s.name for s in specs)}), got {len(avals)}")
    for spec, aval in zip(specs, avals):
        if tuple(aval.shape) != spec.shape:
            raise ValueError(f"{spec.name} has shape {tuple(aval.shape)}, expected {spec.shape}")
        if np.dtype(aval.dtype) != spec.dtype:
            raise TypeError(f"{spec.name} has dtype {np.dtype(aval.dtype).name}, expected "
                            f"{spec.dtype.name}")


@functools.cache
def _jitted(signature: PlanSignature) -> Any:
    return jax.jit(lambda *args: fused_chain_p.bind(*args, signature=signature))


@fused_chain_p.def_impl
def _impl(*args: Any, signature: PlanSignature) -> Any:
    # Eager calls compile a one-op XLA program per signature, once.
    return _jitted(signature)(*args)


def _lowering(ctx: mlir.LoweringRuleContext, *args: Any,
              signature: PlanSignature) -> Sequence[Any]:
    target = _target(ctx)
    attributes: dict[str, Any] = {"plan": signature.encode()}
    if target != FFI_TARGET and pdl_wanted():
        # XLA's command buffer may then start the kernel before the previous kernel ends:
        # the launch overlaps that kernel's last wave, and the kernel waits for it first
        # (csrc/kernels/portable.h: await_previous_kernel). The record stage's launch flag
        # decides per kernel, on Hopper and later only (csrc/ffi/gpu_handler.cc: UsesPdl).
        attributes["uses_pdl"] = True
    return jax.ffi.ffi_lowering(target)(ctx, *args, **attributes)


def _target(ctx: mlir.LoweringRuleContext) -> str:
    """The custom-call target: on CUDA the registration with the record stage where there is
    one, except for exported programs, which name the target every process registers at
    ``import jaxfuse``."""
    module = ctx.module_context
    if tuple(module.platforms) != ("cuda",) or module.lowering_parameters.for_export:
        return FFI_TARGET
    return record_target() or FFI_TARGET


install_rules(fused_chain_p, _bind, _lowering)
