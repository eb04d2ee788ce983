#!/usr/bin/env bash
# Packing against grouping and plain padding on a lent GPU (issue 27's GPU rows; about 8 minutes on one H200).
#
#   bash bench/packing_gpu.sh            # results under $OUT (the device tool's folder), else outputs/bench/packing_gpu
#   SMALL=1 bash bench/packing_gpu.sh    # the same path with a tiny model in fp32 on this CPU (~2 min): a rehearsal
#
# The model: a Qwen2-VL-2B-shaped model built from code, random weights, no download (launcher.model.tiny's
# Qwen2-VL at the size of Qwen2-VL-2B: language model 1536 wide, 28 layers; ViT 1280 wide, 32 layers, patch
# 14, 2x2 merge; images resized to 448 px, so 256 image tokens each). What differs from the released model:
# heads of 32 dimensions (48 and 40 heads, the released 12 x 128 and 16 x 80), an MLP 4x wide (6144, the
# released 8960), full rather than grouped key-value heads, and the vocabulary of the tokenizer trained on the
# records (hundreds of tokens, the released 151,936): about 1.7 B parameters against 2.2 B.
# The data: bench/vs_hf_trainer.py's 2,000 variable-length records (1-3 images, 20-400 text tokens; here
# 280-1,170 tokens each with the image tokens), data.max_length=8192.
# The comparison is the autotuner's batching axis (docs/tune.md): ZeRO 0, bf16, global batch 16, candidates
# pad / group / pack8192 at micro batch 1 and 4 (a packed micro batch counts rows of 8,192 tokens), 5
# measured steps each, compared by real (non-padding) tokens/s, with padding share, MFU (against the H200's
# table peak, launcher/train/peak.py) and peak memory per candidate. A micro batch that does not fit in
# tune.memory_gb is recorded as "does not fit" (a real CUDA out-of-memory: the allocator is capped).
# tune.md/tune.csv/results.json are copied to $OUT after every candidate and at the end: a run stopped at
# the time limit still brings back what it measured. On a machine without the project's packages, carry .whl
# (bench/device_wheels.sh, docs/gpu.md): they are installed first, as bench/device_check.py does.
set -u
if compgen -G ".whl/*.whl" > /dev/null; then
  eval "$(bash bench/device_install.sh /tmp/device_check_site | grep '^export PYTHONPATH=')" || exit 1
fi
export DS_SKIP_CUDA_CHECK=1 HF_HUB_OFFLINE=1
OUT=${OUT:-outputs/bench/packing_gpu}
DIR=outputs/bench/packing_gpu/run-$(date +%H%M%S)
mkdir -p "$OUT"
copy_back() { cp -f "$DIR"/tune.md "$DIR"/tune.csv "$DIR"/results.json "$OUT"/ 2>/dev/null; }
trap copy_back EXIT
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt" 2>&1
DATA=$(python -c "import sys; sys.path.insert(0, 'bench'); from vs_hf_trainer import VARIABLE_DATA, variable_length_data as v; print(' '.join(v(VARIABLE_DATA)))") || exit 1
if [[ ${SMALL:-0} == 1 ]]; then  # the rehearsal: a tiny Qwen2-VL, fp32 (this CPU has no fast bf16), rows of 2,048
  MODEL=(model=tiny_qwen2_vl)
  SPACE=(tune.precisions=[fp32] tune.pack_lengths=[2048] data.max_length=2048 tune.memory_gb=8 tune.measure_steps=2)
  LIMIT=400
else
  MODEL=(model=tiny_qwen2_vl model.hidden_size=1536 model.num_layers=28 model.vision_hidden_size=1280
         model.vision_layers=32 model.image_size=448 model.patch_size=14)
  SPACE=(tune.precisions=[bf16] tune.pack_lengths=[8192] data.max_length=8192 tune.memory_gb=120 tune.measure_steps=5)
  LIMIT=540
fi
( while sleep 20; do copy_back; done ) &
COPIER=$!
# shellcheck disable=SC2086  # DATA is a list of overrides
timeout "$LIMIT" python -m launcher.tune "${MODEL[@]}" $DATA "${SPACE[@]}" \
  train.micro_batch_size=4 train.global_batch_size=16 logger=none \
  tune.presets=[z0] tune.micro_batch_sizes=[1,4] tune.gradient_checkpointing=[false] \
  tune.batching=[pad,group,pack] tune.early_skip=false tune.candidate_timeout_s=240 tune.dir="$DIR" \
  2>&1 | tee "$OUT/tune_stdout.txt" | grep -v WARNING
status=${PIPESTATUS[0]}
kill "$COPIER" 2>/dev/null
copy_back
echo "launcher.tune exit $status; results in $OUT"
