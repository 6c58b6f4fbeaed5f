"""What ``jax.export`` needs to serialize programs that call jaxfuse's fused kernel."""

from __future__ import annotations

import jax

from .._extension import CONVERT_TARGET, FFI_TARGET

__all__ = ["export_disabled_checks"]


def export_disabled_checks() -> list[jax.export.DisabledSafetyCheck]:
    """The ``disabled_checks`` that let ``jax.export`` accept jaxfuse's custom call.

    ``jax.export`` refuses custom calls whose target is not on JAX's list of targets with a
    stable ABI. jaxfuse's targets (``"jaxfuse_fused_chain"``, which carries its whole plan as a
    versioned string attribute, and ``"jaxfuse_convert_many"``, the batched float conversion
    :func:`jaxfuse.fuse` emits for GPUs, whose operand and result types say everything) are
    registered by ``import jaxfuse``, so a serialized program runs in any process that has
    imported jaxfuse (a compatible version of it).

    >>> import jax, jaxfuse as jf                                        # doctest: +SKIP
    >>> exp = jax.export.export(jax.jit(f),
    ...                         disabled_checks=jf.export_disabled_checks())(x, args)
    >>> blob = exp.serialize()           # later, elsewhere: import jaxfuse first, then
    >>> jax.export.deserialize(blob).call(x, args)
    """
    return [jax.export.DisabledSafetyCheck.custom_call(target)
            for target in (FFI_TARGET, CONVERT_TARGET)]
