"""`python train.py` with a misspelt closed choice: Hydra refuses it when composing, before anything starts.

Every choice's refusal is tested in-process (tests/unit/config/test_schema.py); this is the command line's
contract: exit code 1, the options listed, no traceback, no run directory.
"""

from __future__ import annotations


def test_train_py_refuses_a_misspelt_choice_before_anything_starts(run_train, tmp_path):
    run_dir = tmp_path / "run"
    result = run_train("logger.mode=onlin", f"hydra.run.dir={run_dir}", timeout=120)
    assert result.returncode == 1
    assert "Invalid value 'onlin', expected one of [auto, online, offline, disabled]" in result.stderr
    assert "Traceback" not in result.stderr
    assert not run_dir.exists()  # nothing started, nothing written
