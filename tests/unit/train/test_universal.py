"""launcher.train.universal: a checkpoint converted for another world size or ZeRO stage (DeepSpeed's
universal layout), made from a copy of one short run's ZeRO-0 checkpoint (`quick_run`). A resume that
trains from such a copy, and a kill during the conversion, are tests/e2e's (several ranks)."""

from __future__ import annotations

import shutil

import pytest
import torch

from launcher.core import checkpoints
from launcher.core.rundir import RunDir
from launcher.train import universal

pytestmark = pytest.mark.slow  # reads a run that trained (quick_run)


@pytest.fixture
def run_dir(quick_run, tmp_path) -> RunDir:
    shutil.copytree(quick_run.run_dir, tmp_path / "run")
    return RunDir(tmp_path / "run")


def test_a_zero0_checkpoint_converts_to_every_parameters_full_value_and_moments(run_dir):
    marker = checkpoints.read_marker(run_dir, "step2")
    before = checkpoints.saved_files(run_dir.checkpoint("step2"))
    out = universal.ensure_universal(run_dir, "step2", 0, marker.param_names)
    assert out == run_dir.universal("step2") and universal.is_universal(out)
    assert checkpoints.saved_files(run_dir.checkpoint("step2")) == before  # the original is never modified
    for name in marker.param_names:
        assert {p.name for p in (out / "zero" / name).iterdir()} == {
            "fp32.pt",
            "exp_avg.pt",
            "exp_avg_sq.pt",
            "step.pt",
        }
    states = torch.load(
        run_dir.checkpoint("step2") / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False
    )
    shapes = {name: states["module"][name].shape for name in marker.param_names}
    full = universal.full_state_dict(out, shapes)
    assert all(torch.equal(full[name], states["module"][name].float()) for name in marker.param_names)
    assert float(torch.load(out / "zero" / marker.param_names[0] / "step.pt", weights_only=False)) == 2.0
    # Every target stage reads one layout: both model-states names, the optimizer's step and groups.
    assert (out / "mp_rank_00_model_states.pt").is_file() and (
        out / "zero_pp_rank_0_mp_rank_00_model_states.pt"
    ).is_file()
    optimizer = torch.load(out / "zero" / "optimizer_state.pt", weights_only=False)
    assert optimizer["param_groups"] and "ds_version" in optimizer and optimizer["optimizer_state_dict"]["state"][0]


def test_a_complete_copy_is_kept_and_a_partial_one_is_made_again(run_dir):
    names = checkpoints.read_marker(run_dir, "step2").param_names
    partial = run_dir.universal("step2").parent / ".step2.partial"
    partial.mkdir(parents=True)
    (partial / "left_by_a_kill").write_text("")  # a conversion killed part-way
    out = universal.ensure_universal(run_dir, "step2", 0, names)
    assert not partial.exists() and not (out / "left_by_a_kill").exists()
    done = (out / universal.DONE_FILE).read_text()
    (out / "zero" / names[0] / "fp32.pt").unlink()  # a complete copy is not looked into again
    assert universal.ensure_universal(run_dir, "step2", 0, names) == out
    assert (out / universal.DONE_FILE).read_text() == done


def test_a_zero0_checkpoint_without_parameter_names_is_refused(run_dir):
    with pytest.raises(ValueError, match="no parameter names recorded; cannot convert a ZeRO-0 checkpoint"):
        universal.ensure_universal(run_dir, "step2", 0, None)
    with pytest.raises(ValueError, match=r"\d+ optimized tensors, but 1 parameter names recorded"):
        universal.ensure_universal(run_dir, "step2", 0, ["only.one"])
