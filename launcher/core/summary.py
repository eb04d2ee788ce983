"""summary.json: how a run ended, and its figures, as one typed record.

Written by rank 0 while training (status "running" until it ends), by the launcher otherwise (a job
refused before its ranks started, a rank killed by a signal). Readers (the comparison, the tuner, a
resume, W&B) read it back with `Summary.from_json`, by field.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from launcher.core.json_files import finite

# Status of a run: running | completed | preempted | failed | interrupted.
ENDED = ("completed", "preempted", "failed", "interrupted")


@dataclass
class Summary:
    status: str = "running"
    steps: int = 0
    wall_s: float | None = None  # every segment of the run: a resumed run's earlier ones included
    earlier_wall_s: float | None = None  # a resumed run: its earlier segments' wall time (wall_s includes it)
    final_loss: float | None = None
    eval_loss: float | None = None
    eval_accuracy: float | None = None
    # A preference loss: the held-out pairs whose chosen answer's reward is the higher, and the mean margin.
    eval_rewards_accuracy: float | None = None
    eval_rewards_margin: float | None = None
    samples_per_sec: float | None = None
    tokens_per_sec: float | None = None  # real (non-padding) tokens
    padding_frac: float | None = None  # of the token slots of the measured steps' batches, padding
    image_token_frac: float | None = None  # of the real tokens, those an image's rows fill
    model_tflops_per_sec: float | None = None  # the useful work's model FLOPs (launcher.model.flops), all ranks
    mfu: float | None = None  # model FLOPs utilisation: of the devices' peak (peak_flops_source)
    peak_flops_source: str | None = None  # the peak MFU is measured against, and where the figure comes from
    peak_memory_bytes: int | None = None
    planned_memory_bytes: int | None = None  # the planner's figure for the job (launcher.plan), beside the peak
    world_size: int | None = None
    zero_stage: int | None = None
    precision: str | None = None
    offload: str | None = None
    comm: str | None = None
    deepspeed: str | None = None
    model: str | None = None
    error: str | None = None
    overrides: list[str] = field(default_factory=list)
    choices: dict[str, Any] = field(default_factory=dict)
    objective: float | None = None
    # What training learnt about the job: absent from the file until known (LEARNT).
    optimizer: str | None = None  # the optimizer class DeepSpeed stepped (DeepSpeedCPUAdam, AdamW, ...)
    param_groups: list[dict[str, Any]] | None = None  # the optimizer's groups: name, lr, weight_decay, params
    # train.stages: each stage (name, steps, train, lr, lr_scale) with its optimizer's groups once it began.
    stages: list[dict[str, Any]] | None = None
    params_total: int | None = None
    params_trainable: int | None = None
    trainable_fraction: float | None = None
    params_held_per_rank: list[int] | None = None  # parameter elements each rank holds (its ZeRO-3 partition)
    partitioned_at_load: bool | None = None  # ZeRO-3 partitioned the weights while loading them
    method: str | None = None
    attn_implementation: str | None = None
    kernels: str | None = None  # model.kernels as it ran: "torch", or liger's parts and where the loss went
    # How the loss reads the output layer: "chunks of N answer tokens" (launcher.model.logps), or "whole logits".
    loss_logits: str | None = None
    base_model: str | None = None  # the directory or hub id the weights were loaded from
    resumed_from_step: int | None = None
    resharded_from: dict[str, Any] | None = None  # launcher.job.reshard.Reshard.to_json()
    profile: dict[str, float] | None = None  # train.profile_steps: each part's share of those steps' wall time
    memory: dict[str, int] | None = None  # the memory meter's last reading, without its "mem/" prefix
    records_skipped: int | None = None  # bad records skipped (data.on_bad_record=skip)
    records_too_long: int | None = None  # over data.max_length, skipped
    records_truncated: int | None = None  # cut to data.max_length
    data_cache: dict[str, Any] | None = None  # the cache the run trained from: path, built, build_s
    # A preference loss's reference (loss.reference): kind; precomputed: path, computed (this start), seconds.
    reference: dict[str, Any] | None = None
    samples_per_source: dict[str, int] | None = None  # training samples drawn from each source of a mixture

    @classmethod
    def planned(
        cls,
        *,
        world_size: int | None = None,
        zero_stage: int | None = None,
        precision: str | None = None,
        overrides: list[str] | tuple[str, ...] = (),
        choices: dict[str, Any] | None = None,
        planned_memory_bytes: int | None = None,
    ) -> Summary:
        """The summary of a job that has not produced anything yet: its shape and its labels.

        `choices` are the labels of what the DeepSpeed dict trains with (launcher.config.precision.
        labelled_choices); offload, comm, deepspeed and model are read from them."""
        labels = dict(choices or {})
        return cls(
            world_size=world_size,
            zero_stage=zero_stage,
            precision=precision or labels.get("precision"),
            offload=labels.get("offload"),
            comm=labels.get("comm"),
            deepspeed=labels.get("deepspeed"),
            model=labels.get("model"),
            overrides=list(overrides),
            choices=labels,
            planned_memory_bytes=planned_memory_bytes,
        )

    def failed(self, error: str, *, wall_s: float, status: str = "failed") -> None:
        """Record how the job ended when it did not complete."""
        self.status = status
        self.error = error.splitlines()[0] if error else error
        if self.wall_s is None:
            self.wall_s = round(wall_s, 3)

    def to_json(self) -> dict[str, Any]:
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is None and f.name in LEARNT:
                continue
            out[f.name] = value
        return finite(out)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Summary:
        """Read a summary back; keys it does not know (an older or newer launcher's) are left out."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{key: value for key, value in data.items() if key in names})


_FIELDS = [f.name for f in dataclasses.fields(Summary)]
# The fields training fills in as it learns them (optimizer .. samples_per_source).
LEARNT = frozenset(_FIELDS[_FIELDS.index("optimizer") :])
