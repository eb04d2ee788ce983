"""Weights & Biases logging for the training job: rank 0 only, never fatal.

What lives here and why:

- `resolve_mode` decides online / offline / disabled without touching the network, so a job on a
  machine without credentials or without internet never prompts and never hangs.
- `redact`, `run_name`, `tags_from_choices` turn the Hydra job into what W&B shows: a secret-free
  config, a readable run name from the overrides, and one tag per config-group choice (filterable in
  the W&B UI, e.g. ``zero=stage3``).
- `WandbRun` wraps one W&B run. Its methods swallow W&B problems (a warning, then it disables
  itself): losing the dashboard is never a reason to lose a training run.

How runs are laid out:

- ``wandb.init(dir=run_dir)``: the W&B files live in ``run_dir/wandb/`` next to the Hydra outputs;
  an offline run is ``run_dir/wandb/offline-run-<time>-<id>/`` and uploads later with ``wandb sync``.
- The run id is stored in ``run_dir/wandb_run_id``; starting again with that id (``resume="allow"``)
  continues the same W&B run. Offline, every resumed segment gets its own directory with the same id.
- Metrics are plotted against ``trainer/step`` (the optimizer step), logged as a value with every
  call, not as W&B's internal ``_step``: that one must increase per process and restarts at 0 in a
  resumed offline segment.
- ``ds_config.json`` and ``.hydra/config.yaml`` are saved with the run (redacted copies written into
  the run's files directory, as ``ds_config.json`` and ``hydra_config.yaml``; W&B keeps its own
  ``config.yaml`` there).

Costs measured on a 2-core CPU machine (wandb 0.31): offline init about 0.5 s, plus about 0.5 s to
import wandb; an unreachable server with the default init_timeout of 30 s costs about 40 s before the
offline fallback starts (the login and resume checks each wait).

The module imports neither torch nor wandb at import time; wandb is imported inside `WandbRun.start`.
"""

from __future__ import annotations

import json
import logging
import math
import netrc
import os
import re
import secrets
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from launcher.core.logs import FILE_ONLY

log = logging.getLogger(__name__)

MODES = ("auto", "online", "offline", "disabled")
STEP_METRIC = "trainer/step"
METRIC_NAMESPACES = ("train", "eval", "perf", "mem")
RUN_ID_FILE = "wandb_run_id"
REDACTED = "<redacted>"
DEFAULT_INIT_TIMEOUT_S = 30.0

# Hosts whose ~/.netrc entry means "logged in". W&B 0.31 defaults to the CoreWeave Forge endpoint,
# which accepts the same keys as api.wandb.ai; WANDB_BASE_URL adds a self-hosted server.
_KNOWN_HOSTS = ("api.wandb.ai", "api.forge.coreweave.com")
_TRUE = {"1", "true", "yes", "on"}
_ENV_MODE_ALIASES = {"online": "online", "run": "online", "offline": "offline", "dryrun": "offline"}


# --------------------------------------------------------------------------------------------------
# Mode and credentials (pure / no network)


def resolve_mode(requested: str, env: Mapping[str, str], has_credentials: bool) -> str:
    """Return the W&B mode to use: "online", "offline" or "disabled".

    "auto" defers to W&B's own variables (WANDB_MODE, WANDB_DISABLED) and otherwise goes online only
    when credentials exist, so a machine that is not logged in logs offline instead of prompting.
    An explicit "online"/"offline" wins over WANDB_MODE, except that the environment asking to
    disable W&B (WANDB_MODE=disabled or WANDB_DISABLED=true) always wins: turning logging off is
    never harmful, and it is how CI and tests mute W&B.
    """
    if requested not in MODES:
        raise ValueError(f"wandb mode {requested!r} is not one of {', '.join(MODES)}")
    env_mode = env.get("WANDB_MODE", "").strip().lower()
    if env_mode == "disabled" or env.get("WANDB_DISABLED", "").strip().lower() in _TRUE:
        return "disabled"
    if requested != "auto":
        return requested
    if env_mode in _ENV_MODE_ALIASES:
        return _ENV_MODE_ALIASES[env_mode]
    return "online" if has_credentials else "offline"


def has_credentials(env: Mapping[str, str] | None = None) -> bool:
    """True when W&B would find an API key without asking: WANDB_API_KEY, or a netrc entry.

    Reads the environment and the netrc file named by NETRC (default ~/.netrc) only; no network.
    """
    env = os.environ if env is None else env
    if env.get("WANDB_API_KEY", "").strip():
        return True
    path = Path(env.get("NETRC") or Path.home() / ".netrc").expanduser()
    try:
        entries = netrc.netrc(str(path))
    except (OSError, netrc.NetrcParseError):
        return False
    hosts = list(_KNOWN_HOSTS)
    base_url = env.get("WANDB_BASE_URL", "").strip()
    if base_url:
        hosts.insert(0, urlsplit(base_url).netloc or base_url)
    for host in hosts:
        auth = entries.authenticators(host)
        if auth and auth[2]:
            return True
    return False


# --------------------------------------------------------------------------------------------------
# Redaction, names, tags

# Keys whose values are secrets. Matching is on the lower-cased key. "token" alone is too broad
# (pad_token_id, max_tokens, tokens_per_sec are config, not secrets), so token keys are matched by
# suffix and the tokenizer's special tokens are excused.
_SECRET_WORDS = ("password", "passwd", "secret", "apikey", "api_key", "private_key", "credential")
_SECRET_KEY_PREFIXES = ("api", "wandb", "access", "private", "secret", "hf", "auth", "openai", "ssh")
_SPECIAL_TOKEN_KEYS = re.compile(
    r"^(pad|bos|eos|unk|sep|cls|mask|image|video|audio|boi|eoi|boa|eoa|start|end|additional_special)"
    r"_token$"
)
# Values that look like credentials whatever their key (HF, GitHub, OpenAI-style, W&B v1 keys).
_SECRET_VALUE = re.compile(r"^(hf_[A-Za-z0-9]{20,}|gh[pousr]_[A-Za-z0-9]{20,}|sk-[A-Za-z0-9_-]{20,}|wandb_v1_\S+)$")


def is_secret_key(key: object) -> bool:
    """True when a config key names a secret (api_key, hf_token, wandb_key, password, ...)."""
    k = str(key).strip().lower().replace("-", "_").rsplit(".", 1)[-1]
    if any(word in k for word in _SECRET_WORDS):
        return True
    if k == "token" or (k.endswith("token") and not _SPECIAL_TOKEN_KEYS.match(k)):
        return True
    if k.endswith("_key"):
        return k[: -len("_key")].rsplit("_", 1)[-1] in _SECRET_KEY_PREFIXES
    return k in {"key", "auth", "authorization"}


def redact(obj: Any) -> Any:
    """Return a copy of a nested config with secret values replaced by "<redacted>".

    Secrets are recognised by key (see `is_secret_key`) and by the shape of string values (HF,
    GitHub, OpenAI-style tokens); override-like strings (``hf_token=abc``) keep only their key. So
    secrets never reach the logged config, the run summary or the saved files.
    """
    if isinstance(obj, Mapping):
        return {k: REDACTED if is_secret_key(k) and v is not None else redact(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [redact(v) for v in obj]
    if isinstance(obj, str):
        if _SECRET_VALUE.match(obj.strip()):
            return REDACTED
        # Override-like strings ("hf_token=abc", e.g. in a list of Hydra overrides).
        return redact_override(obj) if "=" in obj else obj
    return obj


def redact_override(override: str) -> str:
    """Redact the value of one Hydra override string (``hf_token=abc`` -> ``hf_token=<redacted>``)."""
    key, sep, value = override.partition("=")
    if not sep:
        return override
    if is_secret_key(key.lstrip("+~")) or _SECRET_VALUE.match(value.strip()):
        return f"{key}={REDACTED}"
    return override


# Overrides that say nothing about the experiment: Hydra's own settings, paths and W&B settings.
_NOISY_OVERRIDE_ROOTS = ("hydra", "paths", "wandb", "logger")
_NOISY_OVERRIDE_WORDS = ("dir", "path", "file", "root", "url")
_MAX_NAME_LEN = 128
_MAX_TAG_LEN = 64


def _override_key(override: str) -> str:
    return override.partition("=")[0].lstrip("+~").strip()


def _is_noisy_override(key: str) -> bool:
    parts = re.split(r"[./]", key)
    if parts[0] in _NOISY_OVERRIDE_ROOTS:
        return True
    last = parts[-1].lower()
    return is_secret_key(last) or any(word in last for word in _NOISY_OVERRIDE_WORDS)


def experiment_overrides(overrides: Sequence[str]) -> list[str]:
    """The overrides that describe the experiment, as ``key=value`` without Hydra's +/++/~ prefixes.

    Hydra settings (hydra.*), paths, W&B settings and secrets are left out: they differ between
    runs without changing what is measured, or must not be shown.
    """
    return [o.lstrip("+~").strip() for o in overrides if "=" in o and not _is_noisy_override(_override_key(o))]


def run_name(overrides: Sequence[str]) -> str:
    """A readable run name from Hydra overrides: ``deepspeed=z3_offload,precision=bf16``.

    Sorted so the same configuration always gets the same name; see `experiment_overrides` for
    what is left out. No overrides gives "default".
    """
    name = ",".join(sorted(experiment_overrides(overrides))) or "default"
    return name if len(name) <= _MAX_NAME_LEN else name[: _MAX_NAME_LEN - 3] + "..."


# The groups that decide speed and memory come first, in the order a person reads a configuration.
GROUP_ORDER = ("deepspeed", "zero", "offload", "precision", "comm", "model", "data")


def tags_from_choices(choices: Mapping[str, Any]) -> list[str]:
    """One ``group=choice`` tag per selected config group (Hydra's runtime choices).

    Hydra's own groups (``hydra/...``) and unselected groups are skipped; the DeepSpeed preset is
    included when one was used.
    """
    keys = [k for k in GROUP_ORDER if k in choices]
    keys += sorted(k for k in choices if k not in GROUP_ORDER)
    tags = []
    for key in keys:
        value = choices[key]
        if value is None or str(key).startswith("hydra"):
            continue
        tags.append(f"{key}={value}"[:_MAX_TAG_LEN])
    return tags


# --------------------------------------------------------------------------------------------------
# Provenance helpers (never raise)

_VERSIONED_PACKAGES = (
    "torch",
    "deepspeed",
    "transformers",
    "tokenizers",
    "hydra-core",
    "omegaconf",
    "wandb",
    "numpy",
)


def library_versions() -> dict[str, str]:
    """Versions of Python and the libraries that decide a run's behaviour (no imports, never raises)."""
    import importlib.metadata

    versions = {"python": sys.version.split()[0]}
    for package in _VERSIONED_PACKAGES:
        try:
            versions[package] = importlib.metadata.version(package)
        except Exception:
            versions[package] = "not installed"
    return versions


def git_commit(repo_dir: Path | str | None = None) -> str | None:
    """The current git commit of repo_dir (default: this package), "+dirty" when tracked files changed.

    None outside a git checkout or without git; never raises.
    """
    cwd = Path(repo_dir) if repo_dir is not None else Path(__file__).resolve().parent
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, timeout=5, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "diff", "--quiet", "HEAD", "--"], cwd=cwd, capture_output=True, timeout=5
        ).returncode
    except Exception:
        return None
    if not sha:
        return None
    return f"{sha}+dirty" if dirty == 1 else sha


def read_run_id(run_dir: Path | str) -> str | None:
    """The W&B run id stored in run_dir by an earlier start, or None."""
    try:
        text = (Path(run_dir) / RUN_ID_FILE).read_text().strip()
    except OSError:
        return None
    return text or None


def _new_run_id() -> str:
    alphabet = "abcdefghijklmnopqrstuvwxyz0123456789"
    return "".join(secrets.choice(alphabet) for _ in range(8))


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")


@contextmanager
def _redacted_argv() -> Iterator[None]:
    """W&B records sys.argv in the run's metadata; hide secret overrides given on the command line."""
    saved = sys.argv[:]
    sys.argv = saved[:1] + [redact_override(a) for a in saved[1:]]
    try:
        yield
    finally:
        sys.argv = saved


# --------------------------------------------------------------------------------------------------
# The run


class HistoryWindow:
    """Which steps W&B's history gets, and what: a row at step 1, every `every` steps, on evaluation
    steps and when flushed at the end. Each row holds the mean over the steps since the previous row
    of the per-step quantities (loss, gradient norm, throughput, step time, CPU time) and the latest
    value of the rest (learning rate, peak memory, cumulative counts). metrics.jsonl keeps every step.

    Why not every step: one W&B log call cost ~1 ms of a rank's CPU (under cProfile) and more in W&B's
    service process, several % of a small model's step (BENCHMARKS.md, launcher overhead); the mean
    over the window also shows the trend with less noise, as the HF Trainer's logging_steps does."""

    MEAN_PREFIXES = ("train/loss", "train/grad_norm", "perf/")

    def __init__(self, every: int) -> None:
        self.every = max(1, int(every))
        self.step: int | None = None  # the step a row logged now is logged at
        self._rows: list[Mapping[str, Any]] = []

    def add(self, step: int, metrics: Mapping[str, Any]) -> dict[str, Any] | None:
        """Take one step's metrics; the row to log at this step, or None."""
        self._rows.append(metrics)
        self.step = step
        if step == 1 or step % self.every == 0 or any(key.startswith("eval/") for key in metrics):
            return self.flush()
        return None

    def flush(self) -> dict[str, Any] | None:
        """The row of the steps taken since the last row (None when there are none)."""
        rows, self._rows = self._rows, []
        if not rows:
            return None
        keys = dict.fromkeys(key for row in rows for key in row)
        merged: dict[str, Any] = {}
        for key in keys:
            values = [row[key] for row in rows if key in row]
            mean = key.startswith(self.MEAN_PREFIXES) and all(isinstance(v, int | float) for v in values)
            merged[key] = sum(values) / len(values) if mean else values[-1]
        return merged


class WandbRun:
    """One W&B run of the training job, safe to use whatever W&B does.

    Build it with `WandbRun.start`. When W&B is disabled, or fails, every method is a no-op, so the
    training loop calls `log`/`finish` unconditionally (on rank 0).
    """

    def __init__(self, run: Any, run_dir: Path, mode: str) -> None:
        self._run = run
        self.run_dir = run_dir
        self.mode = mode if run is not None else "disabled"
        self.run_id: str | None = getattr(run, "id", None)
        self.sync_dir: Path | None = None
        self.url: str | None = None
        if run is not None and self.mode == "online":
            with suppress(Exception):
                self.url = run.url
        if run is not None:
            try:
                self.sync_dir = Path(run.settings.sync_dir)
            except Exception:
                self.sync_dir = None

    @property
    def enabled(self) -> bool:
        return self._run is not None

    @classmethod
    def start(
        cls,
        run_dir: Path | str,
        *,
        project: str,
        mode: str,
        entity: str | None = None,
        group: str | None = None,
        name: str | None = None,
        tags: Sequence[str] = (),
        config: Mapping[str, Any] | None = None,
        resume_id: str | None = None,
        init_timeout_s: float = DEFAULT_INIT_TIMEOUT_S,
    ) -> WandbRun:
        """Start (or resume) the W&B run of the job whose outputs are in run_dir.

        mode is a resolved mode (see `resolve_mode`). Online without credentials, or an online init
        that fails or exceeds init_timeout_s, falls back to offline with a one-line warning. The run
        id is resume_id, else the id stored in run_dir, else a new one; it is written to
        run_dir/wandb_run_id. config is redacted before it is logged. Never raises for W&B problems.
        """
        run_dir = Path(run_dir)
        if mode not in ("online", "offline", "disabled"):
            raise ValueError(f"wandb mode {mode!r} must be resolved first (online, offline or disabled)")
        if mode == "disabled":
            return cls(None, run_dir, "disabled")
        try:
            import wandb
        except Exception as exc:
            log.warning("W&B logging disabled: cannot import wandb (%s)", _one_line(exc))
            return cls(None, run_dir, "disabled")

        kwargs = {
            "project": project,
            "entity": entity or None,
            "group": group,
            "name": name,
            "tags": list(tags),
            "job_type": "train",
        }
        try:
            kwargs["config"] = redact(dict(config or {}))
            return cls._start(wandb, run_dir, mode, resume_id, init_timeout_s, init_kwargs=kwargs)
        except Exception as exc:
            log.warning("W&B logging disabled: %s", _one_line(exc))
            return cls(None, run_dir, "disabled")

    @classmethod
    def _start(
        cls,
        wandb: Any,
        run_dir: Path,
        mode: str,
        resume_id: str | None,
        init_timeout_s: float,
        init_kwargs: dict[str, Any],
    ) -> WandbRun:
        run_id = resume_id or read_run_id(run_dir) or _new_run_id()
        if mode == "online" and not has_credentials():
            log.warning("W&B mode online but no credentials (WANDB_API_KEY or ~/.netrc): logging offline")
            mode = "offline"
        run_dir.mkdir(parents=True, exist_ok=True)
        init_kwargs = {**init_kwargs, "dir": str(run_dir), "id": run_id, "resume": "allow"}

        run = None
        started = time.perf_counter()
        if mode == "online":
            run = cls._init(wandb, "online", init_timeout_s, init_kwargs)
            if run is None:
                mode = "offline"
                # The failed online attempt still holds the run id in W&B's service process; shut
                # it down so the offline run can take the same id.
                with suppress(Exception):
                    wandb.teardown()
        if run is None:
            run = cls._init(wandb, "offline", init_timeout_s, init_kwargs)
        if run is None:
            return cls(None, run_dir, "disabled")
        self = cls(run, run_dir, mode)
        seconds = time.perf_counter() - started
        if self.url:  # online: where to watch it, on the terminal; offline, the run summary names the run
            log.info("W&B online run %s started in %.1f s: %s", run.id, seconds, self.url)
        else:
            log.info("W&B %s run %s started in %.1f s", mode, run.id, seconds, extra=FILE_ONLY)
        try:
            (run_dir / RUN_ID_FILE).write_text(f"{run.id}\n")
            run.define_metric(STEP_METRIC)
            for namespace in METRIC_NAMESPACES:
                run.define_metric(f"{namespace}/*", step_metric=STEP_METRIC)
            self._save_job_files()
        except Exception as exc:
            self._disable("setting up the run", exc)
        return self

    @staticmethod
    def _init(wandb: Any, mode: str, init_timeout_s: float, init_kwargs: dict[str, Any]) -> Any:
        try:
            # Silent: W&B's own lines (its banner, the history and summary block at the end) would outnumber
            # the run's; the launcher says where the run is (launcher.logs). WANDB_SILENT=false shows them.
            silent = os.environ.get("WANDB_SILENT", "true").strip().lower() not in ("false", "0", "no")
            settings = wandb.Settings(init_timeout=init_timeout_s, silent=silent)
            with _redacted_argv():
                return wandb.init(mode=mode, settings=settings, **init_kwargs)
        except Exception as exc:
            fallback = "logging offline instead" if mode == "online" else "W&B logging disabled"
            log.warning("W&B %s init failed (%s); %s", mode, _one_line(exc), fallback)
            return None

    def _save_job_files(self) -> None:
        """Attach redacted copies of the DeepSpeed dict and the resolved Hydra config to the run."""
        files_dir = Path(self._run.dir)
        copies = {
            "ds_config.json": self.run_dir / "ds_config.json",
            "hydra_config.yaml": self.run_dir / ".hydra" / "config.yaml",
        }
        for name, src in copies.items():
            if not src.is_file():
                continue
            try:
                if src.suffix == ".json":
                    text = json.dumps(redact(json.loads(src.read_text())), indent=2) + "\n"
                else:
                    import yaml

                    text = yaml.safe_dump(redact(yaml.safe_load(src.read_text())), sort_keys=False)
            except Exception as exc:
                # An unreadable file is not copied raw: it could hold a secret.
                log.warning("W&B: not saving %s (%s)", src, _one_line(exc))
                continue
            dst = files_dir / name
            dst.write_text(text)
            self._run.save(str(dst), base_path=str(files_dir), policy="now")

    def _disable(self, doing: str, exc: BaseException) -> None:
        log.warning("W&B logging disabled after an error while %s: %s", doing, _one_line(exc))
        run, self._run = self._run, None
        if run is not None:
            with suppress(Exception):
                run.finish(exit_code=1)

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        """Log metrics (train/, eval/, perf/, mem/ keys) at training step `step`."""
        if self._run is None:
            return
        try:
            self._run.log({**metrics, STEP_METRIC: int(step)})
        except Exception as exc:
            self._disable("logging metrics", exc)

    def log_table(self, key: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
        """Log a W&B Table (the autotuner's candidates)."""
        if self._run is None:
            return
        try:
            import wandb

            self._run.log({key: wandb.Table(columns=list(columns), data=[list(row) for row in rows])})
        except Exception as exc:
            self._disable("logging a table", exc)

    def log_image(self, key: str, path: Path) -> None:
        """Log a picture file (the autotuner's throughput against memory)."""
        if self._run is None:
            return
        try:
            import wandb

            self._run.log({key: wandb.Image(str(path))})
        except Exception as exc:
            self._disable("logging an image", exc)

    def finish(self, summary: Mapping[str, Any] | None = None, exit_code: int = 0, *, hint: bool = True) -> None:
        """Put the job's summary figures (summary.json's keys) into the run summary and finish.

        Offline, prints one line saying how to upload the run (unless `hint` is false). Safe to call twice.
        """
        if self._run is None:
            return
        run, self._run = self._run, None
        try:
            figures = redact({k: v for k, v in (summary or {}).items() if v is not None})
            figures = {k: v for k, v in figures.items() if not (isinstance(v, float) and math.isnan(v))}
            run.summary.update(figures)
            run.finish(exit_code=exit_code)
        except Exception as exc:
            log.warning("W&B finish failed: %s", _one_line(exc))
            return
        if hint and self.mode == "offline" and self.sync_dir is not None:
            print(self.sync_hint(), flush=True)

    def describe(self) -> str:
        """One line for the run summary: the online run's address, or how to upload the offline run."""
        if self.url:
            return f"online run {self.run_id}: {self.url}"
        if self.sync_dir is None:
            return f"{self.mode} run {self.run_id}"
        return self.sync_hint().removeprefix("W&B ")

    def sync_hint(self) -> str:
        """The one-line command that uploads this offline run (all its resumed segments in run_dir)."""
        # W&B names segments offline-run-<date>_<time>-<id>, adding -1, -2... within the same second.
        pattern = re.compile(rf"offline-run-\d{{8}}_\d{{6}}-{re.escape(str(self.run_id))}(-\d+)?")
        target = str(self.sync_dir)
        if self.sync_dir is not None:
            parent = self.sync_dir.parent
            if sum(1 for p in parent.iterdir() if pattern.fullmatch(p.name)) > 1:
                target = f"{parent}/offline-run-*-{self.run_id}*"
        return f"W&B offline run {self.run_id}: upload with `wandb sync {target}`"


# --------------------------------------------------------------------------------------------------
# The job's run


def job_config(cfg: Mapping[str, Any], job: Mapping[str, Any], ds_config: Mapping[str, Any]) -> dict[str, Any]:
    """The config W&B records for a job: the resolved Hydra config plus what the job derived.

    The final DeepSpeed dict is nested under "deepspeed" (so runs group by
    deepspeed.zero_optimization.stage); the preset's name stays in the tags and summary.
    """
    return {
        **cfg,
        "deepspeed": dict(ds_config),
        "world_size": job.get("world_size"),
        "effective_batch": {
            "train_batch_size": ds_config.get("train_batch_size"),
            "micro_batch_per_gpu": ds_config.get("train_micro_batch_size_per_gpu"),
            "gradient_accumulation_steps": ds_config.get("gradient_accumulation_steps"),
        },
        "job": {k: job.get(k) for k in ("hidden_size", "device", "multirun", "overrides", "choices")},
        "versions": library_versions(),
        "git_commit": git_commit(),
    }


def start_for_job(
    *,
    cfg: Mapping[str, Any],
    run_dir: Path | str,
    job: Mapping[str, Any],
    ds_config: Mapping[str, Any],
    summary: Mapping[str, Any] | None = None,
    resume_id: str | None = None,
) -> WandbRun | None:
    """Start the W&B run of a training job on rank 0; None when W&B ends up disabled.

    cfg is the resolved Hydra config as a plain dict (its "logger" node gives project, entity and
    mode); job is the launcher's job.json (group, overrides, choices, world_size). summary is
    accepted for symmetry with `WandbRun.finish` and not logged at start.
    """
    logger_cfg = dict(cfg.get("logger") or {})
    mode = resolve_mode(str(logger_cfg.get("mode") or "auto"), os.environ, has_credentials())
    run = WandbRun.start(
        run_dir,
        project=str(logger_cfg.get("project") or "vlm-ds-launcher"),
        entity=logger_cfg.get("entity"),
        mode=mode,
        group=job.get("group"),
        name=run_name(job.get("overrides") or []),
        tags=[*tags_from_choices(job.get("choices") or {}), *(logger_cfg.get("tags") or [])],
        config=job_config(cfg, job, ds_config),
        resume_id=resume_id,
    )
    return run if run.enabled else None
