"""JAX transformation rules for the fused-chain primitive (:mod:`jaxfuse.primitive`).

One module per transformation:

- :mod:`.autodiff`: jvp/vjp/grad. The forward stays fused; the derivative is that of the
  unfused jax.numpy composition (:func:`jaxfuse.reference.unfused`), so the backward pass runs
  as ordinary XLA ops.
- :mod:`.batching`: vmap. Batching over the input folds into the batch dimension, batching over
  filters or per-channel parameters folds into (grouped) channels; only batched runtime scalars
  fall back to a loop.
- :mod:`.partitioning`: sharding under ``jax.jit``. A ``custom_partitioning`` rule runs the
  fused kernel on each batch shard and/or output-channel shard with no collectives.
- :mod:`.export`: what ``jax.export`` needs to accept the custom call.

The rules take the primitive (or its bind function) as an argument instead of importing it,
so :mod:`jaxfuse.primitive` can install them without an import cycle.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from jax.extend.core import Primitive
from jax.interpreters import batching as jax_batching
from jax.interpreters import mlir

from .autodiff import with_unfused_derivative
from .batching import batching_rule
from .export import export_disabled_checks
from .partitioning import (
    partitioned_lowering,
    require_devices_at_lowering,
    typed_output_sharding,
)

__all__ = ["export_disabled_checks", "install_rules", "typed_output_sharding",
           "with_unfused_derivative"]


def install_rules(primitive: Primitive, bind: Callable[..., Any],
                  ffi_lowering: Callable[..., Sequence[Any]]) -> None:
    """Registers vmap and sharding-aware lowering rules for the fused-chain `primitive`.

    `bind(signature, *operands)` binds it; `ffi_lowering` is its plain lowering to the FFI
    custom call. Differentiation is not a primitive rule: see :func:`with_unfused_derivative`.
    """
    jax_batching.primitive_batchers[primitive] = batching_rule(bind)
    mlir.register_lowering(primitive, partitioned_lowering(ffi_lowering))
    require_devices_at_lowering(primitive)
