"""launcher.train.memory_meter: the memory figures of a step, read the same way on every preset (their
CUDA side runs on a GPU machine: marked `gpu`, and in tests/gpu/)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from launcher.train import memory_meter
from launcher.train.memory_meter import MemoryMeter, host_peak_bytes, pinned_host_bytes
from tests.helpers import ROOT


def test_on_a_cpu_the_memory_figure_is_the_process_peak_resident_set():
    reading = MemoryMeter(device=torch.device("cpu")).read()
    assert reading[memory_meter.PEAK] == reading[memory_meter.HOST_PEAK] > 0
    assert set(reading) == {memory_meter.PEAK, memory_meter.HOST_PEAK}


def test_the_host_peak_only_grows():
    before = host_peak_bytes()
    held = bytearray(64 * 2**20)  # touched: resident
    held[::4096] = b"x" * len(held[::4096])
    assert host_peak_bytes() >= max(before, 64 * 2**20)
    del held


def test_a_child_process_reports_its_own_peak_not_its_parents():
    """A rank that torchrun forked reports its own memory: ru_maxrss would report the parent's 1.5 GiB."""
    held = bytearray(1536 * 2**20)
    held[::4096] = b"x" * len(held[::4096])
    child = subprocess.run(
        [sys.executable, "-c", "from launcher.train.memory_meter import host_peak_bytes; print(host_peak_bytes())"],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    )
    del held
    assert 0 < int(child.stdout.strip()) < 1024 * 2**20


def test_pinned_bytes_are_read_from_the_host_allocator_stats_of_any_layout():
    assert pinned_host_bytes({"allocated_bytes.peak": 4096, "allocated_bytes.current": 0}) == 4096
    assert pinned_host_bytes({"allocated_bytes.all.peak": 8}) == 8
    assert pinned_host_bytes({"reserved_bytes.peak": 16}) == 16
    assert pinned_host_bytes({}) is None  # CUDA not initialised: torch returns no stats


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_the_figures_are_the_allocators_the_devices_and_the_hosts():
    device = torch.device("cuda", 0)
    held = torch.ones(32 * 2**20, dtype=torch.uint8, device=device)
    pinned = torch.ones(2**20, dtype=torch.uint8).pin_memory()
    meter = MemoryMeter(device)
    reading = meter.read()
    assert reading[memory_meter.PEAK] >= reading[memory_meter.PEAK_ALLOCATED] >= held.numel()
    assert reading[memory_meter.DEVICE_USED] >= reading[memory_meter.PEAK_ALLOCATED]
    assert reading[memory_meter.HOST_PEAK] > 0 and reading.get(memory_meter.PINNED_HOST, 0) >= pinned.numel()
    del held
    torch.cuda.empty_cache()
    assert meter.read()[memory_meter.DEVICE_USED] >= reading[memory_meter.DEVICE_USED]  # a running maximum
