"""Automatic fusion: find convolution chains in any JAX program and run each as one fused call.

:func:`fuse` rewrites a function's jaxpr; :func:`fusion_report` says what it fused and why it
left the rest. Modules: ``graph`` (a flat dataflow view of a jaxpr), ``patterns`` (recognizers of
pointwise steps), ``matcher`` (grows chains from convolutions), ``lowering`` (plans and the fused
call), ``choice`` (the program-wide solver choice), ``converts`` (the conversions only fused calls
read, batched into one op), ``fuse`` (the rewriting evaluator), ``report``.
"""

from .fuse import fuse
from .report import FusedGroup, FusionReport, LeftAlone, count_fused_calls, fusion_report

__all__ = ["FusedGroup", "FusionReport", "LeftAlone", "count_fused_calls", "fuse",
           "fusion_report"]
