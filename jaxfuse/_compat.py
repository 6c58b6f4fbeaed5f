"""Names jax has moved between releases (jaxfuse supports jax 0.10 and newer)."""

from __future__ import annotations

import jax

try:  # public in jax.core through 0.10; may leave it in later releases
    ShapedArray = jax.core.ShapedArray
    Tracer = jax.core.Tracer
except AttributeError:  # pragma: no cover - newer jax
    from jax._src.core import ShapedArray, Tracer

__all__ = ["ShapedArray", "Tracer"]
