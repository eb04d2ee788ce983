"""python -m launcher.infer: a trained model answers questions about an image from the command line, through
its own chat template, greedily (the answers exact match scores, launcher.data.accuracy) or sampled; from a
run's model/ or one of its checkpoints; one question, stdin, or a batch file answered beside it."""

from __future__ import annotations

import io
import json
import subprocess
import sys

import pytest
from PIL import Image

from launcher.infer.infer import Decoding, answer, load_checkpoint, load_trained, main
from tests.helpers import ROOT


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
    assert line == answer(model, processor, "what shape is it?", image, Decoding(max_new_tokens=4))
    # Questions from stdin, one a line (blank lines skipped): one answer line each.
    monkeypatch.setattr("sys.stdin", io.StringIO("what shape is it?\n\nwhat colour is it?\n"))
    assert main([str(quick_run.run_dir), "--image", str(red_square), "--max-new-tokens", "4"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 2


def test_launcher_chat_is_the_same_program(quick_run, red_square, capsys):
    """`python -m launcher.chat`, the name LLaMA-Factory's users type, answers as launcher.infer does."""
    args = [str(quick_run.run_dir), "--image", str(red_square), "what shape is it?", "--max-new-tokens", "4"]
    assert main(args) == 0
    expected = capsys.readouterr().out
    chat = subprocess.run([sys.executable, "-m", "launcher.chat", *args], capture_output=True, text=True, cwd=ROOT)
    assert (chat.returncode, chat.stdout) == (0, expected), chat.stderr[-2000:]
    usage = subprocess.run([sys.executable, "-m", "launcher.chat", "--help"], capture_output=True, text=True, cwd=ROOT)
    assert usage.stdout.startswith("usage: python -m launcher.chat "), usage.stdout


def test_a_checkpoint_answers_as_the_model_it_holds(quick_run, red_square, capsys):
    """--checkpoint TAG: the run's checkpoint, consolidated as launcher.export reads it; the quick run's last
    checkpoint holds the weights its model/ was saved from, so both answer alike."""
    args = [str(quick_run.run_dir), "--image", str(red_square), "what shape is it?", "--max-new-tokens", "4"]
    assert main([*args, "--checkpoint", "step2"]) == 0
    from_checkpoint = capsys.readouterr().out
    assert main(args) == 0
    assert from_checkpoint == capsys.readouterr().out
    model, _ = load_checkpoint(str(quick_run.run_dir), "step2")
    assert not model.training
    assert main([*args, "--checkpoint", "step9"]) == 2
    assert "--checkpoint step9: no complete checkpoint of that name" in capsys.readouterr().err


def test_a_batch_file_is_answered_beside_it_and_sampling_follows_its_seed(quick_run, red_square, tmp_path, capsys):
    (tmp_path / "images").mkdir()
    Image.open(red_square).save(tmp_path / "images" / "red.png")
    questions = [{"question": "what shape is it?", "image": "images/red.png"}, {"question": "what colour?"}]
    batch = tmp_path / "questions.json"
    batch.write_text(json.dumps(questions))
    assert main([str(quick_run.run_dir), "--batch", str(batch), "--max-new-tokens", "4"]) == 0
    out = tmp_path / "questions.answers.jsonl"
    assert capsys.readouterr().out.strip() == f"answers: {out}"
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["question"], r["image"]) for r in rows] == [(q["question"], q.get("image")) for q in questions]
    greedy = [r["answer"] for r in rows]
    model, processor = load_trained(str(quick_run.run_dir))
    assert greedy[0] == answer(model, processor, "what shape is it?", Image.open(red_square).convert("RGB"),
                               Decoding(max_new_tokens=4))  # fmt: skip

    sampled = []
    for seed in (3, 3):
        assert main([str(quick_run.run_dir), "--batch", str(batch), "--sample", "--temperature", "2.0",
                     "--seed", str(seed), "--max-new-tokens", "4"]) == 0  # fmt: skip
        sampled.append(out.read_text())
    assert sampled[0] == sampled[1]  # the same seed, the same draws

    batch.write_text(json.dumps([{"image": "images/red.png"}]))
    capsys.readouterr()
    assert main([str(quick_run.run_dir), "--batch", str(batch)]) == 2
    assert capsys.readouterr().err.strip() == (
        f'error: --batch {batch} item 0: needs a "question" (text), and may name an "image"'
    )


def test_a_lora_runs_adapters_answer_on_their_base(train_in_process, tmp_path, red_square, capsys):
    ran = train_in_process("method=lora", "model.tiny_base=random", "train.max_steps=2", "train.eval_every=0",
                           "data.eval_accuracy=false", "train.micro_batch_size=4", "logger=none")  # fmt: skip
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
