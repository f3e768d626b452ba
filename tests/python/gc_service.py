"""A service that never leaks, for `memtrace watch`: a warm-up cache, then a
GC sawtooth forever.

Prints "ready <pid>", fills a 24 MiB cache over about two seconds (the
warm-up), prints "warm", then builds reference cycles holding 256 KiB
buffers until about 16 MiB is garbage, collects them (gc.collect), and does
it again ("cycle N" each time). Exits when stdin closes.
"""

import gc
import os
import select
import sys
import time

gc.disable()  # the cycles are collected by hand: a clean sawtooth
print(f"ready {os.getpid()}", flush=True)

cache = []
for i in range(48):
    cache.append(bytearray(b"c" * (512 * 1024)))
    time.sleep(0.04)
print("warm", flush=True)

cycle = 0
while True:
    garbage = None
    for i in range(64):
        node = {"buf": bytearray(b"g" * (256 * 1024))}
        node["self"] = node  # a cycle: only the collector frees it
        node = None
        time.sleep(0.03)
        if select.select([sys.stdin], [], [], 0)[0] and not sys.stdin.read(1):
            sys.exit(0)
    gc.collect()
    cycle += 1
    print(f"cycle {cycle}", flush=True)
