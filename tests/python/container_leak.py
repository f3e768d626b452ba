"""A Python program that leaks from known lines using only what Debian's
python3-minimal has (no ctypes, no threading), for the real-container tests
(tests/kernel/docker.rs). Prints `ready PID`, waits for a line on stdin,
keeps every fourth 100000-byte buffer, prints `done`, then sleeps so the
blocks stay live. Lines the test checks carry a `# L:name` marker."""
import os
import sys
import time

kept = []


def render(n):
    return bytearray(n)  # L:render


def handle(i):
    out = render(100000)  # L:handle
    if i % 4 == 0:
        kept.append(out)


print("ready", os.getpid(), flush=True)
sys.stdin.readline()
for i in range(40):
    handle(i)  # L:module_handle
print("done", flush=True)
time.sleep(float(sys.argv[1]) if len(sys.argv) > 1 else 120)
