"""launcher.plan.report: the machine planned for, the rows, the preflight check and the report/CLI
(`main(argv)` in this process), on the built-in model and on the published presets' saved configs.

The presets' configs (llava-1.5-7b, Qwen2-VL-2B) are built from their published dimensions (no download):
their meta models' counts, image tokens and sequence lengths are what the plan rests on, and what the
checks before a job starts (pixel limits, data.max_length, attention) read. `python -m launcher.plan` as a
subprocess is in tests/e2e/test_tools.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from launcher.config.precision import Device, fastest_precisions, resolve_precision
from launcher.config.ranges import check_config
from launcher.core.errors import LauncherError
from launcher.job.checks import check_model_choices
from launcher.job.planning import plan_job
from launcher.job.spec import HydraJob
from launcher.model import stats as model_stats
from launcher.plan import report as plan
from tests.helpers import ROOT, compose_config, compose_typed, run_here

CUDA = Device("cuda", bf16=True, fp16=True)


# ----------------------------------------------------------------------------- the machine planned for
def test_the_target_orders_precisions_as_precision_auto_does_fp32_first_on_a_cpu():
    gpu = plan.target_device(compose_typed(["plan.gpu_memory_gb=80"]).plan)
    assert gpu.precisions == ("bf16", "fp16", "fp32") and gpu.device_bytes == 80 * 2**30
    assert gpu.source == "plan.gpu_memory_gb=80"
    cpu = Device("cpu", bf16=True, fp16=False)
    assert fastest_precisions("cpu")[0] == resolve_precision("auto", cpu) == "fp32"
    target = plan.target_device(compose_typed(["plan.precisions=[bf16,fp32]"]).plan)
    if target.kind == "cpu":  # this machine
        assert target.precisions == ("fp32", "bf16")
        assert target.device_bytes == target.cpu_bytes and "this machine's RAM" in target.source


def test_a_gpu_planned_from_a_cpu_checks_cpu_memory_only_when_told():
    from launcher.job.checks import detect_device

    if detect_device().kind != "cpu":
        pytest.skip("asserts what planning a GPU from a machine without one does")
    target = plan.target_device(compose_typed(["plan.gpu_memory_gb=40"]).plan)
    assert (target.kind, target.cpu_bytes, target.precisions) == ("cuda", None, ("bf16", "fp16", "fp32"))
    told = plan.target_device(compose_typed(["plan.gpu_memory_gb=40", "plan.cpu_memory_gb=64"]).plan)
    assert told.cpu_bytes == 64 * 2**30 and told.usable_cpu == int(64 * 2**30 * 0.9)


def test_schema_accepts_plan_knobs_and_preflight():
    cfg = compose_config(["plan.gpu_memory_gb=80", "plan.seq_len=2048", "preflight=error"])
    assert cfg.plan.gpu_memory_gb == 80 and cfg.plan.seq_len == 2048 and cfg.preflight == "error"
    assert compose_config([]).preflight == "warn"


# ----------------------------------------------------------------------------- the published presets
# Published dimensions of llava-hf/llava-1.5-7b-hf and Qwen/Qwen2-VL-2B-Instruct (no download here).
PUBLISHED_COUNTS = {"llava_1_5_7b": 7_063_427_072, "qwen2_vl_2b": 2_208_985_600}


def save_published_configs(root: Path) -> dict[str, Path]:
    """config.json of llava-1.5-7b and Qwen2-VL-2B, built from their published dimensions."""
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, Qwen2VLConfig

    llava = LlavaConfig(
        vision_config=CLIPVisionConfig(
            hidden_size=1024,
            intermediate_size=4096,
            num_hidden_layers=24,
            num_attention_heads=16,
            image_size=336,
            patch_size=14,
            projection_dim=768,
        ),
        text_config=LlamaConfig(
            hidden_size=4096,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=32,
            intermediate_size=11008,
            vocab_size=32064,
            max_position_embeddings=4096,
            rms_norm_eps=1e-5,
        ),
        image_token_index=32000,
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
        image_seq_length=576,
        dtype="float16",  # the published checkpoint's dtype: what from_pretrained loads
    )
    qwen = Qwen2VLConfig(
        text_config={
            "hidden_size": 1536,
            "num_hidden_layers": 28,
            "num_attention_heads": 12,
            "num_key_value_heads": 2,
            "intermediate_size": 8960,
            "vocab_size": 151936,
            "tie_word_embeddings": True,
        },
        vision_config={
            "depth": 32,
            "embed_dim": 1280,
            "hidden_size": 1536,
            "mlp_ratio": 4,
            "num_heads": 16,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
        },
        tie_word_embeddings=True,
        dtype="bfloat16",
    )
    paths = {"llava_1_5_7b": root / "llava-1.5-7b", "qwen2_vl_2b": root / "qwen2-vl-2b"}
    llava.save_pretrained(paths["llava_1_5_7b"])
    qwen.save_pretrained(paths["qwen2_vl_2b"])
    return paths


@pytest.fixture(scope="module")
def published(tmp_path_factory) -> dict[str, Path]:
    return save_published_configs(tmp_path_factory.mktemp("published"))


def _planned(overrides: list[str], device: Device):
    """The typed config and the job of `train.py OVERRIDES`, planned for `device`."""
    cfg = compose_typed(overrides)
    return cfg, plan_job(cfg, HydraJob(run_dir=ROOT, overrides=tuple(overrides)), device=device, validate=False)


@pytest.mark.parametrize("model", list(PUBLISHED_COUNTS))
def test_meta_model_counts_match_the_published_models(published, model):
    stats = model_stats.model_stats(compose_typed([f"model={model}", f"model.path={published[model]}"]))
    assert stats.total == PUBLISHED_COUNTS[model]
    assert stats.frozen == ("vision",)  # both presets freeze the vision tower
    assert stats.trainable == stats.total - stats.components["vision"]
    assert sum(stats.components.values()) == stats.total
    if model == "llava_1_5_7b":
        assert (stats.vision_tokens, stats.image_tokens) == (577, 576)
        assert stats.largest_layer == 32064 * 4096  # the embedding (and, untied, the head)
        assert stats.load_bytes == 2
    else:
        assert (stats.vision_tokens, stats.image_tokens) == (1024, 256)  # 448 px, 14 px patches, 2x2 merge
        assert stats.text.kv_width == 2 * 128


@pytest.mark.parametrize(
    ("overrides", "tokens"),
    [
        ([], 256),  # null limits: today's 448 px square
        (["model.max_pixels=200704"], 256),  # 448^2: already inside the range
        (["model.max_pixels=50176"], 64),  # 224^2: 8 x 8 merged patches of 28 px
        (["model.min_pixels=802816"], 1024),  # 896^2
        (["model.min_pixels=3136", "model.max_pixels=100000"], 121),  # 308^2 = 94864 px, the largest that fits
        (["plan.image_size=896", "model.max_pixels=200704"], 256),
    ],
)
def test_qwen2_vl_image_tokens_follow_the_pixel_limits(published, overrides, tokens):
    cfg = compose_typed(["model=qwen2_vl_2b", f"model.path={published['qwen2_vl_2b']}", *overrides])
    stats = model_stats.model_stats(cfg)
    assert (stats.vision_tokens, stats.image_tokens) == (4 * tokens, tokens)


@pytest.mark.slow  # a plan and a preflight that does not fit: every preset composed (Hydra), twice
def test_the_plan_and_the_preflight_count_image_tokens_from_max_pixels(published, capsys):
    overrides = ["model=qwen2_vl_2b", f"model.path={published['qwen2_vl_2b']}", "plan.gpu_memory_gb=1"]
    for limit, tokens in (([], 256), (["model.max_pixels=50176"], 64)):
        assert plan.main([*overrides, *limit, "plan.precisions=[bf16]"]) == 0
        assert f"{512 + tokens} tokens per sample (1 image(s) x {tokens} image tokens)" in capsys.readouterr().out
        warning = plan.preflight(*_planned([*overrides, *limit, "precision=bf16"], CUDA))
        assert f"x {512 + tokens} tokens" in warning


def test_pixel_limits_are_checked_before_anything_starts(published):
    qwen = ["model=qwen2_vl_2b", f"model.path={published['qwen2_vl_2b']}"]
    with pytest.raises(LauncherError, match=r"^model.max_pixels=100 is below model.min_pixels=200: raise model"):
        check_config(compose_typed([*qwen, "model.min_pixels=200", "model.max_pixels=100"]))
    with pytest.raises(LauncherError, match=r"^model.min_pixels=0 must be a positive number of pixels per image"):
        check_config(compose_typed([*qwen, "model.min_pixels=0"]))
    with pytest.raises(LauncherError, match=r"^model.max_pixels=-5 must be a positive number"):
        check_config(compose_typed([*qwen, "model.max_pixels=-5"]))
    check_config(compose_typed([*qwen, "model.min_pixels=200", "model.max_pixels=200"]))
    assert check_model_choices(compose_typed([*qwen, "model.max_pixels=50176"]), "cpu", "fp32") == "sdpa"
    llava = compose_typed(["model=llava_1_5_7b", f"model.path={published['llava_1_5_7b']}", "model.max_pixels=50176"])
    with pytest.raises(LauncherError, match=r"^model.max_pixels=50176: only dynamic-resolution models .*\(336 px\)"):
        check_model_choices(llava, "cuda", "bf16")
    with pytest.raises(LauncherError, match=r"\(336 px\)"):  # the planner refuses it as well
        model_stats.model_stats(llava)
    tiny = compose_typed(["model=tiny_llava", "model.min_pixels=1024"])
    with pytest.raises(LauncherError, match=r"\(32 px\): set model.image_size instead"):
        check_model_choices(tiny, "cpu", "fp32")


def test_data_max_length_bounds_the_planned_sequence(published):
    """A batch is padded to its longest sample and none is longer than data.max_length: the plan uses it."""
    qwen = ["model=qwen2_vl_2b", f"model.path={published['qwen2_vl_2b']}"]
    stats = model_stats.model_stats(compose_typed(qwen))

    def planned(*overrides: str) -> int:
        return model_stats.sequence(compose_typed([*qwen, *overrides]), stats)[0]

    assert planned() == 512 + 256  # data=shapes sets no limit: the typical sample
    assert planned("data.max_length=1024") == 1024
    assert planned("data=llava_json", "data.path=x.json") == 2048  # the default limit for your data
    assert planned("data.max_length=1024", "plan.seq_len=4096") == 4096  # plan.seq_len says what to plan
    assert planned("data.max_length=600", "plan.text_tokens=512") == 600  # a typical sample, up to the limit
    assert planned("data.max_length=4096", "plan.text_tokens=512") == 768


@pytest.mark.slow  # a plan and two preflights that do not fit: every preset composed (Hydra)
def test_the_plan_and_the_preflight_use_data_max_length(published, capsys):
    qwen = ["model=qwen2_vl_2b", f"model.path={published['qwen2_vl_2b']}"]
    overrides = [*qwen, "plan.gpu_memory_gb=80", "plan.precisions=[bf16]"]
    assert plan.main([*overrides, "data.max_length=1024"]) == 0
    assert "1024 tokens per sample (data.max_length; 1 image(s) x 256 image tokens)" in capsys.readouterr().out
    unbounded = plan.preflight(*_planned([*qwen, "precision=bf16", "plan.gpu_memory_gb=1"], CUDA))
    bounded = plan.preflight(*_planned([*qwen, "precision=bf16", "plan.gpu_memory_gb=1", "data.max_length=1024"], CUDA))
    assert "x 768 tokens" in unbounded and "x 1024 tokens" in bounded


def test_max_length_is_checked_before_anything_starts(published):
    with pytest.raises(LauncherError, match=r"^data.max_length=0 must be a positive number of tokens per sample"):
        check_config(compose_typed(["data.max_length=0"]))
    llava = ["model=llava_1_5_7b", f"model.path={published['llava_1_5_7b']}"]
    with pytest.raises(
        LauncherError, match=r"^data.max_length=512 leaves no room beside one image's 576 tokens \(llava, every image\)"
    ):
        check_model_choices(compose_typed([*llava, "data.max_length=512"]), "cuda", "bf16")
    check_model_choices(compose_typed([*llava, "data.max_length=1024"]), "cuda", "bf16")
    qwen = ["model=qwen2_vl_2b", f"model.path={published['qwen2_vl_2b']}"]
    with pytest.raises(LauncherError, match=r"one image's 64 tokens \(qwen2_vl, an image of model.min_pixels=50176\)"):
        check_model_choices(compose_typed([*qwen, "model.min_pixels=50176", "data.max_length=64"]), "cpu", "fp32")
    check_model_choices(compose_typed([*qwen, "data.max_length=64"]), "cpu", "fp32")  # 56 x 56: 4 tokens
    with pytest.raises(LauncherError, match=r"one image's 16 tokens \(tiny_llava at model.image_size=32\)"):
        check_model_choices(compose_typed(["data.max_length=16"]), "cpu", "fp32")


def test_attention_that_cannot_run_here_is_refused_before_anything_starts():
    cfg = compose_typed(["model.attn_implementation=flash_attention_2"])
    with pytest.raises(LauncherError, match=r"^model.attn_implementation=flash_attention_2 needs a CUDA device"):
        check_model_choices(cfg, "cpu", "bf16")
    assert check_model_choices(cfg, "cpu", "bf16", launching=False) == "flash_attention_2"  # a dry run plans
    assert check_model_choices(compose_typed([]), "cpu", "fp32") == "sdpa"  # auto
    assert check_model_choices(compose_typed(["model.attn_implementation=eager"]), "cpu", "fp32") == "eager"


# ----------------------------------------------------------------------------- the rows and the report
def test_rows_cover_every_preset_and_precision_and_say_why_one_cannot_be_planned(published):
    overrides = ["model=llava_1_5_7b", f"model.path={published['llava_1_5_7b']}", "dist.nproc_per_node=8",
                 "plan.gpu_memory_gb=80", "train.micro_batch_size=1"]  # fmt: skip
    cfg = compose_typed(overrides)
    stats = model_stats.model_stats(cfg)
    target = plan.target_device(cfg.plan)
    presets = ("z0", "z1", "z2", "z3")  # each a Hydra composition: the CLI's every preset is the slow test's
    rows = plan.plan_rows(cfg, overrides, stats, target, presets=presets, precisions=("bf16",))
    assert [(row.preset, row.dtype) for row in rows] == [(preset, "bf16") for preset in presets]
    by_preset = {row.preset: row for row in rows}
    assert not by_preset["z0"].fits and by_preset["z1"].fits and by_preset["z3"].fits
    assert by_preset["z3"].estimate.layout.world_size == 8 and by_preset["z3"].estimate.seq_len == 512 + 576
    # the states shrink as ZeRO partitions more of them
    on_device = [by_preset[p].estimate.states.on_device for p in ("z0", "z1", "z2", "z3")]
    assert on_device == sorted(on_device, reverse=True)
    table = plan.format_table(rows, stats, markdown=True)
    header, rule = table.splitlines()[:2]
    assert header.startswith("| preset | dtype | model states |") and rule.startswith("|---|")
    # DeepSpeed's own estimators appear where they apply: ZeRO 2/3 in 16 bits, full fine-tuning
    z2 = next(line for line in table.splitlines() if line.startswith("| z2 |"))
    z0 = next(line for line in table.splitlines() if line.startswith("| z0 |"))
    assert z2.split("|")[-2].strip() != "-" and z0.split("|")[-2].strip() == "-"


def test_cli_prints_the_table_and_recommends(published, capsys):
    code = plan.main(
        [
            "model=llava_1_5_7b",
            f"model.path={published['llava_1_5_7b']}",
            "dist.nproc_per_node=8",
            "plan.gpu_memory_gb=80",
            "train.micro_batch_size=1",
            "plan.precisions=[bf16]",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    assert "7,063.4M parameters" in out and "vision 303.5M (frozen)" in out
    assert "1088 tokens per sample" in out  # 512 text + 576 image tokens
    assert "recommendation: deepspeed=z1 precision=bf16" in out
    z0 = next(line for line in out.splitlines() if line.startswith("z0 "))
    assert z0.split()[-2] == "no"  # 16 bytes per parameter and more: not on 80 GB


@pytest.mark.slow  # every preset composed (Hydra)
def test_cli_says_when_nothing_fits(published, capsys):
    overrides = ["model=llava_1_5_7b", f"model.path={published['llava_1_5_7b']}", "plan.gpu_memory_gb=1",
                 "plan.precisions=[bf16]"]  # fmt: skip
    assert plan.main(overrides) == 0
    assert "recommendation: nothing is expected to fit; lower train.micro_batch_size" in capsys.readouterr().out


def test_cli_reports_errors_in_one_line(capsys):
    assert plan.main(["model=llava_1_5_7b", "model.path=/no/such/dir"]) == 2
    err = capsys.readouterr().err
    assert "model.path=/no/such/dir: cannot read its config" in err and len(err.strip().splitlines()) == 1
    assert plan.main(["plan.gpu_memroy_gb=80"]) == 1  # Hydra refuses the key
    assert capsys.readouterr().err.startswith("error: ")
    assert plan.main(["plan.headroom=1.5"]) == 2  # a range (launcher.config.ranges)
    assert capsys.readouterr().err.strip() == "error: plan.headroom=1.5 must be a fraction in [0, 1)"
    assert plan.main(["--help"]) == 0 and "python -m launcher.plan" in capsys.readouterr().out


# ----------------------------------------------------------------------------- the preflight
@pytest.mark.slow  # a preflight that does not fit plans every preset at its precision
def test_preflight_warns_with_a_preset_that_fits(published, tmp_path):
    overrides = [
        "model=llava_1_5_7b",
        f"model.path={published['llava_1_5_7b']}",
        "dist.nproc_per_node=8",
        "plan.gpu_memory_gb=80",
        "train.micro_batch_size=1",
        "precision=bf16",
        f"cache_dir={tmp_path}",  # no data cache built yet: a first run's preflight
    ]
    warning = plan.preflight(*_planned([*overrides, "deepspeed=z0"], CUDA))
    assert warning is not None and "\n" not in warning
    assert warning.startswith("memory plan: deepspeed=z0 bf16 on 8 ranks needs about")
    assert "expected to fit: deepspeed=z1 precision=bf16" in warning
    # Planned at an assumed length only because the cache is not built: the line says how to plan the records.
    assert warning.endswith(
        "; the data cache is not built yet, so the plan assumed 1088 tokens a sample (plan.text_tokens' default and "
        "its images' tokens): python -m launcher.prepare with the same overrides builds it, and the plan then reads "
        "the records"
    ), warning
    capped = plan.preflight(*_planned([*overrides, "deepspeed=z0", "data.max_length=2048"], CUDA))
    assert "so the plan assumed 2048 tokens a sample (data.max_length): python -m launcher.prepare" in capped
    packed = plan.preflight(*_planned([*overrides, "deepspeed=z0", "data.packing=true", "data.pack_length=4096"], CUDA))
    assert "so the plan assumed packed rows of 4096 tokens holding records of plan.text_tokens' default " in packed
    uncached = plan.preflight(*_planned([*overrides, "deepspeed=z0", "data.max_length=2048", "data.cache=false"], CUDA))
    assert uncached is not None and "launcher.prepare" not in uncached  # nothing to prepare
    assert plan.preflight(*_planned([*overrides, "deepspeed=z3"], CUDA)) is None


@pytest.mark.slow  # a preflight that does not fit plans every preset at its precision
def test_preflight_when_nothing_fits_says_what_to_lower(published):
    qwen = ["model=qwen2_vl_2b", f"model.path={published['qwen2_vl_2b']}"]
    overrides = [*qwen, "plan.gpu_memory_gb=1", "precision=bf16"]
    warning = plan.preflight(*_planned(overrides, CUDA))
    assert "no preset is expected to fit: lower train.micro_batch_size" in warning


def test_a_recommended_nvme_preset_comes_with_the_disk_it_needs(published):
    """z3_nvme cannot run without offload.nvme_path: the recommendation names it unless the command line does."""
    qwen = ["model=qwen2_vl_2b", f"model.path={published['qwen2_vl_2b']}", "plan.precisions=[bf16]"]
    tight = [*qwen, "plan.gpu_memory_gb=4", "plan.cpu_memory_gb=30"]  # z3_offload's 30.6 GiB of host memory: no
    last = plan.report(compose_typed(tight), tight).splitlines()[-1]
    assert last.startswith("recommendation: deepspeed=z3_nvme precision=bf16 offload.nvme_path=/local_nvme (")
    assert last.endswith("; offload.nvme_path: a fast local disk of yours, where the states are swapped)")
    given = [*tight, "offload.nvme_path=/nvme"]
    last = plan.report(compose_typed(given), given).splitlines()[-1]
    assert last.startswith("recommendation: deepspeed=z3_nvme precision=bf16 (") and "nvme_path" not in last


def test_preflight_of_the_built_in_job_is_silent():
    assert plan.preflight(*_planned([], Device("cpu", bf16=True, fp16=False))) is None


def test_a_run_records_the_planners_figure_for_the_records_it_trained_on_beside_the_measured_peak(quick_run):
    from launcher.job.spec import read_job

    job = read_job(quick_run.run_dir)
    summary = quick_run.summary()
    # The preflight planned before the ranks built the data cache: a first run's plan is at data.max_length.
    line, preflight = plan.preflight_plan(job.config, job, from_records=not summary["data_cache"]["built"])
    assert line is None and job.planned_memory_bytes == preflight > 2**20
    # The summary's figure is the plan of the records trained on, as a second run's preflight plans it.
    _, from_records = plan.preflight_plan(job.config, job)
    assert summary["planned_memory_bytes"] == from_records > 2**20 and summary["peak_memory_bytes"] > 0


def test_rank_0_plans_a_first_run_again_from_the_records_its_ranks_cached(quick_run, caplog):
    """What the trainer does once the data cache is built (launcher.train.trainer.plan_from_records): the
    figure planned at data.max_length gives way to the records' own, and the change is said in one line."""
    from launcher.job.spec import read_job
    from launcher.model.loading import load_processor
    from launcher.train.trainer import plan_from_records

    job = read_job(quick_run.run_dir)
    _, at_max_length = plan.preflight_plan(job.config, job, from_records=False)
    _, from_records = plan.preflight_plan(job.config, job)
    assert from_records < at_max_length  # the built-in records are ~50 tokens; data.max_length is far above
    processor = load_processor(str(job.model_path))
    summary = job.summary()
    summary.planned_memory_bytes, summary.data_cache = at_max_length, quick_run.summary()["data_cache"]
    with caplog.at_level("DEBUG", logger="launcher"):
        plan_from_records(job, processor, summary)
        assert summary.planned_memory_bytes == from_records
        plan_from_records(job, processor, summary)  # planned from the records already: nothing to say
    records = int(job.config.data.n_train)  # the built-in set: every record cached
    said = [
        (record.levelname, record.getMessage()) for record in caplog.records if "memory plan" in record.getMessage()
    ]
    level = "INFO" if job.device.kind == "cuda" else "DEBUG"  # said where the end line shows it: on a GPU
    assert said == [
        (
            level,
            f"memory plan from the {records:,} records of the data cache: {from_records / 2**20:,.0f} MiB per rank "
            f"(the preflight planned {at_max_length / 2**20:,.0f} MiB)",
        )
    ]
    summary.data_cache = None  # no data cache (streaming, data.cache=false): the preflight's figure stays
    summary.planned_memory_bytes = at_max_length
    plan_from_records(job, processor, summary)
    assert summary.planned_memory_bytes == at_max_length


@pytest.mark.slow  # two preflights that do not fit
def test_the_launcher_warns_or_refuses_with_the_preflight_line(tmp_path):
    """run_job runs the preflight before anything starts: preflight=warn says it, preflight=error refuses."""
    tight = ["logger=none", "plan.gpu_memory_gb=0.0001", "dry_run=true"]
    warned = run_here([*tight, "preflight=warn"], tmp_path / "warn")
    assert warned.outcome.status == "planned", warned.error
    assert any(line.startswith("warning: memory plan: ") for line in warned.lines), warned.lines
    refused = run_here([*tight, "preflight=error"], tmp_path / "error")
    assert refused.outcome.exit_code == 2 and refused.error.startswith("memory plan: ")
    assert refused.error.endswith("(preflight=error; preflight=warn only warns)")
    quiet = run_here([*tight, "preflight=off"], tmp_path / "off")
    assert quiet.outcome.status == "planned" and not any("memory plan" in line for line in quiet.lines)


def test_the_real_model_table_of_docs_planning_md_is_what_its_command_prints(monkeypatch, capsys):
    """docs/planning.md's table of the real presets is the output of the command under it, column by column
    (issue 44: it had drifted from it by up to 5.6 GiB a cell)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the shipped configs; nothing is fetched
    page = (ROOT / "docs" / "planning.md").read_text()
    _, _, *body = page.split("| preset | LLaVA-1.5-7B ×1", 1)[1].split("\n\n", 1)[0].splitlines()
    columns = [("llava_1_5_7b", 1), ("llava_1_5_7b", 8), ("qwen2_vl_2b", 1), ("qwen2_vl_2b", 8)]
    documented = {row.split("|")[1].strip(): [cell.strip() for cell in row.split("|")[2:-1]] for row in body}
    for index, (model, ranks) in enumerate(columns):
        overrides = [f"model={model}", f"dist.nproc_per_node={ranks}", "plan.gpu_memory_gb=80",
                     "train.micro_batch_size=1", "plan.precisions=[bf16]", "plan.markdown=true"]  # fmt: skip
        assert plan.main(overrides) == 0
        printed, compared = capsys.readouterr().out, 0
        for line in printed.splitlines():
            cells = [cell.strip() for cell in line.split("|")[1:-1]]
            if len(cells) != 9 or cells[0] not in documented:
                continue
            device, cpu, fits = cells[5], cells[6], "✓" if cells[7] == "yes" else "✗"
            offloads = "offload" in cells[0] or "nvme" in cells[0]
            expected = f"{device} {fits}" + (f" ({cpu.replace('(+', '+ ').replace(')', '')})" if offloads else "")
            assert documented[cells[0]][index] == expected, f"{cells[0]}, {model} x{ranks}: printed {expected}"
            compared += 1
        assert compared == 7, printed  # every preset's row
        recommended = printed.split("recommendation: deepspeed=", 1)[1].split()[0]
        assert documented["**recommended**"][index] == recommended, f"{model} x{ranks}"
