#!/usr/bin/env bash
# Prints, per pyenv CPython version, the offsets offsets.c reads from that
# version's own headers (the facts behind memtrace/src/interp/python/layout.rs).
set -euo pipefail
cd "$(dirname "$0")"
for v in "$@"; do
  prefix=$(pyenv prefix "$v")
  inc=$(ls -d "$prefix"/include/python3.*)
  cc -I"$inc" offsets.c -o /tmp/memtrace-pyoffsets-$v
  echo "== $v"
  /tmp/memtrace-pyoffsets-$v
done
