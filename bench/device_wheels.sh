#!/usr/bin/env bash
# Fills .whl/ (repo root, git-ignored) with the wheels a lent GPU machine (nvidia-h200) lacks for this
# project: `python train.py`, `pytest` (tests/gpu/test_cuda.py's QLoRA case too) and the bench scripts.
#
#   bash bench/device_wheels.sh                  # about 25 s; the first run also makes the build venv (~1 min)
#   WITH_WANDB=1 bash bench/device_wheels.sh     # + wandb and its needs (+21.8 MB, see below)
#   WITH_BNB=0 bash bench/device_wheels.sh       # without bitsandbytes (QLoRA GPU tests then skip)
#   WITH_AV=1 WITH_BNB=0 bash bench/device_wheels.sh   # + PyAV, for the video rows (bench/gpu_run.py --phases video16 video64)
#
# Then carry it: the device tool's `carry: [".whl"]`, and on the machine `bash bench/device_install.sh
# /tmp/site` (the only install step; bench/device_dry_run.sh rehearses it here in a clean Python 3.12).
#
# Why: the machine has no package registry. Its image (Python 3.12.3, torch 2.11.0+cu130) has torch,
# transformers 5.17.0, huggingface_hub 1.33.0, tokenizers 0.23.2, accelerate 1.15.0, safetensors 0.8.0,
# numpy, pyarrow, pandas, pillow, matplotlib, psutil, ninja, pytest ... (KINDS.md's list, embedded in
# IMAGE below), but no hydra/omegaconf/antlr4, deepspeed/hjson, pydantic, datasets/dill/multiprocess,
# wandb, the Hydra sweeper/launcher plugins, or bitsandbytes; and the project needs transformers 5.24.
# Versions are pinned to the project's venv (.venv, pip list; bitsandbytes, not in it: PyPI's newest). The check at the end walks every
# carried wheel's Requires-Dist (no extras, markers for cp312/Linux/x86_64) and fails on a need that
# is neither carried nor in the image, or that the image's known version does not meet; a need on an
# image package whose version nobody has read there is printed as NOTE. The image's transformers 5.17
# already needs the same regex/typer/tqdm/safetensors bounds as 5.24, and hub 1.33 / tokenizers 0.23.2
# meet 5.24's (hub>=1.31,<3; tokenizers>=0.23.1,<0.24), so huggingface_hub and tokenizers stay behind.
# typing_extensions 4.16 travels because pydantic 2.14 needs >=4.16 and the image's version is unknown.
#
# Built here (source-only on PyPI): antlr4-python3-runtime 4.9.3 and deepspeed 0.19.8, both
# py3-none-any. DeepSpeed's build-time records, read in its setup.py (0.19.8) and used at run time:
#  - setup.py writes deepspeed/git_version_info_installed.py: installed_ops (ops compiled into the
#    wheel), accelerator_name (get_accelerator()._name at build time) and torch_info (torch version,
#    cuda/nccl/hip version of the build env's torch; "0.0" when no torch). compatible_ops is not
#    recorded: deepspeed.ops.__compatible_ops__ is probed at run time, on first access.
#  - The accelerator DeepSpeed uses is chosen at run time (accelerator/real_accelerator.py: DS_ACCELERATOR,
#    else torch.cuda.device_count() > 0 and is_available() -> cuda, else cpu); the record does not take
#    part. OpBuilder.load() (op_builder/builder.py) uses a prebuilt op only if installed_ops[name] is true
#    AND accelerator_name equals the run-time accelerator, and only then checks torch_info against the
#    running torch/CUDA; otherwise it JIT-builds (jit_load). With DS_BUILD_OPS=0 every installed_ops
#    entry is False, so fused_adam/cpu_adam always JIT-build there (ninja, and nvcc for fused_adam).
#  - So a plain CPU build would work on the GPU machine too, but it mis-reports: built here it records
#    accelerator_name='cpu', the CPU accelerator's op list, and torch_info of the build env (the
#    project venv's own deepspeed, built in an isolated env without torch, says torch '0.0', cuda '0.0'),
#    which ds_report (env_report.py) prints as "deepspeed wheel compiled w. torch 0.0, cuda 0.0".
#  - Hence: build with --no-build-isolation in a Python 3.12 venv holding the image's torch 2.11.0
#    (PyPI's CUDA 13.0 build, imports without a GPU) and DS_ACCELERATOR=cuda. The build succeeds here
#    (no GPU, no nvcc) and records accelerator_name='cuda', the CUDA op list (all False), and torch_info
#    {'version': '2.11', 'cuda_version': '13.0', 'nccl_version': '2.28', 'bf16_support': False (no GPU
#    here; nothing reads it)}, i.e. the H200 image's torch; Requires-Dist gains nvidia-ml-py (in the image).
#    bench/device_dry_run.sh prints the record and JIT-builds cpu_adam from such an install.
#
# Left out (measured 2026-12 here):
#  - wandb 0.31.0: its wheel is 20.3 MB (Go binary) and its needs 1.5 MB more (cwevals, distro, sniffio,
#    platformdirs, opentelemetry-* x8, googleapis-common-protos, protobuf 7). With it .whl is 53.7 MB in
#    51 wheels, without it 31.8 MB in 36; the tracked tree is 1.3 MB and a call carries 64 MiB (67.1 MB)
#    in all, so it fits but not comfortably. Without it, runs on the GPU machine use `logger=none`
#    (tests/gpu/test_cuda.py and bench/tune_gpu.sh do) and tests that need wandb fail there. WITH_WANDB=1.
#  - bitsandbytes 0.50.2's wheel (py3-none-manylinux_2_24_x86_64) is 41 MB, mostly one CUDA library per
#    CUDA version (cuda118 ... cuda132, rocm*, xpu*). It does not fit as is, so it travels re-packed
#    (`wheel unpack`/`wheel pack`, RECORD regenerated) with only libbitsandbytes_cpu.so and
#    libbitsandbytes_cuda130.so, the one it loads for torch.version.cuda 13.0 (3.6 MB). WITH_BNB=0
#    leaves it out.
#  - av 18.1.0 (PyAV, FFmpeg inside: the launcher's video decoder): its abi3 wheel is 35.8 MB. With it and
#    without bitsandbytes .whl is ~64.0 MB, under a call's 67.1 MB with the 1.3 MB tree, barely: so it
#    travels only when asked (WITH_AV=1 WITH_BNB=0), for the video rows' call. The image has no video
#    decoder (torchvision 0.26 reads video through PyAV too).
#  - flash-attn: PyPI has its sdist only (no wheel); it compiles its CUDA kernels against torch, far too
#    long for a lent machine's minutes. tests/gpu/test_cuda.py's flash-attention case skips without it.
set -euo pipefail
cd "$(dirname "$0")/.."

PY312=${PY312:-/root/.pyenv/versions/3.12.1/bin/python3}   # a clean CPython 3.12 (pip download, venv)
BUILD_VENV=${BUILD_VENV:-/tmp/vlm-wheel-build-py312}        # torch 2.11.0 (CUDA build) for DeepSpeed's records
WITH_WANDB=${WITH_WANDB:-0}
WITH_BNB=${WITH_BNB:-1}
WITH_AV=${WITH_AV:-0}
BNB_CUDA=130                                               # the image's torch.version.cuda, 13.0

# Binary wheels from PyPI, pinned to the project's venv.
CORE=(hydra-core==1.3.8 omegaconf==2.3.1 hjson==3.1.0
      pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0
      transformers==5.24.0 peft==0.21.2 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19
      liger-kernel==0.8.5)   # model.kernels=liger (0.9 MB, py3-none-any); its Triton is the image's 3.6.0
# Hydra's optuna sweeper, joblib and submitit launchers (tests/e2e/test_sweep.py, tests/e2e/test_dist.py, dist=slurm).
PLUGINS=(hydra-optuna-sweeper==1.3.0 optuna==2.10.1 alembic==1.20.1 sqlalchemy==2.1.9 mako==1.4.3 cmaes==0.13.1
         colorlog==6.12.0 cliff==4.17.0 autopage==0.6.0 cmd2==4.3.1 prompt-toolkit==3.0.53 rich==15.0.0
         rich-argparse==1.8.0 pyperclip==1.11.0 prettytable==3.18.0 wcwidth==0.9.4 stevedore==5.10.0
         hydra-joblib-launcher==1.2.0 hydra-submitit-launcher==1.2.0 submitit==1.5.4)
WANDB=(wandb==0.31.0 cwevals==0.0.1b1 distro==1.9.0 sniffio==1.3.1 platformdirs==4.14.9 protobuf==7.36.2
       opentelemetry-api==1.45.2 opentelemetry-sdk==1.45.2 opentelemetry-exporter-otlp-proto-http==1.45.2
       opentelemetry-exporter-otlp-proto-common==1.45.2 opentelemetry-proto==1.45.2
       opentelemetry-semantic-conventions==0.66b2 opentelemetry-exporter-http-transport==0.66b2
       opentelemetry-exporter-otlp-common==0.66b2 googleapis-common-protos==1.76.0)
BNB=(bitsandbytes==0.50.2)
AV=(av==18.1.0)
# Source-only on PyPI: built below.
SDISTS=(antlr4-python3-runtime==4.9.3 deepspeed==0.19.8)

WANT=("${CORE[@]}" "${PLUGINS[@]}")
[[ $WITH_WANDB == 1 ]] && WANT+=("${WANDB[@]}")
[[ $WITH_BNB == 1 ]] && WANT+=("${BNB[@]}")
[[ $WITH_AV == 1 ]] && WANT+=("${AV[@]}")

WORK=$(mktemp -d /tmp/device-wheels.XXXXXX)
trap 'rm -rf "$WORK"' EXIT

# 1. The build venv: CPython 3.12 + the image's torch (its CUDA 13.0 build; no GPU needed to import it).
if ! "$BUILD_VENV/bin/python" -c 'import torch, wheel, packaging, setuptools; assert torch.__version__.startswith("2.11.0")' 2>/dev/null; then
  echo "== build venv $BUILD_VENV (torch 2.11.0 from PyPI, ~4.6 GB)"
  "$PY312" -m venv --clear "$BUILD_VENV"
  "$BUILD_VENV/bin/python" -m pip install -q torch==2.11.0 numpy setuptools wheel packaging
fi
BPY=$BUILD_VENV/bin/python

# 2. Download the binary wheels for CPython 3.12 on manylinux x86_64 (2_24: bitsandbytes).
echo "== download ${#WANT[@]} wheels"
PLATFORMS=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
  PLATFORMS+=(--platform "$p")
done
"$PY312" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${PLATFORMS[@]}" -d "$WORK/dl" "${WANT[@]}" > "$WORK/pip.log" 2>&1 \
  || { grep -v 'is ignored: it is neither' "$WORK/pip.log"; echo "pip download failed" >&2; exit 1; }

# 3. Build the source-only ones: pure Python, so py3-none-any. DeepSpeed: see the header.
echo "== build ${SDISTS[*]}"
"$PY312" -m pip download -q --no-deps --no-binary=:all: -d "$WORK/src" "${SDISTS[@]}" > "$WORK/pip.log" 2>&1 \
  || { grep -v 'is ignored: it is neither' "$WORK/pip.log"; echo "pip download of the sdists failed" >&2; exit 1; }
for sdist in "$WORK"/src/*.tar.gz; do
  DS_ACCELERATOR=cuda DS_BUILD_OPS=0 "$BPY" -m pip wheel -q --no-deps --no-build-isolation -w "$WORK/dl" "$sdist" \
    > "$WORK/build.log" 2>&1 || { cat "$WORK/build.log"; echo "building $sdist failed" >&2; exit 1; }
done
unzip -p "$WORK"/dl/deepspeed-*.whl deepspeed/git_version_info_installed.py | grep -E '^(accelerator_name|torch_info)'
unzip -p "$WORK"/dl/deepspeed-*.whl deepspeed/git_version_info_installed.py | grep -q "^accelerator_name='cuda'" \
  || { echo "deepspeed's wheel did not record accelerator_name='cuda'" >&2; exit 1; }

# 4. bitsandbytes: keep only the CPU library and the one for CUDA $BNB_CUDA (see the header).
if [[ $WITH_BNB == 1 ]]; then
  "$BPY" -m wheel unpack -d "$WORK/bnb" "$WORK"/dl/bitsandbytes-*.whl > /dev/null
  find "$WORK"/bnb/*/bitsandbytes -maxdepth 1 -name 'libbitsandbytes_*.so' \
    ! -name libbitsandbytes_cpu.so ! -name "libbitsandbytes_cuda${BNB_CUDA}.so" -delete
  ls "$WORK"/bnb/*/bitsandbytes/libbitsandbytes_cuda${BNB_CUDA}.so > /dev/null
  rm "$WORK"/dl/bitsandbytes-*.whl
  "$BPY" -m wheel pack -d "$WORK/dl" "$WORK"/bnb/* > /dev/null
fi

# 5. Check: one wheel per package, each installable on CPython 3.12/x86_64, every need met.
"$BPY" - "$WORK/dl" "${#WANT[@]}" "${#SDISTS[@]}" <<'EOF'
import glob, os, sys, zipfile
from email.parser import Parser
from packaging.requirements import Requirement
from packaging.tags import sys_tags
from packaging.utils import canonicalize_name, parse_wheel_filename

# The image (KINDS.md, nvidia-h200, read 2026-11-17); versions where a session read them.
KNOWN = {"accelerate": "1.15.0", "huggingface-hub": "1.33.0", "numpy": "2.5.2", "safetensors": "0.8.0",
         "sentencepiece": "0.2.2", "tokenizers": "0.23.2", "transformers": "5.17.0", "triton": "3.6.0",
         "torch": "2.11.0", "torchvision": "0.26.0", "torchaudio": "2.11.0"}
IMAGE = set(KNOWN) | set("""absl-py aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch
build certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core
cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock
flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx humanize
hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2
joblib kiwisolver lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown
markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch
mypy-extensions nanobind narwhals networkx ninja numba numba-cuda numpyro nvidia-cublas nvidia-cuda-cupti
nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver
nvidia-cusparse nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13
nvidia-nvtx onnx onnx-ir onnxruntime onnxscript opencv-python-headless optax opt-einsum opt-einsum-fx optimistix
orbax-checkpoint packaging pandas pathspec patsy peft pillow pip pluggy portalocker prometheus-client propcache
protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing pyproject-hooks pyre-extensions pytest
pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist python-dateutil pytorch-lightning pyyaml
regex requests rich sacrebleu scikit-build-core scikit-image scikit-learn scipy seaborn sentence-transformers
setuptools shellingham simplejson six sortedcontainers statsmodels sympy tabulate tensorboard
tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm toolz torch-geometric torchdiffeq
torchmetrics tqdm treescope typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt
xarray xxhash yarl zipp""".split())
ENV = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux", "os_name": "posix",
       "platform_system": "Linux", "platform_machine": "x86_64", "implementation_name": "cpython",
       "platform_python_implementation": "CPython", "extra": ""}

folder, n_binary, n_built = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
here = set(sys_tags())  # this venv: CPython 3.12, x86_64, glibc 2.36
carried, needs, bad = {}, {}, []
for path in sorted(glob.glob(os.path.join(folder, "*.whl"))):
    name, version, _, tags = parse_wheel_filename(os.path.basename(path))
    if name in carried:
        bad.append(f"two wheels of {name}")
    if not tags & here:
        bad.append(f"{os.path.basename(path)} does not install on CPython 3.12/x86_64")
    carried[name] = version
    with zipfile.ZipFile(path) as z:
        meta = Parser().parsestr(z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode())
    needs[name] = [Requirement(r) for r in meta.get_all("Requires-Dist") or []]
if len(carried) != n_binary + n_built:
    bad.append(f"{len(carried)} wheels, expected {n_binary + n_built}")
notes = {}
for name, reqs in needs.items():
    for req in reqs:
        if req.marker is not None and not req.marker.evaluate(ENV):
            continue
        dep = canonicalize_name(req.name)
        if dep in carried:
            if not req.specifier.contains(carried[dep], prereleases=True):
                bad.append(f"{name} needs {req}, carried {carried[dep]}")
        elif dep in KNOWN:
            if not req.specifier.contains(KNOWN[dep], prereleases=True):
                bad.append(f"{name} needs {req}, the image has {KNOWN[dep]}")
        elif dep in IMAGE:
            if str(req.specifier):
                notes.setdefault(dep, set()).add(f"{req.specifier} ({name})")
        else:
            bad.append(f"{name} needs {req}: neither carried nor in the image")
for dep, specs in sorted(notes.items()):
    print(f"NOTE {dep} {', '.join(sorted(specs))}: in the image, version not read there")
sys.stdout.flush()
if bad:
    sys.exit("FAIL " + "\nFAIL ".join(bad))
print(f"OK {len(carried)} wheels, one each, all for cp312/x86_64; every Requires-Dist carried or in the image")
EOF

# 6. Replace .whl/ in one go.
rm -rf .whl
mkdir .whl
mv "$WORK"/dl/*.whl .whl/
ls -l .whl | awk 'NR > 1 {printf "%10d  %s\n", $5, $9}'
echo ".whl: $(du -cb .whl/*.whl | tail -1 | cut -f1) bytes in $(ls .whl | wc -l) wheels;" \
     "tracked tree: $(git ls-files -z | xargs -0 du -cb | tail -1 | cut -f1) bytes"
