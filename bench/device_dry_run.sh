#!/usr/bin/env bash
# Acceptance check for the GPU machine's install step, here on CPU: in a clean Python 3.12 venv that
# holds what the nvidia-h200 image holds (torch 2.11.0 from PyPI, i.e. its CUDA build, which imports
# without a GPU; transformers 5.17.0, hub 1.33.0, tokenizers 0.23.2, ...), run bench/device_install.sh
# exactly as there (--target, --no-index, no pip config), then with its PYTHONPATH:
#   (a) import hydra, omegaconf, deepspeed, transformers (the carried 5.24 must win), datasets, peft,
#       bitsandbytes/wandb when carried, launcher.launch.run, launcher.train.trainer: versions and paths;
#   (b) python train.py train.max_steps=3 logger=none: exit 0 and summary.json (CPU, tiny model; may
#       JIT-build a DeepSpeed op into DIR/torch_extensions);
#   (c) python -m pytest -m gpu -q --co collects tests/gpu/test_cuda.py;
#   (d) DeepSpeed JIT-builds cpu_adam from the --target install's sources (60-75 s on 2 cores, every run:
#       the fresh install renews the sources' mtimes, so ninja rebuilds; fused_adam needs a GPU).
#
#   bash bench/device_wheels.sh && bash bench/device_dry_run.sh [DIR]   # DIR: /tmp/vlm-device-dry-run
#
# The venv (DIR/venv, ~5 GB) is made once, ~2 min; REFRESH=1 makes it again. A rerun takes ~2 min.
# Fresh each run, as on a bare machine: DIR/site, DIR/run, and the launcher's cache (VLM_LAUNCHER_CACHE=DIR/cache).
# Image packages whose version nobody has read there get the project venv's version as a stand-in.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
DIR=${1:-/tmp/vlm-device-dry-run}
PY312=${PY312:-/root/.pyenv/versions/3.12.1/bin/python3}
VENV=$DIR/venv
# Read on the machine (KINDS.md): exact versions.
IMAGE_KNOWN=(torch==2.11.0 torchvision==0.26.0 triton==3.6.0 numpy==2.5.2 transformers==5.17.0 tokenizers==0.23.2
             huggingface_hub==1.33.0 accelerate==1.15.0 safetensors==0.8.0 sentencepiece==0.2.2)
# In the image, version not read: the project venv's versions (peft, nvidia-ml-py, pytest-timeout: any).
IMAGE_OTHER=(pyarrow==26.0.1 pandas==3.1.1 fsspec==2026.9.0 xxhash==4.1.0 pillow==13.0.0 matplotlib==3.11.2
             psutil==7.2.2 py-cpuinfo==9.0.0 msgpack==1.2.4 ninja==1.13.2 einops==0.8.2 packaging==26.4
             pyyaml==6.0.4 regex==2026.11.19 requests==2.34.2 tqdm==4.70.1 filelock==4.3.1 jinja2==3.1.6
             typer==0.29.2 click==8.5.1 scipy==1.17.1 joblib==1.6.0 cloudpickle==3.1.3 markupsafe==3.0.4
             pygments==2.21.0 markdown-it-py==4.3.0 httpx==0.28.1 anyio==4.16.0 hf-xet==1.8.0 protobuf==7.36.2
             pytest==9.2.0 pytest-xdist==3.8.0 pytest-timeout nvidia-ml-py peft)

mkdir -p "$DIR"
if [[ ${REFRESH:-0} == 1 || ! -f $VENV/.image-ready ]]; then
  echo "== venv $VENV: the image's packages from PyPI"
  "$PY312" -m venv --clear "$VENV" || exit 1
  "$VENV/bin/python" -m pip install -q "${IMAGE_KNOWN[@]}" "${IMAGE_OTHER[@]}" 2>&1 | grep -v 'is ignored: it is neither'
  [[ ${PIPESTATUS[0]} == 0 ]] || { echo "FAIL: venv install"; exit 1; }
  touch "$VENV/.image-ready"
fi
export PATH=$VENV/bin:$PATH   # python3 is the venv's, as on the machine (/opt/torch/.venv/bin/python3)

declare -A RESULT
echo "== install (bench/device_install.sh $DIR/site, no index, no pip config)"
rm -rf "$DIR/site"
out=$(env -u PIP_FIND_LINKS -u PIP_CONSTRAINT PIP_CONFIG_FILE=/dev/null bash bench/device_install.sh "$DIR/site")
rc=$?
echo "$out"
line=$(grep '^export PYTHONPATH=' <<< "$out")
if [[ $rc == 0 && -n $line ]]; then RESULT[install]=PASS; eval "$line"; else RESULT[install]="FAIL (rc $rc)"; fi
export HF_HUB_OFFLINE=1 WANDB_MODE=disabled   # no network there
export TORCH_EXTENSIONS_DIR=$DIR/torch_extensions VLM_LAUNCHER_CACHE=$DIR/cache
rm -rf "$VLM_LAUNCHER_CACHE"

echo "== (a) imports"
python3 - "$DIR/site" "$ROOT" <<'EOF'
import importlib, importlib.util, os, sys
site, root = sys.argv[1:]
wanted = ["hydra", "omegaconf", "deepspeed", "transformers", "datasets", "peft", "pydantic", "optuna", "submitit",
          "torch", "tokenizers", "huggingface_hub", "accelerate", "launcher.launch.run", "launcher.train.trainer"]
wanted += [m for m in ("bitsandbytes", "wandb") if os.path.isdir(os.path.join(site, m))]
bad = []
for name in wanted:
    try:
        m = importlib.import_module(name)
    except Exception as e:
        bad.append(name)
        print(f"  {name:16} FAILED: {type(e).__name__}: {e}")
        continue
    print(f"  {name:16} {getattr(m, '__version__', '')!s:14} {m.__file__}")
    expect = root if name.startswith("launcher") else site if name in ("transformers", "deepspeed", "hydra") else None
    if expect and not m.__file__.startswith(expect + os.sep):
        bad.append(f"{name} not from {expect}")
import transformers, deepspeed.git_version_info as g
if transformers.__version__ != "5.24.0":
    bad.append(f"transformers {transformers.__version__}, not the carried 5.24.0")
print(f"  deepspeed record: accelerator_name={g.accelerator_name!r} torch_info={g.torch_info}")
if bad:
    sys.exit("  bad: " + ", ".join(bad))
EOF
[[ $? == 0 ]] && RESULT[imports]=PASS || RESULT[imports]=FAIL

echo "== (b) python train.py train.max_steps=3 logger=none hydra.run.dir=$DIR/run"
rm -rf "$DIR/run"
start=$SECONDS
timeout 900 python3 train.py train.max_steps=3 logger=none hydra.run.dir="$DIR/run" > "$DIR/train.log" 2>&1
rc=$?
took=$((SECONDS - start))
tail -5 "$DIR/train.log"
if [[ $rc == 0 && -f $DIR/run/summary.json ]]; then RESULT[train]="PASS (exit 0, ${took}s, summary.json)"
else RESULT[train]="FAIL (exit $rc, ${took}s, summary.json $([[ -f $DIR/run/summary.json ]] && echo present || echo missing); $DIR/train.log)"; fi

echo "== (c) python -m pytest -m gpu -q --co"
python3 -m pytest -m gpu -q --co -p no:cacheprovider > "$DIR/collect.log" 2>&1
rc=$?
n=$(grep -c '::' "$DIR/collect.log")
tail -2 "$DIR/collect.log"
[[ $rc == 0 && $n -gt 0 ]] && RESULT[collect]="PASS ($n collected)" || RESULT[collect]="FAIL (exit $rc, $n collected; $DIR/collect.log)"

echo "== (d) DeepSpeed JIT: CPUAdamBuilder().load() into $TORCH_EXTENSIONS_DIR"
start=$SECONDS
python3 -c 'from deepspeed.ops.op_builder import CPUAdamBuilder; print("  ", CPUAdamBuilder().load(verbose=False).__file__)' \
  > "$DIR/jit.log" 2>&1
rc=$?
grep -v WARNING "$DIR/jit.log" | tail -2
[[ $rc == 0 ]] && RESULT[jit]="PASS ($((SECONDS - start))s)" || RESULT[jit]="FAIL (exit $rc; $DIR/jit.log)"

echo "== report ($DIR)"
status=0
for k in install imports train collect jit; do
  echo "  $k: ${RESULT[$k]:-FAIL (not run)}"
  [[ ${RESULT[$k]:-FAIL} == PASS* ]] || status=1
done
((status == 0)) && echo "PASS" || echo "FAIL"
exit $status
