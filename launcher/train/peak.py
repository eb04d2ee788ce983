"""A device's peak matmul FLOP/s, what model FLOPs utilisation (MFU) is measured against.

GPUs: the vendors' dense (no sparsity) tensor-core figures for bf16/fp16, and plain fp32 (PyTorch does
not use TF32 for fp32 matmuls unless told to), for the SXM parts where a board comes in several forms.
A GPU not in the table has no peak (MFU is left out, and the run says so). CPUs have no such table: the
peak is measured, as the best of a few square matmuls in the training dtype on this process's threads,
once per process and dtype.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

# name fragment (lower case, as torch.cuda.get_device_name spells it) -> (bf16/fp16 TFLOP/s, fp32 TFLOP/s);
# the first fragment found in the name wins, so longer names come before their prefixes (a100 before a10).
GPU_PEAK_TFLOPS: dict[str, tuple[float, float]] = {
    "h200": (989.0, 67.0),
    "h100": (989.0, 67.0),
    "gh200": (989.0, 67.0),
    "a100": (312.0, 19.5),
    "l40s": (362.0, 91.6),
    "l40": (181.0, 90.5),
    "l4": (121.0, 30.3),
    "a10g": (70.0, 31.2),
    "a10": (125.0, 31.2),
    "v100": (125.0, 15.7),
}
CPU_MATMUL_SIZE = 1024
_measured: dict[tuple[torch.dtype, int], float] = {}


@dataclass(frozen=True)
class Peak:
    """Peak FLOP/s of one device (None: not known) and where the figure comes from."""

    flops: float | None
    source: str


def device_peak(device: torch.device, dtype: torch.dtype) -> Peak:
    if device.type == "cuda":
        return gpu_peak(torch.cuda.get_device_name(device), dtype)
    if device.type == "cpu":
        flops = cpu_matmul_peak(dtype)
        what = f"{_dtype_name(dtype)} (measured matmul, this process's threads)"
        return Peak(flops, f"CPU: {flops / 1e9:.1f} GFLOP/s {what}")
    return Peak(None, f"{device.type}: no peak known")


def gpu_peak(name: str, dtype: torch.dtype) -> Peak:
    """The table's peak for a GPU of this name (as torch.cuda.get_device_name gives it)."""
    for fragment, (half, single) in GPU_PEAK_TFLOPS.items():
        if fragment in name.lower():
            tflops = single if dtype == torch.float32 else half
            return Peak(tflops * 1e12, f"{name}: {tflops:g} TFLOP/s {_dtype_name(dtype)} (dense, vendor figure)")
    return Peak(None, f"{name}: not in launcher.train.peak.GPU_PEAK_TFLOPS")


def cpu_matmul_peak(dtype: torch.dtype) -> float:
    """The best FLOP/s of five CPU_MATMUL_SIZE-square matmuls in `dtype` (~0.1-0.5 s, once per process)."""
    key = (dtype, torch.get_num_threads())
    if key not in _measured:
        a = torch.randn(CPU_MATMUL_SIZE, CPU_MATMUL_SIZE, generator=torch.Generator().manual_seed(0)).to(dtype)
        torch.mm(a, a)  # warm-up: the first call allocates and picks its kernel
        best = float("inf")
        for _ in range(5):
            started = time.perf_counter()
            torch.mm(a, a)
            best = min(best, time.perf_counter() - started)
        _measured[key] = 2.0 * CPU_MATMUL_SIZE**3 / best
    return _measured[key]


def _dtype_name(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}.get(dtype, str(dtype))
