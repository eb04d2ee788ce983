"""launcher.export.export: `python -m launcher.export` as `main(argv)` in this process: what it refuses, and
(slow) exports of trained runs, from model/ and from ZeRO checkpoints, reloaded and checked.

The disk that fills while an export is written (a file size limit on a subprocess) is in
tests/e2e/test_tools.py; LoRA exports (merged and not) are with the LoRA tests."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from launcher.config.schema import config_from_yaml
from launcher.core.rundir import RunDir
from launcher.export.export import main
from tests.helpers import ROOT, compose_config, read_summary, run_here


def export(capsys, run_dir: Path, *args: str) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of `python -m launcher.export RUN_DIR ARGS`, run in this process."""
    code = main([str(run_dir), *args])
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line(done: tuple[int, str, str], message: str) -> None:
    code, _, err = done
    assert code == 2, err[-2000:]
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and message in errors[0], err[-2000:]
    assert "Traceback" not in err


@pytest.fixture
def never_trained(tmp_path: Path) -> Path:
    """A run directory that stopped before its first checkpoint: its config, no model/, no checkpoint."""
    run = RunDir(tmp_path / "run")
    run.hydra.mkdir(parents=True)
    OmegaConf.save(compose_config(["logger=none"]), run.config)
    run.checkpoint("step5").mkdir(parents=True)  # begun, never completed
    return run.path


def test_a_run_with_no_model_and_no_checkpoint_is_one_line(never_trained, capsys):
    done = export(capsys, never_trained)
    assert_one_line(done, f"{never_trained} holds no model/ and no complete checkpoint to export")
    assert not (never_trained / "export").exists()


def test_an_unknown_checkpoint_tag_names_the_complete_ones(never_trained, capsys):
    done = export(capsys, never_trained, "--checkpoint", "step9")
    assert_one_line(done, "--checkpoint step9: no complete checkpoint")
    assert "(complete: none; universal copies: universal/TAG)" in done[2]


@pytest.mark.parametrize("tag", ["../../elsewhere/step5", "/abs/step5", "universal/../step5", ".."])
def test_a_checkpoint_tag_that_is_a_path_is_refused(never_trained, tmp_path, capsys, tag):
    """A tag names a folder of RUN/checkpoints: one that is a path would read a marker and weights from
    outside the run, even one made to look complete."""
    outside = tmp_path / "elsewhere" / "step5"
    outside.mkdir(parents=True)
    (outside / "launcher_complete.json").write_text("{}")
    done = export(capsys, never_trained, "--checkpoint", tag)
    assert_one_line(done, f"--checkpoint {tag}: a checkpoint tag is a folder name in")
    assert not (never_trained / "export").exists()


def test_a_destination_that_exists_and_is_not_empty_is_refused(never_trained, tmp_path, capsys):
    out = tmp_path / "taken"
    out.mkdir()
    (out / "weights.bin").write_text("someone else's")
    assert_one_line(export(capsys, never_trained, "--out", str(out)), f"--out {out} exists and is not empty")
    assert (out / "weights.bin").read_text() == "someone else's"


def test_a_destination_that_is_a_link_or_cannot_be_made_is_refused_before_anything_loads(
    never_trained, tmp_path, capsys
):
    """Checked first: it used to fail after loading and comparing the model (NotADirectoryError, or blaming
    free disk space)."""
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    assert_one_line(export(capsys, never_trained, "--out", str(tmp_path / "link")), "is a symbolic link")
    (tmp_path / "a_file").write_text("")
    out = tmp_path / "a_file" / "export"
    assert_one_line(export(capsys, never_trained, "--out", str(out)), f"--out {out}: cannot be created (")


def test_ctrl_c_during_an_export_is_one_line_and_leaves_nothing(never_trained, tmp_path, monkeypatch, capsys):
    import os
    import signal

    from launcher.export import export as export_module

    def interrupted(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGINT)  # while the trained model loads

    monkeypatch.setattr(export_module, "load_source", interrupted)
    code = main([str(never_trained), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 143 and "Traceback" not in err, err
    assert [line for line in err.splitlines() if line.startswith("error: ")] == [
        "error: export stopped by SIGINT; nothing was written (run it again)"
    ]
    assert not (tmp_path / "out").exists()


def test_a_directory_that_is_no_run_is_refused(tmp_path, capsys):
    assert_one_line(export(capsys, tmp_path), f"{tmp_path} is not a run directory")


@pytest.mark.parametrize(
    ("args", "message"), [(["--samples", "0"], "--samples 0"), (["--tolerance", "-1"], "--tolerance -1.0")]
)
def test_nonsense_samples_or_tolerance_are_refused(never_trained, args, message, capsys):
    with pytest.raises(SystemExit) as exited:
        main([str(never_trained), *args])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and message in err and "Traceback" not in err


# ----------------------------------------------------------------------------- trained runs
def _load(path: Path):
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32)


@pytest.mark.slow
def test_a_zero0_run_exports_from_model_and_from_its_checkpoint_alike(quick_run, tmp_path, capsys):
    """Stage 0 at fp32 keeps no optimizer partitions: the module's own weights are the checkpoint's."""
    run = RunDir(quick_run.run_dir)
    code, out, err = export(capsys, run.path, "--out", str(tmp_path / "end"))
    assert code == 0, err[-3000:]
    assert out.startswith(f"exported the model of model/ to {tmp_path / 'end'}; reloaded, its logits differ")
    assert out.rstrip().endswith("(tolerance 0.0001) on 8 held-out samples")
    code, out, err = export(capsys, run.path, "--checkpoint", "latest", "--out", str(tmp_path / "latest"))
    assert code == 0, err[-3000:]
    assert out.startswith(f"exported the model of checkpoint step2 to {tmp_path / 'latest'}")
    written = {path.name for path in (tmp_path / "latest").iterdir()}
    assert {"model.safetensors", "config.json", "processor_config.json", "tokenizer.json"} <= written
    end, latest = _load(tmp_path / "end").state_dict(), _load(tmp_path / "latest").state_dict()
    for name, tensor in latest.items():
        torch.testing.assert_close(tensor, end[name], msg=name)
    assert not run.path.joinpath("export").exists() and not list(tmp_path.glob(".*partial"))


@pytest.mark.slow
def test_a_damaged_checkpoint_is_one_line_and_nothing_is_written(quick_run, tmp_path, capsys):
    """A checkpoint whose files are cut short (or pruned while exporting) used to end in torch's
    PytorchStreamReader traceback."""
    import shutil

    copy = tmp_path / "run"
    shutil.copytree(quick_run.run_dir, copy)
    for states in RunDir(copy).checkpoint("step2").glob("*.pt"):
        states.write_bytes(states.read_bytes()[:100])
    done = export(capsys, copy, "--checkpoint", "step2", "--out", str(tmp_path / "out"))
    assert_one_line(done, f"checkpoint {RunDir(copy).checkpoint('step2')} cannot be read (")
    assert "it is damaged, or was removed while exporting" in done[2]
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".*partial"))


def eval_accuracy(model, run_dir: Path) -> float:
    """Exact match of `model` on the run's held-out samples, as the run measured it (data.eval_samples)."""
    from transformers import AutoProcessor

    from launcher.data.accuracy import exact_match_accuracy
    from launcher.data.records import ConversationDataset, read_data

    cfg = config_from_yaml(RunDir(run_dir).config)
    records = read_data(cfg.data, Path(cfg.cache_dir).expanduser().absolute()).eval[: int(cfg.data.eval_samples)]
    processor = AutoProcessor.from_pretrained(RunDir(run_dir).model)
    correct, total = exact_match_accuracy(
        model, processor, ConversationDataset(records), max_new_tokens=int(cfg.data.max_new_tokens)
    )
    return correct / total


@pytest.mark.slow
def test_full_finetune_at_zero3_on_two_ranks_exports_from_a_mid_run_checkpoint_and_the_end(
    tmp_path, capsys, monkeypatch
):
    """The launcher in this process, its two ranks child processes; the exports in this process."""
    monkeypatch.setenv("VLM_LAUNCHER_CACHE", str(ROOT / "outputs" / "cache"))
    run_dir = tmp_path / "run"
    ran = run_here(
        ["deepspeed=z3", "dist.nproc_per_node=2", "logger=none", "train.micro_batch_size=8", "train.max_steps=60",
         "train.save_every=30", "train.eval_every=0", "data.eval_samples=64"],
        run_dir,
    )  # fmt: skip
    assert ran.outcome.status == "completed", ran.error
    # Mid-run: the ZeRO-3 partitions of both ranks consolidated by zero_to_fp32, then reloaded and compared.
    code, out, err = export(capsys, run_dir, "--checkpoint", "step30", "--out", str(tmp_path / "step30"))
    assert code == 0, err[-3000:]
    assert out.startswith(f"exported the model of checkpoint step30 to {tmp_path / 'step30'}")
    # The end, from model/ and from the last checkpoint: the same weights either way.
    for args, name in (([], "end"), (["--checkpoint", "latest"], "latest")):
        code, _, err = export(capsys, run_dir, *args, "--out", str(tmp_path / name))
        assert code == 0, err[-3000:]
    exported = {name: _load(tmp_path / name) for name in ("step30", "end", "latest")}
    end_weights = exported["end"].state_dict()
    for name, tensor in exported["latest"].state_dict().items():
        torch.testing.assert_close(tensor, end_weights[name], msg=name)
    middle_weights = exported["step30"].state_dict()
    assert any(not torch.equal(middle_weights[name], end_weights[name]) for name in end_weights)
    assert eval_accuracy(exported["end"], run_dir) == read_summary(run_dir)["eval_accuracy"]
