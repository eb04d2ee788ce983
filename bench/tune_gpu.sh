#!/usr/bin/env bash
# The autotuner on a lent GPU (issue 14's GPU variant; about 8 minutes on one H200).
#
#   bash bench/tune_gpu.sh          # results under $OUT (the device tool's folder), else outputs/bench/tune_gpu
#
# Tunes a tiny-llava of about 1B parameters (hidden 2048, 16 layers) on one GPU with a 24 GiB budget:
# the ranks' CUDA allocator is capped there (launcher.tune sets LAUNCHER_CUDA_MEMORY_GB), so large
# micro batches without checkpointing end in a real CUDA out-of-memory error, recorded as "does not
# fit". On a machine without the project's packages, carry .whl (bench/device_wheels.sh, docs/gpu.md):
# they are installed first, as bench/device_check.py does.
# tune.md/tune.csv/tune.png/results.json are copied to $OUT after every candidate (and at the end), so
# a run stopped at the time limit still brings back what it measured.
set -u
if compgen -G ".whl/*.whl" > /dev/null; then
  eval "$(bash bench/device_install.sh /tmp/device_check_site | grep '^export PYTHONPATH=')" || exit 1
fi
export DS_SKIP_CUDA_CHECK=1 HF_HUB_OFFLINE=1
OUT=${OUT:-outputs/bench/tune_gpu}
DIR=outputs/bench/tune_gpu/run-$(date +%H%M%S)
mkdir -p "$OUT"
copy_back() { cp -f "$DIR"/tune.md "$DIR"/tune.csv "$DIR"/tune.png "$DIR"/results.json "$OUT"/ 2>/dev/null; }
trap copy_back EXIT
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt" 2>&1
( while sleep 20; do copy_back; done ) &
COPIER=$!
timeout 450 python -m launcher.tune \
  model.hidden_size=2048 model.num_layers=16 model.vision_hidden_size=256 \
  train.micro_batch_size=16 train.global_batch_size=64 logger=none \
  tune.presets=[z0,z2,z3,z2_offload] tune.precisions=[bf16] tune.micro_batch_sizes=[8,16,32,64] \
  tune.gradient_checkpointing=[false,true] tune.memory_gb=24 tune.measure_steps=5 \
  tune.candidate_timeout_s=120 tune.dir="$DIR" 2>&1 | tee "$OUT/tune_stdout.txt" | grep -v WARNING
status=${PIPESTATUS[0]}
kill "$COPIER" 2>/dev/null
copy_back
echo "launcher.tune exit $status; results in $OUT"
