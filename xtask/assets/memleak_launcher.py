"""Runs bcc's memleak (Debian's memleak-bpfcc) with two faults worked around.

Debian's python3-bpfcc 0.26 declares libbcc's bpf_attach_uprobe with six
arguments, but libbcc 0.26's C function takes seven (the last is the USDT
semaphore's ref_ctr_offset). ctypes then passes whatever the seventh register
holds, the kernel sees a nonzero ref_ctr_offset, refuses the uprobe PMU
attach (a "ref_ctr_offset mismatch" when another probe sits on the same
instruction, EINVAL otherwise) and bcc's tracefs fallback fails too ("Event
name is too long" for a /proc/PID/root path). This passes ref_ctr_offset = 0,
what the Python caller means.

memleak probes mmap and munmap in the object given by -O (its way to trace
another allocator) and gives up when that object has none (jemalloc,
tcmalloc, mimalloc define no mmap). Those two are skipped there, with a line
on stderr, as memleak already does for the allocator functions it marks
optional. The tool itself runs unmodified.

Usage: python3 memleak_launcher.py PATH_TO_MEMLEAK [ARGS...]
"""
import ctypes as ct
import runpy
import sys

import bcc
from bcc import libbcc

raw = libbcc.lib.bpf_attach_uprobe
if len(raw.argtypes) == 6:
    raw.argtypes = list(raw.argtypes) + [ct.c_uint32]

    def attach_uprobe(*args):
        return raw(*args, 0) if len(args) == 6 else raw(*args)

    libbcc.lib.bpf_attach_uprobe = attach_uprobe

OPTIONAL = ("mmap", "munmap")


def text(value):
    return value.decode() if isinstance(value, bytes) else str(value)


def tolerant(attach):
    def wrapper(self, *args, **kwargs):
        try:
            return attach(self, *args, **kwargs)
        except Exception as err:
            sym = text(kwargs.get("sym", ""))
            if sym in OPTIONAL and "could not determine address" in str(err):
                where = text(kwargs.get("name", ""))
                print("memleak_launcher: %s not in %s: not probed" % (sym, where), file=sys.stderr)
                return self
            raise

    return wrapper


bcc.BPF.attach_uprobe = tolerant(bcc.BPF.attach_uprobe)
bcc.BPF.attach_uretprobe = tolerant(bcc.BPF.attach_uretprobe)

tool = sys.argv[1]
sys.argv = [tool] + sys.argv[2:]
runpy.run_path(tool, run_name="__main__")
