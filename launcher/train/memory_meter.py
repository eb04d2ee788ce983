"""Memory a run used, read the same way for every preset, so offloading shows where the bytes went.

On a GPU, `torch.cuda.max_memory_allocated` (the tensors alone) leaves out what the caching allocator
holds beyond them, the CUDA context and NCCL's buffers, and it says nothing of host memory: an offload
preset then looks cheaper than it is, because its optimizer states moved to (pinned) host memory. So a
reading holds, side by side:

- `mem/peak_bytes`: the figure that decides whether a job fits. On a GPU the allocator's peak
  reserved bytes (what `LAUNCHER_CUDA_MEMORY_GB`'s cap and an out-of-memory error count); on a CPU
  the process's peak resident set size.
- `mem/peak_allocated_bytes` (GPU): the peak of live tensors, the old figure.
- `mem/device_used_bytes` (GPU): the largest device-wide use seen at a reading (cudaMemGetInfo:
  total - free), which adds the CUDA context, NCCL and anything else on the device.
- `mem/pinned_host_bytes` (GPU): the peak of page-locked host memory torch's host allocator handed
  out (DeepSpeed's offload buffers and a pinned DataLoader's batches go through it).
- `mem/host_peak_bytes`: the process's peak resident set size (where offloaded states live).

Each figure is the largest over the ranks: they hold different batches (lengths, images), so their peaks
differ, and the job fits only if the largest does.
"""

from __future__ import annotations

import resource
from typing import Any

PEAK = "mem/peak_bytes"
PEAK_ALLOCATED = "mem/peak_allocated_bytes"
DEVICE_USED = "mem/device_used_bytes"
PINNED_HOST = "mem/pinned_host_bytes"
HOST_PEAK = "mem/host_peak_bytes"


def host_peak_bytes() -> int:
    """This process's peak resident set size: VmHWM on Linux, which is its own; ru_maxrss elsewhere (Linux's
    carries the larger of it and the parent's at the fork over the exec: a rank torchrun started would
    report torchrun's memory when its own is smaller)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def pinned_host_bytes(stats: dict[str, Any]) -> int | None:
    """Peak pinned bytes from `torch.cuda.host_memory_stats()`; None when this torch reports none."""
    for key in ("allocated_bytes.peak", "allocated_bytes.all.peak", "reserved_bytes.peak"):
        if key in stats:
            return int(stats[key])
    return None


FIGURES = (PEAK, PEAK_ALLOCATED, DEVICE_USED, PINNED_HOST, HOST_PEAK)  # one order on every rank


class MemoryMeter:
    """Reads the figures above after each step; device use is a running maximum over readings."""

    def __init__(self, device: Any) -> None:
        self.device = device
        self.device_used_max = 0

    def read(self) -> dict[str, int]:
        """The figures at their largest over the ranks (collective: every rank calls it)."""
        from launcher.train.distributed import all_reduce_max

        own = self.read_own()
        largest = all_reduce_max([float(own.get(key, -1)) for key in FIGURES], self.device)
        return {key: int(value) for key, value in zip(FIGURES, largest, strict=True) if value >= 0}

    def read_own(self) -> dict[str, int]:
        """This rank's figures."""
        host = host_peak_bytes()
        if getattr(self.device, "type", "cpu") != "cuda":
            return {PEAK: host, HOST_PEAK: host}
        import torch

        free, total = torch.cuda.mem_get_info(self.device)
        self.device_used_max = max(self.device_used_max, int(total - free))
        reading = {
            PEAK: int(torch.cuda.max_memory_reserved(self.device)),
            PEAK_ALLOCATED: int(torch.cuda.max_memory_allocated(self.device)),
            DEVICE_USED: self.device_used_max,
            HOST_PEAK: host,
        }
        pinned = pinned_host_bytes(torch.cuda.host_memory_stats())
        if pinned is not None:
            reading[PINNED_HOST] = pinned
        return reading
