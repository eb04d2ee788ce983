"""Batch arithmetic: global batch = micro batch x accumulation steps x world size (pure).

Any two of `train.micro_batch_size`, `train.grad_accum` and `train.global_batch_size` determine the
third (a micro batch alone means no accumulation). With a `deepspeed_json` base some of the three may
come from the file: an error then says where each number came from (the file, an override, a default).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from launcher.config.tree import is_unset
from launcher.core.errors import LauncherError

# The train.* batch keys and the DeepSpeed keys they name, in the order a base JSON's values are kept.
TRAIN_BATCH_KEYS = {
    "micro_batch_size": "train_micro_batch_size_per_gpu",
    "grad_accum": "gradient_accumulation_steps",
    "global_batch_size": "train_batch_size",
}
BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


@dataclass(frozen=True)
class BatchSizes:
    micro: int
    accum: int
    total: int  # micro x accum x world size: what DeepSpeed calls train_batch_size


def resolve_batch_sizes(micro: int | None, accum: int | None, total: int | None, world_size: int) -> BatchSizes:
    """Derive the missing one of (micro batch per device, accumulation steps, global batch).

    total = micro x accum x world_size. Any two determine the third; micro alone means accum=1.
    """
    if world_size < 1:
        raise LauncherError(f"world size must be at least 1, got {world_size}")
    for key, value in (
        ("train.micro_batch_size", micro),
        ("train.grad_accum", accum),
        ("train.global_batch_size", total),
    ):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise LauncherError(f"{key}={value} must be a positive integer")
    if micro is not None and accum is None and total is None:
        accum = 1
    if micro is not None and accum is not None:
        if total is not None and total != micro * accum * world_size:
            raise LauncherError(
                f"inconsistent batch sizes: train.global_batch_size={total} but train.micro_batch_size="
                f"{micro} x train.grad_accum={accum} x world size {world_size} = {micro * accum * world_size};"
                " give only two of the three"
            )
        return BatchSizes(micro, accum, micro * accum * world_size)
    if total is None:
        raise LauncherError(
            "batch size is underdetermined: give two of train.micro_batch_size, train.grad_accum and "
            "train.global_batch_size"
        )
    known_key, known = ("train.micro_batch_size", micro) if micro is not None else ("train.grad_accum", accum)
    if known is None:
        raise LauncherError(
            "batch size is underdetermined: with train.global_batch_size also give train.micro_batch_size "
            "or train.grad_accum"
        )
    if total % (known * world_size):
        raise LauncherError(
            f"train.global_batch_size={total} is not divisible by {known_key}={known} x world size "
            f"{world_size} = {known * world_size}; pick a global batch that is a multiple of it"
        )
    other = total // (known * world_size)
    if micro is not None:
        return BatchSizes(micro=known, accum=other, total=total)
    return BatchSizes(micro=other, accum=known, total=total)


@dataclass(frozen=True)
class _Given:
    """One batch size to resolve and where it came from, so that an error can say so."""

    value: Any
    key: str  # train.micro_batch_size, ...
    ds_key: str  # train_micro_batch_size_per_gpu, ...
    origin: str  # "override" (named on the command line), "default" (the train node) or "file"
    file: str = ""  # the base JSON, for origin "file"

    def said(self, *, file_named: bool = False) -> str:
        if self.origin == "override":
            return f"{self.key}={self.value}"
        if self.origin == "default":
            return f"the default {self.key}={self.value}"
        if file_named:
            return f"the file's {self.ds_key}={self.value}"
        return f"{self.ds_key}={self.value} (from {self.file})"

    def subject(self) -> str:
        """As the start of a sentence: a file's value names the file."""
        return f"{self.file} sets {self.ds_key}={self.value}" if self.origin == "file" else self.said()


def batch_givens(
    train: Mapping[str, Any], base: Mapping[str, Any] | None, explicit_groups: frozenset[str], source: str
) -> tuple[_Given, _Given, _Given]:
    """(micro, accumulation, global) to resolve, each with where it came from.

    Batch keys named on the command line win (a `train=` choice names all three). A base JSON's
    concrete values fill the others: with none named, all of them (they must agree); else its micro
    batch, then its accumulation, then its global batch, until two are known (the third is derived).
    If the batch is still open, the train node's values fill in (its micro batch first)."""
    named = {name for name in TRAIN_BATCH_KEYS if "train" in explicit_groups or f"train.{name}" in explicit_groups}
    ours = {
        name: _Given(train[name], f"train.{name}", ds_key, "override" if name in named else "default")
        for name, ds_key in TRAIN_BATCH_KEYS.items()
    }
    files = {
        name: _Given(base[ds_key], f"train.{name}", ds_key, "file", source)
        for name, ds_key in TRAIN_BATCH_KEYS.items()
        if base is not None and name not in named and not is_unset(base.get(ds_key))
    }
    if not files:
        return ours["micro_batch_size"], ours["grad_accum"], ours["global_batch_size"]
    givens = {name: ours[name] for name in named}
    for name, given in files.items():
        if named and sum(g.value is not None for g in givens.values()) >= 2:
            break
        givens[name] = given
    for name, given in ours.items():
        if _determined(*(givens[n].value if n in givens else None for n in TRAIN_BATCH_KEYS)):
            break
        givens.setdefault(name, given)
    unset = {name: _Given(None, given.key, given.ds_key, given.origin) for name, given in ours.items()}
    micro, accum, total = ({**unset, **givens}[name] for name in TRAIN_BATCH_KEYS)
    return micro, accum, total


def _determined(micro: Any, accum: Any, total: Any) -> bool:
    """Whether (micro, accumulation, global) fix the batch: a micro batch alone means accumulation 1."""
    return micro is not None or (accum is not None and total is not None)


def resolve_givens(givens: tuple[_Given, _Given, _Given], world_size: int) -> BatchSizes:
    """`resolve_batch_sizes`, with errors that name where each number came from when a base JSON
    gave some of them: the file's keys, the user's overrides and the defaults involved."""
    micro, accum, total = givens
    if world_size < 1 or all(given.origin != "file" for given in givens):
        return resolve_batch_sizes(micro.value, accum.value, total.value, world_size)
    for given in givens:
        value = given.value
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            if given.origin == "file":
                raise LauncherError(
                    f'{given.file} sets {given.ds_key}={value}, which must be a positive integer (or "auto" to '
                    f"derive it): fix it in the file, or set {given.key}"
                )
            raise LauncherError(f"{given.key}={value} must be a positive integer")
    m, a, t = micro.value, accum.value, total.value
    if m is not None and a is not None and t is not None and t != m * a * world_size:
        if all(given.origin == "file" for given in givens):
            fix = (
                'set one of them to "auto" in the file (it is then derived), or override one with '
                "train.global_batch_size, train.micro_batch_size or train.grad_accum"
            )
        else:
            fix = _batch_fix(givens)
        file_named = total.origin == "file"
        raise LauncherError(
            f"inconsistent batch sizes: {total.subject()}, but {micro.said(file_named=file_named)} x "
            f"{accum.said(file_named=file_named)} x world size {world_size} = {m * a * world_size}: {fix}"
        )
    if t is not None and (m is None) != (a is None):
        known = micro if m is not None else accum
        if t % (known.value * world_size):
            times = f" = {known.value * world_size}" if world_size > 1 else ""
            raise LauncherError(
                f"{total.subject()}{', which' if total.origin == 'file' else ''} is not divisible by "
                f"{known.said(file_named=total.origin == 'file')} x world size {world_size}{times}: "
                f"{_batch_fix((total, known))}"
            )
    if not _determined(m, a, t):
        known = ", ".join(given.said() for given in givens if given.value is not None)
        file = next(given.file for given in givens if given.origin == "file")
        raise LauncherError(
            f"batch size is underdetermined ({known}): give two of train.micro_batch_size, train.grad_accum and "
            f"train.global_batch_size, or set them in {file}"
        )
    return resolve_batch_sizes(m, a, t, world_size)


def _batch_fix(involved: tuple[_Given, ...]) -> str:
    """What to change: a default the user never set, else the overrides and the file's keys involved."""
    defaults = [given for given in involved if given.origin == "default"]
    if defaults:
        return "set " + " or ".join(f"{given.key} (or {given.ds_key} in the file)" for given in defaults)
    options = [" or ".join(given.key for given in involved if given.origin == "override")]
    files = [given for given in involved if given.origin == "file"]
    if files:
        options.append(
            f"{' or '.join(given.ds_key for given in files)} in the file "
            f"(or set {' or '.join(given.key for given in files)})"
        )
    return "change " + ", or ".join(option for option in options if option)
