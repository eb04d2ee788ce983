"""The trainer in this process, on gloo: a tiny job trains, stops on request, and resumes exactly (from
every save point); ZeRO stages, offload, LoRA and gradient checkpointing change memory, not the losses;
a non-finite loss stops the run at its step.

The launcher plans each job as train.py would (launcher.launch.run.run_job); its one rank trains here
(`train_here`) instead of in a child process, so a job costs its steps, not an interpreter's start-up.
Signals, kills and two ranks: tests/e2e/test_train.py and test_resume.py.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from launcher.core.rundir import RunDir
from launcher.core.signals import recording_stop_signals
from launcher.data.shapes import generate_shapes
from launcher.job.spec import Job, read_job
from launcher.model.kernels import triton_interpreted
from launcher.train.faults import FAULT_ENV
from tests.helpers import losses, plain, read_metrics, read_summary, run_here, train_here

JOB = (
    "logger=none",
    "train.micro_batch_size=4",
    "train.eval_every=0",
    "data.eval_accuracy=false",
    "train.save_every=2",
)


def test_a_job_trains_writes_its_run_directory_and_reads_its_job_back(train_in_process, tmp_path):
    ran = train_in_process(*JOB, "train.max_steps=3", run_dir=tmp_path / "run")
    assert ran.outcome.status == "completed" and ran.outcome.exit_code == 0, ran.outcome.error
    run_dir = RunDir(tmp_path / "run")
    summary = read_summary(run_dir.path)
    assert summary["status"] == "completed" and summary["steps"] == 3
    assert summary["world_size"] == 1 and summary["zero_stage"] == 0 and summary["precision"] == "fp32"
    assert [row["step"] for row in read_metrics(run_dir.path)] == [1, 2, 3]
    assert (run_dir.model / "config.json").is_file() and run_dir.marker("step3").is_file()
    job = read_job(run_dir.path)
    assert Job.from_json(json.loads(json.dumps(job.to_json()))) == job  # job.json round-trips
    assert job.max_steps == 3 and job.model_path == summary["base_model"]
    assert ran.lines[0].startswith("job: tiny_llava (full) on 1 rank (cpu), ZeRO 0")


def test_a_stopped_job_resumes_with_the_losses_of_an_uninterrupted_one(train_in_process, tmp_path):
    whole = train_in_process(*JOB, "train.max_steps=4", run_dir=tmp_path / "whole")
    assert whole.outcome.status == "completed", whole.outcome.error

    stopped = RunDir(tmp_path / "stopped")
    stopped.path.mkdir()
    stopped.stop_file.touch()  # what the launcher writes when a scheduler's SIGTERM reaches it
    first = train_in_process(*JOB, "train.max_steps=4", run_dir=stopped.path)
    assert first.outcome.status == "preempted" and first.outcome.exit_code == 143
    assert read_summary(stopped.path)["steps"] == 1 and stopped.marker("step1").is_file()
    assert not stopped.model.exists()

    stopped.stop_file.unlink()
    resumed = train_in_process(f"resume={stopped.path}", run_dir=stopped.path)
    assert resumed.outcome.status == "completed", resumed.outcome.error
    assert read_summary(stopped.path)["resumed_from_step"] == 1
    assert losses(stopped.path) == losses(whole.run_dir)  # bitwise: same world size, ZeRO-0, fp32


def test_a_stop_signal_before_the_handlers_are_in_place_still_ends_the_job_honestly(process_group, tmp_path):
    """A stop that reaches train.py while Hydra starts ends the job as interrupted, with a summary (it used
    to kill the process with only `.lock` written); one that reaches a rank while it starts (torch's import,
    the model) stops it after its first step, with a checkpoint, as preempted (it used to die unrecorded),
    and a sweep's next job in the same process does not start."""

    def stopped_while_starting(job, run_dir, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)  # what a scheduler sends the whole process group
        return train_here(job, run_dir, **kwargs)

    with recording_stop_signals():
        os.kill(os.getpid(), signal.SIGTERM)
        early = run_here([*JOB, "train.max_steps=4"], tmp_path / "early", start=train_here).outcome
    assert (early.status, early.exit_code) == ("interrupted", 143), early.error
    assert early.error == "stopped by SIGTERM before training started; start the job again"
    assert read_summary(tmp_path / "early")["status"] == "interrupted"

    with recording_stop_signals():
        starting = run_here([*JOB, "train.max_steps=4"], tmp_path / "rank", start=stopped_while_starting).outcome
        after = run_here([*JOB, "train.max_steps=4"], tmp_path / "next", start=train_here).outcome  # a sweep's next
    assert (starting.status, starting.exit_code) == ("preempted", 143), starting.error
    assert read_summary(tmp_path / "rank")["steps"] == 1 and RunDir(tmp_path / "rank").marker("step1").is_file()
    assert (after.status, after.exit_code) == ("interrupted", 143)  # the stop holds for the rest of the process


def test_a_streamed_job_resumes_mid_block_with_the_losses_of_an_uninterrupted_one(train_in_process, tmp_path, caplog):
    """data.streaming: the position saved (rows of the epoch consumed) lands inside a shuffled block of 16
    rows; the resumed run re-reads that block and goes on as the uninterrupted one did, with 2 workers."""
    streamed = (*JOB, "train.max_steps=4", "data.streaming=true", "data.shuffle_block=16", "data.num_workers=2")
    whole = train_in_process(*streamed, run_dir=tmp_path / "whole")
    assert whole.outcome.status == "completed", whole.outcome.error
    assert "data: streaming 1 file(s)" in caplog.text

    stopped = RunDir(tmp_path / "stopped")
    stopped.path.mkdir()
    stopped.stop_file.touch()
    first = train_in_process(*streamed, run_dir=stopped.path)
    assert first.outcome.status == "preempted" and read_summary(stopped.path)["steps"] == 1
    saved = torch.load(stopped.checkpoint("step1") / "launcher_rank0.pt", weights_only=False)
    assert (saved["epoch"], saved["records"]) == (0, 4)  # one micro-batch of 4 rows, inside the first block

    stopped.stop_file.unlink()
    resumed = train_in_process(f"resume={stopped.path}", run_dir=stopped.path)
    assert resumed.outcome.status == "completed", resumed.outcome.error
    assert losses(stopped.path) == losses(whole.run_dir)


def test_a_packed_job_resumes_with_the_losses_of_an_uninterrupted_one(train_in_process, tmp_path):
    """data.packing: rows of 8 records (256 tokens of the built-in set's 31-token records), 2 rows per
    micro-batch; stopped after step 1 and resumed, the plan is recomputed and the rows after the saved
    position train, to the same losses and final weights bit for bit. The summary counts records, not
    rows. (A SIGKILL resumes from the last complete checkpoint through the same load:
    tests/e2e/test_resume.py.)"""
    packed = (*JOB, "train.max_steps=4", "data.packing=true", "data.pack_length=256", "train.micro_batch_size=2")
    whole = train_in_process(*packed, run_dir=tmp_path / "whole")
    assert whole.outcome.status == "completed", whole.outcome.error
    summary = read_summary(whole.run_dir)
    assert summary["padding_frac"] == 0.0 and summary["samples_per_sec"] > 0
    first = read_metrics(whole.run_dir)[0]
    assert first["perf/tokens_per_sec"] / first["perf/samples_per_sec"] == pytest.approx(31, rel=0.05)  # per record

    stopped = RunDir(tmp_path / "stopped")
    stopped.path.mkdir()
    stopped.stop_file.touch()
    assert train_in_process(*packed, run_dir=stopped.path).outcome.status == "preempted"
    stopped.stop_file.unlink()
    resumed = train_in_process(f"resume={stopped.path}", run_dir=stopped.path)
    assert resumed.outcome.status == "completed", resumed.outcome.error
    assert losses(stopped.path) == losses(whole.run_dir)
    weights = "model/model.safetensors"
    assert (stopped.path / weights).read_bytes() == (whole.run_dir / weights).read_bytes()


def test_data_pack_max_images_caps_the_images_of_each_packed_row(train_in_process, tmp_path):
    """Rows of 256 tokens hold 8 of the built-in set's one-image records; at most 3 images a row, each row
    holds 3 and a step of 4 rows trains 12 records."""
    capped = (*JOB, "train.max_steps=1", "train.save_every=0", "data.packing=true", "data.pack_length=256",
              "train.micro_batch_size=2", "train.global_batch_size=4", "data.pack_max_images=3")  # fmt: skip
    ran = train_in_process(*capped, run_dir=tmp_path / "capped")
    assert ran.outcome.status == "completed", ran.outcome.error
    first = read_metrics(ran.run_dir)[0]
    assert first["perf/samples_per_sec"] * first["perf/step_time_s"] == pytest.approx(12)


@pytest.mark.skipif(not (torch.cuda.is_available() or triton_interpreted()), reason="Triton has no device here")
def test_model_compile_and_liger_kernels_train_the_same_losses(train_in_process, tmp_path):
    """model.compile=true (each layer's MLP and norms compiled, tests/unit/model/test_components.py) and
    model.kernels=liger (its fused loss, in Triton's interpreter here: tests/unit/model/test_kernels.py) through
    the whole job: the plain run's losses, and the summary says what ran."""
    curves = {}
    for name, setting in (("plain", "model.compile=false"), ("compiled", "model.compile=true"),
                          ("liger", "model.kernels=liger")):  # fmt: skip
        ran = train_in_process(*JOB, "train.max_steps=2", "train.save_every=0", setting, run_dir=tmp_path / name)
        assert ran.outcome.status == "completed", ran.outcome.error
        curves[name] = losses(ran.run_dir)
        summary = read_summary(ran.run_dir)
        expected = "torch" if name != "liger" else "liger (layers: torch (liger's layer kernels run on CUDA only); "
        assert summary["kernels"].startswith(expected)
    assert summary["kernels"].endswith("loss: fused linear cross-entropy)")
    assert summary["loss_logits"] == "liger's fused linear cross-entropy (chunks of its own)"
    assert curves["compiled"] == pytest.approx(curves["plain"], rel=1e-5)
    assert curves["liger"] == pytest.approx(curves["plain"], rel=1e-5)


@pytest.mark.skipif(not (torch.cuda.is_available() or triton_interpreted()), reason="Triton has no device here")
def test_liger_fused_loss_at_zero_3_trains_dpos_losses_with_the_output_layer_partitioned(train_in_process, tmp_path):
    """ZeRO-3 with no parameter kept whole (persistence threshold 0): the fused loss reads the output layer's
    weight, gathered for the model's forward and backward passes as its external parameter; DPO's per-row path
    makes the logits again in the backward pass. A live reference beside it (torch's loss). The torch run's
    losses."""
    dpo = (*JOB, "deepspeed=z3", "comm.stage3_param_persistence_threshold=0", "loss=dpo", "loss.reference=live",
           "train.max_steps=3", "train.save_every=0")  # fmt: skip
    curves = {}
    for kernels in ("torch", "liger"):
        ran = train_in_process(*dpo, f"model.kernels={kernels}", run_dir=tmp_path / kernels)
        assert ran.outcome.status == "completed", ran.outcome.error
        curves[kernels] = losses(ran.run_dir)
    assert read_summary(tmp_path / "liger")["kernels"].endswith("loss: fused linear cross-entropy)")
    assert curves["torch"][0] == pytest.approx(0.6931, abs=1e-4)  # log 2: the reference is the policy
    assert curves["liger"] == pytest.approx(curves["torch"], rel=1e-5)


def test_the_first_update_moves_the_weights_and_each_step_logs_the_rate_it_applied(train_in_process, tmp_path):
    """Step k of the warm-up applies lr x k / warm-up steps (DeepSpeed's WarmupCosineLR as built gave the
    first two updates rate 0: a 1-step run saved its starting weights), then the cosine falls to
    lr x min_lr_ratio; metrics.jsonl logs each step's own rate, not the next one's."""
    one = train_in_process(*JOB, "train.max_steps=1", "train.save_every=0", run_dir=tmp_path / "one")
    assert one.outcome.status == "completed", one.outcome.error
    start = load_file(Path(read_job(one.run_dir).model_path) / "model.safetensors")
    trained = load_file(one.run_dir / "model" / "model.safetensors")
    moved = [name for name in start if not torch.equal(start[name], trained[name])]
    assert moved, "a one-step run saved its starting weights"
    ran = train_in_process(*JOB, "train.max_steps=6", "train.warmup_steps=3", "train.lr=1e-3",
                           "train.min_lr_ratio=0.05", "train.save_every=0", run_dir=tmp_path / "six")  # fmt: skip
    rates = [row["train/lr"] for row in read_metrics(ran.run_dir)]
    assert rates[:2] == pytest.approx([1e-3 / 3, 2e-3 / 3])
    assert 1e-3 * 2 / 3 < rates[2] < 1e-3 and rates[2] > rates[3] > rates[4]
    assert rates[-1] == pytest.approx(1e-3 * 0.05)


# Every step holds the same 16 records of the built-in set (one epoch); the learning rate large enough
# for the weights to move within 4 steps.
EPOCH_STEPS = (
    *JOB,
    "data.n_train=16",
    "train.max_steps=4",
    "train.save_every=0",
    "train.lr=3e-3",
    "train.warmup_steps=1",
)


@pytest.mark.slow
@pytest.mark.parametrize(("arch", "preset"), [("tiny_llava", "z0"), ("tiny_qwen2_vl", "z3")])
def test_a_packed_run_has_the_losses_of_the_unpacked_run_of_the_same_records(train_in_process, tmp_path, arch, preset):
    """Packed into rows of at most 256 tokens (tiny LLaVA's 31-token records: 8 + 8 per row; tiny
    Qwen2-VL's 23-token ones: 11 + 5), one row per micro-batch, against one unpacked micro-batch of all
    16 (and, once, four of 4): the loss is the mean over the step's answer tokens however the records are split,
    so every step's loss agrees to 1e-5 (fp32): LLaVA at ZeRO 0, Qwen2-VL at ZeRO 3 (the other two pairs
    passed too when this was written; kept out of CI's time). Two ranks: tests/e2e/test_dist.py."""
    common = (*EPOCH_STEPS, f"model.arch={arch}", f"deepspeed={preset}")
    packed = ("data.packing=true", "data.pack_length=256", "train.micro_batch_size=1", "train.global_batch_size=2")
    runs = {
        "one micro-batch": (*common, "train.micro_batch_size=16", "train.global_batch_size=16"),
        "packed rows": (*common, *packed),
    }
    if (arch, preset) == ("tiny_llava", "z0"):  # the split into micro-batches alone (once: it is family-blind)
        runs["four micro-batches"] = (*common, "train.micro_batch_size=4", "train.global_batch_size=16")
    curves = {}
    for name, overrides in runs.items():
        ran = train_in_process(*overrides, run_dir=tmp_path / name.replace(" ", "_"))
        assert ran.outcome.status == "completed", ran.outcome.error
        curves[name] = losses(ran.run_dir)
        first = read_metrics(ran.run_dir)[0]
        assert first["perf/samples_per_sec"] * first["perf/step_time_s"] == pytest.approx(16)  # all 16 records
    assert curves["one micro-batch"][-1] < curves["one micro-batch"][0] - 0.05  # the weights moved
    assert_same_curves(curves, rel=1e-5)


# ----------------------------------------------------------------------------- the same mathematics
# Short runs of the built-in job: no W&B, no generation, fp32, seeded.
SHORT = ("logger=none", "train.micro_batch_size=8", "train.eval_every=0", "data.eval_accuracy=false", "train.seed=1")


def assert_same_curves(curves: dict[str, list[float]], rel: float) -> None:
    reference_name, reference = next(iter(curves.items()))
    for name, curve in curves.items():
        assert len(curve) == len(reference), name
        for step, (a, b) in enumerate(zip(reference, curve, strict=True), start=1):
            assert abs(a - b) <= rel * abs(a), f"{name} vs {reference_name} at step {step}: {b} vs {a}"


@pytest.mark.slow
def test_zero_stages_give_the_same_losses(train_in_process, tmp_path):
    """ZeRO changes memory, not mathematics: stages 0-3 agree to 1e-4 relative at fp32 (at two ranks:
    tests/e2e/test_train.py)."""
    curves = {}
    for stage in range(4):
        ran = train_in_process(*SHORT, "train.max_steps=6", f"zero=stage{stage}", run_dir=tmp_path / str(stage))
        assert ran.outcome.status == "completed", ran.outcome.error
        assert read_summary(ran.run_dir)["zero_stage"] == stage
        curves[f"stage{stage}"] = losses(ran.run_dir)
    assert len(curves["stage0"]) == 6 and curves["stage0"][-1] < curves["stage0"][0]  # it trains
    assert_same_curves(curves, rel=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["z2_offload", "z3_offload"])  # the optimizer on the CPU; at 3 the parameters too
def test_bf16_with_cpu_offload_trains(train_in_process, tmp_path, preset):
    job = (*SHORT, "train.max_steps=6", f"deepspeed={preset}", "precision=bf16")
    ran = train_in_process(*job, run_dir=tmp_path / "run")
    assert ran.outcome.status == "completed", ran.outcome.error
    curve = losses(ran.run_dir)
    assert curve[-1] < curve[0]
    ds = json.loads(RunDir(ran.run_dir).ds_config.read_text())
    assert ds["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert read_summary(ran.run_dir)["precision"] == "bf16"


@pytest.mark.slow
def test_a_nonfinite_loss_stops_naming_the_step_and_the_checkpoint_before_it_still_loads(train_in_process, tmp_path):
    """fp32 with a learning rate of 1e20: step 1's update (the first one applies the rate) overflows the
    weights, and the loss is NaN at step 2 (seeded); a checkpoint every step.
    (1e4, the old test's rate, no longer diverges here: the model collapses to a constant loss instead.)"""
    run_dir = RunDir(tmp_path / "run")
    diverging = ["logger=none", "train.micro_batch_size=8", "train.max_steps=6", "train.save_every=1"]
    diverging += ["train.lr=1e20", "train.grad_clip=0", "train.warmup_steps=1", "train.eval_every=0"]
    ran = train_in_process(*diverging, "data.eval_accuracy=false", run_dir=run_dir.path)
    assert (ran.outcome.status, ran.outcome.exit_code) == ("failed", 1)
    assert "loss is nan at step 2: lower train.lr" in ran.error
    assert f"checkpoint step1, saved before it, resumes with resume={run_dir.path}" in ran.error
    assert "\n" not in ran.error and "Traceback" not in ran.error
    assert read_summary(run_dir.path)["status"] == "failed" and run_dir.latest.read_text().strip() == "step1"
    assert [row["step"] for row in read_metrics(run_dir.path)] == [1] and not run_dir.model.exists()

    # The checkpoint loads, and the same job fails again at the same step: usable and deterministic.
    again = train_in_process(f"resume={run_dir.path}", run_dir=run_dir.path)
    assert again.outcome.exit_code == 1 and "loss is nan at step 2" in again.error
    assert read_summary(run_dir.path)["resumed_from_step"] == 1


# ----------------------------------------------------------------------------- the resume matrix
# Resumed from every save point of one uninterrupted run (its directory copied, only the resumed
# checkpoint kept, as a kill after that save leaves it), each continuation must equal it bitwise: the
# loss, gradient-norm and learning-rate curves, the random state and the final weights. Data sizes put
# the save points mid-epoch, on an epoch's end, and before a dropped partial batch (drop_last). Two ranks
# (ZeRO-3, DataLoader workers): tests/e2e/test_resume.py.
MATRIX_STEPS, MATRIX_SAVE = 12, 3  # checkpoints at steps 3, 6 and 9 (and 12, the final one)
MATRIX_RUN = (
    "logger=none",
    "train.micro_batch_size=8",
    f"train.max_steps={MATRIX_STEPS}",
    f"train.save_every={MATRIX_SAVE}",
    "train.keep_checkpoints=10",
    "train.eval_every=4",  # evaluations between checkpoints: the eval loader must not shift the random state
    "data.eval_accuracy=false",
    "train.seed=1",
)
MATRIX = {  # id: (data= kind, train records, num_workers)
    "shapes-n24-w0": ("shapes", 24, 0),  # 3 batches an epoch: every save point ends an epoch
    "shapes-n44-w0": ("shapes", 44, 0),  # 5 batches and 4 records dropped each epoch
    "shapes-n64-w0": ("shapes", 64, 0),  # 8 batches: save points inside the first and second epoch
    "llava_json-n24-w2": ("llava_json", 24, 2),
    "llava_json-n44-w2": ("llava_json", 44, 2),
    "llava_json-n64-w2": ("llava_json", 64, 2),
}


def matrix_args(kind: str, n_train: int, workers: int, data_dir: Path) -> list[str]:
    if kind == "shapes":
        data = [f"data.n_train={n_train}", "data.n_eval=16"]
    else:  # a file in LLaVA format: the shapes set, written where the test says
        train_json, eval_json, images = generate_shapes(data_dir, seed=0, n_train=n_train, n_eval=16, image_size=32)
        data = ["data=llava_json", f"data.path={train_json}", f"data.eval_path={eval_json}"]
        data.append(f"data.image_root={images}")
    return [*MATRIX_RUN, *data, f"data.num_workers={workers}"]


def resumed_copy(reference: Path, run_dir: Path, step: int) -> None:
    """`reference` as a kill after step `step`'s save leaves it."""
    shutil.copytree(reference, run_dir)
    for tag in RunDir(run_dir).checkpoints.glob("step*"):
        if tag.name != f"step{step}":
            shutil.rmtree(tag)
    RunDir(run_dir).latest.write_text(f"step{step}")


def final_state(run_dir: Path) -> tuple[Any, bytes]:
    """The saved random state at the last step (as plain lists), and the final weights' bytes."""
    own = torch.load(RunDir(run_dir).checkpoint(f"step{MATRIX_STEPS}") / "launcher_rank0.pt", weights_only=False)
    return plain(own["rng"]), (RunDir(run_dir).model / "model.safetensors").read_bytes()


def curves(run_dir: Path, steps: int) -> dict[str, list[float]]:
    rows = read_metrics(run_dir)
    assert [row["step"] for row in rows] == list(range(1, steps + 1))
    return {key: [row[key] for row in rows] for key in ("train/loss", "train/grad_norm", "train/lr")}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(MATRIX))
def test_resume_from_every_save_point_is_bitwise_identical(train_in_process, tmp_path, case):
    reference = train_in_process(*matrix_args(*MATRIX[case], tmp_path / "data"), run_dir=tmp_path / "reference")
    assert reference.outcome.status == "completed", reference.outcome.error
    expected, (expected_rng, expected_weights) = curves(reference.run_dir, MATRIX_STEPS), final_state(reference.run_dir)
    for step in range(MATRIX_SAVE, MATRIX_STEPS, MATRIX_SAVE):
        run_dir = tmp_path / f"from{step}"
        resumed_copy(reference.run_dir, run_dir, step)
        ran = train_in_process(f"resume={run_dir}", run_dir=run_dir)
        assert ran.outcome.status == "completed", ran.outcome.error
        assert read_summary(run_dir)["resumed_from_step"] == step
        assert curves(run_dir, MATRIX_STEPS) == expected, f"{case}: resumed from step {step}"
        rng, weights = final_state(run_dir)
        assert rng == expected_rng, f"{case}: random state at step {MATRIX_STEPS}, resumed from step {step}"
        assert weights == expected_weights, f"{case}: final weights, resumed from step {step}"


# ----------------------------------------------------------------------------- LoRA
# On the tiny model's random weights (model.tiny_base=random): these tests are about the adapters at each stage,
# not the pretrained base `method=lora` starts from by default (tests/unit/launch/test_run.py tests that).
LORA = ("method=lora", "model.tiny_base=random", *SHORT, "train.max_steps=8")


@pytest.fixture(scope="module")
def lora_runs(process_group: None, tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """The same 8-step LoRA job at a DeepSpeed preset (z0, z2, z3), trained once per preset on first use."""
    done: dict[str, Path] = {}

    def run(preset: str) -> Path:
        if preset not in done:
            run_dir = tmp_path_factory.mktemp("lora") / preset
            ran = run_here([*LORA, f"deepspeed={preset}"], run_dir, start=train_here)
            assert ran.outcome.status == "completed", ran.outcome.error
            done[preset] = run_dir
        return done[preset]

    return run


@pytest.mark.slow
def test_the_same_lora_job_trains_and_gives_the_same_losses_at_every_zero_stage(lora_runs):
    """The adapters start from train.seed whatever the stage (zero.Init draws differently while the base
    loads), so ZeRO changes memory, not the mathematics: the curves agree to 1e-3 relative. Each run saves
    a complete adapter (at two ranks: tests/e2e/test_train.py)."""
    curves = {}
    for preset in ("z0", "z2", "z3"):
        run_dir = lora_runs(preset)
        curve = curves[preset] = losses(run_dir)
        assert len(curve) == 8 and curve[-1] < curve[0]
        summary = read_summary(run_dir)
        assert summary["method"] == "lora" and 0 < summary["params_trainable"] <= 0.1 * summary["params_total"]
        assert summary["zero_stage"] == int(preset[1])
        adapter = load_file(RunDir(run_dir).model / "adapter_model.safetensors")
        assert adapter and all(tensor.numel() > 0 for tensor in adapter.values())
    assert_same_curves(curves, rel=1e-3)


@pytest.mark.slow
def test_a_lora_run_resumes_where_it_stopped(lora_runs, train_in_process, tmp_path, monkeypatch):
    """The adapter, the projector trained beside it and their optimizer states come back from the
    checkpoint: the resumed run ends where an uninterrupted one does."""
    stopped = tmp_path / "stopped"
    # A crash at step 6 (rank 0) after the checkpoint of step 4; the resume trains steps 5-8 again.
    monkeypatch.setenv(FAULT_ENV, "0:6")
    crashed = train_in_process(*LORA, "deepspeed=z2", "train.save_every=4", run_dir=stopped)
    assert crashed.outcome.exit_code == 1 and "fault injected" in crashed.error
    assert read_summary(stopped)["steps"] == 5  # the last step trained, in a failed run's summary too
    monkeypatch.delenv(FAULT_ENV)
    resumed = train_in_process(f"resume={stopped}", run_dir=stopped)
    assert resumed.outcome.status == "completed", resumed.outcome.error
    assert read_summary(stopped)["resumed_from_step"] == 4
    curve, reference = losses(stopped), losses(lora_runs("z2"))
    assert len(curve) == 8
    for step, (a, b) in enumerate(zip(reference, curve, strict=True), start=1):
        assert abs(a - b) <= 1e-5 * abs(a), f"step {step}: {b} vs {a}"


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["z2", "z3"])
def test_qlora_trains_its_projector_at_zero_2_and_3_and_exports_merged(train_in_process, tmp_path, preset):
    """QLoRA failed at ZeRO 2 and 3 on a GPU in DeepSpeed's gradient hooks: the projector trained in full was
    4-bit, and got no gradient (tests/unit/model/test_method.py). Now it trains (its saved copy moves off the
    base's weights), and the run exports merged. On a CPU: bitsandbytes >= 0.48 (the GPU suite runs CUDA)."""
    pytest.importorskip("bitsandbytes")
    from launcher.export.export import export

    ran = train_in_process(
        "method=qlora", "model.tiny_base=random", "precision=bf16", f"deepspeed={preset}", *SHORT, "train.max_steps=6"
    )
    assert ran.outcome.status == "completed", ran.outcome.error
    summary = read_summary(ran.run_dir)
    assert summary["method"] == "qlora" and summary["zero_stage"] == int(preset[1])
    curve = losses(ran.run_dir)
    assert len(curve) == 6 and curve[-1] < curve[0]
    model = RunDir(ran.run_dir).model
    assert json.loads((model / "adapter_config.json").read_text())["modules_to_save"]
    saved = load_file(model / "adapter_model.safetensors")
    base = load_file(Path(summary["base_model"]) / "model.safetensors")
    # The adapter file's names of the projector, and the base's (base_model.model.model.X -> X).
    projector = {
        name: "multi_modal_projector" + name.split("multi_modal_projector")[1]
        for name in saved
        if "multi_modal_projector" in name and name.endswith(".weight")
    }
    assert projector and all(not torch.equal(saved[a].float(), base[b].float()) for a, b in projector.items())
    exported = export(ran.run_dir, merge=True, out=tmp_path / "merged")
    assert exported.kind == "merged model" and (tmp_path / "merged" / "model.safetensors").is_file()


@pytest.mark.slow
def test_gradient_checkpointing_leaves_the_loss_curve_unchanged(train_in_process, tmp_path):
    """Same seed, LoRA on the language model with a frozen vision tower: checkpointing recomputes
    activations, so the losses agree to 1e-5 relative."""
    curves = {}
    for flag in ("false", "true"):
        checkpointing = [f"model.gradient_checkpointing={flag}", f"model.vision_gradient_checkpointing={flag}"]
        ran = train_in_process(*LORA, *checkpointing, run_dir=tmp_path / flag)
        assert ran.outcome.status == "completed", ran.outcome.error
        curves[flag] = losses(ran.run_dir)
    assert len(curves["true"]) == 8 and curves["true"][-1] < curves["true"][0]
    assert_same_curves(curves, rel=1e-5)


@pytest.mark.slow
def test_a_resume_on_other_training_records_is_refused(train_in_process, tmp_path):
    """The checkpoint records which records it saved its place in (the data cache's key: a digest of them);
    an edited data file, or a hand-edited data setting in .hydra/overrides.yaml (here data.n_train 64 -> 48),
    used to resume silently at that place in other records."""
    run_dir = tmp_path / "run"
    job = (*JOB, "data.n_train=64", "data.n_eval=16", "train.max_steps=2", "train.save_every=1")
    assert train_in_process(*job, run_dir=run_dir).outcome.status == "completed"
    overrides = RunDir(run_dir).overrides
    overrides.write_text(overrides.read_text().replace("data.n_train=64", "data.n_train=48"))
    refused = train_in_process(f"resume={run_dir}", "train.max_steps=3", run_dir=run_dir).outcome
    assert refused.exit_code == 2, refused
    assert refused.error.startswith("the training data changed since the checkpoint was saved (data cache ")
    assert "resume with the data it was saved with, or start a new run" in refused.error
    overrides.write_text(overrides.read_text().replace("data.n_train=48", "data.n_train=64"))
    resumed = train_in_process(f"resume={run_dir}", "train.max_steps=3", run_dir=run_dir).outcome
    assert resumed.status == "completed" and resumed.summary.steps == 3, resumed.error
