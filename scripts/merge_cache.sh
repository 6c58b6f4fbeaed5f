#!/usr/bin/env bash
# Adds the kernel-cache entries a device call brought back (its jaxfuse-cache.tgz, only the
# entries that call wrote) to the cache the next call carries, .prebuilt/jaxfuse-cache.tgz.
#   bash scripts/merge_cache.sh /work/.device/N/jaxfuse-cache.tgz
set -euo pipefail
new=${1:?the jaxfuse-cache.tgz a call brought back}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/jaxfuse-cache/kernels" .prebuilt
[[ -f .prebuilt/jaxfuse-cache.tgz ]] && tar xzf .prebuilt/jaxfuse-cache.tgz -C "$work"
tar xzf "$new" -C "$work"  # (an entry is named by its key: a newer one replaces it)
tar czf .prebuilt/jaxfuse-cache.tgz -C "$work" jaxfuse-cache
echo "$(find "$work/jaxfuse-cache/kernels" -type f | wc -l) entries," \
  "$(du -h .prebuilt/jaxfuse-cache.tgz | cut -f1)"
