#!/usr/bin/env bash
# Adds the kernel-cache entries a device call brought back (its jaxfuse-cache.tgz, only the
# entries that call wrote) to the cache the next call carries, .prebuilt/jaxfuse-cache.tgz.
#   bash scripts/merge_cache.sh /work/.device/N/jaxfuse-cache.tgz
set -euo pipefail
new=${1:?the jaxfuse-cache.tgz a call brought back}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/jaxfuse-cache/kernels" .prebuilt
# (whatever each archive's top folder is called; an entry is named by its key, so a newer one
# replaces it)
for archive in .prebuilt/jaxfuse-cache.tgz "$new"; do
  [[ -f $archive ]] && tar xzf "$archive" -C "$work/jaxfuse-cache" --strip-components=1
done
tar czf .prebuilt/jaxfuse-cache.tgz -C "$work" jaxfuse-cache
echo "$(find "$work/jaxfuse-cache/kernels" -type f | wc -l) entries," \
  "$(du -h .prebuilt/jaxfuse-cache.tgz | cut -f1)"
