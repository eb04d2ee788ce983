"""python -m launcher.infer: a trained model answers questions about an image from the command line, through
its own chat template, greedily: the answers exact match scores (launcher.data.accuracy)."""

from __future__ import annotations

import io

import pytest
from PIL import Image

from launcher.infer.infer import answer, load_trained, main


@pytest.fixture(scope="module")
def red_square(tmp_path_factory):
    path = tmp_path_factory.mktemp("images") / "red.png"
    Image.new("RGB", (32, 32), "red").save(path)
    return path


def test_a_run_answers_each_question_with_its_greedy_answer(quick_run, red_square, capsys, monkeypatch):
    assert main([str(quick_run.run_dir), "--image", str(red_square), "what shape is it?", "--max-new-tokens", "4"]) == 0
    (line,) = capsys.readouterr().out.splitlines()
    model, processor = load_trained(str(quick_run.run_dir / "model"))
    image = Image.open(red_square).convert("RGB")
    assert line == answer(model, processor, "what shape is it?", image, max_new_tokens=4)
    # Questions from stdin, one a line (blank lines skipped): one answer line each.
    monkeypatch.setattr("sys.stdin", io.StringIO("what shape is it?\n\nwhat colour is it?\n"))
    assert main([str(quick_run.run_dir), "--image", str(red_square), "--max-new-tokens", "4"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 2


def test_a_lora_runs_adapters_answer_on_their_base(train_in_process, tmp_path, red_square, capsys):
    ran = train_in_process("method=lora", "train.max_steps=2", "train.eval_every=0", "data.eval_accuracy=false",
                           "train.micro_batch_size=4", "logger=none")  # fmt: skip
    assert ran.summary()["status"] == "completed", ran.error
    assert (ran.run_dir / "model" / "adapter_config.json").is_file()
    capsys.readouterr()  # the run's own lines
    assert main([str(ran.run_dir), "--image", str(red_square), "what shape?", "--max-new-tokens", "3"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 1


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (["/nowhere/run", "q"], "error: /nowhere/run: no such run or model directory (nor a hub id like org/name)"),
        (["{run}", "--image", "/nowhere.png", "q"], "error: --image /nowhere.png: no such file"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(quick_run, args, line, capsys):
    assert main([arg.format(run=quick_run.run_dir) for arg in args]) == 2
    assert capsys.readouterr().err.strip() == line
