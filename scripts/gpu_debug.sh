#!/usr/bin/env bash
# Debug build + the smoke test, under cuda-gdb when it crashes (prints a native backtrace).
set -uo pipefail
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false JAXFUSE_CACHE_DIR=""
python3 -m pip install --no-build-isolation --no-deps -q -e . -Ccmake.build-type=RelWithDebInfo \
  -Cinstall.strip=false > /tmp/build.log 2>&1 || { tail -30 /tmp/build.log; exit 1; }
python3 scripts/gpu_smoke.py && exit 0
echo "== crashed; backtrace:"
cuda-gdb -batch -ex run -ex bt -ex "info sharedlibrary _jaxfuse" --args python3 scripts/gpu_smoke.py 2>&1 \
  | grep -v "^\[New Thread\|^\[Thread\|Detaching" | tail -60
