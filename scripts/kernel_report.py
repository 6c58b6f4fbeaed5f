"""Registers, spills and the instructions that matter, for every variant of a plan's GPU
kernel, without a GPU: the generated source is compiled with nvcc (ptxas -v) and the SASS is
counted (tensor-core, bulk-copy, local-memory and 16-byte memory instructions).

    python scripts/kernel_report.py --ops CBNA --dtype bfloat16 --c 64 --k 256 --n 64 --hw 56 --r 1
    python scripts/kernel_report.py --suite resnet50 --n 64      # every layer of a bench suite
    python scripts/kernel_report.py --suite mobilenet --layout NCHW --dtype float16 --n 64 --only dw
    python scripts/kernel_report.py --suite resnet50_net --layout NCHW --dtype float32 --form

(`--form`: the kernels of NCHW plans' NHWC form, jaxfuse.solvers.kernel_forms, whatever the
variables that switch forms on or off say.)

Needs nvcc from a CUDA toolkit ($CUDA_HOME, else /usr/local/cuda) and cuobjdump (the
toolkit's, one on PATH, or `pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm`).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shutil
import subprocess
import sys
import tempfile
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from cases import Case, layer_case, suite_layers  # noqa: E402

from jaxfuse._extension import extension  # noqa: E402

CUDA = Path(os.environ.get("CUDA_HOME", "/usr/local/cuda"))


def _cuobjdump() -> str:
    for candidate in (CUDA / "bin/cuobjdump", shutil.which("cuobjdump")):
        if candidate and Path(candidate).exists():
            return str(candidate)
    import nvidia  # the pip wheels' namespace package

    for folder in nvidia.__path__:
        for found in Path(folder).glob("*/bin/cuobjdump"):
            os.environ["PATH"] = f"{found.parent}{os.pathsep}{os.environ['PATH']}"  # nvdisasm
            return str(found)
    raise SystemExit("cuobjdump not found: pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm")

# SASS opcodes worth counting, by what they say about a kernel.
OPCODES = {"HGMMA": "wgmma", "HMMA": "mma.sync", "UTMALDG": "TMA loads", "LDGSTS": "cp.async",
           "LDL": "local loads", "STL": "local stores", "STG.E.128": "16B stores",
           "LDG.E.128": "16B loads", "BAR.SYNC": "barriers", "SYNCS": "mbarrier ops"}


def report(case: Case, arch: str, form: bool = False) -> None:
    signature = case.build()[0].signature
    if form:  # the form jaxfuse.solvers.kernel_forms offers on Hopper by default
        from jaxfuse import solvers

        for variable in ("JAXFUSE_NHWC_FORM", "JAXFUSE_TF32_NCHW_FORM"):
            os.environ.pop(variable, None)
        hopper = types.SimpleNamespace(platform="gpu", compute_capability="9.0")
        forms = solvers.kernel_forms(signature, hopper)
        if not forms:
            print(f"== {case}: no NHWC form offered")
            return
        signature = solvers.kernel_signature(signature, *forms[0])
    encoded = signature.encode()
    count = extension().gpu_compile_only("CUDA", encoded, arch)["variants"]
    print(f"== {case}  ({count} variants)")
    for variant in range(count):
        out = extension().gpu_compile_only("CUDA", encoded, arch, variant=variant)
        target = "sm_90a" if out["solver"] in ("conv_wgmma", "conv_tma") else arch
        with tempfile.TemporaryDirectory() as folder:
            src, cubin = Path(folder, "k.cu"), Path(folder, "k.cubin")
            src.write_text(out["source"])
            done = subprocess.run(
                [str(CUDA / "bin/nvcc"), "-cubin", f"-gencode=arch=compute_{target[3:]},"
                 f"code={target}", "-std=c++17", "-Xptxas", "-v", "-I", str(ROOT / "csrc/kernels"),
                 "-o", str(cubin), str(src)], capture_output=True, text=True)
            if done.returncode != 0:
                print(f"  {variant}: {out['solver']} {out['tile']}: nvcc failed\n{done.stderr}")
                continue
            usage = {}
            for line in done.stderr.splitlines():
                fn = re.search(r"Compiling entry function '(\w+)'", line)
                if fn:
                    name = fn.group(1)
                regs = re.search(r"Used (\d+) registers", line)
                if regs:
                    usage[name] = regs.group(1)
                spill = re.search(r"(\d+) bytes spill stores", line)
                if spill and spill.group(1) != "0":
                    usage[name] = usage.get(name, "?") + f" SPILLS {spill.group(1)}B"
            sass = subprocess.run([_cuobjdump(), "-sass", str(cubin)],
                                  capture_output=True, text=True).stdout
            main = out["entries"][0]["name"] if out.get("entries") else ""
            body = sass.split(f"Function : {main}")[-1].split("Function :")[0] if main else sass
            counts = {label: len(re.findall(rf"\b{re.escape(op)}\b", body))
                      for op, label in OPCODES.items()}
            shown = ", ".join(f"{label} {n}" for label, n in counts.items() if n)
            # Static instructions (the padding NOPs aside): for straight-line kernels, what a
            # thread issues, so an issue-bound kernel's cost shows without a GPU.
            static = len(re.findall(r"^\s+/\*[0-9a-f]{4}\*/\s+(?!NOP)", body, re.M))
            print(f"  {variant}: {out['solver']:<14} {out['tile']:<20} regs {usage.get(main, '?')}"
                  f"  instructions {static}  [{shown}]")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--suite", default=None)
    parser.add_argument("--only", default="", help="a regular expression on layer names")
    parser.add_argument("--ops", default="CBNA")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--layout", default="NHWC", choices=["NHWC", "NCHW"])
    parser.add_argument("--filter-layout", default=None,
                        help="default: HWIO for NHWC, OIHW for NCHW (as the benchmarks run them)")
    parser.add_argument("--c", type=int, default=64)
    parser.add_argument("--k", type=int, default=64)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--hw", type=int, default=28)
    parser.add_argument("--r", type=int, default=3)
    parser.add_argument("--stride", type=int, default=1)
    parser.add_argument("--arch", default="sm_90")
    parser.add_argument("--form", action="store_true",
                        help="the NHWC form of NCHW plans (NHWC input, NCHW output)")
    opts = parser.parse_args()
    if opts.form and opts.layout != "NCHW":
        parser.error("--form: the NHWC form is of NCHW plans (--layout NCHW)")
    filter_layout = opts.filter_layout or ("HWIO" if opts.layout == "NHWC" else "OIHW")
    if opts.suite:
        cases = [dataclasses.replace(layer_case(layer, dtype=opts.dtype, layout=opts.layout,
                                                n=opts.n), filter_layout=filter_layout)
                 for layer in suite_layers(opts.suite) if re.search(opts.only, layer.name)]
    else:
        pad = (opts.r - 1) // 2
        cases = [Case(ops=opts.ops, dtype=opts.dtype, layout=opts.layout,
                      filter_layout=filter_layout, n=opts.n, c=opts.c, k=opts.k, h=opts.hw,
                      w=opts.hw, r=opts.r, s=opts.r, strides=(opts.stride,) * 2,
                      padding=((pad, pad),) * 2)]
    for case in cases:
        report(case, opts.arch, opts.form)


if __name__ == "__main__":
    main()
