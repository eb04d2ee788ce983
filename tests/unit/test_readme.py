"""The README's two set-up-and-go commands stay true to what CI runs."""

from __future__ import annotations

import re

from tests.helpers import ROOT


def _first_commands() -> list[str]:
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"```bash\n(.*?)```", readme, re.S).group(1)
    return [line for line in block.splitlines() if line and not line.startswith("#")]


def test_readme_has_exactly_two_set_up_and_go_commands():
    run, test = _first_commands()
    for command in (run, test):
        assert command.startswith("python3 -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0")
        assert "pip install -e '.[dev]'" in command
    assert run.endswith("&& python train.py")
    assert test.endswith("&& python -m pytest -q -n 2")  # every test, the slow ones too


def test_ci_installs_the_same_way_and_runs_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text()
    test = _first_commands()[1]
    assert "python -m pip install -q torch==2.13.0" in ci
    assert "python -m pip install -q -e '.[dev]'" in ci
    command = test.split("&& ")[-1].strip()
    assert [line for line in ci.splitlines() if "pytest" in line and not line.startswith("#")] == [command]
