"""Kernel-matrix Python check (tests/kernel-matrix/smoke.sh): keeps 10 of 40
bytearray(100000) made in render() <- handle() <- <module>, then leaves with
os._exit so nothing is freed by interpreter teardown. Needs no stdlib beyond
the frozen modules (run with -S)."""
import os

kept = []


def render(n):
    return bytearray(n)


def handle(i):
    out = render(100000)
    if i % 4 == 0:
        kept.append(out)


for i in range(40):
    handle(i)
os._exit(0)
