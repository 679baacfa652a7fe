"""Host memory for copies to and from a GPU: page-locked or not, and token uploads that do not block the host.

Note [stream-ordered copies]
Host<->device copies in a step never make the host wait. Tokens go up from
page-locked memory with `non_blocking=True` on the compute stream, before
the forward that reads them (`upload`). Offload and prefetch run on the copy
stream (runtime/comm.py `Comm.copy`), and their `wait` makes the compute
stream wait for the copy's event; the host goes on posting. Three rules keep
memory safe when the host no longer knows that a copy has finished:

- Device memory: the caching allocator hands a freed block to the next
  allocation on the block's stream at once, ordered only by that stream. So
  every device tensor a copy reads or writes is `record_stream`ed on the
  copy stream, and every block the copy stream allocates for the compute
  stream is allocated on the compute stream instead (parameters coming back:
  `MinistageBuffers.allocate_device_copy`). A free after a `wait` (dropping
  offloaded parameters, or a stash that went to the host) then waits, inside
  the allocator, for the copy stream's work.
- Page-locked host memory comes from torch's caching host allocator, which
  records the copy's stream on the block: a host buffer dropped while its
  copy is in flight is not reused before the copy ends. `upload` also keeps
  its staging tensors until the step ends.
- The host reads host memory a copy wrote only after the step's end, where
  the host waits for the compute stream, which waited for every copy (the
  interpreter's `_end`).

Pageable memory (`offload { pin_memory = false }`) keeps the same code:
CUDA then copies through a staging buffer and returns to the host only when
the source has been read (host to device) or the copy is complete (device
to host), so those copies block the host, as the user asked.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["host_buffer", "upload"]


def host_buffer(like: Tensor, pinned: bool, device: torch.device) -> Tensor:
    """An empty host tensor shaped like `like`, page-locked when `pinned` and `device` is a GPU (pinning
    matters only for copies to and from one)."""
    return torch.empty(like.shape, dtype=like.dtype, device="cpu", pin_memory=pinned and device.type == "cuda")


def upload(host: Tensor, device: torch.device, staged: list[Tensor]) -> Tensor:
    """`host` on `device`. To a GPU: from page-locked memory, without blocking the host (Note [stream-ordered
    copies]); the page-locked copy is appended to `staged`, which the caller keeps until the step ends."""
    if device.type != "cuda":
        return host.to(device)
    pinned = host.pin_memory()
    staged.append(pinned)
    return pinned.to(device, non_blocking=True)
