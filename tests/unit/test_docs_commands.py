"""Every `python train.py ...` and `python -m launcher.plan|tune|prepare ...` line in the README's and docs/'s
shell blocks composes and plans as written: its overrides parse with Hydra's grammar and name keys and values
the config has (a sweep's `-m k=a,b` line composes its first job), its values pass every range check and
the job is planned (its batch, its DeepSpeed dict, its checks between keys), as the launcher plans it before
anything starts; only a data file or model folder the page names as the reader's own (`/data/...`) need not
exist here. docs/models.md's regex example did not compose (issue 28). What the README's commands then do
when run is tests/e2e/test_readme_commands.py."""

from __future__ import annotations

import re
import shlex

import pytest

from launcher.config.compose import compose_typed
from launcher.config.ranges import check_config
from launcher.core.errors import LauncherError
from launcher.job.planning import plan_job, training_length
from launcher.job.spec import HydraJob
from tests.helpers import ROOT

# A path the page gives as the reader's own (their data, their model folder): absent here, as it should be.
READERS_OWN = re.compile(r"^(data\.path|data\.image_root|model\.path)=(/(data|models|scratch)/\S*|\.\.\.): no such ")

COMMAND = re.compile(r"^(?:[A-Z_]+=\S+\s+)*python3? (?:train\.py|-m launcher\.(?:plan|tune|prepare))\b(?P<args>.*)$")


def _commands() -> list[tuple[str, str]]:
    found = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for block in re.findall(r"```(?:bash|sh|console)?\n(.*?)```", page.read_text(), re.S):
            for line in block.replace("\\\n", " ").splitlines():
                if (match := COMMAND.match(line.strip())) is not None:
                    found.append((f"{page.relative_to(ROOT)}: {line.strip()[:90]}", match["args"]))
    return found


def _first_job(words: list[str], sweep: bool) -> list[str]:
    """The overrides of a command (flags and placeholders left out); of a sweep, its first job's."""
    overrides = [word for word in words if "=" in word and not word.startswith("-")]
    if sweep:
        overrides = [re.sub(r"^([^=\[\]{}'\"]+)=([^\[\]{}'\",]+),.*$", r"\1=\2", word) for word in overrides]
    return overrides


COMMANDS = _commands()


def test_the_pages_hold_commands():
    assert len(COMMANDS) >= 30


@pytest.mark.parametrize(("where", "args"), COMMANDS, ids=[where for where, _ in COMMANDS])
def test_a_documented_command_composes_and_plans_as_written(where, args, tmp_path):
    words = shlex.split(re.split(r"\s#", args)[0])
    overrides = _first_job(words, sweep="-m" in words or "--multirun" in words)
    tuner = "launcher.tune" in where  # the tuner checks its own knobs, and varies the micro batch itself
    cfg = compose_typed(overrides)
    check_config(cfg, tuner=tuner)
    try:
        # Planned as the tuner plans a job (Hydra's choices only label a run: one composition is enough here).
        plan_job(training_length(cfg)[0], HydraJob(run_dir=tmp_path, overrides=tuple(overrides)), validate=not tuner)
    except LauncherError as err:
        if READERS_OWN.match(str(err)) is None:
            raise
