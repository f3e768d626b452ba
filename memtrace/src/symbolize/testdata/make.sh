#!/bin/sh
# Rebuilds the symbolizer's test objects from libleak.c (gcc, objcopy, strip):
# libleak-N.so (stripped, build-id, .gnu_debuglink "libleak.debug") and
# libleak-N.debug (its separate debug file), for N = 1, 2.
set -eu
cd "$(dirname "$0")"
for n in 1 2; do
    gcc -O1 -g -fPIC -shared -DVARIANT=$n -Wl,--build-id=sha1 \
        -ffile-prefix-map="$PWD"=. -o libleak-$n.full libleak.c
    objcopy --only-keep-debug libleak-$n.full libleak-$n.debug
    strip --strip-all -o libleak-$n.so libleak-$n.full
    cp libleak-$n.debug libleak.debug
    objcopy --add-gnu-debuglink=libleak.debug libleak-$n.so
    rm -f libleak.debug libleak-$n.full
done
