"""launcher.tune.runner: how the tuner runs one candidate and reads it: throughput, the ranks among its
children, a job's error line, the per-candidate test hook, its verdicts; and (slow) one candidate run in
this process (run_job with its rank as a child process), its rank's output in logs/NAME.log."""

from __future__ import annotations

import os
import signal
import time

import pytest
import yaml

from launcher.core.errors import Interrupted
from launcher.core.rundir import RunDir
from launcher.launch.run import Outcome
from launcher.tune import runner, tuner
from launcher.tune.decide import MiB, Result
from launcher.tune.report import Tuning
from launcher.tune.space import Candidate
from tests.helpers import compose_typed


def test_throughput_leaves_the_warm_up_steps_out():
    records = [
        {"step": 1, "perf/step_time_s": 5.0, "perf/tokens_per_sec": 10.0},
        {"step": 2, "perf/step_time_s": 1.0, "perf/tokens_per_sec": 300.0},
        {"step": 3, "perf/step_time_s": 3.0, "perf/tokens_per_sec": 100.0},
    ]
    figures = runner.measure(records, warmup=1, global_batch=8)
    assert figures[:3] == (pytest.approx(16 / 4), pytest.approx(600 / 4), 2)
    assert figures.padding_frac is None and figures.mfu is None  # the rows report neither
    assert runner.measure(records[:1], warmup=1, global_batch=8) is None


def test_padding_and_mfu_are_weighted_by_the_tokens_and_time_of_each_measured_step():
    """Step 2: 300 real tokens of 400 computed (25% padding) in 1 s; step 3: 300 of 1200 (75%) in 3 s.
    Packed rows report their records per second: samples/s is theirs, not the global batch's."""
    records = [
        {"step": 1, "perf/step_time_s": 9.0, "perf/tokens_per_sec": 1.0, "perf/padding_frac": 0.9, "perf/mfu": 0.9},
        {"step": 2, "perf/step_time_s": 1.0, "perf/tokens_per_sec": 300.0, "perf/padding_frac": 0.25,
         "perf/mfu": 0.2, "perf/samples_per_sec": 20.0},
        {"step": 3, "perf/step_time_s": 3.0, "perf/tokens_per_sec": 100.0, "perf/padding_frac": 0.75,
         "perf/mfu": 0.1, "perf/samples_per_sec": 4.0},
    ]  # fmt: skip
    figures = runner.measure(records, warmup=1, global_batch=8)
    assert figures.padding_frac == pytest.approx(1 - 600 / 1600)
    assert figures.mfu == pytest.approx((0.2 * 1 + 0.1 * 3) / 4)
    assert figures.samples_per_s == pytest.approx((20 + 12) / 4)


def test_the_ranks_are_told_from_their_launchers_and_their_dataloader_workers():
    rank = ["/v/bin/python", "-u", "-m", "launcher.launch.worker", "/runs/a"]
    agent = [
        "/v/bin/python",
        "-m",
        "launcher.launch.torchrun",
        "--nproc-per-node=2",
        "-m",
        "launcher.launch.worker",
        "/runs/a",
    ]
    assert runner._runs_module(rank, runner.WORKER) and runner.WORKER == "launcher.launch.worker"
    assert not runner._runs_module(agent, "launcher.launch.worker")
    assert not runner._runs_module(["python", "train.py", "-m"], "launcher.launch.worker")


def test_the_test_hook_sets_variables_of_one_candidate_only(monkeypatch):
    monkeypatch.setenv(runner.CANDIDATE_ENV, "z2-fp32-mb8:LAUNCHER_TEST_FAULT=0:1:alloc=3000;z2-fp32-mb4:A=1;;")
    assert runner._candidate_env("z2-fp32-mb8") == {"LAUNCHER_TEST_FAULT": "0:1:alloc=3000"}
    assert runner._candidate_env("z2-fp32-mb4") == {"A": "1"}
    assert runner._candidate_env("z0-fp32-mb4") == {}


def test_new_metrics_are_read_up_to_the_last_complete_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    assert runner._read_new_records(path, 0) == ([], 0)  # not there yet
    path.write_text('{"step": 1, "train/loss": 2.0}\n{"step": 2, "train/lo')
    records, offset = runner._read_new_records(path, 0)
    assert records == [{"step": 1, "train/loss": 2.0}] and offset == len('{"step": 1, "train/loss": 2.0}\n')
    with path.open("a") as handle:
        handle.write('ss": 1.5}\n')
    assert runner._read_new_records(path, offset)[0] == [{"step": 2, "train/loss": 1.5}]


def _tuning(tmp_path, **kw) -> Tuning:
    return Tuning(tmp_path / "tune", [], global_batch=8, world_size=1, budget=1000 * MiB, budget_source="test", **kw)


def test_candidates_after_the_first_that_ran_check_the_data_caches_sizes_not_its_checksums(tmp_path):
    t = _tuning(tmp_path)
    first, pruned, second = (Result(Candidate("z0", "fp32", m, 8 // m, False)) for m in (1, 2, 4))
    t.results = [first, pruned, second]
    assert not runner._cache_checked(t, first) and not runner._cache_checked(t, pruned)
    first.run_dir = str(tmp_path / "runs" / "first")  # it ran, and so checked (or built) the cache
    assert runner._cache_checked(t, pruned) and runner._cache_checked(t, second)
    assert runner._cache_checked(t, Result(first.candidate))  # a confirmation run: after every candidate
    t.base = ["data.cache_check=checksums"]  # the job's own choice holds for every candidate
    assert not runner._cache_checked(t, second)


def test_the_verdicts_on_a_running_candidate(tmp_path):
    tc = compose_typed(["tune.warmup_steps=1", "tune.measure_steps=2", "tune.candidate_timeout_s=60"]).tune
    t = _tuning(tmp_path)
    rows = [{"step": s, "perf/step_time_s": 1.0, "perf/tokens_per_sec": 8.0} for s in (1, 2, 3)]
    now = time.time()
    over = runner.Watch(rank_peaks={1: 1200 * MiB}, records=rows[:1])
    assert runner._verdict(t, over, rows[:1], now, tc) == (
        "does not fit",
        "a rank reached 1200 MiB > budget 1000 MiB in step 2",
    )
    assert runner._verdict(t, runner.Watch(records=rows), rows, now, tc) == ("fits", "")  # warm-up + measured
    assert runner._verdict(t, runner.Watch(records=rows[:2]), rows[1:2], now, tc) is None  # one measured step so far
    status, note = runner._verdict(t, runner.Watch(records=rows[:1]), [], now - 61, tc)
    assert status == "failed" and "tune.candidate_timeout_s=60 s" in note
    # a measured candidate twice as fast with no more memory than this one has used: dominated
    faster = Result(Candidate("z0", "fp32", 8, 1, False), status="fits", tokens_per_s=16.0, peak=100 * MiB)
    t.results = [faster]
    slow = runner.Watch(rank_peaks={1: 200 * MiB}, records=rows[:2])
    status, note = runner._verdict(t, slow, rows[1:2], now, tc)
    assert status == "dominated" and note.startswith("z0-fp32-mb8 is faster (16 > 8 real tokens/s after 1 steps)")
    no_skip = compose_typed(["tune.warmup_steps=1", "tune.measure_steps=2", "tune.early_skip=false"]).tune
    assert runner._verdict(t, slow, rows[1:2], now, no_skip) is None
    # Other processes were using the machine when it started: its speed says little, it is not stopped for it.
    assert runner._verdict(t, slow, rows[1:2], now, tc, busy=True) is None


def test_a_watch_peak_is_the_largest_of_the_ranks_and_of_what_they_report():
    watch = runner.Watch(rank_peaks={1: 5, 2: 7}, records=[{"step": 1, "mem/peak_bytes": 9}, {"step": 2}])
    assert watch.peak == 9
    assert runner.Watch(rank_peaks={1: 5}).peak == 5


@pytest.mark.slow
def test_a_candidate_runs_as_train_py_would_its_rank_logging_to_its_log_file(tmp_path, monkeypatch):
    """run_job in this process, its rank a child process: measured, then ended by the tuner. The launcher's
    lines and the rank's output go to logs/NAME.log; run_job writes the candidate's .hydra/."""
    for key in ("WANDB_MODE", runner.CANDIDATE_ENV):
        monkeypatch.delenv(key, raising=False)
    tc = compose_typed(["tune.warmup_steps=1", "tune.measure_steps=2"]).tune
    t = _tuning(tmp_path, device_kind="cpu")
    t.budget = 4096 * MiB
    result = Result(Candidate("z0", "fp32", 4, 2, False))
    runner.run_candidate(t, result, tc)
    assert result.status == "fits", result.note
    assert result.steps == 2 and result.samples_per_s > 0 and result.tokens_per_s > 0
    assert 100 * MiB < result.peak < t.budget and result.cpu_s > 0 and result.wall_s > 0
    assert len(result.losses) >= 3 and all(loss > 0 for loss in result.losses)
    run_dir = RunDir(tmp_path / "tune" / "runs" / "z0-fp32-mb4")
    assert result.run_dir == str(run_dir.path)
    log = (tmp_path / "tune" / "logs" / "z0-fp32-mb4.log").read_text()
    assert log.startswith("job: tiny_llava (full) on 1 rank (cpu), ZeRO 0")  # the launcher's line
    assert "step 1/4 | loss" in log  # the rank's own output
    assert "tune: z0-fp32-mb4 ended by the tuner: fits\n" in log  # then the job's own last line
    # The job's own last line and its summary name the tuner, not the out-of-memory killer a SIGKILL suggests
    # (the GPU check found "a rank was killed by SIGKILL (the kernel's out-of-memory killer ...)" there).
    ended = "ended by the tuner (fits): its ranks were stopped on purpose (SIGKILL), not by a fault"
    assert log.rstrip().endswith(ended) and "out-of-memory" not in log, log[-500:]
    assert ended in run_dir.read_summary().error
    overrides = run_dir.read_overrides()
    assert overrides[: len(Candidate("z0", "fp32", 4, 2, False).overrides(8))] == result.candidate.overrides(8)
    assert {"train.max_steps=4", "logger=none", "preflight=off"} <= set(overrides)
    hydra = yaml.safe_load(run_dir.hydra_config.read_text())
    assert hydra["hydra"]["runtime"]["choices"] == {"deepspeed": "z0", "precision": "fp32"}
    assert run_dir.config.is_file() and run_dir.job.is_file()
    assert not runner.rank_processes(os.getpid())  # the tuner ended its rank


def test_a_candidate_stopped_from_outside_stops_the_tuning_even_after_it_was_measured(tmp_path):
    """A SIGTERM reaching the tuner while a candidate runs is forwarded to its ranks, which stop as
    "preempted"; the watcher may have measured the candidate meanwhile, and the tuning still stops (it went
    on to the next candidate before). The watcher's own kills (SIGKILL) end a candidate as failed."""
    t = _tuning(tmp_path)
    tc = compose_typed(["tune.warmup_steps=1", "tune.measure_steps=2"]).tune
    result = Result(Candidate("z0", "fp32", 8, 1, False))
    watcher = runner._Watcher(t, RunDir(tmp_path / "run"), tc, time.time())
    watcher.decided.append(("fits", ""))
    log = tmp_path / "candidate.log"
    log.write_text("")
    preempted = Outcome(tmp_path / "run", "preempted", 143)
    with pytest.raises(Interrupted, match="tune: stopped during z0-fp32-mb8"):
        runner._settle(t, result, watcher, preempted, tc, time.time(), log)
    killed = Outcome(tmp_path / "run", "failed", 1, "rank 0 was killed by SIGKILL")
    runner._settle(t, result, watcher, killed, tc, time.time(), log)
    assert result.status == "fits"  # the tuner's own kill of a measured candidate


def test_a_candidate_that_failed_before_its_first_step_reports_no_peak(tmp_path):
    """A rank polled while starting (a few MiB) is no peak of the candidate: the table used to say
    "peak 11 MiB" of a candidate that crashed before any step."""
    t = _tuning(tmp_path)
    tc = compose_typed(["tune.warmup_steps=1", "tune.measure_steps=2"]).tune
    result = Result(Candidate("z0", "fp32", 8, 1, False))
    watcher = runner._Watcher(t, RunDir(tmp_path / "run"), tc, time.time())
    watcher.watch.rank_peaks[1] = 11 * MiB
    log = tmp_path / "candidate.log"
    log.write_text("error: model.path=/x: cannot read its config\n")
    runner._settle(t, result, watcher, Outcome(tmp_path / "run", "failed", 2, "cannot read its config"), tc, 0, log)
    assert (result.status, result.peak) == ("failed", None)


def test_a_stop_signal_while_candidates_are_composed_ends_the_tuning_in_one_line(tmp_path, monkeypatch, capsys):
    def interrupted(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C, delivered while the first candidate is planned

    monkeypatch.setattr(tuner, "_planned", interrupted)
    code = tuner.main(["logger=none", f"tune.dir={tmp_path / 'tune'}", "tune.presets=[z0]", "tune.precisions=[fp32]"])
    err = capsys.readouterr().err
    assert code == 143 and "Traceback" not in err, err
    assert [line for line in err.splitlines() if line.startswith("error:")] == [
        "error: tune: stopped by SIGINT before any candidate ran; nothing was measured"
    ]
    assert not (tmp_path / "tune").exists()


def test_a_stop_signal_once_the_tuning_began_names_its_tune_md(tmp_path, monkeypatch, capsys):
    def interrupted(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGINT)  # delivered while the first candidate would run

    monkeypatch.setattr(tuner, "run_candidate", interrupted)
    code = tuner.main(["logger=none", f"tune.dir={tmp_path / 'tune'}", "tune.presets=[z0]", "tune.precisions=[fp32]"])
    err = capsys.readouterr().err
    assert code == 143 and "Traceback" not in err, err
    assert [line for line in err.splitlines() if line.startswith("error:")] == [
        f"error: tune: stopped by SIGINT; {tmp_path / 'tune' / 'tune.md'} holds what was measured"
    ]
    assert "not run" in (tmp_path / "tune" / "tune.md").read_text()
