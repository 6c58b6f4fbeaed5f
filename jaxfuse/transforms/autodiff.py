"""Differentiation of the fused chain: the primal is fused, the derivative is the unfused one.

The fused kernel computes no residuals, so the tangent comes from ``jax.jvp`` of
:func:`jaxfuse.reference.unfused` (conv via ``lax.conv_general_dilated``, epilogue in float32,
activation with jax.nn's conventions at kinks). A ``custom_jvp`` is enough for reverse mode
too: JAX linearizes and transposes the unfused tangent computation, which is linear in the
tangents. Every operand is differentiable: x, filters, bias, batch-norm scale/shift/mean/var,
side input, and the float32 scalars vector (conv alpha, epsilon, activation alpha/beta/gamma,
side alpha). Derivatives nest (hessians), since the rule's primal is the wrapped op itself.

Cost: the backward pass recomputes the pre-activation with XLA ops (the fused kernel keeps
no intermediates) and runs the transposed convolutions as XLA ops; nothing of it is fused.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax

from ..reference import unfused
from ..signature import PlanSignature

__all__ = ["with_unfused_derivative"]

Bind = Callable[..., jax.Array]  # bind(signature, *operands) -> output


def with_unfused_derivative(bind: Bind) -> Bind:
    """Wraps `bind(signature, *operands)` so that jvp, vjp and grad see the unfused derivative.

    The returned function has the same signature; its primal output is always `bind`'s (the
    fused kernel), under differentiation too.
    """

    @functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
    def fused(signature: PlanSignature, *operands: Any) -> jax.Array:
        return bind(signature, *operands)

    @fused.defjvp
    def _jvp(signature: PlanSignature, primals: tuple[Any, ...],
             tangents: tuple[Any, ...]) -> tuple[jax.Array, jax.Array]:
        out = fused(signature, *primals)  # itself differentiable: higher orders work too
        # The unfused primal is dead code (XLA removes what the tangent does not need, e.g. the
        # conv itself when the chain has no activation).
        definition = functools.partial(unfused, signature, out_sharding=_sharding_type(out))
        _, out_tangent = jax.jvp(definition, primals, tangents)
        return out, out_tangent

    return fused


def _sharding_type(array: jax.Array) -> Any:
    """`array`'s sharding when its type carries one (a mesh with Explicit axes), else None."""
    sharding = getattr(jax.typeof(array), "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    return None if mesh is None or mesh.empty else sharding
