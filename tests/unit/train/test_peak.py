"""launcher.train.peak: the peak MFU is measured against: a GPU's from the table by its name (the longest
fragment first), in the training dtype; a CPU's measured once per process and dtype."""

from __future__ import annotations

import torch

from launcher.train.peak import cpu_matmul_peak, device_peak, gpu_peak


def test_a_gpus_peak_comes_from_the_table_by_its_name_and_dtype():
    h200 = gpu_peak("NVIDIA H200", torch.bfloat16)
    assert h200.flops == 989e12 and "NVIDIA H200: 989 TFLOP/s bf16" in h200.source
    assert gpu_peak("NVIDIA H200", torch.float32).flops == 67e12  # fp32 without TF32
    assert gpu_peak("NVIDIA A100-SXM4-80GB", torch.float16).flops == 312e12  # not the A10's
    assert gpu_peak("NVIDIA A10G", torch.bfloat16).flops == 70e12
    assert gpu_peak("NVIDIA L40S", torch.bfloat16).flops == 362e12  # not the L4's
    unknown = gpu_peak("Some Future GPU", torch.bfloat16)
    assert unknown.flops is None and "not in launcher.train.peak.GPU_PEAK_TFLOPS" in unknown.source


def test_a_cpus_peak_is_measured_once_and_leaves_the_global_random_state_alone():
    state = torch.get_rng_state()
    first = cpu_matmul_peak(torch.float32)
    assert torch.equal(torch.get_rng_state(), state)  # a resumed run's random stream is not shifted
    assert first > 1e8 and cpu_matmul_peak(torch.float32) == first  # measured once per process
    peak = device_peak(torch.device("cpu"), torch.float32)
    assert peak.flops == first and peak.source.startswith("CPU: ") and "fp32 (measured matmul" in peak.source
