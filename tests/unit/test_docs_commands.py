"""Every `python train.py ...` and `python -m launcher.plan|tune|prepare ...` line in the README's and docs/'s
shell blocks composes as written: its overrides parse with Hydra's grammar and name keys and values the
config has (a sweep's `-m k=a,b` line composes its first job). docs/models.md's regex example did not
(issue 28). What the README's commands then do when run is tests/e2e/test_readme_commands.py."""

from __future__ import annotations

import re
import shlex

import pytest

from launcher.config.compose import compose_typed
from tests.helpers import ROOT

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
def test_a_documented_command_composes_as_written(where, args):
    words = shlex.split(re.split(r"\s#", args)[0])
    compose_typed(_first_job(words, sweep="-m" in words or "--multirun" in words))
