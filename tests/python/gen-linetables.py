"""Dumps the line tables of a sample module's code objects, with the line of
every code unit as the running interpreter computes it, as a test vector for
memtrace/src/interp/python/lines.rs. Run with each CPython version:
    python3.X gen-linetables.py > ../../memtrace/src/interp/python/testdata/lines-3.X.json
"""
import dis
import json
import sys

SAMPLE = '''
import os

def render(n):
    buf = bytearray(n)
    if n > 10:
        buf += b"x" * n
    return buf

class Handler:
    def handle(self, requests):
        kept = []
        for i, r in enumerate(requests):
            out = render(r)
            if i % 4 == 0:
                kept.append(out)
        return kept

    async def agen(self):
        yield 1

def long_function():
    x = 0
''' + "".join("    x += %d\n" % i for i in range(300)) + '''
    try:
        y = 1 / x
    except ZeroDivisionError:
        y = None
    finally:
        x = -1
    return [lambda q: q + k for k in range(3)]

def far_jump():
    a = 1
''' + "\n" * 400 + '''
    return a

result = Handler().handle([1, 20, 3])
'''


def lines(co):
    n = len(co.co_code) // 2
    if sys.version_info >= (3, 11):
        return [p[0] for p in co.co_positions()]
    per_unit = [None] * n
    if sys.version_info >= (3, 10):
        for start, end, line in co.co_lines():
            for u in range(start // 2, end // 2):
                per_unit[u] = line
        return per_unit
    current = None
    starts = dict(dis.findlinestarts(co))
    for u in range(n):
        current = starts.get(2 * u, current)
        per_unit[u] = current
    return per_unit


def table(co):
    if sys.version_info >= (3, 10):
        return co.co_linetable
    return co.co_lnotab


def walk(co, out):
    out.append({
        "name": getattr(co, "co_qualname", co.co_name),
        "firstlineno": co.co_firstlineno,
        "table": table(co).hex(),
        "lines": lines(co),
    })
    for const in co.co_consts:
        if hasattr(const, "co_code"):
            walk(const, out)


out = []
walk(compile(SAMPLE, "sample.py", "exec"), out)
json.dump({"version": "%d.%d" % sys.version_info[:2], "code": out}, sys.stdout, indent=0)
print()
