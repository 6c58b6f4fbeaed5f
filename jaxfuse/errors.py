"""Exceptions raised by jaxfuse."""

from __future__ import annotations

__all__ = ["FusionError", "UnsupportedFusionError"]


class FusionError(ValueError):
    """A fusion plan was used wrongly: not compiled, changed since compile, or bad arguments."""


class UnsupportedFusionError(FusionError):
    """The plan asks for an operator combination jaxfuse cannot fuse; the message says why."""
