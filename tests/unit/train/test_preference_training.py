"""Preference training in this process, on gloo (loss=dpo): the loss starts at log 2, the three references
give the same losses (LLaVA and Qwen2-VL), a stopped run resumes bitwise, and a reference of other data is
refused in one line.
Two ranks, ZeRO-3 and learning the built-in preference task: tests/e2e/test_preference.py."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

from launcher.core.rundir import RunDir
from tests.helpers import losses, read_metrics, read_summary

JOB = (
    "loss=dpo",
    "logger=none",
    "data.task=colour",
    "data.n_train=48",
    "data.n_eval=16",
    "data.eval_accuracy=false",
    "train.micro_batch_size=4",
    "train.max_steps=4",
    "train.eval_every=2",
    "train.save_every=2",
)


def _eval_losses(run_dir) -> list[float]:
    return [row["eval/loss"] for row in read_metrics(run_dir) if "eval/loss" in row]


def test_dpo_starts_at_log_2_and_its_references_agree_and_a_stopped_run_resumes_bitwise(train_in_process, tmp_path):
    precomputed = train_in_process(*JOB, run_dir=tmp_path / "precomputed")
    assert precomputed.outcome.status == "completed", precomputed.outcome.error
    rows = read_metrics(precomputed.run_dir)
    assert rows[0]["train/loss"] == pytest.approx(math.log(2.0), abs=1e-6)  # the policy is the reference
    assert rows[0]["train/rewards_margin"] == pytest.approx(0.0, abs=1e-6)
    for key in ("rewards_chosen", "rewards_rejected", "rewards_margin", "rewards_accuracy"):
        assert f"train/{key}" in rows[-1] and f"eval/{key}" in rows[-1]
    assert rows[-1]["train/loss"] < math.log(2.0)  # it learns
    reference = precomputed.summary()["reference"]
    assert reference["kind"] == "precomputed"
    meta = json.loads((Path(reference["path"]) / "meta.json").read_text())
    assert meta["pairs"] == {"train": 48, "eval": 16} and meta["model"] == precomputed.summary()["base_model"]

    live = train_in_process(*JOB, "loss.reference=live", run_dir=tmp_path / "live")
    assert live.outcome.status == "completed", live.outcome.error
    assert losses(live.run_dir) == pytest.approx(losses(precomputed.run_dir), abs=1e-5)
    assert _eval_losses(live.run_dir) == pytest.approx(_eval_losses(precomputed.run_dir), abs=1e-5)

    stopped = RunDir(tmp_path / "stopped")
    stopped.path.mkdir()
    stopped.stop_file.touch()
    first = train_in_process(*JOB, run_dir=stopped.path)
    assert first.outcome.status == "preempted" and read_summary(stopped.path)["steps"] == 1
    stopped.stop_file.unlink()
    kept = Path(reference["path"]).rename(tmp_path / "kept")  # the reference gone: a trained run cannot remake it
    refused = train_in_process(f"resume={stopped.path}", run_dir=stopped.path)
    assert refused.outcome.status == "failed" and "is missing, and this run has trained steps" in refused.outcome.error
    kept.rename(reference["path"])
    resumed = train_in_process(f"resume={stopped.path}", run_dir=stopped.path)
    assert resumed.outcome.status == "completed", resumed.outcome.error
    assert read_summary(stopped.path)["reference"]["computed"] is False
    assert losses(stopped.path) == losses(precomputed.run_dir)  # bitwise: the reference read back, not recomputed
    assert _eval_losses(stopped.path) == _eval_losses(precomputed.run_dir)

    other_data = train_in_process(
        *JOB, "data.n_train=40", f"loss.reference_path={reference['path']}", run_dir=tmp_path / "other"
    )
    assert other_data.outcome.status == "failed"
    assert "computed for another model or data" in other_data.outcome.error
    assert "\n" not in other_data.outcome.error


@pytest.mark.parametrize(
    ("extra", "other"),
    [
        # LoRA: the base under the disabled adapter (and data other than the test above's, whose reference
        # it moves away for a while).
        (("data.n_train=56", "method=lora", "model.tiny_base=random"), "adapter"),
        # Qwen2-VL: its rows carry image grids and token types beside the pixels, which the pairs' batches keep.
        (("model=tiny_qwen2_vl", "train.max_steps=2"), "live"),
    ],
    ids=["lora-adapter", "qwen2_vl-live"],
)
def test_another_reference_gives_the_precomputed_ones_losses_from_log_2(train_in_process, tmp_path, extra, other):
    runs = {}
    for reference in ("precomputed", other):
        ran = train_in_process(*JOB, *extra, f"loss.reference={reference}", run_dir=tmp_path / reference)
        assert ran.outcome.status == "completed", ran.outcome.error
        runs[reference] = ran.run_dir
    assert losses(runs[other])[0] == pytest.approx(math.log(2.0), abs=1e-6)
    assert losses(runs[other]) == pytest.approx(losses(runs["precomputed"]), abs=1e-5)
    assert _eval_losses(runs[other]) == pytest.approx(_eval_losses(runs["precomputed"]), abs=1e-5)


def _flip_bytes(file: Path) -> None:
    data = bytearray(file.read_bytes())
    for at in range(len(data) - 56, len(data)):  # the log-probs, after the header: same size, other numbers
        data[at] ^= 0x5A
    file.write_bytes(bytes(data))


# Data of this test's own (the reference's key with it): the cache is shared, and this test damages its reference.
OWN = (*JOB, "data.n_train=44")
DAMAGE = {
    "truncated": lambda file: file.write_bytes(file.read_bytes()[:40]),
    "bytes-flipped": _flip_bytes,
    "missing": lambda file: file.unlink(),
    "broken-meta": lambda file: (file.parent / "meta.json").write_text('{"key": '),
}


def test_a_damaged_precomputed_reference_is_never_trained_on(train_in_process, tmp_path, caplog):
    """Each chunk's size and checksum are in the reference's meta.json. A chunk truncated, changed in place
    (the same size: the case that trained silently wrong, step-1 loss 0.589 instead of log 2) or missing, or
    a meta.json that does not parse: a new run says which file and why in one line, computes it again and
    trains as on the intact reference; a resumed run, which cannot remake it, and a reference given by
    loss.reference_path are refused in one line naming the file."""
    clean = train_in_process(*OWN, run_dir=tmp_path / "clean")
    assert clean.outcome.status == "completed", clean.outcome.error
    said = caplog.messages
    assert "data: 44 train preference pairs" in said and "data: 16 eval preference pairs" in said  # not rows
    reference = Path(clean.summary()["reference"]["path"])
    meta = json.loads((reference / "meta.json").read_text())
    assert set(meta["chunks"]) == {"train-00000.npy", "eval-00000.npy"}
    assert all(set(record) == {"bytes", "sha256"} for record in meta["chunks"].values())

    for kind, harm in DAMAGE.items():
        harm(reference / "train-00000.npy")
        caplog.clear()
        again = train_in_process(*OWN, run_dir=tmp_path / kind)
        assert again.outcome.status == "completed", (kind, again.outcome.error)
        assert again.summary()["reference"]["computed"] is True, kind
        said = [r.getMessage() for r in caplog.records if "is damaged" in r.getMessage()]
        assert len(said) == 1 and "computing it again" in said[0] and "\n" not in said[0], (kind, said)
        assert losses(tmp_path / kind) == losses(clean.run_dir), kind  # from log 2, as on the intact reference
        assert json.loads((reference / "meta.json").read_text())["chunks"] == meta["chunks"], kind

    stopped = RunDir(tmp_path / "stopped")  # a run with steps trained cannot remake its reference
    stopped.path.mkdir()
    stopped.stop_file.touch()
    assert train_in_process(*OWN, run_dir=stopped.path).outcome.status == "preempted"
    stopped.stop_file.unlink()
    _flip_bytes(reference / "train-00000.npy")
    refused = train_in_process(f"resume={stopped.path}", run_dir=stopped.path)
    assert refused.outcome.status == "failed"
    assert "is damaged (train-00000.npy: its checksum differs" in refused.outcome.error
    assert "restore it, or start a new run" in refused.outcome.error

    _flip_bytes(reference / "eval-00000.npy")
    given = train_in_process(*OWN, f"loss.reference_path={reference}", run_dir=tmp_path / "given")
    assert given.outcome.status == "failed"
    said = given.outcome.error
    assert f"{reference / 'train-00000.npy'} is damaged (its checksum differs" in said and "(and 1 more)" in said
    assert "\n" not in said
    assert (reference / "eval-00000.npy").is_file()  # a reference the user gave is left as it is
    shutil.rmtree(reference)  # the next run of this test computes it anew
