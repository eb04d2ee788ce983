"""`resume=DIR|auto`, decided once by launcher.job.resume: which job is continued (`continued`), from
which checkpoint, or why not (`decide`), and what the user is told (`schedule_change`, damaged
checkpoints passed over).

The decisions read one real run (`saved_run`: 4 steps, checkpoints at steps 2 and 4), copied where a
test changes it. The runs that continue train their one rank in this process (`train_in_process`).
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from pathlib import Path

import pytest

from launcher.config.compose import compose
from launcher.config.schema import Config, typed
from launcher.core.checkpoints import CheckpointMarker, lr_schedule_of
from launcher.core.errors import LauncherError
from launcher.core.rundir import RunDir
from launcher.job.planning import plan_job, training_length
from launcher.job.resume import continued, decide, schedule_change
from launcher.job.spec import Job, Resume
from launcher.launch.run import run_job
from tests.helpers import Ran, hydra_job, read_metrics, read_summary, run_here, train_here

SAVED = (
    "logger=none",
    "train.micro_batch_size=4",
    "train.eval_every=0",
    "data.eval_accuracy=false",
    "train.max_steps=4",
    "train.save_every=2",
)


@pytest.fixture(scope="module")
def saved_run(process_group: None, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One completed 4-step run with checkpoints at steps 2 and 4, read by the tests (copied where changed)."""
    run_dir = tmp_path_factory.mktemp("saved") / "run"
    ran = run_here(list(SAVED), run_dir, start=train_here)
    assert ran.outcome.status == "completed", ran.outcome.error
    return run_dir


def copy_of(run_dir: Path, where: Path) -> Path:
    shutil.copytree(run_dir, where)
    return where


def planned(overrides: Sequence[str], run_dir: Path, *, multirun: bool = False) -> tuple[Config, Job]:
    """The job `python train.py OVERRIDES` plans in `run_dir`, continued as the launcher continues it,
    before the resume is decided (launcher.launch.run)."""
    cfg, hydra = compose(list(overrides)), hydra_job(overrides, run_dir, multirun=multirun)
    if (job := continued(cfg, hydra)) is not None:
        cfg, hydra = job.cfg, job.hydra
    config, _ = training_length(typed(cfg))
    return config, plan_job(config, hydra)


def curves(run_dir: Path) -> dict[str, list[float]]:
    rows = read_metrics(run_dir)
    return {key: [row[key] for row in rows] for key in ("step", "train/loss", "train/grad_norm", "train/lr")}


# ----------------------------------------------------------------------------- the schedule (no run)
def schedule(*overrides: str) -> dict:
    config = typed(compose(["logger=none", *overrides]))
    return plan_job(config, hydra_job(overrides, Path("unused")), validate=False).ds_config


def test_a_changed_schedule_is_one_line_with_the_learning_rate_before_and_after():
    marker = CheckpointMarker(step=4, tag="step4", lr_schedule=lr_schedule_of(schedule("train.max_steps=4")))
    longer = schedule_change(marker, schedule("train.max_steps=8"))
    # The 4-step cosine had reached its floor (0.05 x lr); re-stretched to 8 steps it is well above it again.
    assert longer is not None and longer.startswith(
        "resume: train.max_steps 4 -> 8: the learning-rate schedule is re-stretched to 8 steps from step 5 on "
        f"(lr at step 5: {5e-5:.1e} -> "
    )
    assert float(longer.removesuffix(")").rsplit(" ", 1)[1]) > 2e-4
    lr = schedule_change(marker, schedule("train.max_steps=4", "train.lr=2e-3"))
    assert lr is not None and lr.startswith("resume: train.lr 0.001 -> 0.002: the learning-rate schedule is changed")
    assert schedule_change(marker, schedule("train.max_steps=4")) is None
    older = CheckpointMarker(step=4, tag="step4")  # an older launcher's checkpoint records no schedule
    assert schedule_change(older, schedule("train.max_steps=8")) is None


# ----------------------------------------------------------------------------- continued, decide
@pytest.mark.slow
def test_continued_composes_the_runs_own_command_line_with_the_new_one(saved_run, tmp_path):
    overrides = [f"resume={saved_run}", "train.max_steps=8"]
    job = continued(compose(overrides), hydra_job(overrides, saved_run))
    assert job is not None and job.hydra.run_dir == saved_run and job.notes == ()
    assert job.cfg.train.max_steps == 8  # the new value wins
    assert (job.cfg.train.micro_batch_size, job.cfg.train.save_every, job.cfg.logger.name) == (4, 2, "none")
    assert "train.max_steps=8" in job.hydra.overrides and "train.max_steps=4" not in job.hydra.overrides

    elsewhere = tmp_path / "elsewhere"
    with pytest.raises(LauncherError, match=f"continues in its own directory, but hydra.run.dir={elsewhere}"):
        continued(compose(overrides), hydra_job(overrides, elsewhere))
    # A new directory (resume=auto's first start) and a sweep's job continue nothing: they start as planned.
    fresh = ["logger=none", "resume=auto"]
    assert continued(compose(fresh), hydra_job(fresh, tmp_path / "new")) is None
    assert continued(compose(overrides), hydra_job(overrides, saved_run, multirun=True)) is None


@pytest.mark.slow
def test_decide_continues_from_the_newest_checkpoint_or_finds_the_run_finished(saved_run, tmp_path):
    config, job = planned([f"resume={saved_run}", "train.max_steps=8"], saved_run)
    plan = decide(config, job, warn=pytest.fail)
    assert plan is not None and plan.resume == Resume("step4", None) and plan.finished is None
    assert [note.split(":")[:2] for note in plan.notes] == [["resume", " train.max_steps 4 -> 8"]]

    config, job = planned([f"resume={saved_run}"], saved_run)
    plan = decide(config, job, warn=pytest.fail)
    assert plan is not None and plan.finished is not None and plan.finished.steps == 4 and plan.notes == ()

    fresh = tmp_path / "new"
    fresh.mkdir()
    config, job = planned(["logger=none", "resume=auto"], fresh)
    plan = decide(config, job, warn=pytest.fail)
    assert plan is not None and plan.resume is None and plan.starts_over
    assert plan.notes == (f"resume=auto: no checkpoint in {RunDir(fresh).checkpoints}, starting fresh",)
    config, job = planned(["logger=none"], fresh)
    assert decide(config, job, warn=pytest.fail) is None


@pytest.mark.slow
@pytest.mark.parametrize(
    ("change", "message"),
    [
        ("precision=bf16", "the job differs from the one that saved it (precision fp32 -> bf16); resume with"),
        ("train.max_steps=3", "train.max_steps=3 is below step 4 of the checkpoint step4 this resume continues"),
    ],
    ids=["precision", "fewer-steps"],
)
def test_decide_refuses_a_job_the_checkpoint_cannot_continue_in_one_line(saved_run, change, message):
    config, job = planned([f"resume={saved_run}", change], saved_run)
    with pytest.raises(LauncherError) as refused:
        decide(config, job, warn=pytest.fail)
    assert refused.value.exit_code == 2 and message in str(refused.value) and "\n" not in str(refused.value)


@pytest.mark.slow
def test_a_refused_resume_exits_2_and_leaves_the_run_as_it_was(saved_run, tmp_path):
    run_dir = copy_of(saved_run, tmp_path / "run")
    before = {name: (run_dir / name).read_bytes() for name in ("summary.json", ".hydra/overrides.yaml", "job.json")}
    refused = run_here([f"resume={run_dir}", "precision=bf16"], run_dir)
    assert refused.outcome.exit_code == 2 and "precision fp32 -> bf16" in refused.error
    assert {name: (run_dir / name).read_bytes() for name in before} == before

    missing = run_here([f"resume={tmp_path / 'nothing'}"], tmp_path / "new")
    assert missing.outcome.exit_code == 2
    assert missing.error.startswith(f"resume={tmp_path / 'nothing'}: no such directory")


@pytest.mark.slow
def test_a_damaged_newest_checkpoint_is_named_and_the_one_before_it_resumed(saved_run, train_in_process, tmp_path):
    """A truncated file in the newest checkpoint: one line names it, and the run continues, bitwise, from
    the checkpoint before it. Every checkpoint damaged: the resume is refused and the run left as it was."""
    run_dir = copy_of(saved_run, tmp_path / "run")
    damaged = RunDir(run_dir).checkpoint("step4") / "mp_rank_00_model_states.pt"
    size = damaged.stat().st_size
    with open(damaged, "r+b") as handle:
        handle.truncate(size // 2)
    expected = f"checkpoint step4 is damaged ({damaged}: {size // 2} bytes, {size} at save); resuming from step2"
    warned: list[str] = []
    config, job = planned([f"resume={run_dir}"], run_dir)
    plan = decide(config, job, warn=warned.append)
    assert warned == [expected] and plan is not None and plan.resume == Resume("step2", None)

    resumed = train_in_process(f"resume={run_dir}", run_dir=run_dir)
    assert resumed.outcome.status == "completed", resumed.outcome.error
    assert [line for line in resumed.lines if "is damaged" in line] == [f"warning: {expected}"]
    assert read_summary(run_dir)["resumed_from_step"] == 2
    assert curves(run_dir) == curves(saved_run)

    for tag in ("step2", "step4"):
        with open(RunDir(run_dir).checkpoint(tag) / "mp_rank_00_model_states.pt", "r+b") as handle:
            handle.truncate(100)
    finished = (run_dir / "summary.json").read_bytes()
    refused = run_here([f"resume={run_dir}"], run_dir)
    assert refused.outcome.exit_code == 2
    assert f"every checkpoint in {RunDir(run_dir).checkpoints} is damaged" in refused.error
    assert (run_dir / "summary.json").read_bytes() == finished


def test_a_resume_with_other_optimizer_groups_is_refused_by_the_rank_in_one_line(saved_run, train_in_process, tmp_path):
    """The optimizer's state is saved per group: other groups (train.groups) cannot load it. Found by the rank,
    before the checkpoint loads; the run is left as it was."""
    run_dir = copy_of(saved_run, tmp_path / "run")
    before = (run_dir / "summary.json").read_bytes()
    refused = train_in_process(f"resume={run_dir}", "train.max_steps=6", "train.groups.vision.lr=0", run_dir=run_dir)
    assert refused.outcome.exit_code == 2, refused.outcome
    assert refused.outcome.error == (
        f"cannot resume {RunDir(run_dir).checkpoint('step4')}: its optimizer groups (default) differ from this "
        "job's (vision, default): train.groups, train.decay_norms_and_biases or train.weight_decay (zero or not) "
        "changed; resume with the groups it was saved with, or start a new run"
    )
    assert (run_dir / "summary.json").read_bytes() == before


# ----------------------------------------------------------------------------- resumes that train
@pytest.mark.slow
def test_a_resume_with_more_steps_says_once_that_the_schedule_is_re_stretched(saved_run, train_in_process, tmp_path):
    """train.max_steps 4 -> 8 on resume: DeepSpeed restores only the scheduler's step count, so the cosine
    schedule is rebuilt for 8 steps and the learning rate jumps at step 5; one line says so, with both rates."""
    run_dir = copy_of(saved_run, tmp_path / "run")
    more = train_in_process(f"resume={run_dir}", "train.max_steps=8", run_dir=run_dir)
    assert more.outcome.status == "completed", more.outcome.error
    lr = {row["step"]: row["train/lr"] for row in read_metrics(run_dir)}
    (line,) = [line for line in more.lines if "learning-rate schedule" in line]
    assert line == (
        "resume: train.max_steps 4 -> 8: the learning-rate schedule is re-stretched to 8 steps from step 5 on "
        f"(lr at step 5: {5e-5:.1e} -> {lr[5]:.1e})"  # the 4-step schedule had reached its floor, 0.05 x lr
    )
    assert read_summary(run_dir)["status"] == "completed" and read_summary(run_dir)["resumed_from_step"] == 4
    assert sorted(lr) == list(range(1, 9)) and lr[5] > lr[4]


AUTO = ("logger=none", "train.micro_batch_size=4", "train.eval_every=0", "data.eval_accuracy=false", "resume=auto")


@pytest.mark.slow
def test_resume_auto_starts_fresh_then_leaves_a_finished_run_and_continues_a_longer_one(train_in_process, tmp_path):
    """A requeued job: the same command in the same directory."""
    run_dir = tmp_path / "run"
    first = train_in_process(*AUTO, "train.max_steps=2", run_dir=run_dir)
    assert first.outcome.status == "completed", first.outcome.error
    assert f"resume=auto: no checkpoint in {RunDir(run_dir).checkpoints}, starting fresh" in first.lines
    finished = read_summary(run_dir)
    assert "resumed_from_step" not in finished

    again = train_in_process(*AUTO, "train.max_steps=2", run_dir=run_dir)
    assert (again.outcome.status, again.outcome.exit_code) == ("finished", 0)
    assert any(line.startswith(f"resume: {run_dir} already finished at step 2") for line in again.lines), again.lines
    assert read_summary(run_dir) == finished  # a finished run stays as it is

    more = train_in_process(*AUTO, "train.max_steps=3", run_dir=run_dir)
    assert more.outcome.status == "completed", more.outcome.error
    assert read_summary(run_dir)["resumed_from_step"] == 2
    assert [row["step"] for row in read_metrics(run_dir)] == [1, 2, 3]
    # Its time covers both segments (it covered the last alone: issue 42), the first as summary.json said.
    resumed = read_summary(run_dir)
    assert resumed["earlier_wall_s"] == finished["wall_s"] and resumed["wall_s"] > finished["wall_s"]


def sweep_job(overrides: Sequence[str], run_dir: Path) -> Ran:
    """One job of `python train.py -m ...` in its sweep directory, its rank trained in this process."""
    lines: list[str] = []
    outcome = run_job(compose(list(overrides)), hydra_job(overrides, run_dir, multirun=True), say=lines.append,
                      start=train_here)  # fmt: skip
    return Ran(outcome, lines, run_dir)


@pytest.mark.slow
def test_a_rerun_sweep_with_resume_auto_resumes_every_job_in_its_own_directory(process_group, tmp_path):
    """A requeued sweep (-m deepspeed=z0,z2): the same command and sweep directory; each job continues from
    its own checkpoint, and once finished stays so."""
    sweep = tmp_path / "sweep"
    for number, preset in enumerate(("z0", "z2")):
        run_dir = sweep / str(number)
        for attempt, steps in enumerate((2, 3, 3)):
            ran = sweep_job([f"deepspeed={preset}", *AUTO, f"train.max_steps={steps}"], run_dir)
            assert ran.outcome.exit_code == 0, (preset, attempt, ran.outcome.error)
        assert ran.outcome.status == "finished"  # the third: nothing left to train
        assert any("already finished at step 3" in line for line in ran.lines), ran.lines
        summary = read_summary(run_dir)
        assert (summary["status"], summary["resumed_from_step"]) == ("completed", 2)
        assert summary["zero_stage"] == int(preset[1])
        assert [row["step"] for row in read_metrics(run_dir)] == [1, 2, 3]
