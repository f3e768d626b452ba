"""Keeps 500 small objects made on one line, for `--allocators python`
(tests/kernel/python.rs). `__slots__` instances come from no free list: one
PyObject_Malloc each. Prints `ready`, waits for a line, works, prints `done`."""
import sys
import time

kept = []


class Item:
    __slots__ = ("i",)


def make():
    return Item()  # L:make


print("ready", flush=True)
sys.stdin.readline()
for _ in range(500):
    kept.append(make())  # L:module_make
print("done", flush=True)
time.sleep(120)
