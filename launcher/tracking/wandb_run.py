"""One W&B run per training job: rank 0 only, never fatal.

- `WandbRun` wraps one W&B run. Its methods swallow W&B problems (a warning, then it disables
  itself): losing the dashboard is never a reason to lose a training run. What it logs is redacted
  (launcher.core.credentials); its mode, name and tags come from launcher.tracking.naming.

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

from launcher.config.schema import plain
from launcher.core.credentials import redact, redact_override
from launcher.core.errors import one_line
from launcher.core.logs import FILE_ONLY
from launcher.core.rundir import RunDir
from launcher.job.spec import Job
from launcher.tracking.naming import has_credentials, resolve_mode, run_name, tags_from_choices

log = logging.getLogger(__name__)


STEP_METRIC = "trainer/step"


METRIC_NAMESPACES = ("train", "eval", "perf", "mem")


DEFAULT_INIT_TIMEOUT_S = 30.0


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
        text = RunDir(Path(run_dir)).wandb_run_id.read_text().strip()
    except OSError:
        return None
    return text or None


def _new_run_id() -> str:
    alphabet = "abcdefghijklmnopqrstuvwxyz0123456789"
    return "".join(secrets.choice(alphabet) for _ in range(8))


@contextmanager
def _redacted_argv() -> Iterator[None]:
    """W&B records sys.argv in the run's metadata; hide secret overrides given on the command line."""
    saved = sys.argv[:]
    sys.argv = saved[:1] + [redact_override(a) for a in saved[1:]]
    try:
        yield
    finally:
        sys.argv = saved


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
            log.warning("W&B logging disabled: cannot import wandb (%s)", one_line(exc, named=True))
            return cls(None, run_dir, "disabled")

        kwargs = {
            "project": project,
            "entity": entity or None,
            "group": group,
            "name": name,
            "tags": [str(tag) for tag in redact(list(tags))],  # a token given as a tag stays out of W&B
            "job_type": "train",
        }
        try:
            kwargs["config"] = redact(dict(config or {}))
            return cls._start(wandb, run_dir, mode, resume_id, init_timeout_s, init_kwargs=kwargs)
        except Exception as exc:
            log.warning("W&B logging disabled: %s", one_line(exc, named=True))
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
            RunDir(run_dir).wandb_run_id.write_text(f"{run.id}\n")
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
            log.warning("W&B %s init failed (%s); %s", mode, one_line(exc, named=True), fallback)
            return None

    def _save_job_files(self) -> None:
        """Attach redacted copies of the DeepSpeed dict and the resolved Hydra config to the run."""
        files_dir = Path(self._run.dir)
        copies = {
            "ds_config.json": RunDir(self.run_dir).ds_config,
            "hydra_config.yaml": RunDir(self.run_dir).config,
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
                log.warning("W&B: not saving %s (%s)", src, one_line(exc, named=True))
                continue
            dst = files_dir / name
            dst.write_text(text)
            self._run.save(str(dst), base_path=str(files_dir), policy="now")

    def _disable(self, doing: str, exc: BaseException) -> None:
        log.warning("W&B logging disabled after an error while %s: %s", doing, one_line(exc, named=True))
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
            log.warning("W&B finish failed: %s", one_line(exc, named=True))
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


def job_config(job: Job) -> dict[str, Any]:
    """The config W&B records for a job: the resolved config plus what the launcher derived.

    The final DeepSpeed dict is nested under "deepspeed" (so runs group by
    deepspeed.zero_optimization.stage); the preset's name stays in the tags and summary."""
    ds_config = job.ds_config
    return {
        **plain(job.config),
        "deepspeed": dict(ds_config),
        "world_size": job.world_size,
        "effective_batch": {
            "train_batch_size": ds_config.get("train_batch_size"),
            "micro_batch_per_gpu": ds_config.get("train_micro_batch_size_per_gpu"),
            "gradient_accumulation_steps": ds_config.get("gradient_accumulation_steps"),
        },
        "job": {
            "hidden_size": job.hidden_size,
            "device": job.device.kind,
            "multirun": job.hydra.multirun,
            "overrides": list(job.hydra.overrides),
            "choices": job.labels,
        },
        "versions": library_versions(),
        "git_commit": git_commit(),
    }


def start_for_job(job: Job, *, resume_id: str | None = None) -> WandbRun | None:
    """Start (or, with `resume_id`, continue) the W&B run of a training job on rank 0; None when W&B
    ends up disabled. Its project, entity, mode and tags come from the job's logger config."""
    logger = job.config.logger
    mode = resolve_mode(str(logger.mode), os.environ, has_credentials())
    run = WandbRun.start(
        job.run_dir,
        project=str(logger.project or "vlm-ds-launcher"),
        entity=logger.entity,
        mode=mode,
        group=job.hydra.group,
        name=run_name(job.hydra.overrides),
        tags=[*tags_from_choices(job.labels), *logger.tags],
        config=job_config(job),
        resume_id=resume_id,
    )
    return run if run.enabled else None
