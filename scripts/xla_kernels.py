"""The kernels XLA generates for one benchmark case's unfused composition: each fused
kernel's PTX entry with its block size and registers, from XLA's own dump.

    python scripts/xla_kernels.py NA_C256_H56 --dtype bfloat16 --batch 1 --out /tmp/xla_dump

Prints, per PTX entry, the `.reqntid`/`.maxntid` block shape and the launch grid XLA recorded
in the optimized HLO's backend config (where it records one), so a jaxfuse kernel's launch can
be compared with XLA's for the same layer.
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import sys
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("layer")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--layout", default="NHWC")
    parser.add_argument("--chain", default="CBNA")
    parser.add_argument("--out", default="/tmp/xla_dump")
    opts = parser.parse_args()
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_dump_to={opts.out} --xla_dump_hlo_as_text")
    import jax  # after XLA_FLAGS

    from jaxfuse.bench.cases import BenchCase

    case = BenchCase.for_layer(opts.layer, opts.batch, opts.dtype, opts.layout, opts.chain)
    args = case.arg_sets(1, jax.devices()[0])[0]
    jax.block_until_ready(jax.jit(case.unfused())(*args))
    for ptx in sorted(glob.glob(f"{opts.out}/*.ptx")):
        text = Path(ptx).read_text()
        for entry in re.finditer(r"\.entry\s+(\w+)\((.*?)\)\s*(.*?)\{", text, re.S):
            shape = " ".join(re.findall(r"\.(?:reqntid|maxntid)\s+[\d, ]+", entry.group(3)))
            print(f"{os.path.basename(ptx)}: {entry.group(1)} {shape}")
    for hlo in sorted(glob.glob(f"{opts.out}/*after_optimizations.txt")):
        for line in Path(hlo).read_text().splitlines():
            if "fusion" in line and ("launch" in line or "kind=" in line):
                print(line.strip()[:300])
    sys.stdout.flush()


if __name__ == "__main__":
    main()
