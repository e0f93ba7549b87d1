#!/usr/bin/env bash
# Every GPU number of docs/benchmarks.md on a 2-GPU H200 host (device kind nvidia-h200-x2), in parts:
#   tests    GPU tests of the kernels and the model dispatch
#   kernels  `gemrec bench kernels` on GPU 1; on GPU 0 at the same time (or after the trainer when `trainer` runs)
#            the per-kernel device times of ours on B and C (--profile), then C with the resident-side kernels off
#            (--no-resident, ours only: their before/after)
#   trainer  gpu_bench compiled, then eager, then eager with the reference attention (the kernels' before/after)
#   scaling  scaling_bench (compiled, ZeRO-2, bf16 reduction) at 2 then 1 GPUs (the 2-GPU run warms the compile
#            cache) with nothing else running, and its report
# On a 1-GPU host (nvidia-h200) the kernels part runs its steps one after another on that GPU instead.
# Each step has its own time limit, so a slow step cannot eat the others. All parts take about 10 minutes plus
# compile time: within one device call's 10-minute limit, run `tests,kernels,trainer` and `scaling` as two calls.
# Results land in OUT (JSON, logs, traces) and OUT/all.tgz.
#
#   bash infra/bench/h200_session.sh OUT [STEP_LIMIT_SECONDS] [PARTS]     (PARTS default: tests,kernels,trainer,scaling)
# The repo root must be importable as `gemrec` (the device image has no install): this script links it.
# Name the copy's folder so it cannot be imported as another module: a copy in `.../tree` was found as the
# dm-tree package, which dynamo skips, so torch.compile refused every function in the copy's tests.
set -u
out=${1:?usage: h200_session.sh OUT [STEP_LIMIT_SECONDS] [PARTS]}
limit=${2:-300}
parts=",${3:-tests,kernels,trainer,scaling},"
root=$(cd "$(dirname "$0")/../.." && pwd)
# a `git archive` snapshot has no history: its commit comes from COMMIT (`git rev-parse --short HEAD > COMMIT`)
if [[ -f $root/COMMIT ]]; then export GEMREC_COMMIT=$(cat "$root/COMMIT"); fi
mkdir -p "$out" /tmp/gemrec-path
ln -sfn "$root" /tmp/gemrec-path/gemrec
export PYTHONPATH=/tmp/gemrec-path PYTHONUNBUFFERED=1
cd "$root"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv > "$out/gpus.txt"
gpus=$(nvidia-smi -L | wc -l)
T=gemrec.components.trainer
S=$T.parallel.scaling_bench
run() { local name=$1; shift; timeout "$limit" "$@" > "$out/$name.log" 2>&1; echo "$name: exit $?" | tee -a "$out/status.txt"; }
want() { [[ $parts == *",$1,"* ]]; }

if want tests; then
  run gpu_tests python3 -m pytest -q -p no:cacheprovider -n 8 -m gpu tests/kernels/test_attention_gpu.py \
    tests/model/test_model_attention.py
fi
if want kernels; then
  kernel_extras() {
    run kernels_profile python3 -m gemrec.kernels.cli --configs B,C-cross,C-pma --profile
    run kernels_tiled python3 -m gemrec.kernels.cli --configs C-cross,C-pma --no-peers --no-resident \
      --out "$out/kernels_tiled"
  }
  if (( gpus < 2 )); then
    run kernels python3 -m gemrec.kernels.cli --out "$out/kernels"
    kernel_extras
  else
    (export CUDA_VISIBLE_DEVICES=1; run kernels python3 -m gemrec.kernels.cli --out "$out/kernels") &
    if ! want trainer; then (export CUDA_VISIBLE_DEVICES=0; kernel_extras) & fi  # GPU 0 is free without the trainer
  fi
fi
if want trainer; then
  export CUDA_VISIBLE_DEVICES=0
  run trainer_compiled python3 -m $T.gpu_bench --out "$out/trainer_compiled" --set train.compile=true --trace
  run trainer_eager python3 -m $T.gpu_bench --out "$out/trainer_eager"
  run trainer_reference python3 -m $T.gpu_bench --out "$out/trainer_reference" --set model.attention_backend=reference
  if want kernels && (( gpus >= 2 )); then kernel_extras; fi
  unset CUDA_VISIBLE_DEVICES
fi
wait
if want scaling; then
  common="--param-dtype bfloat16 --reduce-dtype bfloat16 --compile --no-reshard-after-forward"
  steps="--set bench.steps=20 --set bench.warmup_steps=4"
  run scaling_2 python3 -m torch.distributed.run --nproc_per_node 2 -m $S --out "$out/scaling" $common --trace $steps
  run scaling_1 python3 -m torch.distributed.run --nproc_per_node 1 -m $S --out "$out/scaling" $common $steps
  python3 -m $S report "$out"/scaling/*.json > "$out/scaling_report.md" 2>&1
  cat "$out/scaling_report.md"
fi
cat "$out/status.txt"
(cd "$out" && tar czf all.tgz --exclude=all.tgz .)
