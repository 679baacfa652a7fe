"""The bare torchrun worker benchmarks/elastic.py compares hetc with: a gloo process group and a loop
of all-reduces, nothing else. Appends one JSON line per start to argv[1]: when the process started,
when its code ran (after `import torch`) and when its first all-reduce was done."""

from __future__ import annotations

import json
import sys
import time

from hetc.runtime.local import process_start_time

import torch
import torch.distributed as dist

entered = time.time()     # like hetc's: after Python and `import torch` (its "worker start")

dist.init_process_group("gloo")
t = torch.ones(1)
for i in range(1_000_000):
    dist.all_reduce(t)
    if i == 0 and dist.get_rank() == 0:
        with open(sys.argv[1], "a") as f:
            f.write(json.dumps({"ranks": dist.get_world_size(), "process_start": process_start_time(),
                                "entered": entered, "first_step_done": time.time()}) + "\n")
    if i + 1 == int(sys.argv[2]):
        break
    time.sleep(0.05)
dist.destroy_process_group()
