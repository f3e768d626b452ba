"""A Python program that leaks from known lines, for the kernel suite
(tests/kernel/python.rs). Prints `ready PID`, waits for a line on stdin (EOF
also goes), runs its workloads, prints `done`, then sleeps so the blocks stay
live. Lines the test checks carry a `# L:name` marker."""
import ctypes
import os
import sys
import threading
import time

kept = []
LEAK = 100000


def render(n):
    return bytearray(n)  # L:render


def handle(i):
    out = render(LEAK)  # L:handle
    if i % 4 == 0:
        kept.append(out)


def balanced(i):
    scratch = bytearray(LEAK * 2)  # L:balanced
    return len(scratch)


leaked = threading.Event()


def worker():
    libc = ctypes.CDLL(None)
    libc.prctl(15, b"leaky-worker", 0, 0, 0)
    for _ in range(5):
        kept.append(bytearray(150000))  # L:worker
    leaked.set()
    # Stays alive, so its name can be read.
    threading.Event().wait()


def c_alloc(libc):
    return libc.malloc(300000)  # L:c_alloc


def gil_released():
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    for _ in range(3):
        kept.append(c_alloc(libc))  # L:gil_released


print("ready", os.getpid(), flush=True)
if not sys.stdin.readline() and len(sys.argv) > 2:
    # Launched under memtrace (stdin at EOF): give it time to find the
    # interpreter, which it does only once libpython is mapped.
    time.sleep(float(sys.argv[2]))
for i in range(40):
    handle(i)  # L:module_handle
    balanced(i)
threading.Thread(target=worker, name="leaky-worker", daemon=True).start()
leaked.wait()
gil_released()  # L:module_gil
print("done", flush=True)
time.sleep(float(sys.argv[1]) if len(sys.argv) > 1 else 120)
