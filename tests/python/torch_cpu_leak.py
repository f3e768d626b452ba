"""A real PyTorch (CPU) tensor leak, for the attach bench (`cargo xtask
bench --section attach`): imports torch, prints `ready PID`, then every
50 ms clones a 256 KiB tensor and keeps it (the leak, line marked `# L:leak`)
and clones one it drops at once. Runs until killed."""
import os
import sys
import time

import torch

base = torch.ones(65536, dtype=torch.float32)  # 256 KiB
kept = []
print("ready", os.getpid(), flush=True)
while True:
    kept.append(base.clone())  # L:leak
    scratch = base.clone()
    del scratch
    time.sleep(0.05)
