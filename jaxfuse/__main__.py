"""``python -m jaxfuse info``: what jaxfuse finds on this machine.

Reports the jax version, the backends and devices jax sees, the runtime compiler the GPU backend
would use (and its version), the kernel cache directory and the compiled kernels in it.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import jax
import jaxlib

from . import __version__, runtime
from ._extension import extension, pdl_wanted, record_stage_wanted


def _backends() -> list[str]:
    lines = []
    for platform in ("cpu", "gpu", "tpu"):
        try:
            devices = jax.devices(platform)
        except RuntimeError:
            continue
        for d in devices:
            extra = ""
            if d.platform == "gpu":
                extra = f" [{runtime.gpu_platform(d)}, {getattr(d, 'compute_capability', '?')}]"
            lines.append(f"{d.platform}:{d.id} {d.device_kind}{extra}")
    return lines


def _compilers(ext: Any) -> list[str]:
    lines = []
    for platform, name in (("CUDA", "NVRTC"), ("ROCM", "hiprtc")):
        try:
            info = ext.gpu_compiler(platform)
            lines.append(f"{platform}: {info['version']} ({info['library']})")
        except RuntimeError as err:
            # (The error names each library tried, one a line: "  <name>: <why>".)
            tried = [line.strip().split(":")[0] for line in str(err).splitlines()[1:]
                     if line.startswith("  ")]
            lines.append(f"{platform}: no {name} (tried {', '.join(tried) or 'nothing'})")
    return lines


def _is_decision(key: str) -> bool:
    """Whether a cache key holds a solver decision (jaxfuse.find) rather than a kernel."""
    return key.startswith("jaxfuse-solver")


def _is_measured_record(key: str) -> bool:
    """Whether a cache key only records that a signature was measured on a device
    (jaxfuse.find.compile_ahead reads it): counted, not listed."""
    return key.startswith("jaxfuse-measured")


def _describe_key(key: str) -> str:
    """One line for a cache key: platform, arch (device kind, for a solver decision), compiler
    (jax, for a decision), solver (the fused kernel's label, for a decision) and the plan's main
    facts."""
    parts = key.split("|")
    if _is_decision(key) and len(parts) >= 9:
        platform, arch, compiler, solver, plan = parts[1], parts[2], parts[3], parts[7], parts[8]
    elif len(parts) >= 7:
        platform, arch, compiler, solver, plan = parts[1], parts[2], parts[3], parts[5], parts[6]
    else:
        return key
    fields = dict(f.split("=", 1) for f in plan.split(";")[1:] if "=" in f)
    conv = fields.get("conv", "")
    geometry = ""
    if conv:
        c = conv.split(",")
        geometry = f" {c[1]}x{c[2]}/{c[3]} ->{c[0]}" + (f" g{c[11]}" if c[11] != "1" else "")
    return (f"{platform} {arch} {compiler:<12} {solver:<14} {fields.get('ops', '?'):<6} "
            f"{fields.get('dtype', '?'):<4} {fields.get('layout', '?')} "
            f"in={fields.get('in', '?')}{geometry}")


def _command_buffers(ext: Any) -> str:
    """How fused kernels enter XLA's CUDA command buffers."""
    if not hasattr(ext, "register_cuda_record"):
        return "captured from the execute stage (these FFI headers have no record stage)"
    if not record_stage_wanted():
        return "captured from the execute stage (JAXFUSE_FFI_RECORD=0)"
    pdl = ("programmatic dependent launch on sm_90 and later" if pdl_wanted() else
           "programmatic dependent launch off (JAXFUSE_PDL=0)")
    return f"launch nodes of their own (the record stage); {pdl}"


def info(out: Any = sys.stdout) -> None:
    """Prints the report."""
    ext = extension()
    cache = ext.gpu_cache()
    print(f"jaxfuse {__version__}   jax {jax.__version__}   jaxlib {jaxlib.__version__}", file=out)
    print("devices:", file=out)
    for line in _backends() or ["(none)"]:
        print(f"  {line}", file=out)
    print(f"CPU kernel threads: {ext.cpu_threads()}", file=out)
    print("runtime compilers:", file=out)
    for line in _compilers(ext):
        print(f"  {line}", file=out)
    print(f"CUDA command buffers: {_command_buffers(ext)}", file=out)
    off = "(disk cache off)" if cache["problem"] else "(disk cache off: JAXFUSE_CACHE_DIR is empty)"
    print(f"kernel cache: {cache['directory'] or off}", file=out)
    if cache["problem"]:  # also before first use: the check runs now, creating nothing
        print(f"  not used: {cache['problem']}", file=out)
    keys = [key for key in sorted(cache["keys"]) if not _is_measured_record(key)]
    decisions = [key for key in keys if _is_decision(key)]
    records = len(cache["keys"]) - len(keys)
    print(f"  {len(keys) - len(decisions)} compiled kernel(s), {len(decisions)} solver "
          f"decision(s){f', {records} signature(s) marked measured' if records else ''}",
          file=out)
    for key in sorted(keys, key=_is_decision):
        print(f"  {'decision ' if _is_decision(key) else ''}{_describe_key(key)}", file=out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jaxfuse", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="report versions, devices, the runtime compiler and the cache")
    args = parser.parse_args(argv)
    if args.command == "info":
        try:
            info()
        except BrokenPipeError:  # the reader stopped early (`... info | head`): not an error
            # Stdout is flushed once more at exit; point it at /dev/null so that is silent too.
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


if __name__ == "__main__":
    sys.exit(main())
