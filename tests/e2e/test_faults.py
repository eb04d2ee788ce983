"""Seeded fault injection (issue 42's acceptance; issue 45's kill points): a short job is driven to its end
through faults drawn from a seed, each start the same command (`resume=auto`, as a requeued job runs it):

    signal   SIGTERM, SIGINT or SIGHUP to the job's process group while it is held in a phase: after a training
             step, in an evaluation, between a checkpoint's files and its completion marker
             (launcher.core.signals.pause_for_test, so the signal lands there however loaded the machine is)
    abort    the rank dies by SIGABRT at a step, recording nothing, as gloo and NCCL end a process
             (launcher.train.faults)
    damage   the newest intact checkpoint's model file is cut in half between two starts, an older one kept
    cache    one byte of a data cache file flipped between two starts (the next start rebuilds its shard)
    disk     the run dir's disk (a tmpfs of DISK_MIB) filled to 0-4 MiB of its end for one start, which
             ends in one line, then room made again

After every fault the job ends in one line (no traceback) within the tests' time limits, and at the end its
final model's weights equal, bitwise, those of the same job run without a fault (fp32, CPU). The seed is
LAUNCHER_FAULT_SEED (default 0); docs/reliability.md records what other seeds found.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import random
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from launcher.core.checkpoints import checkpoint_damage, complete_tags
from launcher.core.rundir import RunDir
from launcher.core.signals import PAUSE_ENV
from launcher.train.faults import FAULT_ENV
from tests.helpers import ROOT, latest, read_summary, run_train_py, small_disk, start_train

pytestmark = pytest.mark.slow

STEPS = 6
SAVE_EVERY = 2  # checkpoints at steps 2, 4 and 6: a damaged newest one leaves an older one to resume from
JOB = (
    "logger=none", "train.micro_batch_size=8", "data.n_train=64", "data.n_eval=16", "data.eval_accuracy=false",
    f"train.max_steps={STEPS}", f"train.save_every={SAVE_EVERY}", "train.eval_every=2", "train.seed=1",
    "data.num_workers=1",
)  # fmt: skip
CACHE = "cache"  # under the test's own directory: its data cache is damaged on purpose
DISK_MIB = 48  # the run dir's disk: three checkpoints of about 3.6 MiB and the model fit with room to spare
FAULTS = 4  # faults that land; a damage drawn where no older intact checkpoint exists is drawn again
SEED = int(os.environ.get("LAUNCHER_FAULT_SEED", "0"))
STOPS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
STOPPED = (143, 129)  # a stop the job honours with a checkpoint (143), or one before it planned (128 + SIGHUP)


def draw(rng: random.Random) -> tuple[str, object]:
    """One fault: (kind, where), `where` counted from the step the start resumes from (so that each lands)."""
    kind = rng.choice(["signal", "signal", "abort", "damage", "cache", "disk"])
    if kind == "signal":
        return kind, (rng.choice(["step", "step", "eval", "save"]), rng.randint(1, 3), rng.choice(STOPS))
    if kind == "cache":
        return kind, rng.random()  # which file, and where in it
    if kind == "disk":
        return kind, rng.randint(0, 4 * 2**20)  # bytes left free
    return kind, rng.randint(1, 3) if kind == "abort" else None


def intact_tags(run_dir: Path) -> list[str]:
    """The complete checkpoints whose files have the sizes their markers recorded, oldest first."""
    run = RunDir(run_dir)
    return [tag for _, tag in complete_tags(run) if checkpoint_damage(run, tag) is None]


def resumes_from(run_dir: Path) -> int:
    """The step the next start continues after (its `latest` checkpoint; 0: none)."""
    tag = latest(run_dir)
    return int(tag.removeprefix("step")) if tag else 0


def phase_of(what: str, offset: int, start: int) -> str:
    """The pause point `offset` steps after `start`: a step's end, the next evaluation, the next save."""
    step = min(start + offset, STEPS)
    if what == "step":
        return f"step{step}"
    if what == "save":  # the next checkpoint: every SAVE_EVERY steps, and the last step's (finish saves one)
        return f"save-step{min(STEPS, (start // SAVE_EVERY + 1) * SAVE_EVERY)}"
    return "eval"  # the next one (every 2 steps)


def attempt(env: dict[str, str], tmp_path: Path, run_dir: Path, number: int, extra: dict[str, str]) -> tuple:
    """One start of the job, with `extra` in its environment: (process, its output file)."""
    log = tmp_path / f"attempt-{number}.out"
    job = (*JOB, f"cache_dir={tmp_path / CACHE}", "resume=auto", f"hydra.run.dir={run_dir}")
    process = start_train({**env, **extra}, *job, log=log)
    return process, log


def ended(process: subprocess.Popen, log: Path) -> int:
    code = process.wait(timeout=600)
    text = log.read_text()
    assert "Traceback" not in text, text[-3000:]
    return code


def listing(root: Path) -> dict[str, tuple[int, str]]:
    """Every file under `root` with its size and SHA-256: what a job must leave as it found it."""
    return {
        str(path.relative_to(root)): (path.stat().st_size, hashlib.sha256(path.read_bytes()).hexdigest())
        for path in sorted(root.rglob("*"))
        if path.is_file()
    }


def fill(disk: Path, leave: int) -> Path:
    """A file that fills `disk` to its last `leave` bytes (a tmpfs frees what a truncation gives back)."""
    ballast = disk / "ballast"
    with contextlib.suppress(OSError), ballast.open("wb") as handle:
        while True:
            handle.write(b"\0" * 2**20)
            handle.flush()
    size = ballast.stat().st_size
    with ballast.open("r+b") as handle:
        handle.truncate(max(size - leave, 0))
    return ballast


def test_a_job_driven_through_seeded_faults_ends_with_the_uninterrupted_jobs_weights(isolated_env, tmp_path):
    with small_disk(tmp_path / "disk", DISK_MIB):
        faults_then_compare(isolated_env, tmp_path, tmp_path / "disk")


def faults_then_compare(isolated_env: dict[str, str], tmp_path: Path, disk: Path) -> None:
    run_dir = disk / "run"
    # Beside the run dir and the cache: a user's folder, and the project's top level (the jobs' working
    # directory). Neither may change, whatever the faults (issue 42's acceptance).
    neighbour = tmp_path / "neighbour"
    (neighbour / "model").mkdir(parents=True)
    (neighbour / "NOTES.txt").write_text("mine")
    (neighbour / "model" / "model.safetensors").write_bytes(os.urandom(4096))
    before, top_level = listing(neighbour), {path.name for path in ROOT.iterdir()}
    rng, done, number = random.Random(SEED), [], 0
    while len(done) < FAULTS:
        if (run_dir / "summary.json").exists() and read_summary(run_dir)["status"] == "completed":
            break  # the job finished before every fault landed on it
        kind, where = draw(rng)
        number += 1
        if kind == "damage":
            # The newest intact checkpoint, where an older one stays to resume from (with none, the run would
            # be refused until the user starts it over: tests/unit/job/test_resume.py); else another draw.
            tags = intact_tags(run_dir)
            if len(tags) >= 2:
                model_file = RunDir(run_dir).checkpoint(tags[-1]) / "mp_rank_00_model_states.pt"
                with open(model_file, "r+b") as handle:
                    handle.truncate(model_file.stat().st_size // 2)
                done.append(f"{tags[-1]}'s model file cut in half")
            continue
        if kind == "disk":
            ballast = fill(disk, where)
            process, log = attempt(isolated_env, tmp_path, run_dir, number, {})
            code = ended(process, log)
            ballast.unlink()
            done.append(f"the disk filled to {where // 1024} KiB of its end: exit {code}")
            if code == 0:  # the job ended on what room there was
                continue
            errors = [line for line in log.read_text().splitlines() if line.startswith("error: ")]
            full = ("No space left on device", "MiB free there")  # the start refused, or a write in it failed
            assert code in (1, 2) and len(errors) == 1 and any(why in errors[0] for why in full), (done, errors)
            continue
        if kind == "cache":
            files = sorted((tmp_path / CACHE / "data_cache").glob("*/shards/*/*.bin"))
            if files:
                target = files[int(where * len(files))]
                data = bytearray(target.read_bytes())
                data[int(where * len(data))] ^= 0x01
                target.write_bytes(bytes(data))
                done.append(f"a byte of {target.parent.parent.parent.name[:8]}'s {target.name} flipped")
            continue
        start = resumes_from(run_dir)
        if kind == "abort":
            step = min(start + where, STEPS)
            process, log = attempt(isolated_env, tmp_path, run_dir, number, {FAULT_ENV: f"0:{step}:abort"})
            code = ended(process, log)
            done.append(f"SIGABRT of the rank at step {step}: exit {code}")
            assert code == 1, (done, log.read_text()[-3000:])
            continue
        what, offset, signum = where
        phase = phase_of(what, offset, start)
        mark = tmp_path / f"in-{phase}-{number}"
        process, log = attempt(isolated_env, tmp_path, run_dir, number, {PAUSE_ENV: f"{phase}:600:{mark}"})
        while process.poll() is None and not mark.exists():
            time.sleep(0.05)
        if mark.exists():
            os.killpg(process.pid, signum)
        code = ended(process, log)
        done.append(f"{signal.Signals(signum).name} in {phase}: exit {code}" if mark.exists() else f"{phase}: passed")
        assert code in (0, *STOPPED), (done, log.read_text()[-3000:])

    process, log = attempt(isolated_env, tmp_path, run_dir, number + 1, {})
    assert ended(process, log) == 0, (done, log.read_text()[-3000:])
    assert read_summary(run_dir)["status"] == "completed", done

    clean = run_train_py(isolated_env, *JOB, f"cache_dir={tmp_path / CACHE}", f"hydra.run.dir={tmp_path / 'clean'}",
                         timeout=900)  # fmt: skip
    assert clean.returncode == 0, clean.stderr[-3000:]
    faulted = load_file(RunDir(run_dir).model / "model.safetensors")
    expected = load_file(RunDir(tmp_path / "clean").model / "model.safetensors")
    assert faulted.keys() == expected.keys()
    different = [name for name in expected if not torch.equal(faulted[name], expected[name])]
    assert different == [], (SEED, done, different[:5])
    assert listing(neighbour) == before
    assert {path.name for path in ROOT.iterdir()} - top_level <= {"outputs"}, "a job wrote into its working directory"
    print(f"seed {SEED}: {'; '.join(done) or 'no fault landed'}; the final weights equal the uninterrupted run's")
