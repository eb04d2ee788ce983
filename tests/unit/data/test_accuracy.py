"""launcher.data.accuracy: held-out exact match of greedy answers, case and whitespace aside; batched
(left-padded) generation answers each sample as it would alone."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader

from launcher.data.accuracy import exact_match_accuracy, normalize_answer
from launcher.data.collate import Collator, PromptCollator
from launcher.data.records import ConversationDataset, load_records
from launcher.data.shapes import COLOURS, QUESTION, SHAPES, generate_shapes
from launcher.model.loading import load_model_and_processor
from launcher.model.tiny import build_tiny_model_dir


def test_normalize_answer():
    assert normalize_answer("  Red   Circle\n") == normalize_answer("red circle") == "red circle"


def test_exact_match_accuracy_runs(shapes, model_and_processor):
    model, processor = model_and_processor
    _, eval_json, root = shapes
    dataset = ConversationDataset(load_records(eval_json, root)[0])
    model.train()
    correct, total = exact_match_accuracy(model, processor, dataset, max_new_tokens=4, synced_gpus=False)
    assert total == 36 and 0 <= correct <= total
    assert model.training  # mode restored

    loader = DataLoader(dataset, batch_size=12, collate_fn=PromptCollator(processor))
    assert exact_match_accuracy(model, processor, loader, max_new_tokens=4, synced_gpus=False) == (correct, total)


def with_answer(sample: dict, text: str) -> dict:
    """The sample with its last assistant turn's text replaced."""
    return {
        **sample,
        "messages": [*sample["messages"][:-1], {"role": "assistant", "content": [{"type": "text", "text": text}]}],
    }


def test_a_sample_is_counted_correct_when_greedy_generation_gives_its_answer(shapes, model_and_processor):
    """Each sample's greedy answer, generated alone, taken as its reference: the batched, left-padded
    evaluation matches every one (in any case and spacing), and none once the references change."""
    model, processor = model_and_processor
    _, eval_json, root = shapes
    samples = list(ConversationDataset(load_records(eval_json, root)[0][:12]))
    model.eval()
    own = []
    with torch.no_grad():
        for sample in samples:
            batch, _ = PromptCollator(processor)([sample])
            generated = model.generate(
                **batch, max_new_tokens=4, do_sample=False, pad_token_id=processor.tokenizer.pad_token_id
            )
            new = generated[0, batch["input_ids"].shape[1] :]
            own.append(processor.tokenizer.decode(new, skip_special_tokens=True))
    shouted = [with_answer(sample, f"  {text.upper()} \n") for sample, text in zip(samples, own, strict=True)]
    loader = DataLoader(shouted, batch_size=5, collate_fn=PromptCollator(processor))  # batches of 5, 5 and 2
    assert exact_match_accuracy(model, processor, loader, max_new_tokens=4) == (12, 12)
    wrong = [with_answer(sample, f"{text} never") for sample, text in zip(samples, own, strict=True)]
    loader = DataLoader(wrong, batch_size=12, collate_fn=PromptCollator(processor))
    assert exact_match_accuracy(model, processor, loader, max_new_tokens=4) == (0, 12)


@pytest.mark.slow
def test_tiny_llava_learns_colours_within_a_few_hundred_steps(tmp_path):
    """End to end through labels, generate and exact match: colours come first (shapes take ~1000 steps)."""
    torch.manual_seed(0)
    train_json, eval_json, root = generate_shapes(tmp_path / "s", seed=0, n_train=720, n_eval=72, image_size=32)
    train, _ = load_records(train_json, root)
    out = build_tiny_model_dir(
        "tiny_llava",
        tmp_path / "m",
        [QUESTION] + [f"{c} {s}" for c in COLOURS for s in SHAPES],
        seed=0,
        hidden_size=64,
        num_layers=2,
        vision_hidden_size=64,
        vision_layers=2,
        image_size=32,
        patch_size=8,
    )
    model, processor = load_model_and_processor(str(out))
    eval_set = ConversationDataset(load_records(eval_json, root)[0])
    assert exact_match_accuracy(model, processor, eval_set, max_new_tokens=4)[0] == 0
    loader = DataLoader(
        ConversationDataset(train),
        batch_size=32,
        shuffle=True,
        drop_last=True,
        collate_fn=Collator(processor),
        generator=torch.Generator().manual_seed(0),
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model.train()
    for _epoch in range(7):  # 154 steps
        for batch in loader:
            model(**batch).loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
    correct, total = exact_match_accuracy(model, processor, eval_set, max_new_tokens=4)
    assert correct / total > 0.2  # right colour, shape still near chance (1/3)
