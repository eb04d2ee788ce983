"""The pure DeepSpeed-dict builder (launcher.config.ds_config): buckets, every preset x precision x offload x
comm combination, golden dicts, extra keys and rules between keys, the migration of a user's DeepSpeed JSON.

The batch arithmetic is tested in test_batch.py, precision= in test_precision.py, and the train.* ranges
(no longer build_ds_config's) in test_ranges.py.
"""

from __future__ import annotations

import copy
import itertools
import json
import logging
from pathlib import Path
from typing import Any

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from launcher.config.batch import BATCH_KEYS
from launcher.config.ds_config import (
    KNOWN_TOP_LEVEL_KEYS,
    OWNERS,
    build_ds_config,
    check_ds_config,
    derived_bucket_sizes,
    explicit_groups_from_overrides,
)
from launcher.config.knobs import TRAIN_KEY_OWNS
from launcher.config.precision import Device, precision_of, resolve_precision
from launcher.core.errors import LauncherError
from tests.helpers import CONF, QUICK, ROOT, compose_plain

CPU = Device(kind="cpu", bf16=True, fp16=False, name="")
GPU = Device(kind="cuda", bf16=True, fp16=True, name="H100")
GOLDEN = ROOT / "tests" / "golden"
LLAVA_7B_HIDDEN = 4096

PRESETS = {  # preset -> (stage, offload group it selects)
    "z0": (0, "none"),
    "z1": (1, "none"),
    "z2": (2, "none"),
    "z2_offload": (2, "optimizer"),
    "z3": (3, "none"),
    "z3_offload": (3, "all"),
    "z3_nvme": (3, "nvme"),
}
PRECISIONS = ("fp32", "bf16", "fp16", "auto")
OFFLOADS = (None, "none", "optimizer", "param", "all", "nvme")  # None: the preset's choice
COMMS = ("default", "overlap", "low_memory")
OFFLOAD_DEVICES = {  # offload group -> (optimizer device, param device)
    "none": ("none", "none"),
    "optimizer": ("cpu", "none"),
    "param": ("none", "cpu"),
    "all": ("cpu", "cpu"),
    "nvme": ("nvme", "nvme"),
}


def build(cfg: dict[str, Any], *, world_size: int = 1, hidden: int = 64, device: Device = CPU, **kw: Any):
    return build_ds_config(cfg, world_size=world_size, hidden_size=hidden, device=device, **kw)


# --------------------------------------------------------------------------- buckets
@pytest.mark.parametrize("hidden", [64, 128, 4096, 1536, 3584])
def test_default_bucket_sizes_are_integers_derived_from_hidden_size(hidden):
    buckets = derived_bucket_sizes(hidden)
    assert buckets["reduce_bucket_size"] == hidden * hidden
    assert buckets["stage3_prefetch_bucket_size"] == round(0.9 * hidden * hidden)
    assert buckets["stage3_param_persistence_threshold"] == 10 * hidden
    assert all(isinstance(value, int) for value in buckets.values())


def test_a_hidden_size_below_one_is_refused():
    with pytest.raises(LauncherError, match="model hidden size must be positive, got 0"):
        derived_bucket_sizes(0)


# --------------------------------------------------------------------------- every combination
@pytest.fixture(scope="module")
def composer():
    """One Hydra context for the module: composing hundreds of configs stays fast."""
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        yield lambda overrides: OmegaConf.to_container(compose(config_name="config", overrides=overrides), resolve=True)


def expected_error(stage: int, offload: str, precision: str, device: Device) -> str | None:
    """What the rules say about a combination (written independently of the builder)."""
    optimizer_device, param_device = OFFLOAD_DEVICES[offload]
    if precision == "fp16" and not device.fp16:
        return "precision=fp16 is not supported"
    if param_device != "none" and stage < 3:
        return "parameter offload"
    if optimizer_device == "nvme" and stage < 3:
        return "NVMe optimizer offload needs ZeRO stage 3"
    if optimizer_device != "none" and stage == 0:
        return "optimizer offload needs ZeRO stage 1, 2 or 3"
    if "nvme" in (optimizer_device, param_device):
        return "needs a directory: set offload.nvme_path"
    return None


def check_combination(cfg: dict[str, Any], preset: str, precision: str, offload: str | None, comm: str) -> str:
    """Build for a CPU and a GPU; each build either passes DeepSpeed's checks or fails with its rule."""
    from launcher.job.checks import validate_with_deepspeed

    stage, preset_offload = PRESETS[preset]
    chosen_offload = offload or preset_offload
    label = f"deepspeed={preset} precision={precision} offload={offload} comm={comm}"
    assert cfg["zero"]["stage"] == stage, label
    outcome = ""
    for device in (CPU, GPU):
        expected = expected_error(stage, chosen_offload, precision, device)
        if expected:
            with pytest.raises(LauncherError, match=expected):
                build(cfg, device=device)
            outcome += "refused "
            continue
        ds = build(cfg, device=device, hidden=64)
        validate_with_deepspeed(ds)
        zero = ds["zero_optimization"]
        assert zero["stage"] == stage, label
        optimizer_device, param_device = OFFLOAD_DEVICES[chosen_offload]
        assert zero.get("offload_optimizer", {}).get("device", "none") == optimizer_device, label
        assert zero.get("offload_param", {}).get("device", "none") == param_device, label
        dtype = resolve_precision(precision, device)
        assert ds["bf16"]["enabled"] == (dtype == "bf16"), label
        assert ds["fp16"]["enabled"] == (dtype == "fp16"), label
        assert "auto" not in json.dumps(ds), label
        if stage > 0 and comm == "default":
            assert zero["reduce_bucket_size"] == 64 * 64, label
        if stage == 3:
            prefetch = round(0.9 * 64 * 64) if comm == "default" else cfg["comm"]["stage3_prefetch_bucket_size"]
            assert zero["stage3_prefetch_bucket_size"] == prefetch, label
        assert set(ds) <= KNOWN_TOP_LEVEL_KEYS, label
        outcome += "ok "
    return outcome


COMBINATIONS = list(itertools.product(PRESETS, PRECISIONS, OFFLOADS, COMMS))


def _overrides(preset: str, precision: str, offload: str | None, comm: str) -> list[str]:
    return [f"deepspeed={preset}", f"precision={precision}", f"comm={comm}"] + (
        [f"offload={offload}"] if offload is not None else []
    )


def test_every_combination_fast(composer):
    """All combinations. A preset only selects the zero and offload groups, and an offload= given on the
    command line replaces the preset's; the precision and comm nodes only set themselves. So Hydra composes
    each preset, and each option of the other groups once, and the combinations are put together from
    those nodes (test_every_combination_composed_by_hydra composes each one)."""
    presets = {preset: composer([f"deepspeed={preset}"]) for preset in PRESETS}
    offload_nodes = {o: composer([f"offload={o}"])["offload"] for o in OFFLOADS if o is not None}
    precision_nodes = {p: composer([f"precision={p}"])["precision"] for p in PRECISIONS}
    comm_nodes = {c: composer([f"comm={c}"])["comm"] for c in COMMS}
    # What the assembly relies on, checked once against Hydra's own composition.
    assert composer(_overrides("z3_offload", "bf16", "param", "overlap")) == {
        **presets["z3_offload"],
        "offload": offload_nodes["param"],
        "precision": precision_nodes["bf16"],
        "comm": comm_nodes["overlap"],
    }
    outcomes = []
    for preset, precision, offload, comm in COMBINATIONS:
        cfg = {**presets[preset], "precision": precision_nodes[precision], "comm": comm_nodes[comm]}
        if offload is not None:
            cfg["offload"] = offload_nodes[offload]
        outcomes.append(check_combination(cfg, preset, precision, offload, comm))
    assert sum("ok" in o for o in outcomes) > 100 and sum("refused" in o for o in outcomes) > 100


# Composed by Hydra: every pair of two groups' choices at least once (pairwise), 66 command lines instead
# of 504; every row of the table is checked by the pure test above, and Hydra composes each group alike.
PAIRWISE = sorted(
    {(preset, PRECISIONS[(p + o) % 4], offload, COMMS[(p + o) % 3])
     for (p, preset), (o, offload) in itertools.product(enumerate(PRESETS), enumerate(OFFLOADS))}
    | {("z3", precision, offload, COMMS[(a + o) % 3])
       for (a, precision), (o, offload) in itertools.product(enumerate(PRECISIONS), enumerate(OFFLOADS))},
    key=str,
)  # fmt: skip


def test_every_pair_of_choices_composed_by_hydra(composer):
    """Every pair of two groups' choices (preset, precision, offload, comm), composed by Hydra from its
    command line, builds the dict the table says."""
    for pair in itertools.combinations(range(4), 2):
        wanted = {tuple(row[i] for i in pair) for row in COMBINATIONS}
        assert wanted == {tuple(row[i] for i in pair) for row in PAIRWISE}, pair
    for preset, precision, offload, comm in PAIRWISE:
        check_combination(composer(_overrides(preset, precision, offload, comm)), preset, precision, offload, comm)


def test_nvme_with_a_path_composes(composer, tmp_path):
    cfg = composer(["deepspeed=z3_nvme", f"offload.nvme_path={tmp_path}"])
    zero = build(cfg)["zero_optimization"]
    assert zero["offload_param"]["device"] == "nvme"
    assert zero["offload_param"]["nvme_path"] == str(tmp_path)
    assert zero["offload_optimizer"]["nvme_path"] == str(tmp_path)


def test_a_group_on_the_command_line_wins_over_the_preset(composer):
    zero = build(composer(["deepspeed=z3_offload", "offload=none"]))["zero_optimization"]
    assert zero["stage"] == 3
    assert "offload_param" not in zero and "offload_optimizer" not in zero
    assert build(composer(["deepspeed=z3", "zero=stage2"]))["zero_optimization"]["stage"] == 2


# --------------------------------------------------------------------------- golden dicts
def _golden_cfg(overrides: list[str]) -> dict[str, Any]:
    # Pin the training knobs so the golden files do not move with the built-in job's defaults.
    return compose_plain(
        [
            *overrides,
            "train.micro_batch_size=4",
            "train.grad_accum=2",
            "train.lr=2e-5",
            "train.max_steps=1000",
            "train.warmup_steps=30",
            "train.weight_decay=0.0",
            "train.log_every=10",
        ]
    )


@pytest.mark.parametrize("world_size", [1, 8])
@pytest.mark.parametrize(
    ("name", "overrides"),
    [("z3_offload_bf16", ["deepspeed=z3_offload", "precision=bf16"]), ("z2_fp32", ["deepspeed=z2", "precision=fp32"])],
)
def test_golden(name, overrides, world_size):
    ds = build(_golden_cfg(overrides), world_size=world_size, hidden=LLAVA_7B_HIDDEN, device=GPU)
    golden = json.loads((GOLDEN / f"{name}_ws{world_size}.json").read_text())
    assert ds == golden


# --------------------------------------------------------------------------- extra keys and rules
def test_deepspeed_extra_is_merged_last():
    cfg = compose_plain(["deepspeed=z3", "+deepspeed_extra.zero_optimization.stage3_max_reuse_distance=5"])
    ds = build(cfg)
    assert ds["zero_optimization"]["stage3_max_reuse_distance"] == 5
    assert ds["zero_optimization"]["stage"] == 3


def test_unknown_top_level_key_in_extra_is_an_error():
    cfg = compose_plain(["+deepspeed_extra.zero_optimisation.stage=3"])
    with pytest.raises(LauncherError, match=r"deepspeed_extra\.zero_optimisation is not a DeepSpeed key"):
        build(cfg)


def test_both_half_precisions_is_an_error():
    cfg = compose_plain(["precision=bf16", "+deepspeed_extra.fp16.enabled=true"])
    with pytest.raises(LauncherError, match="fp16 and bf16 are both enabled"):
        build(cfg, device=GPU)


def test_auto_strings_never_reach_deepspeed():
    cfg = compose_plain(["+deepspeed_extra.gradient_clipping=auto"])
    with pytest.raises(LauncherError, match='gradient_clipping="auto" would be silently dropped'):
        build(cfg)


@pytest.mark.parametrize(
    "override",
    ["+deepspeed_extra.gradient_clipping=nan", "+deepspeed_extra.zero_optimization.stage3_max_live_parameters=inf"],
)
def test_a_value_json_cannot_hold_never_reaches_deepspeed(override):
    """NaN or infinity would be written as null in ds_config.json and replaced by DeepSpeed's default."""
    path = override.split("=")[0].removeprefix("+deepspeed_extra.")
    with pytest.raises(LauncherError, match=rf"{path}=(nan|inf) is not a finite number \(JSON has none"):
        build(compose_plain(["deepspeed=z3", override]))


def test_fractional_bucket_size_is_an_error():
    cfg = compose_plain(["deepspeed=z2", "+deepspeed_extra.zero_optimization.reduce_bucket_size=1000.5"])
    with pytest.raises(LauncherError, match=r"reduce_bucket_size=1000\.5 must be a whole number"):
        build(cfg)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["deepspeed=z2", "comm.reduce_bucket_size=0"], "zero_optimization.reduce_bucket_size=0 must be positive"),
        (["deepspeed=z2", "comm.allgather_bucket_size=-5"], "allgather_bucket_size=-5 must be positive"),
        (["deepspeed=z3", "comm.stage3_param_persistence_threshold=-1"], "threshold=-1 must be positive"),
    ],
)
def test_bad_bucket_sizes_are_refused(overrides, message):
    """The train.* ranges are launcher.config.ranges.check_config's (test_ranges.py); the dict's own rules stay here."""
    with pytest.raises(LauncherError, match=message):
        build(compose_plain(overrides))
    # A threshold of 0 (every parameter partitioned) is a value.
    build(compose_plain(["deepspeed=z3", "comm.stage3_param_persistence_threshold=0"]))


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        (("offload", "optimizer"), "disk", "offload.optimizer=disk is unknown"),
        (("precision", "dtype"), "fp8", "precision.dtype=fp8 is unknown"),
    ],
)
def test_bad_choices_in_plain_dicts_are_refused(key, value, message):
    """Composed configs cannot hold them (test_schema.py); the builder refuses them in plain dicts too."""
    cfg = compose_plain(["deepspeed=z2"])
    cfg[key[0]][key[1]] = value
    with pytest.raises(LauncherError, match=message):
        build(cfg)


def test_world_size_enters_the_global_batch():
    cfg = compose_plain(["train.micro_batch_size=4", "train.global_batch_size=64"])
    ds = build(cfg, world_size=8)
    assert (ds["train_batch_size"], ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"]) == (
        64,
        4,
        2,
    )


# --------------------------------------------------------------------------- deepspeed_json migration
ALIGN_ANYTHING_Z3_OFFLOAD = {  # the shape of align-anything's ds_z3_offload_config.json
    "train_batch_size": None,
    "train_micro_batch_size_per_gpu": 16,
    "gradient_accumulation_steps": None,
    "steps_per_print": 10,
    "zero_optimization": {
        "stage": 3,
        "offload_param": {"device": "cpu"},
        "offload_optimizer": {"device": "cpu"},
        "param_persistence_threshold": 1e4,
        "max_live_parameters": 3e7,
        "prefetch_bucket_size": 3e7,
        "memory_efficient_linear": False,
        "gather_16bit_weights_on_model_save": True,
    },
    "gradient_clipping": 1.0,
    "prescale_gradients": False,
    "wall_clock_breakdown": False,
    "hybrid_engine": {"enabled": False},
    "bf16": {"enabled": True},
}
LLAMA_FACTORY_Z3 = {  # the shape of LLaMA-Factory's ds_z3_config.json, "auto" everywhere
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "zero_allow_untested_optimizer": True,
    "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16},
    "bf16": {"enabled": "auto"},
    "zero_optimization": {
        "stage": 3,
        "overlap_comm": False,
        "contiguous_gradients": True,
        "sub_group_size": 1e9,
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
        "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9,
        "stage3_gather_16bit_weights_on_model_save": True,
    },
}


def test_llama_factory_auto_values_are_filled_by_the_composition():
    from launcher.job.checks import validate_with_deepspeed

    cfg = compose_plain(["precision=bf16", "train.micro_batch_size=4", "train.grad_accum=2"])
    ds = build(cfg, world_size=8, hidden=4096, device=GPU, base=LLAMA_FACTORY_Z3)
    validate_with_deepspeed(ds)
    assert "auto" not in json.dumps(ds)
    assert (ds["train_batch_size"], ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"]) == (
        64,
        4,
        2,
    )
    zero = ds["zero_optimization"]
    assert zero["stage"] == 3  # the base's stage stays: zero= was not given on the command line
    assert zero["reduce_bucket_size"] == 4096 * 4096
    assert zero["stage3_prefetch_bucket_size"] == round(0.9 * 4096 * 4096)
    assert zero["stage3_param_persistence_threshold"] == 40960
    assert zero["overlap_comm"] is False  # a concrete value of the base is kept
    assert ds["bf16"]["enabled"] is True and ds["fp16"]["enabled"] is False
    assert ds["zero_allow_untested_optimizer"] is True
    assert ds["optimizer"]["type"] == "AdamW"  # the base has none: the composition supplies it


def test_align_anything_nulls_are_filled_and_command_line_groups_override():
    base = copy.deepcopy(ALIGN_ANYTHING_Z3_OFFLOAD)
    cfg = compose_plain(["precision=bf16", "offload=none", "train.grad_accum=2"])
    explicit = explicit_groups_from_overrides(["precision=bf16", "offload=none", "train.grad_accum=2"])
    ds = build(cfg, world_size=2, hidden=64, device=GPU, base=base, explicit_groups=explicit)
    zero = ds["zero_optimization"]
    assert "offload_param" not in zero and "offload_optimizer" not in zero  # offload=none was given
    assert ds["train_batch_size"] == ds["train_micro_batch_size_per_gpu"] * 2 * 2
    assert base == ALIGN_ANYTHING_Z3_OFFLOAD  # the caller's dict is not modified


def test_concrete_batch_sizes_of_a_json_base_decide_unless_train_is_given():
    base = {"train_micro_batch_size_per_gpu": 16, "train_batch_size": None, "gradient_accumulation_steps": None}
    ds = build(compose_plain(), world_size=2, base=base)
    assert (ds["train_batch_size"], ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"]) == (
        32,
        16,
        1,
    )
    overrides = ["train.micro_batch_size=4"]
    ds = build(compose_plain(overrides), base=base, explicit_groups=explicit_groups_from_overrides(overrides))
    assert ds["train_micro_batch_size_per_gpu"] == 4


def test_a_json_base_still_meets_the_rules():
    base = copy.deepcopy(ALIGN_ANYTHING_Z3_OFFLOAD)
    cfg = compose_plain(["zero=stage2"])
    with pytest.raises(LauncherError, match="parameter offload"):
        build(cfg, device=GPU, base=base, explicit_groups=frozenset({"zero"}))


def test_an_unknown_key_in_the_json_base_names_the_file():
    with pytest.raises(LauncherError, match=r"deepspeed_json=my.json: unknown DeepSpeed key 'zero_opt'"):
        build(compose_plain(), base={"zero_opt": {}}, base_source="deepspeed_json=my.json")


def test_an_auto_the_composition_cannot_fill_is_an_error():
    base = {"zero_optimization": {"stage": 2, "round_robin_gradients": "auto"}}
    with pytest.raises(LauncherError, match=r"cannot fill \"auto\" at zero_optimization\.round_robin_gradients"):
        build(compose_plain(), base=base, base_source="deepspeed_json=x.json")


def test_explicit_groups_come_from_overrides():
    assert explicit_groups_from_overrides(["deepspeed=z3", "precision=bf16", "+train.lr=1"]) == {
        "zero",
        "offload",
        "precision",
        "train.lr",  # a train.* key is named by itself: it owns only its own values
    }
    assert explicit_groups_from_overrides(["train=default", "train.betas=[0.8,0.9]"]) == {"train", "train.betas"}
    assert explicit_groups_from_overrides(["model=tiny_llava", "dry_run=true"]) == frozenset()


# --------------------------------------------------------------------------- train.* overrides on a JSON base
DS_JSON = "deepspeed_json=ds.json"
FILE_16_4_4 = {  # concrete everywhere, and different from every train default
    "train_batch_size": 16,
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 4,
    "gradient_clipping": 0.5,
    "steps_per_print": 7,
    "zero_optimization": {"stage": 2},
    "optimizer": {
        "type": "AdamW",
        "params": {"lr": 3e-5, "betas": [0.8, 0.9], "eps": 1e-6, "weight_decay": 0.1},
    },
    "scheduler": {
        "type": "WarmupDecayLR",
        "params": {"warmup_min_lr": 0, "warmup_max_lr": 3e-5, "warmup_num_steps": 100, "total_num_steps": 5000},
    },
}


def build_on_file(overrides: list[str], base: dict[str, Any] = FILE_16_4_4, world_size: int = 1) -> dict[str, Any]:
    return build(
        compose_plain(overrides),
        world_size=world_size,
        base=base,
        base_source=DS_JSON,
        explicit_groups=explicit_groups_from_overrides(overrides),
    )


def leaves(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        flat.update(leaves(value, f"{prefix}{key}.") if isinstance(value, dict) else {f"{prefix}{key}": value})
    return flat


def changed_leaves(before: dict[str, Any], after: dict[str, Any]) -> set[str]:
    """The paths of `before` whose value differs in `after`."""
    now = leaves(after)
    return {path for path, value in leaves(before).items() if now.get(path, "absent") != value}


def test_a_train_override_keeps_the_files_batch_and_changes_only_lr():
    """The issue's example: file 16/4/4 + train.lr=1e-4 used to become 32 x 1."""
    ds = build_on_file(["train.lr=1e-4"])
    assert (ds["train_batch_size"], ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"]) == (
        16,
        4,
        4,
    )
    assert ds["optimizer"]["params"]["lr"] == 1e-4
    assert ds["scheduler"]["params"]["warmup_max_lr"] == 1e-4
    assert changed_leaves(FILE_16_4_4, ds) == {"optimizer.params.lr", "scheduler.params.warmup_max_lr"}
    assert ds["scheduler"]["type"] == "WarmupDecayLR"  # the file's own blocks stay


@pytest.mark.parametrize(
    "override",
    [
        "train.micro_batch_size=8",
        "train.grad_accum=2",
        "train.global_batch_size=64",
        "train.grad_clip=2.0",
        "train.lr=1e-4",
        "train.betas=[0.7,0.75]",
        "train.eps=1e-9",
        "train.weight_decay=0.2",
        "train.max_steps=300",
        "train.warmup_steps=20",
        "train.seed=3",
        "train.log_every=5",
        "train.eval_every=10",
    ],
)
def test_a_train_override_replaces_only_what_it_names(override):
    key = override.split("=", 1)[0]
    names = set(TRAIN_KEY_OWNS.get(key, ()))
    derived = set(BATCH_KEYS) if names & set(BATCH_KEYS) else set()  # a batch key also moves the derived one
    changed = changed_leaves(FILE_16_4_4, build_on_file([override]))
    assert names <= changed <= names | derived


def test_grad_clip_replaces_only_gradient_clipping():
    ds = build_on_file(["train.grad_clip=2.0"])
    assert ds["gradient_clipping"] == 2.0
    assert changed_leaves(FILE_16_4_4, ds) == {"gradient_clipping"}


@pytest.mark.parametrize(
    ("overrides", "world_size", "expected"),
    [
        (["train.micro_batch_size=8"], 1, (32, 8, 4)),  # the file's accumulation stays, the total is derived
        (["train.grad_accum=2"], 1, (8, 4, 2)),
        (["train.global_batch_size=64"], 2, (64, 4, 8)),  # the file's micro batch stays
        (["train.micro_batch_size=8", "train.grad_accum=1"], 1, (8, 8, 1)),
        (["train.micro_batch_size=2", "train.lr=1e-4"], 2, (16, 2, 4)),
        (["train=default"], 1, (32, 32, 1)),  # a train= choice owns the whole batch
    ],
)
def test_named_batch_keys_win_and_the_file_fills_the_rest(overrides, world_size, expected):
    ds = build_on_file(overrides, world_size=world_size)
    got = (ds["train_batch_size"], ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"])
    assert got == expected


def test_a_file_batch_that_conflicts_with_the_defaults_names_where_each_number_came_from():
    with pytest.raises(LauncherError) as err:
        build_on_file([], base={"train_batch_size": 16})
    assert str(err.value) == (
        "deepspeed_json=ds.json sets train_batch_size=16, which is not divisible by the default "
        "train.micro_batch_size=32 x world size 1: set train.micro_batch_size (or train_micro_batch_size_per_gpu "
        "in the file)"
    )
    ds = build_on_file(["train.micro_batch_size=4"], base={"train_batch_size": 16})
    assert (ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"]) == (4, 4)


@pytest.mark.parametrize(
    ("overrides", "base", "world_size", "message"),
    [
        (
            [],
            FILE_16_4_4,
            2,
            "inconsistent batch sizes: deepspeed_json=ds.json sets train_batch_size=16, but the file's "
            "train_micro_batch_size_per_gpu=4 x the file's gradient_accumulation_steps=4 x world size 2 = 32: set "
            'one of them to "auto" in the file',
        ),
        (
            ["train.global_batch_size=30"],
            FILE_16_4_4,
            1,
            "train.global_batch_size=30 is not divisible by train_micro_batch_size_per_gpu=4 (from "
            "deepspeed_json=ds.json) x world size 1: change train.global_batch_size, or "
            "train_micro_batch_size_per_gpu in the file (or set train.micro_batch_size)",
        ),
        (
            ["train.micro_batch_size=5"],
            {"train_batch_size": 16},
            1,
            "deepspeed_json=ds.json sets train_batch_size=16, which is not divisible by train.micro_batch_size=5 x "
            "world size 1: change train.micro_batch_size, or train_batch_size in the file",
        ),
        (
            [],
            {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 3},
            2,
            "sets train_batch_size=16, which is not divisible by the file's train_micro_batch_size_per_gpu=3 x world "
            "size 2 = 6",
        ),
        (
            [],
            {"gradient_accumulation_steps": 0},
            1,
            "deepspeed_json=ds.json sets gradient_accumulation_steps=0, which must be a positive integer",
        ),
    ],
)
def test_inconsistent_batch_sizes_name_the_files_keys_and_the_overrides(overrides, base, world_size, message):
    with pytest.raises(LauncherError) as err:
        build_on_file(overrides, base=base, world_size=world_size)
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_an_override_the_files_optimizer_has_no_place_for_is_refused():
    base = {**FILE_16_4_4, "optimizer": {"type": "AdamW", "params": {"lr": 3e-5}}}
    with pytest.raises(LauncherError, match=r"train\.betas would change nothing: the optimizer of deepspeed_json=ds"):
        build_on_file(["train.betas=[0.7,0.75]"], base=base)
    base["optimizer"]["params"]["betas"] = "auto"  # what the message suggests
    assert build_on_file(["train.betas=[0.7,0.75]"], base=base)["optimizer"]["params"]["betas"] == [0.7, 0.75]


# --------------------------------------------------------------------------- bf16's older spelling
def test_the_legacy_bfloat16_key_of_a_json_base_trains_bf16():
    base = {"bfloat16": {"enabled": True}, "zero_optimization": {"stage": 2}}
    ds = build(compose_plain([]), device=GPU, base=base)
    assert "bfloat16" not in ds and ds["bf16"] == {"enabled": True}
    assert precision_of(ds) == "bf16"
    # A precision named on the command line still replaces it.
    fp32 = build(compose_plain(["precision=fp32"]), device=GPU, base=base, explicit_groups=frozenset({"precision"}))
    assert precision_of(fp32) == "fp32"


def test_both_spellings_at_once_are_refused():
    base = {"bf16": {"enabled": True}, "bfloat16": {"enabled": True}}
    with pytest.raises(LauncherError, match='both "bf16" and its older spelling "bfloat16"'):
        build(compose_plain([]), device=GPU, base=base, base_source="x.json")
    with pytest.raises(LauncherError, match="deepspeed_extra: has both"):
        build({**compose_plain(["precision=bf16"]), "deepspeed_extra": base}, device=GPU)
    with pytest.raises(LauncherError, match='"bf16" and its older spelling "bfloat16" are both set'):
        check_ds_config({**build(compose_plain([])), "bfloat16": {"enabled": False}}, world_size=1, device=GPU)


# --------------------------------------------------------------------------- DeepSpeed ops
def test_the_composed_optimizer_needs_no_compiled_op_unless_offloaded():
    plain = build(compose_plain(["deepspeed=z3"]), device=GPU)
    assert plain["optimizer"]["params"]["torch_adam"] is True
    offloaded = build(compose_plain(["deepspeed=z2_offload"]), device=GPU)
    assert "torch_adam" not in offloaded["optimizer"]["params"]  # DeepSpeed's compiled CPU Adam steps offloaded states
    # The same where the offload comes from a deepspeed_json base (README's align-anything file; issue 44 saw
    # torch's AdamW step its offloaded states): the final dict decides, whichever source offloads.
    from_json = build(compose_plain([]), device=GPU, base=ALIGN_ANYTHING_Z3_OFFLOAD, base_source="x.json")
    assert from_json["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert "torch_adam" not in from_json["optimizer"]["params"]


@pytest.mark.slow
def test_the_default_job_builds_no_deepspeed_op(train_in_process, tmp_path, monkeypatch, caplog):
    extensions = tmp_path / "torch_extensions"
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(extensions))
    with caplog.at_level(logging.INFO, logger="launcher"):
        ran = train_in_process(*QUICK, run_dir=tmp_path / "run")
    assert ran.outcome.status == "completed", ran.error
    assert not [r for r in caplog.records if "building DeepSpeed op" in r.getMessage()]
    assert not any(extensions.rglob("*.so"))
    # The optimizer DeepSpeed stepped is torch's own (an op loaded earlier in this process would not be built
    # again, so the class it stepped is what shows that none was asked for).
    assert ran.summary()["optimizer"] == "AdamW"


# --------------------------------------------------------------------------- the final dict's rules
@pytest.mark.parametrize(
    ("change", "world_size", "message"),
    [
        (
            {"train_batch_size": 64},
            1,
            "inconsistent batch sizes: train_batch_size=64 but train_micro_batch_size_per_gpu",
        ),
        ({"train_batch_size": 32}, 2, r"x world size 2 = 64"),
        ({"gradient_accumulation_steps": 0}, 1, "gradient_accumulation_steps=0 must be a positive integer"),
        ({"train_micro_batch_size_per_gpu": True}, 1, "train_micro_batch_size_per_gpu=True must be a positive integer"),
        ({"gradient_clipping": -1.0}, 1, r"gradient_clipping=-1.0 must be a non-negative number \(0 disables"),
        ({"gradient_clipping": "1.0"}, 1, "gradient_clipping=1.0 must be a non-negative number"),
        ({"zero_opt": {}}, 1, "unknown DeepSpeed key 'zero_opt' .*check the spelling"),
        ({"steps_per_print": "auto"}, 1, 'steps_per_print="auto" would be silently dropped'),
        ({"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "disk"}}}, 1, "optimizer=disk, param=none"),
        (
            {"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}},
            1,
            "offload_param.device=nvme needs a",
        ),
    ],
)
def test_check_ds_config_refuses_a_final_dict_deepspeed_would_misread(change, world_size, message):
    ds = {**build(compose_plain(["train.micro_batch_size=32"])), **change}
    with pytest.raises(LauncherError, match=message):
        check_ds_config(ds, world_size=world_size, device=CPU)


def test_check_ds_config_accepts_what_build_ds_config_builds():
    for overrides, world_size in ((["deepspeed=z3_offload", "precision=bf16"], 4), (["deepspeed=z1"], 1)):
        ds = build(compose_plain(overrides), world_size=world_size)
        check_ds_config(ds, world_size=world_size, device=CPU)
    with pytest.raises(LauncherError, match="x world size 4 = 128"):  # the world size it was built for
        check_ds_config(build(compose_plain([])), world_size=4, device=CPU)


def test_every_owned_path_is_a_deepspeed_key_owned_by_a_group():
    assert {path.split(".", 1)[0] for path in OWNERS} <= KNOWN_TOP_LEVEL_KEYS
    assert set(OWNERS.values()) == {"zero", "offload", "comm", "precision", "train"}
    assert set(BATCH_KEYS) <= {path for path, group in OWNERS.items() if group == "train"}


# --------------------------------------------------------------------------- the key list itself
def test_every_known_top_level_key_is_read_somewhere_in_deepspeed():
    import deepspeed

    source = "\n".join(path.read_text(errors="ignore") for path in Path(deepspeed.__file__).parent.rglob("*.py"))
    missing = [key for key in KNOWN_TOP_LEVEL_KEYS if f'"{key}"' not in source and f"'{key}'" not in source]
    assert not missing
