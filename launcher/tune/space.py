"""The tuner's search space: candidates (preset x precision x micro batch x checkpointing x attention x
batching), each the overrides `python train.py OVERRIDES CANDIDATE` adds to the job's command line."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from launcher.core.overrides import override_key
from launcher.job.planning import VARIANT_KEYS

# The overrides a candidate sets; the user's own values of these are replaced (with the keys of
# launcher.job.variant_overrides: deepspeed, zero, offload, precision).
_CANDIDATE_KEYS = (
    "train.micro_batch_size",
    "train.grad_accum",
    "train.global_batch_size",
    "model.gradient_checkpointing",
    "model.vision_gradient_checkpointing",
)


# The overrides a batching choice sets (tune.batching): replaced when the tuner tunes it.
_BATCHING_KEYS = ("data.group_by_length", "data.packing", "data.pack_length")

# How a micro batch is filled: plain padding to its longest record, records grouped by length, or
# records packed into rows of data.pack_length tokens.
BATCHINGS = ("pad", "group", "pack")


# Overrides of the tuner itself, or of one job only, which a candidate's command line leaves out.
_TUNER_ONLY = ("tune", "hydra", "dry_run", "resume", "preflight", "logger")


# ================================================================================ the space
@dataclass(frozen=True)
class Candidate:
    """One configuration: what `python train.py OVERRIDES CANDIDATE` changes."""

    preset: str
    precision: str
    micro: int
    accum: int
    checkpointing: bool
    attention: str | None = None  # None: the job's own model.attn_implementation
    batching: str | None = None  # pad | group | pack (BATCHINGS); None: the job's own data.* settings
    pack_length: int | None = None  # tokens per packed row (pack); None: the job's data.pack_length
    kernels: str | None = None  # torch | liger (model.kernels); None: the job's own

    @property
    def name(self) -> str:
        parts = [self.preset, self.precision, f"mb{self.micro}"]
        if self.checkpointing:
            parts.append("gc")
        if self.attention:
            parts.append(self.attention)
        if self.batching:
            parts.append(f"{self.batching}{self.pack_length or ''}")
        if self.kernels:
            parts.append(self.kernels)
        return "-".join(parts)

    @property
    def group(self) -> tuple[str, str, bool, str | None, str | None, int | None, str | None]:
        """Candidates that differ only in micro batch size (memory grows with it)."""
        return (
            self.preset, self.precision, self.checkpointing, self.attention, self.batching, self.pack_length,
            self.kernels,
        )  # fmt: skip

    @property
    def twin_key(self) -> tuple[str, str, int, str | None, str | None, int | None, str | None]:
        """Everything but gradient checkpointing: a candidate and its twin with checkpointing share it."""
        return (self.preset, self.precision, self.micro, self.attention, self.batching, self.pack_length, self.kernels)

    def overrides(self, global_batch: int) -> list[str]:
        flag = "true" if self.checkpointing else "false"
        line = [
            f"deepspeed={self.preset}",
            f"precision={self.precision}",
            f"train.micro_batch_size={self.micro}",
            "train.grad_accum=null",
            f"train.global_batch_size={global_batch}",
            f"model.gradient_checkpointing={flag}",
            f"model.vision_gradient_checkpointing={flag}",
        ]
        if self.attention:
            line.append(f"model.attn_implementation={self.attention}")
        if self.batching:
            packing = self.batching == "pack"
            line += [
                f"data.group_by_length={'true' if self.batching == 'group' else 'false'}",
                f"data.packing={'true' if packing else 'false'}",
            ]
            if packing and self.pack_length:
                line.append(f"data.pack_length={self.pack_length}")
        if self.kernels:
            line.append(f"model.kernels={self.kernels}")
        return line


def base_overrides(
    overrides: Sequence[str],
    *,
    tunes_attention: bool,
    tunes_batching: bool = False,
    tunes_pack_length: bool = False,
    tunes_kernels: bool = False,
) -> list[str]:
    """The job's overrides without those a candidate sets or only the tuner reads. The job's
    data.pack_length stays when the tuner tunes batching but not row lengths: its packed candidates use it."""
    replaced = (
        *VARIANT_KEYS,
        *_CANDIDATE_KEYS,
        *(("model.attn_implementation",) if tunes_attention else ()),
        *(("model.kernels",) if tunes_kernels else ()),
        *(_BATCHING_KEYS[:2] if tunes_batching else ()),
        *(_BATCHING_KEYS[2:] if tunes_pack_length else ()),
    )
    kept = []
    for override in overrides:
        key = override_key(override)
        if key in replaced or key.split(".", 1)[0] in _TUNER_ONLY:
            continue
        kept.append(override)
    return kept


def search_space(
    presets: Sequence[str],
    precisions: Sequence[str],
    micro_batch_sizes: Sequence[int],
    checkpointing: Sequence[bool],
    attentions: Sequence[str | None],
    *,
    global_batch: int,
    world_size: int,
    batchings: Sequence[tuple[str | None, int | None]] = ((None, None),),
    kernels: Sequence[str | None] = (None,),
) -> tuple[list[Candidate], list[str]]:
    """Every combination, in the order they run (presets as given, fastest-first by convention; in a
    group, micro batch sizes ascending, so a group's first candidate calibrates the predictions for
    the larger ones); and a line per micro batch size left out because it cannot keep the global batch.
    `batchings`: (pad | group | pack, tokens per packed row or None), or (None, None) for the job's own.
    A packed candidate's micro batch counts rows, each holding several records: compare by real tokens/s.
    `kernels`: model.kernels of each candidate (torch | liger), or None for the job's own."""
    per_rank = global_batch // world_size
    micros, left_out = [], []
    for micro in sorted(set(micro_batch_sizes)):
        if micro < 1 or global_batch % (micro * world_size):
            left_out.append(
                f"micro batch {micro}: the global batch {global_batch} is no multiple of micro batch x "
                f"{world_size} rank(s)"
            )
        elif micro <= per_rank:
            micros.append(micro)
        else:
            left_out.append(f"micro batch {micro}: above the global batch per rank ({per_rank})")
    candidates = [
        Candidate(
            preset, precision, micro, global_batch // (micro * world_size), gc, attention, batching, budget, kernel
        )
        for preset in presets
        for precision in precisions
        for gc in checkpointing
        for attention in attentions
        for batching, budget in batchings
        for kernel in kernels
        for micro in micros
    ]
    return candidates, left_out


def default_micro_batch_sizes(micro: int) -> list[int]:
    return sorted({max(1, micro // 2), micro, micro * 2})
