"""launcher.tune.tuner: the tuning as `python -m launcher.tune` runs it (`main(argv)` in this process): its
bad input in one line, its candidates planned, and (slow) one real tuning of the built-in tiny model.

The real tuning runs real candidates (run_job, DeepSpeed, each rank a child process), one forced over the
memory budget and one forced to crash (the fault hook, set for that candidate only), and W&B offline, read
back with W&B's own CLI. `python -m launcher.tune` as a subprocess is in tests/e2e/test_tools.py.
"""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

from launcher.core.errors import LauncherError
from launcher.tune import tuner
from launcher.tune.decide import MiB
from launcher.tune.runner import CANDIDATE_ENV
from tests.helpers import compose_typed, run_here, subprocess_env


@pytest.mark.parametrize(
    ("args", "code", "message"),
    [
        (["tune.measure_steps=0"], 2, "tune.measure_steps=0 must be 1 or more"),
        (["tune.memory_gb=-1"], 2, "tune.memory_gb=-1.0 must be positive"),
        (["tune.skip_margin=-0.1"], 2, "tune.skip_margin=-0.1 must be positive"),
        (["tune.micro_batch_sizes=[5]", "train.micro_batch_size=4", "train.global_batch_size=8"], 2, "no candidate"),
        (["tune.presets=[z9]"], 1, "tune.presets"),
        (["tune.micro_batch_sizes=[0]"], 2, "tune.micro_batch_sizes=[0] must list positive micro batch sizes"),
        (["tune.pack_lengths=[8]", "tune.batching=[pack]"], 2, "tune.pack_lengths=[8] must list row lengths of 16"),
        (["tune.pack_lengths=[1024]"], 2, "tune.pack_lengths=[1024] without pack in tune.batching"),
        (["tune.batching=[group,pack]"], 2, "tune.batching has pack but no row length: set tune.pack_lengths"),
        (["tune.batching=[squeeze]"], 1, "tune.batching"),
        (["tune.kernels=[fused]"], 1, "tune.kernels"),
        (
            ["tune.kernels=[torch,liger]", "model.compile=true"],
            2,
            "tune.kernels=[torch,liger]: model.compile=true and model.kernels=liger both fuse each layer's MLP",
        ),
    ],
)
def test_bad_tune_settings_are_one_line(args, code, message, tmp_path, capsys):
    assert tuner.main(["logger=none", f"tune.dir={tmp_path / 'tune'}", *args]) == code
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and message in errors[0], err[-2000:]
    assert "Traceback" not in err
    assert not (tmp_path / "tune" / "tune.md").exists()


def test_a_job_given_in_epochs_is_planned_in_its_steps_and_its_packed_candidates_are_refused(tmp_path):
    """The recipes give their length in epochs (conf/recipe/): each candidate's DeepSpeed dict counts the
    steps train.py counts, so best.yaml's dry run reproduces it; a packed job cannot count epochs, so its
    candidates fail with train.py's own line instead of a pick whose best.yaml does not run."""
    overrides = ["train.epochs=2", "train.micro_batch_size=4", "train.global_batch_size=8", "data.max_length=256",
                 "tune.presets=[z0]", "tune.precisions=[fp32]", "tune.micro_batch_sizes=[4]",
                 "tune.gradient_checkpointing=[false]", "tune.batching=[pad,pack]", f"tune.dir={tmp_path / 'tune'}",
                 "logger=none"]  # fmt: skip
    cfg = compose_typed(overrides)
    assert cfg.train.max_steps is None
    padded, packed = tuner._tuning(cfg, overrides).results
    assert padded.status == "not run" and padded.planned
    assert padded.ds_config["scheduler"]["params"]["total_num_steps"] == 2 * cfg.data.n_train // 8
    assert packed.status == "failed" and packed.note.startswith("train.epochs with data.packing=true"), packed.note


def test_the_candidates_are_planned_before_any_runs(tmp_path):
    overrides = ["train.micro_batch_size=8", "train.global_batch_size=16", "tune.presets=[z2]", "train.lr=3e-4",
                 "tune.precisions=[fp32]", "tune.micro_batch_sizes=[4,8,3]", "tune.gradient_checkpointing=[false]",
                 "tune.memory_gb=2.5", f"tune.dir={tmp_path / 'tune'}", "deepspeed=z3", "logger=none"]  # fmt: skip
    t = tuner._tuning(compose_typed(overrides), overrides)
    assert [r.name for r in t.results] == ["z2-fp32-mb4", "z2-fp32-mb8"]
    assert all(r.status == "not run" for r in t.results)
    assert t.base == ["train.lr=3e-4"]  # the job's own, less what candidates set and what only the tuner reads
    assert (t.global_batch, t.world_size, t.budget) == (16, 1, int(2.5 * 2**30))
    assert t.left_out == ["micro batch 3: the global batch 16 is no multiple of micro batch x 1 rank(s)"]
    assert t.space_line.startswith(
        "tune: 2 candidates (1 presets x 1 precisions x 2 micro batch sizes x 1 checkpointing)"
    )
    assert "budget 2560 MiB per rank (tune.memory_gb=2.5)" in t.space_line
    for result in t.results:
        assert result.planned == sum(result.components.values()) > 0
        assert set(result.components) == {"model states", "activations", "step+buffers"}
        assert result.ds_config["zero_optimization"]["stage"] == 2  # the candidate's preset, not the job's z3
        assert result.ds_config["optimizer"]["params"]["lr"] == 3e-4
    small, large = t.results
    assert (
        large.ds_config["train_micro_batch_size_per_gpu"] == 8 and large.ds_config["gradient_accumulation_steps"] == 2
    )
    assert (
        small.ds_config["train_micro_batch_size_per_gpu"] == 4 and small.ds_config["gradient_accumulation_steps"] == 4
    )
    assert small.components["activations"] < large.components["activations"]  # half the micro batch
    # a tuning directory is never written over
    (tmp_path / "tune").mkdir()
    (tmp_path / "tune" / "tune.md").write_text("an earlier tuning")
    with pytest.raises(LauncherError, match=r"already holds a tuning \(tune.md\): choose a new directory"):
        tuner._tuning(compose_typed(overrides), overrides)


def test_batching_candidates_are_planned_and_one_the_job_cannot_honour_fails_before_running(tmp_path):
    """tune.batching x tune.pack_lengths: a packed row plans the activations of its row length; a streamed
    job cannot group or pack (train.py refuses both), so those candidates fail in planning, in one line."""
    overrides = ["train.micro_batch_size=4", "train.global_batch_size=8", "tune.presets=[z0]",
                 "data.group_by_length=true", "tune.precisions=[fp32]", "tune.micro_batch_sizes=[4]",
                 "tune.gradient_checkpointing=[false]",
                 "tune.batching=[pad,group,pack]", "tune.pack_lengths=[512,1024]", f"tune.dir={tmp_path / 'tune'}",
                 "logger=none"]  # fmt: skip
    t = tuner._tuning(compose_typed(overrides), overrides)
    assert [r.name for r in t.results] == [
        "z0-fp32-mb4-pad", "z0-fp32-mb4-group", "z0-fp32-mb4-pack512", "z0-fp32-mb4-pack1024"
    ]  # fmt: skip
    assert t.base == [] and "x 4 batching)" in t.space_line
    assert all(r.status == "not run" for r in t.results)
    pad, _, pack512, pack1024 = t.results
    assert pad.components["activations"] < pack512.components["activations"] < pack1024.components["activations"]
    streamed = [*overrides[:3], "data.streaming=true", *overrides[4:]]
    t = tuner._tuning(compose_typed(streamed), streamed)
    assert [r.status for r in t.results] == ["not run", "failed", "failed", "failed"]
    assert t.results[1].note.startswith("data.streaming=true with data.group_by_length=true")
    assert t.results[2].note.startswith("data.packing=true with data.streaming=true")


def test_the_tuner_builds_the_data_cache_first_and_plans_its_candidates_from_the_records(tmp_path):
    """The candidates would each find the cache the first one built: the tuner builds it before planning
    (as `python -m launcher.prepare` does), so a padded candidate is planned at the longest record's tokens,
    not at data.max_length; a second tuning finds it built."""
    overrides = ["train.micro_batch_size=4", "train.global_batch_size=8", "tune.presets=[z0]", "data.n_train=200",
                 "data.n_eval=8", "data.max_length=1024", f"cache_dir={tmp_path / 'cache'}", "tune.precisions=[fp32]",
                 "tune.micro_batch_sizes=[4]", "tune.gradient_checkpointing=[false]", "tune.batching=[pad]",
                 f"tune.dir={tmp_path / 'tune'}", "logger=none"]  # fmt: skip
    cfg = compose_typed(overrides)
    said: list[str] = []
    shapes = tuner._prepared_shapes(cfg, said.append)
    assert shapes is not None and len(shapes.lengths) == 200 and shapes.lengths.max() < 100
    assert said[0].startswith("tune: data cache built (200 train records, ") and "the longest " in said[0]
    (at_limit,) = tuner._tuning(cfg, overrides).results
    (from_records,) = tuner._tuning(cfg, overrides, lambda: shapes).results
    assert from_records.components["activations"] < at_limit.components["activations"] / 10
    assert from_records.components["model states"] == at_limit.components["model states"]
    assert tuner._prepared_shapes(cfg, said.append) is not None and said[1].startswith("tune: data cache found (200")


# ----------------------------------------------------------------------------- a real tuning
def _inspect(run: Path, *, summary: bool) -> dict:
    wandb_cli = Path(sys.executable).with_name("wandb")
    out = subprocess.run(
        [str(wandb_cli), "leet", "inspect", *(["--summary"] if summary else []), "--json", str(run)],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    if summary:
        return json.loads(out.stdout)
    records = [json.loads(line) for line in out.stdout.splitlines() if line.strip()]
    return next(r for r in records if r.get("type") == "run")["run"]


def _csv(path: Path) -> list[dict[str, str]]:
    with path.open() as handle:
        return list(csv.DictReader(handle))


@pytest.mark.slow
def test_a_tuning_goes_on_past_a_candidate_over_budget_and_one_that_crashes(tmp_path, monkeypatch, capsys):
    for key, value in subprocess_env(tmp_path).items():
        if key.startswith("WANDB_"):
            monkeypatch.setenv(key, value)
    # z2-fp32-mb8 holds 3000 MiB more from step 1 (over the 2.5 GiB budget); z2-fp32-mb4 crashes in step 2.
    monkeypatch.setenv(
        CANDIDATE_ENV, "z2-fp32-mb8:LAUNCHER_TEST_FAULT=0:1:alloc=3000;z2-fp32-mb4:LAUNCHER_TEST_FAULT=0:2"
    )
    directory = tmp_path / "tune"
    code = tuner.main(
        [
            "train.micro_batch_size=8",
            "train.global_batch_size=16",
            "tune.presets=[z0,z2]",
            "tune.precisions=[fp32]",
            "tune.micro_batch_sizes=[4,8]",
            "tune.gradient_checkpointing=[false]",
            "tune.memory_gb=2.5",
            "tune.early_skip=false",
            "tune.confirm_runs=1",  # 2 runs each, enough for the round's path (the default, 3, for users)
            f"tune.dir={directory}",
        ]
    )
    out, err = capsys.readouterr()
    assert code == 0, out[-3000:] + err[-3000:]
    rows = {row["candidate"]: row for row in _csv(directory / "tune.csv")}
    assert {name: row["status"] for name, row in rows.items()} == {
        "z0-fp32-mb4": "fits",
        "z0-fp32-mb8": "fits",
        "z2-fp32-mb4": "failed",
        "z2-fp32-mb8": "does not fit",
    }
    assert "fault injected by LAUNCHER_TEST_FAULT on rank 0 at step 2" in rows["z2-fp32-mb4"]["note"]
    assert "> budget 2560 MiB" in rows["z2-fp32-mb8"]["note"]
    assert float(rows["z2-fp32-mb8"]["peak_mib"]) > 2560
    for name in ("z0-fp32-mb4", "z0-fp32-mb8"):
        assert float(rows[name]["samples_per_s"]) > 0 and int(rows[name]["measured_steps"]) == 4
        assert float(rows[name]["tokens_per_s"]) > 0 and float(rows[name]["padding_frac"]) == 0.0  # equal lengths
        assert 300 < float(rows[name]["peak_mib"]) < 2560 and float(rows[name]["planned_mib"]) > 0
    # the same data order and seed: the two micro batch sizes see the same first batch (equal-length records)
    assert float(rows["z0-fp32-mb4"]["first_loss"]) == pytest.approx(float(rows["z0-fp32-mb8"]["first_loss"]), rel=1e-4)
    fitting = ("z0-fp32-mb4", "z0-fp32-mb8")
    runs = {name: [float(rate) for rate in rows[name]["runs_tokens_per_s"].split()] for name in fitting}
    # Both are ZeRO 0 without checkpointing: neither is simpler, so the faster median is the pick either way.
    best, slower = sorted(runs, key=lambda n: -float(rows[n]["tokens_per_s"]))
    tied = max(runs[slower]) >= sum(runs[best]) / 2  # a run of the other reached the pick's median (of two: the mean)
    report = (directory / "tune.md").read_text()
    assert f"**Pick: {best}**" in report and "best.yaml: verified" in report
    # The confirmation round: the two that fit ran once more each, in turn; each is the median of its runs.
    assert "confirm: z0-fp32-mb" in out and "[confirm 2] z0-fp32-mb4: fits:" in out
    for name, rates in runs.items():
        assert len(rates) == 2 and float(rows[name]["tokens_per_s"]) == pytest.approx(sum(rates) / 2, rel=1e-3)
        assert (directory / "logs" / f"{name}-run2.log").is_file()
        assert 0.0 <= float(rows[name]["others_cpu"]) <= 1.0
    assert "## Noise" in report and f"{best}: 2 runs, real tokens/s" in report
    assert f"kept {best}, no simpler configuration among them" in report if tied else "the pick " in report
    assert (directory / "tune.png").stat().st_size > 0 and not list(directory.glob("runs/*/model"))
    assert f"pick: {best}: fits:" in out and out.splitlines()[-1].startswith("  best.yaml verified")
    # each candidate's log: the launcher's lines, its rank's output, how it ended (as train.py prints it)
    crashed = (directory / "logs" / "z2-fp32-mb4.log").read_text()
    assert crashed.startswith("job: tiny_llava (full) on 1 rank (cpu), ZeRO 2") and "step 1/" in crashed
    error = crashed.splitlines()[-1]
    assert error.startswith("error: ") and "fault injected by LAUNCHER_TEST_FAULT on rank 0 at step 2" in error
    over = (directory / "logs" / "z2-fp32-mb8.log").read_text()
    assert "tune: z2-fp32-mb8 ended by the tuner: does not fit (a rank reached " in over
    # best.yaml, composed as train.py composes it, gives the candidate's DeepSpeed dict
    check = run_here([f"hydra.searchpath=[file://{directory}]", "experiment=best", "dry_run=true"], tmp_path / "check")
    assert check.outcome.status == "planned", check.error
    planned = {r["name"]: r for r in json.loads((directory / "results.json").read_text())}[best]["ds_config"]
    assert json.loads((tmp_path / "check" / "ds_config.json").read_text()) == planned == check.outcome.ds_config
    # W&B: one run per candidate in one group, and the report run with the table
    runs = {p.parent.parent.name: p for p in (directory / "wandb_runs").glob("*/wandb/offline-run-*")}
    assert set(runs) == {*rows, "report"}
    groups = {_inspect(path, summary=False)["run_group"] for path in runs.values()}
    assert len(groups) == 1 and groups.pop().startswith("tune-")
    assert _inspect(runs["z2-fp32-mb8"], summary=True)["summary"]["status"] == "does not fit"
    report_summary = _inspect(runs["report"], summary=True)["summary"]
    assert report_summary["pick"] == best and "tune/candidates" in report_summary
    assert f"W&B: {directory / 'wandb_runs'} (offline" in out
    assert "MiB" in out and rows[best]["peak_mib"] and float(rows[best]["peak_mib"]) * MiB < 2.5 * 2**30


def _variable_length_set(root: Path, records: int = 384) -> list[str]:
    """LLaVA JSON records of 1-3 images and questions of 0-80 words (about 20-140 tokens of the tiny
    model's); the overrides that read them."""
    import random

    from tests.helpers import conversation, write_images

    images = write_images(root / "img")
    rng = random.Random(0)
    rows = []
    for index in range(records):
        chosen = rng.sample(images, rng.randint(1, 3))
        question, answer = conversation(index, chosen)
        question = " ".join([question, *("and" for _ in range(rng.randint(0, 80)))])
        turns = [{"from": "human", "value": "<image>" * len(chosen) + question}, {"from": "gpt", "value": answer}]
        rows.append({"id": str(index), "images": chosen, "conversations": turns})
    (root / "train.json").write_text(json.dumps(rows))
    return ["data=llava_json", f"data.path={root / 'train.json'}", f"data.image_root={root / 'img'}"]


@pytest.mark.slow
def test_the_batching_axis_is_measured_by_real_tokens_and_packing_removes_the_padding(tmp_path, capsys):
    """Padding, grouping by length and packing on records of varied length: each candidate reports its
    padding share and MFU; the pick is the fastest by real (non-padding) tokens/s."""
    directory = tmp_path / "tune"
    code = tuner.main(
        [
            *_variable_length_set(tmp_path / "data"),
            "data.max_length=256",
            "data.eval_path=null",
            "train.micro_batch_size=4",
            "train.global_batch_size=8",
            "tune.presets=[z0]",
            "tune.precisions=[fp32]",
            "tune.micro_batch_sizes=[4]",
            "tune.gradient_checkpointing=[false]",
            "tune.batching=[pad,group,pack]",
            "tune.pack_lengths=[512]",
            "tune.measure_steps=3",
            "tune.early_skip=false",
            "tune.confirm_runs=0",  # the confirmation round: the test above
            "logger=none",
            f"tune.dir={directory}",
        ]
    )
    out, err = capsys.readouterr()
    assert code == 0, out[-3000:] + err[-3000:]
    rows = {row["candidate"]: row for row in _csv(directory / "tune.csv")}
    assert {name: row["status"] for name, row in rows.items()} == dict.fromkeys(
        ["z0-fp32-mb4-pad", "z0-fp32-mb4-group", "z0-fp32-mb4-pack512"], "fits"
    )
    padding = {name: float(row["padding_frac"]) for name, row in rows.items()}
    # grouping and packing both leave little (on this set grouping ~1%, as much as packing: docs/data.md)
    assert max(padding["z0-fp32-mb4-pack512"], padding["z0-fp32-mb4-group"]) < 0.05 < padding["z0-fp32-mb4-pad"]
    assert all(float(row["mfu"]) > 0 for row in rows.values())  # against this CPU's measured matmul peak
    # a packed micro batch of 4 rows of 512 tokens holds more records than 4: samples/s counts records
    pack, pad = rows["z0-fp32-mb4-pack512"], rows["z0-fp32-mb4-pad"]
    assert float(pack["tokens_per_s"]) / float(pack["samples_per_s"]) == pytest.approx(
        float(pad["tokens_per_s"]) / float(pad["samples_per_s"]), rel=0.5
    )  # real tokens per record: the same records' mean, whatever the batching
    best = max(rows, key=lambda name: float(rows[name]["tokens_per_s"]))
    assert f"**Pick: {best}**" in (directory / "tune.md").read_text()
    import yaml

    data = yaml.safe_load((directory / "experiment" / "best.yaml").read_text())["data"]
    assert (data["packing"], data["group_by_length"]) == {"pad": (False, False), "group": (False, True)}.get(
        best.rsplit("-", 1)[1], (True, False)
    )


def test_with_stages_the_candidates_train_the_heaviest_stage_alone(tmp_path):
    """A short run of the schedule would train its first stage (the projector alone): the candidates train
    the stage with the most to train, and best.yaml keeps the schedule."""
    schedule = "train.stages=[{steps: 10, train: [projector]}, {train: [projector, language]}]"
    overrides = ["train.micro_batch_size=8", "tune.presets=[z2]", "tune.precisions=[fp32]",
                 "tune.micro_batch_sizes=[8]", "tune.gradient_checkpointing=[false]", "tune.memory_gb=2.5",
                 f"tune.dir={tmp_path / 'tune'}", "train.max_steps=40", schedule]  # fmt: skip
    t = tuner._tuning(compose_typed(overrides), overrides)
    assert schedule in t.base
    assert t.trial_overrides == [
        "train.stages=null", "model.freeze_vision=true", "model.freeze_projector=false", "model.freeze_language=false"
    ]  # fmt: skip
    assert "train.stages=null" not in t.command_line(t.results[0])
