"""Flax layers that run conv + batch norm + activation as one fused kernel at inference.

``jaxfuse.flax.linen`` and ``jaxfuse.flax.nnx`` each provide ``ConvBNAct``, ``ConvAct`` and
``BNAct``. Their variables are laid out exactly as the unfused Flax layers they replace, so
checkpoints load either way; see the two modules for the layout.

Training runs flax's own layers: batch statistics must be reduced over the whole conv output
before anything can be normalized, so conv and batch norm cannot share one pass, and XLA
already fuses the elementwise normalize + activation. Inference, with the running statistics,
is one pointwise epilogue on the conv, which is where the fused kernel pays.

Flax is an optional dependency (``pip install "jaxfuse[flax]"``): ``import jaxfuse`` does not
import it, this package does.
"""

from __future__ import annotations

try:
    import flax  # noqa: F401
except ImportError as err:  # pragma: no cover - exercised only without flax
    raise ImportError("jaxfuse.flax needs flax: pip install 'jaxfuse[flax]'") from err

from . import linen, nnx
from ._activation import Activation, resolve_activation

__all__ = ["Activation", "linen", "nnx", "resolve_activation"]
