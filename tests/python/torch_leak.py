"""PyTorch's allocator probes driven from Python, for the kernel suite
(tests/kernel/usdt.rs): loads the stub libc10_cuda.so (argv[1]) by ctypes,
prints `ready PID`, waits for a line on stdin, then allocates "tensors" on
stream 7: three of 1 MiB kept (leaked) from one line, three of 4 KiB freed
at once from another; prints `done` and sleeps. The stub carves them from
one 4 MiB cudaMalloc segment. Lines the test checks carry a `# L:name`
marker."""
import ctypes
import os
import sys
import time

lib = ctypes.CDLL(sys.argv[1])
lib.c10_stub_alloc.restype = ctypes.c_void_p
lib.c10_stub_alloc.argtypes = [ctypes.c_size_t, ctypes.c_long]
lib.c10_stub_free.argtypes = [ctypes.c_void_p]

kept = []


def forward(step):
    kept.append(lib.c10_stub_alloc(1 << 20, 7))  # L:leak


def scratch(step):
    p = lib.c10_stub_alloc(4096, 7)  # L:scratch
    lib.c10_stub_free(p)


print("ready", os.getpid(), flush=True)
sys.stdin.readline()
for step in range(3):
    forward(step)
    scratch(step)
print("done", flush=True)
time.sleep(60)
