"""Held-out exact match: greedy answers compared with the reference, case and whitespace aside."""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, Dataset

from launcher.data.collate import PromptCollator
from launcher.data.video import takes_model_dtype


def normalize_answer(text: str) -> str:
    """Case- and whitespace-insensitive form used for exact match."""
    return " ".join(text.lower().split())


@torch.no_grad()
def exact_match_accuracy(
    model,
    processor,
    dataset_or_loader,
    *,
    max_new_tokens: int,
    synced_gpus: bool = False,
    video_every_batch: bool = False,
    batch_size: int = 32,
) -> tuple[int, int]:
    """Greedy-generate an answer for each sample and count exact matches; return (correct, total).

    Takes a ConversationDataset (batched here) or a DataLoader built with `PromptCollator`. With
    several ranks under ZeRO-3 pass `synced_gpus=True` and give every rank the same number of batches
    (DistributedSampler pads to that), so the ranks' generate calls stay in lock-step.
    """
    loader = dataset_or_loader
    if isinstance(dataset_or_loader, Dataset):
        collate = PromptCollator(processor, image_every_batch=synced_gpus, video_every_batch=video_every_batch)
        loader = DataLoader(dataset_or_loader, batch_size=batch_size, collate_fn=collate)
    tokenizer = processor.tokenizer
    was_training = model.training
    model.eval()
    correct = total = 0
    try:
        for batch, answers in loader:
            batch = {
                key: value.to(model.device, model.dtype if takes_model_dtype(key, value) else None)
                for key, value in batch.items()
            }
            generated = model.generate(
                **batch,
                max_new_tokens=max_new_tokens,
                do_sample=False,
                synced_gpus=synced_gpus,
                pad_token_id=tokenizer.pad_token_id,
            )
            new_tokens = generated[:, batch["input_ids"].shape[1] :]
            for text, answer in zip(tokenizer.batch_decode(new_tokens, skip_special_tokens=True), answers, strict=True):
                correct += normalize_answer(text) == normalize_answer(answer)
                total += 1
    finally:
        model.train(was_training)
    return correct, total
