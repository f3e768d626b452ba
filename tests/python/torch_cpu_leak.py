"""A real PyTorch (CPU) tensor leak, for the attach bench (`cargo xtask
bench --section attach`): imports torch, prints `ready PID`, then every
50 ms keeps a 256 KiB clone of a tensor (`# L:clone`) and the 256 KiB output
of a small model's forward pass made a few Python calls deep (`# L:forward`:
the deep C++ dispatcher stacks), and drops one clone at once. Runs until
killed."""
import os
import time

import torch

base = torch.ones(65536, dtype=torch.float32)  # 256 KiB
x = torch.ones(256, 256)
model = torch.nn.Sequential(
    torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256)
)
kept = []


def forward(depth):
    if depth == 0:
        with torch.no_grad():
            return model(x)  # L:forward
    return forward(depth - 1)


print("ready", os.getpid(), flush=True)
while True:
    kept.append(base.clone())  # L:clone
    kept.append(forward(4))
    scratch = base.clone()
    del scratch
    time.sleep(0.05)
