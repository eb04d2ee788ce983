"""launcher.launch.run.run_job refuses bad input in one line, in this process (the table in docs/errors.md).

Every case is planned by the real launcher (`run_here`: what `python train.py ARGS hydra.run.dir=RUN`
does inside Hydra's job, without the subprocess) and must end in one line (`Outcome.error`, which train.py
prints after "error: ") that names the key or file and says what to do, with exit code 2 (a mistake the
user can fix; 1 for a failure while training), said once (no warning that repeats it), `summary.json`
saying "failed" with that line where the job has a run directory of its own, and nothing that looks
complete: no model/, no complete checkpoint, and no ds_config.json or job.json when the job stopped
before its plan was accepted. A refused resume leaves the run it would have continued exactly as it was.

What only the ranks find (an image that does not decode, corrupt weights, a full disk) is trained here
with its one rank in this process (`train_in_process`). The command line's own contract (exit codes,
stderr, no traceback, run directories refused before Hydra) is in tests/e2e/test_cli.py; train.py's
pre-Hydra checks as functions in tests/unit/launch/test_cli.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import resource
import shutil
import signal
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from launcher.config.schema import run_dir_of
from launcher.core.disk import free_bytes
from launcher.core.overrides import argument
from tests.helpers import QUICK, ROOT, Ran, cpu_only, no_fp16, read_summary, run_here, small_disk

GOOD = {
    "image": "images/ok.png",
    "conversations": [{"from": "human", "value": "<image>\nwhat?"}, {"from": "gpt", "value": "red"}],
}
# A tiny model's sizes: a 64-wide language model, a 32-wide vision tower of 32 px images in 8 px patches.
SIZES = {
    "hidden_size": 64,
    "num_layers": 1,
    "vision_hidden_size": 32,
    "vision_layers": 1,
    "image_size": 32,
    "patch_size": 8,
}


@dataclass(frozen=True)
class Case:
    """One bad input: the arguments, and a part of the error line (both formatted with `_inputs`)."""

    id: str
    args: tuple[str, ...]
    message: str
    code: int = 2
    planned: bool = False  # stopped after the plan was accepted (ds_config.json and job.json may exist)
    run_dir: str = "new"  # new: the job's own run dir holds a failed summary; old: {old} is left unchanged
    marks: tuple = ()
    unset: tuple[str, ...] = ()  # environment variables the case runs without


CASES = [
    # ------------------------------------------------------------------ preference pairs (loss=dpo|ipo)
    Case(
        "preference-record-without-rejected",
        ("loss=dpo", "data=llava_json", "data.path={data}/no_rejected.json"),
        "{data}/no_rejected.json record 3: a preference record needs a 'chosen' and a 'rejected' answer",
    ),
    Case(
        "preference-record-same-answers",
        ("loss=dpo", "data=llava_json", "data.path={data}/same_answers.json"),
        "{data}/same_answers.json record 1: its chosen and rejected answers are the same: nothing to prefer",
    ),
    Case(
        "preference-record-under-sft",
        ("data=llava_json", "data.path={data}/pairs.json"),
        "{data}/pairs.json record 0: a preference record ('chosen'/'rejected' answers): train it with a preference",
    ),
    # Refused for the preference loss first, not for the row length packing would need next.
    Case("dpo-with-packing", ("loss=dpo", "data.packing=true"), "loss=dpo with data.packing=true"),
    Case("dpo-with-streaming", ("loss=dpo", "data.streaming=true"), "loss=dpo with data.streaming=true"),
    Case(
        "dpo-adapter-without-lora", ("loss=dpo", "loss.reference=adapter"), "loss.reference=adapter needs method=lora"
    ),
    # ------------------------------------------------------------------ data
    Case(
        "data-path-is-a-plain-folder",
        ("data=llava_json", "data.path={data}/images"),
        "{data}/images is a folder, but not one `datasets` saved (no state.json or dataset_dict.json)",
    ),
    Case("data-path-not-set", ("data=llava_json",), "data.path is not set for data=llava_json"),
    Case(
        "data-path-missing",
        ("data=llava_json", "data.path={data}/nowhere.json"),
        "data.path={data}/nowhere.json: no such file or folder",
    ),
    Case(
        "image-zero-bytes",
        ("data=llava_json", "data.path={data}/zero_byte.json"),
        "{data}/zero_byte.json record 1: image file {data}/images/empty.png is empty (0 bytes)",
    ),
    Case(
        "image-undecodable",
        ("data=llava_json", "data.path={data}/not_image.json"),
        "{data}/not_image.json record 1: image file {data}/images/text.png cannot be decoded as an image",
    ),
    Case(
        "image-decompression-bomb",
        ("data=llava_json", "data.path={data}/bomb.json", "data.max_image_pixels=10000"),
        "{data}/bomb.json record 1: image file {data}/images/big.png is 300x300 = 90000 pixels, over "
        "data.max_image_pixels=10000",
    ),
    Case(
        "image-path-leaves-the-root",
        ("data=llava_json", "data.path={data}/escape.json"),
        "{data}/escape.json record 1: image path '../outside.png' leaves the image root {data}",
    ),
    Case(
        "image-markers-do-not-match",
        ("data=llava_json", "data.path={data}/markers.json"),
        "{data}/markers.json record 1: 2 '<image>' marker(s) but 1 image(s)",
    ),
    Case(
        "data-format-does-not-match",
        ("data=llava_json", "data.path={data}/train.json", "data.format=sharegpt"),
        "{data}/train.json record 0: 'messages' must be a non-empty list (sharegpt format)",
    ),
    Case(
        "data-format-unknown-record",
        ("data=llava_json", "data.path={data}/unknown.json"),
        "{data}/unknown.json record 0: not a record of a known format (found 'question', 'answer')",
    ),
    Case(
        "data-path-and-sources",
        ("data=llava_json", "data.path={data}/train.json", "data.sources=[{{path: {data}/train.json}}]"),
        "data.path and data.sources are both set",
    ),
    Case("mixture-without-sources", ("data=mixture",), "data.sources is not set for data=mixture"),
    Case(
        "mixture-weight-negative",
        ("data=mixture", "data.sources=[{{path: {data}/train.json, weight: -1}}]"),
        "data.sources[0].weight=-1.0: a mixture weight must be a positive number",
    ),
    Case(
        "mixture-source-missing",
        ("data=mixture", "data.sources=[{{path: {data}/train.json}}, {{path: {data}/gone.json}}]"),
        "data.sources[1].path={data}/gone.json: no such file or folder",
    ),
    Case(
        "group-by-length-with-a-mixture",
        ("data=mixture", "data.sources=[{{path: {data}/train.json}}]", "data.group_by_length=true"),
        "data.group_by_length=true with data.sources: a mixture deals its draws by weight",
    ),
    Case(
        "group-by-length-without-the-cache",
        ("data.group_by_length=true", "data.cache=false"),
        "data.group_by_length=true needs data.cache=true",
    ),
    Case(
        "streaming-a-mixture",
        ("data=mixture", "data.sources=[{{path: {data}/train.json}}]", "data.streaming=true"),
        "data.streaming=true with data.sources (a mixture): a stream reads one set in file order; stream one data.path",
    ),
    Case(
        "streaming-grouped-by-length",
        ("data.streaming=true", "data.group_by_length=true"),
        "data.streaming=true with data.group_by_length=true",
    ),
    Case(
        "streaming-no-files",
        ("data=llava_json", "data.path={data}/nowhere-*.jsonl", "data.streaming=true"),
        "data.path={data}/nowhere-*.jsonl: no data files there",
    ),
    Case("shuffle-block-zero", ("data.shuffle_block=0",), "data.shuffle_block=0"),
    Case(
        "packing-without-the-cache",
        ("data.packing=true", "data.pack_length=256", "data.cache=false"),
        "data.packing=true with data.cache=false: packing plans rows from the cached lengths: set data.cache=true",
    ),
    Case(
        "packing-grouped-by-length",
        ("data.packing=true", "data.pack_length=256", "data.group_by_length=true"),
        "data.packing=true with data.group_by_length=true: packing already fills rows",
    ),
    Case(
        "packing-without-a-row-length",
        ("data.packing=true",),
        "data.packing=true needs a row length: set data.pack_length (tokens per packed row), or data.max_length",
    ),
    Case(
        "pack-length-below-max-length",
        (
            "data=llava_json",
            "data.path={data}/train.json",
            "data.packing=true",
            "data.max_length=512",
            "data.pack_length=256",
        ),
        "data.pack_length=256 is below data.max_length=512: a record may be 512 tokens",
    ),
    Case(
        "pack-length-below-one-image",
        ("data.packing=true", "data.pack_length=16"),
        "data.pack_length=16 is no longer than one image's 16 tokens (tiny_llava at model.image_size=32): no record "
        "with an image fits a row",
    ),
    Case(
        "max-length-zero",
        ("data.max_length=0",),
        "data.max_length=0 must be a positive number of tokens per sample (text + image tokens), e.g. 2048",
    ),
    Case(
        "max-length-below-one-image",
        ("data.max_length=16",),
        "data.max_length=16 leaves no room beside one image's 16 tokens (tiny_llava at model.image_size=32): "
        "every record with an image would be skipped; raise data.max_length",
    ),
    Case(
        "eval-path-missing",
        ("data=llava_json", "data.path={data}/train.json", "data.eval_path={data}/nowhere.json"),
        "data.eval_path={data}/nowhere.json: no such file",
    ),
    Case(
        "image-root-missing",
        ("data=llava_json", "data.path={data}/train.json", "data.image_root={data}/nowhere"),
        "data.image_root={data}/nowhere: no such directory",
    ),
    Case(
        "data-file-not-utf8",
        ("data=llava_json", "data.path={data}/binary.json"),
        "{data}/binary.json: not UTF-8 text",
    ),
    Case(
        "data-file-is-one-json-object",
        ("data=llava_json", "data.path={data}/object.json"),
        "{data}/object.json: the file is one JSON object (keys 'data'), not records",
    ),
    Case(
        "all-records-bad-with-skip",
        ("data=llava_json", "data.path={data}/all_bad.json", "data.on_bad_record=skip"),
        "{data}/all_bad.json: empty data set (all 5 records are bad and were skipped)",
    ),
    Case(
        "fewer-records-than-a-micro-batch",
        ("data=llava_json", "data.path={data}/two.json"),
        "data: 2 usable training records, fewer than one global micro-batch (4 x 1 ranks)",
    ),
    Case(
        "image-is-a-directory",
        ("data=llava_json", "data.path={data}/image_dir.json"),
        "{data}/image_dir.json record 1: image {data}/images is a directory",
    ),
    Case("num-workers-negative", ("data.num_workers=-1",), "data.num_workers=-1 must lie in [0, "),
    Case("num-workers-huge", ("data.num_workers=500",), "data.num_workers=500 must lie in [0, "),
    Case(
        "image-path-is-a-symlink-loop",
        ("data=llava_json", "data.path={data}/loop.json"),
        "{data}/loop.json record 1: image path {data}/images/loop cannot be read (Too many levels of symbolic links)",
    ),
    Case(
        "image-path-too-long",
        ("data=llava_json", "data.path={data}/long_name.json"),
        "{data}/long_name.json record 1: image path {data}/images/xxxx",
    ),
    # ------------------------------------------------------------------ model
    Case(
        "model-path-with-a-tiny-model",
        ("model.path={models}/good",),
        "model.path={models}/good is given, but model=tiny_llava builds a tiny model from code and would ignore it",
    ),
    Case(
        "compile-at-zero-3",
        ("model.compile=true", "deepspeed=z3"),
        "model.compile=true with ZeRO-3: DeepSpeed gathers each layer's partitioned weights in hooks that",
    ),
    Case(
        "liger-with-compile",
        ("model.kernels=liger", "model.compile=true"),
        "model.compile=true and model.kernels=liger both fuse each layer's MLP and norms; choose one: "
        "model.compile=false (liger's kernels) or model.kernels=torch (compiled torch)",
    ),
    Case(
        "liger-without-cuda",
        ("model.kernels=liger",),
        "model.kernels=liger runs Triton kernels, which need a CUDA device (this job runs on cpu): use "
        "model.kernels=torch",
        unset=("TRITON_INTERPRET",),  # tests/conftest.py runs Triton's interpreter on the CPU
        marks=(pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA"),),
    ),
    Case(
        "tiny-base-for-a-real-model",
        ("model=qwen2_vl_2b", "model.tiny_base=shape"),
        "model.tiny_base=shape sets a tiny model's starting weights, and model=qwen2_vl_2b is model.source=pretrained",
    ),
    Case("tiny-hidden-size-zero", ("model.hidden_size=0",), "model.hidden_size=0 must be a positive multiple of 32"),
    Case("tiny-hidden-size-odd", ("model.hidden_size=3",), "model.hidden_size=3 must be a positive multiple of 32"),
    Case("tiny-no-layers", ("model.num_layers=0",), "model.num_layers=0 must be positive"),
    Case(
        "tiny-image-not-whole-patches",
        ("model.image_size=30",),
        "model.image_size=30 must be a multiple of model.patch_size=8",
    ),
    Case(
        "pixels-range-empty",
        ("model=tiny_qwen2_vl", "model.min_pixels=4096", "model.max_pixels=1024"),
        "model.max_pixels=1024 is below model.min_pixels=4096: raise model.max_pixels or lower model.min_pixels",
    ),
    Case(
        "pixels-not-positive",
        ("model=tiny_qwen2_vl", "model.max_pixels=0"),
        "model.max_pixels=0 must be a positive number of pixels per image",
    ),
    # Stopped by launcher.job.checks.check_model_choices in check_inputs, before any rank starts.
    Case(
        "pixels-for-llava",
        ("model.max_pixels=4096",),
        "model.max_pixels=4096: only dynamic-resolution models (the Qwen2-VL family) resize images to a pixel count",
    ),
    Case(
        "flash-attention-on-cpu",
        ("model.attn_implementation=flash_attention_2",),
        "model.attn_implementation=flash_attention_2 needs a CUDA device (this job runs on cpu)",
        marks=(cpu_only,),
    ),
    Case(
        "model-dir-without-config",
        ("model=llava_1_5_7b", "model.path={models}/empty"),
        "model.path={models}/empty: cannot read its config",
    ),
    Case(
        "model-is-text-only",
        ("model=llava_1_5_7b", "model.path={models}/text_only"),
        "model.path={models}/text_only is a llama model (LlamaForCausalLM), not an image-text-to-text model",
    ),
    Case(
        "model-without-weights",
        ("model=llava_1_5_7b", "model.path={models}/no_weights"),
        "model.path={models}/no_weights has a config but no weights",
    ),
    Case(
        "model-is-a-lora-adapter",
        ("model=llava_1_5_7b", "model.path={models}/lora_run/model"),
        "model.path={models}/lora_run/model is a LoRA adapter (adapter_config.json), not a model: fold it into its "
        "base first (python -m launcher.export {models}/lora_run --merge)",
    ),
    # ------------------------------------------------------------------ knobs that reach DeepSpeed
    Case("lr-infinite", ("train.lr=inf",), "train.lr=inf must be a finite number"),
    # ------------------------------------------------------------------ parameter groups (train.groups)
    Case(
        "group-unknown-part",
        ("+train.groups.visoin.lr=1e-5",),
        "train.groups.visoin is no part of the model (vision, projector, language, adapters): give it a regex",
    ),
    Case("group-unknown-setting", ("+train.groups.vision.lrr=1e-5",), "train.groups.vision.lrr is no group setting"),
    Case(
        "group-lr-and-scale",
        ("train.groups.vision.lr=1e-5", "train.groups.vision.lr_scale=2"),
        "train.groups.vision sets both lr and lr_scale: give one",
    ),
    Case("group-negative-rate", ("train.groups.projector.lr=-1",), "train.groups.projector.lr=-1 must be a finite"),
    Case(
        "group-frozen-part",
        ("model.freeze_vision=true", "train.groups.vision.lr=1e-5"),
        "train.groups.vision: nothing in the vision part trains (model.freeze_vision=true); drop the group",
    ),
    Case(
        "group-part-lora-leaves-frozen",
        ("method=lora", "train.groups.vision.lr=1e-5"),
        "train.groups.vision: nothing in the vision part trains (method=lora); drop the group",
    ),
    Case(
        "group-adapters-without-lora",
        ("train.groups.adapters.lr=1e-4",),
        "train.groups.adapters: nothing in the adapters part trains; drop the group",
    ),
    Case(
        "group-match-nothing",
        ("+train.groups.heads.match=.*lm_heed.*", "+train.groups.heads.lr=1e-5"),
        "train.groups.heads: no trainable parameter's name matches '.*lm_heed.*'",
    ),
    Case(
        "group-overlap",
        ("train.groups.language.lr=1e-4", "+train.groups.heads.match=.*lm_head.*", "+train.groups.heads.lr=1e-5"),
        "train.groups.language and train.groups.heads both hold lm_head.weight: a parameter takes one group's rate",
    ),
    Case(
        "group-match-bad-regex",
        ("+train.groups.heads.match='['", "+train.groups.heads.lr=1e-5"),
        "train.groups.heads.match=[ is no regular expression",
    ),
    Case("betas-out-of-range", ("train.betas=[0.9,1.0]",), "train.betas=[0.9, 1.0] must be two numbers in [0, 1)"),
    Case("dist-timeout-zero", ("dist.timeout_s=0",), "dist.timeout_s=0 must be positive"),
    Case(
        "step-timeout-negative",
        ("dist.step_timeout_s=-5",),
        "dist.step_timeout_s=-5.0 must be a number of seconds, or 0 (or null) for no watchdog",
    ),
    Case("max-image-pixels-zero", ("data.max_image_pixels=0",), "data.max_image_pixels=0 must be positive"),
    Case("wandb-log-every-zero", ("logger.log_every=0",), "logger.log_every=0 must be positive"),
    Case("synthetic-eval-set-empty", ("data.n_eval=0",), "data.n_eval=0 must be positive"),
    Case(
        "optimizer-parameter-unknown",
        ("+deepspeed_extra.optimizer.params.momentum=0.9",),
        "optimizer.params.momentum is not a parameter of the optimizer (type AdamW) (AdamW takes",
    ),
    Case(
        "optimizer-type-unknown",
        ("+deepspeed_extra.optimizer.type=Adamm",),
        "optimizer.type=Adamm is not an optimizer DeepSpeed can build",
    ),
    Case(
        "scheduler-type-unknown",
        ("+deepspeed_extra.scheduler.type=Cosine",),
        "scheduler.type=Cosine is not a scheduler DeepSpeed can build: use one of LRRangeTest",
    ),
    Case(
        "scheduler-parameter-unknown",
        ("+deepspeed_extra.scheduler.params.warmup_steps=3",),
        "scheduler.params.warmup_steps is not a parameter of the scheduler WarmupCosineLR",
    ),
    # ------------------------------------------------------------------ machine and directories
    Case(
        "more-ranks-than-devices",
        ("dist.nproc_per_node={too_many_ranks}",),
        "dist.nproc_per_node={too_many_ranks} is more than the",
    ),
    # Found as the ranks are started (launcher.launch.ranks.master_port), after the plan: none starts.
    Case(
        "master-port-busy",
        ("dist.master_port={busy_port}",),
        "dist.master_port={busy_port} is already in use",
        planned=True,
    ),
    Case(
        "cache-dir-under-a-file",
        ("cache_dir={data}/a_file/cache",),
        "cache_dir={data}/a_file/cache: cannot write there ({data}/a_file is a file, not a directory)",
    ),
    # ------------------------------------------------------------------ method and model choices
    Case(
        "lora-targets-match-nothing",
        ("method=lora", "method.target_modules=[qproj]"),
        "method.target_modules=['qproj'] (method.include_vision=False, model.freeze_language=False, "
        "model.freeze_vision=False) matches no module of LlavaForConditionalGeneration",
    ),
    # ------------------------------------------------------------------ resume
    Case("resume-missing-directory", ("resume={tmp}/nowhere",), "resume={tmp}/nowhere: no such directory"),
    Case("resume-not-a-run", ("resume={data}",), "resume={data}: {data} is not a run directory"),
    Case(
        "resume-run-without-checkpoint",
        ("resume={never_saved}",),
        "resume={never_saved}: no complete checkpoint in {never_saved}/checkpoints",
        run_dir="old",
    ),
    Case(
        "resume-into-a-link-out",  # a planted link would have the final save replace a folder outside (issue 42)
        ("resume={linked}",),
        "{linked}/model leads to {tmp}/victim, outside the run directory {linked}: a run writes only inside its "
        "own directory; remove the link",
        run_dir="old",
    ),
    Case(
        "resume-incomplete-checkpoint",
        ("resume={incomplete}",),
        "resume={incomplete}: no complete checkpoint in {incomplete}/checkpoints",
        run_dir="old",
    ),
    Case(
        "resume-other-precision",
        ("resume={old}", "precision=bf16"),
        "cannot resume {old}/checkpoints/step2: the job differs from the one that saved it (precision fp32 -> bf16)",
        run_dir="old",
    ),
    Case(
        "resume-global-batch-not-kept",
        ("resume={old}", "dist.nproc_per_node=2"),
        "the checkpoint's global batch 4 cannot be kept on 2 rank(s) with micro batch 4 (4 is no multiple of "
        "4 x 2): give train.micro_batch_size=1 or 2",
        run_dir="old",
    ),
    Case(
        "resume-global-batch-other",
        ("resume={old}", "dist.nproc_per_node=2", "train.micro_batch_size=2", "train.global_batch_size=8"),
        "train.global_batch_size=8: a resume keeps the checkpoint's global batch (4); leave it out",
        run_dir="old",
    ),
    Case(
        "resume-other-model",
        ("resume={old}", "model=tiny_qwen2_vl"),
        "the job differs from the one that saved it (model.arch tiny_llava -> tiny_qwen2_vl;",
        run_dir="old",
    ),
    Case(
        "resume-other-method",
        ("resume={old}", "method=lora"),
        "the job differs from the one that saved it (method.name full -> lora",
        run_dir="old",
    ),
]

# What only a rank finds, once the plan is accepted: the rank trains in this process.
RANK_CASES = [
    Case(
        "image-truncated",
        ("data=llava_json", "data.path={data}/truncated.json"),
        "{data}/truncated.json record 7: cannot decode image {data}/images/cut.png",
        planned=True,
    ),
    Case(
        "image-truncated-all-skipped",
        ("data=llava_json", "data.path={data}/all_truncated.json", "data.on_bad_record=skip"),
        "data: none of the 8 records could be decoded (all skipped under data.on_bad_record=skip)",
        planned=True,
    ),
    Case(
        "model-weights-corrupt",
        ("model=llava_1_5_7b", "model.path={models}/corrupt_weights"),
        "model.path={models}/corrupt_weights: cannot load its weights",
        planned=True,
    ),
    Case(
        "model-without-processor",
        ("model=llava_1_5_7b", "model.path={models}/no_processor"),
        "model.path={models}/no_processor: cannot load its processor",
        planned=True,
    ),
]

# The config core (docs/configuration.md's table; every row a case): refused while the job is planned,
# before anything is written that looks like a plan. Run as dry runs, as a user checks a config.
CONFIG_CORE = [
    Case(
        "offload-param-below-zero-3",
        ("zero=stage2", "offload=param"),
        "parameter offload (offload_param.device=cpu) needs ZeRO stage 3",
    ),
    Case("offload-nvme-below-zero-3", ("deepspeed=z2", "offload=nvme"), "needs ZeRO stage 3"),
    Case("nvme-path-not-set", ("deepspeed=z3_nvme",), "set offload.nvme_path="),
    Case(
        "nvme-path-missing",
        ("deepspeed=z3_nvme", "offload.nvme_path=/nonexistent/nvme"),
        "offload.nvme_path=/nonexistent/nvme does not exist",
    ),
    Case(
        "fp16-on-a-cpu-without-it",
        ("precision=fp16",),
        "precision=fp16 is not supported on this cpu: use precision=bf16 or precision=fp32",
        marks=(no_fp16,),
    ),
    Case(
        "fp16-and-bf16",
        ("precision=bf16", "+deepspeed_extra.fp16.enabled=true"),
        "fp16 and bf16 are both enabled",
    ),
    Case(
        "global-batch-not-divisible",
        ("train.global_batch_size=30", "train.micro_batch_size=4"),
        "train.global_batch_size=30 is not divisible",
    ),
    Case(
        "batch-sizes-inconsistent",
        ("train.global_batch_size=32", "train.micro_batch_size=4", "train.grad_accum=2"),
        "inconsistent batch sizes: train.global_batch_size=32",
    ),
    Case("micro-batch-zero", ("train.micro_batch_size=0",), "train.micro_batch_size=0 must be a positive integer"),
    Case("lr-negative", ("train.lr=-1",), "train.lr=-1.0 must be positive"),
    Case(
        "deepspeed-key-misspelt",
        ("+deepspeed_extra.zero_optimisation.stage=3",),
        "deepspeed_extra.zero_optimisation is not a DeepSpeed key",
    ),
    Case(
        "deepspeed-subkey-unknown",
        ("+deepspeed_extra.zero_optimization.bogus=1",),
        "DeepSpeed rejects zero_optimization.bogus",
    ),
    Case(
        "gradient-clipping-auto",
        ("+deepspeed_extra.gradient_clipping=auto",),
        'gradient_clipping="auto" would be silently dropped',
    ),
    Case(
        "deepspeed-json-missing",
        ("deepspeed_json=/nonexistent/ds.json",),
        "deepspeed_json=/nonexistent/ds.json: no such file",
    ),
    # A JSON written for 8 ranks (64 = 4 x 2 x 8), run on 1: the error names the file's keys and the overrides.
    Case(
        "deepspeed-json-for-another-world-size",
        ("deepspeed_json=tests/golden/z2_fp32_ws8.json", "train.lr=1e-4"),
        "inconsistent batch sizes: deepspeed_json=tests/golden/z2_fp32_ws8.json sets train_batch_size=64, but the "
        "file's train_micro_batch_size_per_gpu=4 x the file's gradient_accumulation_steps=2 x world size 1 = 8",
    ),
    Case(
        "override-not-divisible-by-the-files-micro-batch",
        ("deepspeed_json=tests/golden/z2_fp32_ws8.json", "train.global_batch_size=30"),
        "train.global_batch_size=30 is not divisible by train_micro_batch_size_per_gpu=4 (from "
        "deepspeed_json=tests/golden/z2_fp32_ws8.json) x world size 1",
    ),
    Case(
        "offload-optimizer-at-zero-0",
        ("zero=stage0", "offload=optimizer"),
        "optimizer offload needs ZeRO stage 1, 2 or 3",
    ),
    Case(
        "model-path-unreadable",
        ("model=llava_1_5_7b", "model.path=/nonexistent/llava"),
        "model.path=/nonexistent/llava: cannot read its config",
    ),
    # The table's rows that were not cases before the move (docs/configuration.md).
    Case("max-steps-zero", ("train.max_steps=0",), "train.max_steps=0 must be positive"),
    Case("grad-clip-negative", ("train.grad_clip=-1",), "train.grad_clip=-1.0 must not be negative"),
    Case("weight-decay-negative", ("train.weight_decay=-0.1",), "train.weight_decay=-0.1 must not be negative"),
    Case(
        "warmup-not-below-steps",
        ("train.max_steps=4", "train.warmup_steps=4"),
        "train.warmup_steps=4 must lie in [1, train.max_steps=4)",
    ),
    Case(
        "bucket-size-fractional",
        ("zero=stage2", "+deepspeed_extra.zero_optimization.reduce_bucket_size=1.5"),
        "zero_optimization.reduce_bucket_size=1.5 must be a whole number of elements",
    ),
]


@pytest.fixture(autouse=True)
def _one_line_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    """The launcher as a user runs it: HYDRA_FULL_ERROR=1 (which adds the traceback) only where a test sets it."""
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)


# ---------------------------------------------------------------------------------------------- inputs
@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    """Records files, good and bad, next to their images."""
    from PIL import Image

    root = tmp_path_factory.mktemp("data")
    (root / "images").mkdir()
    Image.new("RGB", (32, 32), (200, 20, 20)).save(root / "images" / "ok.png")
    files = {
        "train.json": json.dumps([GOOD] * 8),
        "two.json": json.dumps([GOOD] * 2),
        "object.json": json.dumps({"data": [GOOD] * 8}, indent=1),  # records wrapped in an object
        "all_bad.json": json.dumps([{**GOOD, "image": "images/nowhere.png"}] * 5),
        "image_dir.json": json.dumps([GOOD, {**GOOD, "image": "images"}] * 4),
        "a_file": "a regular file where a directory is expected",
    }
    files["loop.json"] = json.dumps([GOOD, {**GOOD, "image": "images/loop"}])
    for name, image in (("zero_byte", "empty"), ("not_image", "text"), ("bomb", "big"), ("escape", "../outside")):
        image = image if image.startswith("..") else f"images/{image}"
        files[f"{name}.json"] = json.dumps([GOOD, {**GOOD, "image": f"{image}.png"}] * 4)
    files["truncated.json"] = json.dumps([GOOD] * 7 + [{**GOOD, "image": "images/cut.png"}])
    files["all_truncated.json"] = json.dumps([{**GOOD, "image": "images/cut.png"}] * 8)
    two_markers = [{"from": "human", "value": "<image><image>what?"}, {"from": "gpt", "value": "red"}]
    files["markers.json"] = json.dumps([GOOD, {**GOOD, "conversations": two_markers}] * 4)
    files["unknown.json"] = json.dumps([{"question": "what?", "answer": "red"}] * 8)
    files["long_name.json"] = json.dumps([GOOD, {**GOOD, "image": "images/" + "x" * 5000}])
    pair = {"images": ["images/ok.png"], "prompt": "<image>what?", "chosen": "red", "rejected": "blue"}
    files["pairs.json"] = json.dumps([pair] * 8)
    files["no_rejected.json"] = json.dumps([pair] * 3 + [{**pair, "rejected": None}] + [pair] * 4)
    files["same_answers.json"] = json.dumps([pair, {**pair, "rejected": "red"}] + [pair] * 6)
    for name, text in files.items():
        (root / name).write_text(text)
    (root / "images" / "loop").symlink_to(root / "images" / "loop")  # a symlink to itself
    (root / "images" / "empty.png").write_bytes(b"")
    (root / "images" / "text.png").write_text("not an image")
    Image.new("RGB", (300, 300)).save(root / "images" / "big.png")
    Image.new("RGB", (64, 64), (20, 200, 20)).save(root / "images" / "cut.png")
    whole = (root / "images" / "cut.png").read_bytes()
    (root / "images" / "cut.png").write_bytes(whole[: len(whole) // 2])  # the header survives, the pixels do not
    (root / "binary.json").write_bytes(b"\xff\xd8\xff\xe0 a JPEG saved as .json")
    return root


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory) -> Path:
    """A tiny image-text-to-text model, broken copies of it, and a text-only model."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from launcher.model.tiny import build_tiny_model_dir

    root = tmp_path_factory.mktemp("models")
    vocabulary = ["red circle", "what is in the image?"]
    good = build_tiny_model_dir("tiny_llava", root / "good", vocabulary, seed=0, **SIZES)
    (root / "empty").mkdir()
    shutil.copytree(good, root / "no_weights")
    (root / "no_weights" / "model.safetensors").unlink()
    shutil.copytree(good, root / "corrupt_weights")
    (root / "corrupt_weights" / "model.safetensors").write_bytes(b"truncated")
    shutil.copytree(good, root / "no_processor")
    for name in ("tokenizer.json", "tokenizer_config.json", "processor_config.json", "chat_template.jinja"):
        (root / "no_processor" / name).unlink(missing_ok=True)
    text_config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=1
    )
    LlamaForCausalLM(text_config).save_pretrained(root / "text_only")
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForImageTextToText

    base = AutoModelForImageTextToText.from_pretrained(good)  # a LoRA run's model/: peft's adapter directory
    get_peft_model(base, LoraConfig(r=2, target_modules=["q_proj"])).save_pretrained(root / "lora_run" / "model")
    return root


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A port something listens on."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def _usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _inputs(case: Case, request: pytest.FixtureRequest, tmp_path: Path) -> dict[str, object]:
    """The values the case's arguments and message name; fixtures are made only when a case needs them."""
    text = " ".join(case.args) + case.message
    values: dict[str, object] = {"tmp": tmp_path, "too_many_ranks": _usable_cores() + 1}
    if "{data}" in text:
        values["data"] = request.getfixturevalue("data_dir")
    if "{models}" in text:
        values["models"] = request.getfixturevalue("models_dir")
    if "{busy_port}" in text:
        values["busy_port"] = request.getfixturevalue("busy_port")
    if "{old}" in text or "{incomplete}" in text:
        # A copy of the shared finished run (2 steps, checkpoint step2): a refused resume must leave the
        # run alone, and the copy shows whether it did.
        old = tmp_path / "old"
        shutil.copytree(request.getfixturevalue("quick_run").run_dir, old)
        if "{incomplete}" in text:
            (old / "checkpoints" / "step2" / "launcher_complete.json").unlink()
            values["incomplete"] = old
        values["old"] = old
    if "{linked}" in text:  # the shared run, its model/ a link to someone's folder
        linked, victim = tmp_path / "linked", tmp_path / "victim"
        shutil.copytree(request.getfixturevalue("quick_run").run_dir, linked)
        shutil.move(linked / "model", victim)
        (victim / "NOTES.txt").write_text("not the run's")
        (linked / "model").symlink_to(victim)
        values["linked"] = values["old"] = linked
    if "{never_saved}" in text:
        # A run directory as a job leaves it that stopped before its first checkpoint.
        never_saved = tmp_path / "never_saved"
        (never_saved / ".hydra").mkdir(parents=True)
        (never_saved / ".hydra" / "overrides.yaml").write_text("- logger=none\n")
        values["never_saved"] = values["old"] = never_saved
    return values


def _where(args: list[str], tmp_path: Path) -> Path:
    """The run directory Hydra runs the job in: `resume=DIR` of a run continues in DIR (conf/config.yaml's
    hydra.run.dir, launcher.config.schema.run_dir_of), any other job in the test's own."""
    return Path(run_dir_of(argument(["train.py", *args], "resume"), str(tmp_path / "run")))


# ---------------------------------------------------------------------------------------------- checks
def _files(run_dir: Path) -> dict[str, bytes]:
    """Every file of a run directory but the log a job appends to and the lock (and room) it takes in it."""
    return {
        str(path.relative_to(run_dir)): path.read_bytes()
        for path in sorted(run_dir.rglob("*"))
        if path.is_file() and path.name not in ("train.log", ".lock", ".reserve")
    }


def assert_one_clear_error(ran: Ran, message: str, code: int) -> str:
    """The job ended with `code` and one line holding `message`, which nothing else the launcher said repeats."""
    outcome = ran.outcome
    assert outcome.exit_code == code, (outcome, ran.lines)
    assert outcome.status == "failed" and outcome.error is not None, outcome
    assert message in outcome.error, outcome.error
    assert "\n" not in outcome.error and not outcome.error.startswith("error: ")
    assert "Traceback" not in outcome.error
    assert outcome.lines() == [(f"error: {outcome.error}", True)]  # what train.py prints: that line, on stderr
    assert not any(message in line for line in ran.lines), ran.lines  # said once: no warning that repeats it
    return outcome.error


def assert_failed_and_incomplete(run_dir: Path, message: str, *, planned: bool) -> None:
    summary = read_summary(run_dir)
    assert summary["status"] == "failed" and message in summary["error"]
    assert not (run_dir / "model").exists()
    assert not list(run_dir.glob("checkpoints/*/launcher_complete.json"))
    assert not (run_dir / "checkpoints" / "latest").exists()
    if not planned:
        assert not (run_dir / "ds_config.json").exists()
        assert not (run_dir / "job.json").exists()


def assert_not_repeated_by_the_rank(message: str, capfd: pytest.CaptureFixture, caplog: pytest.LogCaptureFixture):
    """The rank trained in this process neither printed nor logged the line: train.py says it once."""
    printed = capfd.readouterr()
    assert message not in printed.out + printed.err
    assert not any(message in record for record in caplog.messages), caplog.messages


def _params(cases: list[Case]) -> list:
    return [pytest.param(case, marks=case.marks, id=case.id) for case in cases]


def _check_case(ran: Ran, case: Case, message: str, where: Path, tmp_path: Path, before: dict | None) -> None:
    assert_one_clear_error(ran, message, case.code)
    if case.run_dir == "new":
        assert where == tmp_path / "run"
        assert_failed_and_incomplete(where, message, planned=case.planned)
    else:
        assert _files(where) == before  # its .hydra/ files and summary untouched
        assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("case", _params(CASES))
def test_bad_input_is_one_clear_error(request, tmp_path, monkeypatch, case):
    for name in case.unset:
        monkeypatch.delenv(name, raising=False)
    values = _inputs(case, request, tmp_path)
    args = [arg.format(**values) for arg in case.args]
    message = case.message.format(**values)
    where = _where(args, tmp_path)
    before = _files(where) if case.run_dir == "old" else None
    ran = run_here([*args, *QUICK], where)
    _check_case(ran, case, message, where, tmp_path, before)


@pytest.mark.slow  # the plan is accepted, and the rank (trained here) finds the problem: 3-10 s each
@pytest.mark.parametrize("case", _params(RANK_CASES))
def test_bad_input_found_by_the_rank_is_one_clear_error(request, tmp_path, train_in_process, capfd, caplog, case):
    values = _inputs(case, request, tmp_path)
    args = [arg.format(**values) for arg in case.args]
    message = case.message.format(**values)
    ran = train_in_process(*args, *QUICK, run_dir=tmp_path / "run")
    _check_case(ran, case, message, tmp_path / "run", tmp_path, None)
    assert_not_repeated_by_the_rank(message, capfd, caplog)


@pytest.mark.parametrize("case", _params(CONFIG_CORE))
def test_a_config_core_refusal_is_one_clear_line_and_writes_no_plan(tmp_path, case):
    run_dir = tmp_path / "run"
    ran = run_here([*case.args, "dry_run=true", "logger=none"], run_dir)
    assert_one_clear_error(ran, case.message, case.code)
    assert_failed_and_incomplete(run_dir, case.message, planned=False)


def test_hydra_full_error_adds_the_traceback_before_the_same_line(tmp_path, monkeypatch):
    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")
    ran = run_here(["zero=stage2", "offload=param", "dry_run=true", "logger=none"], tmp_path / "run")
    message = "parameter offload (offload_param.device=cpu) needs ZeRO stage 3"
    assert ran.outcome.exit_code == 2 and message in ran.outcome.error
    (traceback,) = ran.lines
    assert traceback.startswith("Traceback (most recent call last)") and message in traceback.splitlines()[-1]
    assert_failed_and_incomplete(tmp_path / "run", message, planned=False)


def test_an_auto_in_a_deepspeed_json_that_nothing_fills_is_refused(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 2, "sub_group_size": "auto"}}))
    ran = run_here([f"deepspeed_json={path}", "dry_run=true", "logger=none"], tmp_path / "run")
    message = f'deepspeed_json={path}: cannot fill "auto" at zero_optimization.sub_group_size'
    assert_one_clear_error(ran, message, 2)
    assert_failed_and_incomplete(tmp_path / "run", message, planned=False)


def test_a_deepspeed_json_that_does_not_parse_names_its_line_and_column(tmp_path):
    path = tmp_path / "broken.json"
    path.write_text('{"zero_optimization": {"stage": 3,}}')
    ran = run_here([f"deepspeed_json={path}", "dry_run=true", "logger=none"], tmp_path / "run")
    assert_one_clear_error(ran, f"deepspeed_json={path}: not valid JSON (line 1", 2)
    assert_failed_and_incomplete(tmp_path / "run", f"deepspeed_json={path}: not valid JSON (line 1", planned=False)


def test_a_deepspeed_json_is_migrated_from_the_command_line(tmp_path):
    base = {
        "train_micro_batch_size_per_gpu": "auto",
        "train_batch_size": "auto",
        "gradient_accumulation_steps": "auto",
        "bf16": {"enabled": "auto"},
        "zero_optimization": {"stage": 2, "reduce_bucket_size": "auto", "overlap_comm": False},
    }
    path = tmp_path / "ds_z2_config.json"
    path.write_text(json.dumps(base))
    run_dir = tmp_path / "run"
    ran = run_here([f"deepspeed_json={path}", "precision=bf16", "dry_run=true", "logger=none"], run_dir)
    assert ran.outcome.status == "planned" and ran.outcome.exit_code == 0, ran.outcome.error
    ds = json.loads((run_dir / "ds_config.json").read_text())
    assert ds == ran.outcome.ds_config  # what the dry run prints
    assert ds["zero_optimization"]["stage"] == 2
    assert ds["zero_optimization"]["overlap_comm"] is False
    assert ds["zero_optimization"]["reduce_bucket_size"] == 64 * 64
    assert ds["train_micro_batch_size_per_gpu"] == 32 and ds["bf16"]["enabled"] is True
    assert not (run_dir / "job.json").exists()  # a dry run trains nothing


def test_a_dry_run_writes_the_final_deepspeed_json_and_trains_nothing(tmp_path):
    run_dir = tmp_path / "run"
    ran = run_here(["deepspeed=z3_offload", "precision=bf16", "dry_run=true", "logger=none"], run_dir)
    assert ran.outcome.status == "planned" and ran.outcome.exit_code == 0, ran.outcome.error
    written = json.loads((run_dir / "ds_config.json").read_text())
    assert ran.outcome.ds_config == written
    (printed, to_stderr), (said, _) = ran.outcome.lines()
    assert json.loads(printed) == written and not to_stderr  # the JSON on stdout, alone
    assert said == f"dry run: wrote {run_dir / 'ds_config.json'}; nothing trained"
    zero = written["zero_optimization"]
    assert zero["stage"] == 3
    assert zero["offload_param"]["device"] == "cpu" and zero["offload_optimizer"]["device"] == "cpu"
    assert written["bf16"]["enabled"] is True
    assert zero["reduce_bucket_size"] == 64 * 64  # tiny_llava's language model: hidden 64
    assert not (run_dir / "metrics.jsonl").exists() and not (run_dir / "job.json").exists()


# ---------------------------------------------------------------------------------------------- data files
def _write_records(root: Path, records: object, name: str = "train.json") -> Path:
    from PIL import Image

    (root / "images").mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (32, 32), (200, 20, 20)).save(root / "images" / "ok.png")
    (root / "images" / "broken.png").write_bytes(b"not a png")
    path = root / name
    path.write_text(records if isinstance(records, str) else json.dumps(records))
    return path


NO_ANSWER = {"image": "images/ok.png", "conversations": [{"from": "human", "value": "<image>\nwhat?"}]}
MISSING_IMAGE = {**GOOD, "image": "images/nowhere.png"}
BAD_DATA = [
    ("malformed", '[{"image": "images/ok.png",]', "train.json:1: malformed JSON"),
    ("jsonl-malformed", json.dumps(GOOD) + "\n{oops\n", "train.json:2: malformed JSON in record 1"),
    ("missing-image", [GOOD, MISSING_IMAGE], "train.json record 1: image file"),
    ("no-assistant", [GOOD, NO_ANSWER], "train.json record 1: no assistant turn to learn from (llava format)"),
    ("empty", [], "train.json: empty data set (it holds no records)"),
    ("unreadable-image", [{**GOOD, "image": "images/broken.png"}] * 40, "broken.png"),
]


@pytest.mark.parametrize(("case", "records", "message"), BAD_DATA, ids=[c for c, _, _ in BAD_DATA])
def test_bad_data_names_the_file_and_record(tmp_path, case, records, message):
    path = _write_records(tmp_path / "data", records)
    run_dir = tmp_path / "run"
    ran = run_here(["data=llava_json", f"data.path={path}", "logger=none", "train.micro_batch_size=4"], run_dir)
    assert_one_clear_error(ran, message, 2)
    assert_failed_and_incomplete(run_dir, message, planned=False)


def test_a_missing_data_file_is_named(tmp_path):
    ran = run_here(["data=llava_json", "data.path=/nonexistent/train.json", "logger=none"], tmp_path / "run")
    assert_one_clear_error(ran, "data.path=/nonexistent/train.json: no such file", 2)


@pytest.mark.slow  # it trains two steps (in this process)
def test_bad_records_can_be_skipped_and_counted(tmp_path, train_in_process, caplog):
    path = _write_records(tmp_path / "data", [GOOD] * 8 + [MISSING_IMAGE, NO_ANSWER])
    run_dir = tmp_path / "run"
    ran = train_in_process(
        "data=llava_json",
        f"data.path={path}",
        "data.on_bad_record=skip",
        "logger=none",
        "train.micro_batch_size=4",
        "train.max_steps=2",
        run_dir=run_dir,
    )
    assert ran.outcome.status == "completed" and ran.outcome.exit_code == 0, ran.outcome.error
    summary = read_summary(run_dir)
    assert summary["status"] == "completed" and summary["records_skipped"] == 2
    # Which, and why: one line each, with the line data.on_bad_record=error would have stopped with.
    listed = run_dir / "skipped_records.jsonl"
    lines = [json.loads(line) for line in listed.read_text().splitlines()]
    assert [(line["split"], line["file"], line["record"]) for line in lines] == [
        ("train", str(path), 8),
        ("train", str(path), 9),
    ]
    assert lines[0]["reason"] == f"{path} record 8: image file {path.parent / 'images' / 'nowhere.png'} does not exist"
    assert lines[1]["reason"] == f"{path} record 9: no assistant turn to learn from (llava format)"
    # The line rank 0 logs (to train.log in a rank's own process; here, where pytest holds the logging, to
    # pytest's log capture: launcher.core.logs.setup_rank_log keeps the handlers a process has).
    assert f"data: 2 bad record(s) skipped: see {listed}" in caplog.messages


def test_adapters_on_the_built_in_data_start_from_a_pretrained_base_and_on_random_weights_are_warned_about(tmp_path):
    """`python train.py method=lora` trains adapters on a tiny base pretrained on the built-in set's other question
    (a dry run says which, and trains nothing); with model.tiny_base=random it warns, naming how to give it a
    trained base; a full fine-tune neither pretrains nor warns."""
    planned = run_here(["method=lora", "dry_run=true", "logger=none"], tmp_path / "lora")
    assert planned.outcome.exit_code == 0, planned.outcome.error
    (line,) = [line for line in planned.lines if line.startswith("base: ")]
    assert "tiny_llava pretrained on the built-in colour question (400 steps, trained once at the first start" in line
    assert not any("random" in line and "warning" in line for line in planned.lines)

    warned = run_here(["method=lora", "model.tiny_base=random", "dry_run=true", "logger=none"], tmp_path / "random")
    (line,) = [line for line in warned.lines if line.startswith("warning: ")]
    assert line.startswith("warning: method=lora on model.source=tiny: the base's weights are random")
    assert "method=lora model.source=pretrained model.path=RUN_DIR/model" in line
    full = run_here(["dry_run=true"], tmp_path / "full").lines
    assert not any(line.startswith(("base: ", "warning: ")) for line in full)


@pytest.mark.slow
def test_the_pretrained_tiny_base_is_trained_once_by_train_py_and_loaded_by_the_lora_job(tmp_path):
    """`python train.py method=lora`: the launcher trains the tiny base on the built-in colour question once (a
    child train.py, into the cache), says so and how well it learned it, and the ranks train adapters on it; the
    next job reuses it as it is. In a cache of its own, so that the first job surely trains it."""
    job = ["method=lora", *QUICK, f"cache_dir={tmp_path / 'cache'}"]
    first = run_here(job, tmp_path / "first")
    assert first.outcome.exit_code == 0, first.outcome.error
    training, trained = [line for line in first.lines if line.startswith("base: ")]
    assert training.startswith("base: training tiny_llava pretrained on the built-in colour question, 400 steps")
    scored = re.fullmatch(r"base: .* held-out exact match ([\d.]+) after 400 steps; this job's question is new to it",
                          trained)  # fmt: skip
    assert scored and float(scored[1]) >= 0.95, trained  # the base knows colours (1.0 in bench/lora_second_task.py)
    (base,) = (tmp_path / "cache" / "models").glob("tiny_llava-*-colour-base-*")
    assert read_summary(first.run_dir)["base_model"] == str(base)
    adapter = json.loads((first.run_dir / "model" / "adapter_config.json").read_text())
    assert adapter["base_model_name_or_path"] == str(base)
    assert not list(base.glob("run")) and (base / "model.safetensors").is_file()  # the model only, not its run

    record = (base / "tiny_base.json").read_text()
    second = run_here(job, tmp_path / "second")
    assert second.outcome.exit_code == 0, second.outcome.error
    assert [line for line in second.lines if line.startswith("base: ")] == [trained]  # reused: no training line
    assert (base / "tiny_base.json").read_text() == record


def test_a_stop_while_the_tiny_base_trains_stops_its_train_py_and_leaves_no_base(tmp_path, monkeypatch):
    """A stop the launcher hears while its child train.py trains the tiny base reaches the child, the job ends
    "interrupted" in one line (exit 143), and the cache holds no base, whole or half-written."""
    monkeypatch.setattr("launcher.launch.base.received", lambda: "SIGTERM")  # as if it came once the child started
    ran = run_here(["method=lora", *QUICK, f"cache_dir={tmp_path / 'cache'}"], tmp_path / "run")
    assert ran.outcome.exit_code == 143, ran.outcome.error
    assert ran.outcome.error == "stopped by SIGTERM while training the tiny base; start again"
    assert read_summary(ran.run_dir)["status"] == "interrupted"
    assert not [path.name for path in (tmp_path / "cache" / "models").iterdir() if "-base-" in path.name]


# ---------------------------------------------------------------------------------------------- memory plan
def test_the_preflight_warns_or_refuses_a_job_that_will_not_fit(tmp_path):
    too_small = ["dry_run=true", "logger=none", "plan.gpu_memory_gb=0.0001", "plan.cpu_memory_gb=0.0001"]
    warned = run_here(too_small, tmp_path / "warn")
    assert warned.outcome.exit_code == 0, warned.outcome.error
    assert any(
        line.startswith("warning: memory plan: deepspeed=z0 fp32 on 1 rank needs about") for line in warned.lines
    )
    refused = run_here([*too_small, "preflight=error"], tmp_path / "error")
    assert_one_clear_error(refused, "memory plan: deepspeed=z0 fp32 on 1 rank", 2)
    assert_failed_and_incomplete(tmp_path / "error", "memory plan: deepspeed=z0 fp32 on 1 rank", planned=False)
    quiet = run_here([*too_small, "preflight=off"], tmp_path / "off")
    assert quiet.outcome.exit_code == 0 and not any("memory plan" in line for line in quiet.lines)


# ---------------------------------------------------------------------------------------------- a full disk
@contextmanager
def file_size_limit(limit: int) -> Iterator[None]:
    """No file this process writes may grow past `limit` bytes, as on a full disk (a write past it fails
    with EFBIG); the limit and SIGXFSZ's handler are put back after."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, handler)


@pytest.mark.slow  # it trains (in this process)
def test_a_failed_checkpoint_write_is_one_line_and_leaves_nothing_that_looks_complete(
    tmp_path, train_in_process, capfd, caplog
):
    """A real write error while saving: files may grow to 2 MiB, the checkpoint (about 3.5 MiB) cannot.

    Everything written before the save (the cached tiny model: about 1.2 MiB) stays under the limit;
    the data cache (49 MB of pixels) is not used here: its own write failure is the next test."""
    run_dir = tmp_path / "run"
    with file_size_limit(2 * 2**20):
        # data.n_eval=8: the evaluation at the end (before the save) in 2 batches, not 50.
        ran = train_in_process(*QUICK, "train.save_every=0", "data.cache=false", "data.n_eval=8", run_dir=run_dir)
    message = f"cannot write checkpoint {run_dir / 'checkpoints' / 'step2'} ("
    line = assert_one_clear_error(ran, message, 1)
    assert "file size limit (ulimit -f) 2 MiB" in line
    assert_failed_and_incomplete(run_dir, message, planned=True)
    assert (run_dir / "checkpoints" / "step2").is_dir()  # the partial files stay, never resumed from
    assert_not_repeated_by_the_rank(message, capfd, caplog)


@pytest.mark.slow  # it builds the built-in set and its data cache (in this process)
def test_a_failed_data_cache_write_is_one_line_and_leaves_no_cache_that_looks_complete(
    tmp_path, train_in_process, capfd, caplog
):
    """Files may grow to 2 MiB; the data cache of 300 built-in records holds 3.5 MiB of pixels (stored as
    pixels: encoded, they take less than the limit)."""
    cache = tmp_path / "cache"
    with file_size_limit(2 * 2**20):
        ran = train_in_process(
            *QUICK, "data.n_train=300", "data.n_eval=20", "data.cache_images=pixels", f"cache_dir={cache}",
            run_dir=tmp_path / "run",
        )  # fmt: skip
    message = f"cannot write the data cache under {cache / 'data_cache'} ("
    line = assert_one_clear_error(ran, message, 1)
    assert "data.cache=false" in line
    assert_failed_and_incomplete(tmp_path / "run", message, planned=True)
    assert_not_repeated_by_the_rank(message, capfd, caplog)
    assert not list((cache / "data_cache").rglob("meta.json"))  # nothing that looks complete
    # The shard being written is removed; a build keeps only complete shards, under a dot-name, for its next try.
    assert all(path.name.startswith(".") for path in (cache / "data_cache").iterdir())
    assert not list((cache / "data_cache").rglob("*.bin"))


@pytest.mark.slow  # it trains (in this process), twice
def test_a_full_disk_during_a_save_is_one_line_even_where_the_summary_cannot_be_written(
    tmp_path, train_in_process, capfd
):
    """The run dir on a 6 MiB disk: the step-1 checkpoint (about 3.6 MiB) fits, step 2's does not (ENOSPC):
    one line with the cause, and `latest` stays at step 1. Then the disk filled to its last byte, where not
    even summary.json or the rank's error record can be written (once: "training exited with code 1" and two
    tracebacks): the resume still ends in one line, saying what could not be written. With room made, the
    same resume completes."""
    disk = tmp_path / "disk"
    with small_disk(disk, 6) as resize:
        run_dir = disk / "run"
        ran = train_in_process(*QUICK, "train.save_every=1", "train.keep_checkpoints=2", run_dir=run_dir)
        line = assert_one_clear_error(ran, f"cannot write checkpoint {run_dir / 'checkpoints' / 'step2'} (", 1)
        assert " MiB free there" in line  # a 6 MiB disk, filled
        assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step1"

        ballast = disk / "ballast"
        with contextlib.suppress(OSError), ballast.open("wb") as handle:
            while True:
                handle.write(b"\0" * 4096)
                handle.flush()
        capfd.readouterr()
        full = train_in_process(f"resume={run_dir}", run_dir=run_dir)
        assert full.outcome.status == "failed" and full.outcome.exit_code == 2, full.outcome
        assert full.outcome.error == (
            f"hydra.run.dir={run_dir}: cannot write in it (No space left on device; 0.0 MiB free): free disk "
            "space, or choose another directory"
        )
        assert "Traceback" not in capfd.readouterr().err
        ballast.unlink()

        # Room for the reserve (docs/reliability.md), not for a checkpoint: the save fails, and the rank's
        # record and the summary are still written (the reserve given back), so the job says one line.
        resize(12)
        with ballast.open("wb") as handle:
            handle.write(b"\0" * (int(free_bytes(disk)) - 5 * 2**19))  # 2.5 MiB left: a checkpoint needs 3.6
        short = train_in_process(f"resume={run_dir}", run_dir=run_dir)
        line = assert_one_clear_error(short, f"cannot write checkpoint {run_dir / 'checkpoints' / 'step2'} (", 1)
        assert "could not be written" not in line and "not written" not in line
        assert read_summary(run_dir)["status"] == "failed" and (run_dir / "errors" / "rank0.json").is_file()
        assert "Traceback" not in capfd.readouterr().err

        ballast.unlink()
        resize(32)  # room made: the same run resumes from its complete checkpoint
        resumed = train_in_process(f"resume={run_dir}", run_dir=run_dir)
        assert resumed.outcome.status == "completed", resumed.outcome.error
        assert read_summary(run_dir)["resumed_from_step"] == 1 and (run_dir / "model" / "config.json").is_file()


def test_every_row_of_the_error_table_names_a_test_that_exists():
    """docs/errors.md tags each row with the id of its test: a case here, a pytest id elsewhere, or the
    words of a test's name (`[run-dir-in-proc]`: test_a_run_dir_in_proc_is_refused)."""
    tags = set(re.findall(r"`\[([a-z0-9-]+)\]`", (ROOT / "docs" / "errors.md").read_text()))
    assert len(tags) > 50
    cases = {case.id for case in CASES + RANK_CASES + CONFIG_CORE}
    tests = "\n".join(path.read_text() for path in (ROOT / "tests").rglob("test_*.py"))
    named = set(re.findall(r"def (test_\w+)", tests))
    missing = [
        tag
        for tag in sorted(tags - cases)
        if f'"{tag}"' not in tests and not any(tag.replace("-", "_") in name for name in named)
    ]
    assert not missing, f"docs/errors.md rows whose test is gone: {missing}"


def test_a_stop_signal_wrapped_by_an_import_is_still_the_stop():
    """transformers' lazy modules have re-raised what an import raised as a RuntimeError: a stop signal
    landing in that import is the stop (status interrupted, exit 143), not a failed import with a traceback."""
    from launcher.core.errors import Interrupted
    from launcher.launch.run import _interruption_behind

    stop = Interrupted("stopped by SIGTERM before training started; start the job again")
    try:
        try:
            raise stop
        except Interrupted as err:
            raise RuntimeError("Failed to import transformers.models.llava.modeling_llava") from err
    except RuntimeError as wrapped:
        assert _interruption_behind(wrapped) is stop
    assert _interruption_behind(RuntimeError("a real failure")) is None


def test_group_rates_a_users_scheduler_would_undo_are_refused(tmp_path):
    """DeepSpeed's WarmupLR sets every group to its warmup_max_lr: per-part rates would silently vanish."""
    path = tmp_path / "ds.json"
    scheduler = {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 1e-3, "warmup_num_steps": 10}}
    path.write_text(json.dumps({"scheduler": scheduler}))
    ran = run_here(
        [f"deepspeed_json={path}", "train.groups.vision.lr=1e-5", "dry_run=true", "logger=none"], tmp_path / "run"
    )
    assert_one_clear_error(
        ran,
        "train.groups.vision sets its own learning rate, but the scheduler WarmupLR sets every group to one rate of "
        "its own and would undo it: use WarmupCosineLR (the default, which scales each group's rate), or drop the "
        "group's lr",
        2,
    )
