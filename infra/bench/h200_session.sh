#!/usr/bin/env bash
# Every GPU number of docs/benchmarks.md on a 2-GPU H200 host (device kind nvidia-h200-x2), in parts:
#   tests    GPU tests of the kernels (attention, FP8 GEMMs and attention) and the model dispatch
#   kernels  `gemrec bench kernels` on GPU 1; on GPU 0 at the same time (or after the trainer when `trainer` runs)
#            the per-kernel device times of ours on B and C (--profile), then C with the resident-side kernels off
#            (--no-resident, ours only: their before/after)
#   trainer  gpu_bench compiled, then eager, then eager with the reference attention (the kernels' before/after)
#   scaling  scaling_bench with the h200-bench recipe's [parallel] layout (compiled, ZeRO-2, bf16 all-gather and
#            reduction) at 2 then 1 GPUs (the 2-GPU run warms the compile cache) with nothing else running, and its
#            report
#   services the trainer data path's GPU tests (also with services-long), then the real path on GPU 0:
#            `gemrec data synth --profile h200-bench`, `gemrec serve features` and
#            `gemrec serve data` as processes on this machine's CPUs, the compiled h200-bench step trained through
#            --data-addr (no MLflow), then gpu_bench compiled on batches of the same dataset staged on the GPU;
#            services_report.json: E2E MFU through the services vs staged, the wait for data (share, p50/p99),
#            batches read ahead, data-service CPU per batch, local MFU (compiled layers), the FLOP-count check.
#            One nvidia-h200 call: `bash infra/bench/h200_session.sh OUT 420 services` (about 8 minutes)
#   services-long  the same with recipe h200-long (`data synth --profile h200-long`: histories up to 16,384 events,
#            about 4,100 on average): services_long_report.json
#   long     recipe h200-long on GPU 0 (one GPU is enough): full attention at the issue's baseline shape (batch 64,
#            lognormal mean 2,048, max 16,384, compiled), then the window (1,024) and block (64) variants on the same
#            batch, each its own process within STEP_LIMIT_SECONDS, then their comparison (OUT/long/compare.md:
#            step ms, tokens/s, MFU, peak memory, tokens/s gain beside the FLOP ratio)
# On a 1-GPU host (nvidia-h200) the kernels part runs its steps one after another on that GPU instead.
# Each step has its own time limit, so a slow step cannot eat the others. All parts take about 10 minutes plus
# compile time: within one device call's 10-minute limit, run `tests,kernels,trainer` and `scaling` as two calls.
# Results land in OUT (JSON, logs, traces) and OUT/all.tgz.
#
#   bash infra/bench/h200_session.sh OUT [STEP_LIMIT_SECONDS] [PARTS [GPU_BENCH_ARGS...]]
# PARTS default: tests,kernels,trainer,scaling (long, services and services-long only when named); GPU_BENCH_ARGS go to part long's
# gpu_bench runs after their own.
# The repo root must be importable as `gemrec` (the device image has no install): this script links it.
# Name the copy's folder so it cannot be imported as another module: a copy in `.../tree` was found as the
# dm-tree package, which dynamo skips, so torch.compile refused every function in the copy's tests.
set -u
out=${1:?usage: h200_session.sh OUT [STEP_LIMIT_SECONDS] [PARTS]}
limit=${2:-300}
parts=",${3:-tests,kernels,trainer,scaling},"
shift $(( $# < 3 ? $# : 3 ))
long_extra=("$@")  # part long: more gpu_bench arguments, after the part's own (its CPU test shrinks the model)
root=$(cd "$(dirname "$0")/../.." && pwd)
# a `git archive` snapshot has no history: its commit comes from COMMIT (`git rev-parse --short HEAD > COMMIT`)
if [[ -f $root/COMMIT ]]; then export GEMREC_GIT_COMMIT=$(cat "$root/COMMIT"); fi
mkdir -p "$out" && out=$(cd "$out" && pwd)  # the steps run from the repo root
path_dir=$(mktemp -d /tmp/gemrec-path.XXXXXX)  # this run's own: runs beside it link their own trees
ln -sfn "$root" "$path_dir/gemrec"
export PYTHONPATH=$path_dir PYTHONUNBUFFERED=1
# Wheels carried in .whl (the image lacks grpcio-health-checking, grpcio-reflection and this protobuf) go first.
if compgen -G "$root/.whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/gemrec-site \
    "$root"/.whl/*.whl && export PYTHONPATH=/tmp/gemrec-site:$PYTHONPATH
fi
cd "$root"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv > "$out/gpus.txt"
gpus=$(nvidia-smi -L | wc -l)
T=gemrec.components.trainer
S=$T.parallel.scaling_bench
run() { local name=$1; shift; timeout "$limit" "$@" > "$out/$name.log" 2>&1; echo "$name: exit $?" | tee -a "$out/status.txt"; }
want() { [[ $parts == *",$1,"* ]]; }

if want tests; then
  run gpu_tests python3 -m pytest -q -p no:cacheprovider -n 8 -m gpu tests/kernels/test_attention_gpu.py \
    tests/kernels/test_fp8_gpu.py tests/kernels/test_fp8_attention_gpu.py tests/model/test_model_attention.py \
    tests/model/test_model_masks.py tests/model/test_model_step.py tests/model/test_model_layers.py \
    tests/components/trainer/test_memory_plan.py
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
if want long; then
  export CUDA_VISIBLE_DEVICES=0
  long_runs=()
  for mask in full window block; do
    run long_$mask python3 -m $T.gpu_bench --recipe h200-long --out "$out/long_$mask" --set model.seq_attention_mask=$mask \
      --set data.batch_size=64 --set bench.mean_seq_len=2048 --set train.local_mfu=false ${long_extra[@]+"${long_extra[@]}"}
    if [[ -f $out/long_$mask/gpu_bench.json ]]; then long_runs+=("$out/long_$mask/gpu_bench.json"); fi
  done
  if (( ${#long_runs[@]} )); then python3 -m $T.gpu_bench --compare "${long_runs[@]}" --out "$out/long"; fi
  unset CUDA_VISIBLE_DEVICES
fi
wait
if want scaling; then
  steps="--set bench.steps=20 --set bench.warmup_steps=4"  # the layout: the recipe's [parallel]
  run scaling_2 python3 -m torch.distributed.run --nproc_per_node 2 -m $S --out "$out/scaling" --trace $steps
  run scaling_1 python3 -m torch.distributed.run --nproc_per_node 1 -m $S --out "$out/scaling" $steps
  python3 -m $S report "$out"/scaling/*.json > "$out/scaling_report.md" 2>&1
  cat "$out/scaling_report.md"
fi
# The real path (parts services, services-long): RECIPE's synth dataset served by `gemrec serve features` and
# `gemrec serve data` on this machine's CPUs, the compiled step trained through --data-addr, then gpu_bench on
# batches of the same dataset staged on the GPU; outputs prefixed TAG, TAG_report.json compares the two.
real_path() {
  local tag=$1 recipe=$2 port=$3
  local data=/tmp/gemrec-$recipe-data
  export CUDA_VISIBLE_DEVICES=0 TORCHINDUCTOR_CACHE_DIR=/tmp/gemrec-inductor  # the staged run reuses the kernels
  serve() { local name=$1; shift; python3 -m gemrec.cli serve "$@" > "$out/${tag}_$name.log" 2>&1 & }
  healthy() { python3 -c "import sys; from gemrec.components.common.grpc_channel import open_channel, wait_healthy
for port in sys.argv[1:]:
    with open_channel(f'127.0.0.1:{port}') as channel: wait_healthy(channel, timeout_s=120)" "$@"; }
  run ${tag}_synth python3 -m gemrec.cli data synth --profile "$recipe" --out "$data" --overwrite
  serve features features --dataset "$data" --port "$port"
  local features_pid=$!
  healthy "$port"  # the data service refuses to start without a reachable feature service
  serve data data --dataset "$data" --features "127.0.0.1:$port" --port $((port + 1)) --workers 8
  local data_pid=$!
  healthy "$port" $((port + 1)) && nproc > "$out/${tag}_cpus.txt"
  # 8 untimed steps (compilation), then 32 timed ones in windows of 8, as gpu_bench's 8 warm-up and 32 timed steps
  local steps="--set train.steps=40 --set train.log_every=8 --set train.untimed_steps=8"
  run ${tag}_train python3 -m gemrec.cli train --recipe "$recipe" --data-addr "127.0.0.1:$((port + 1))" --device cuda \
    --no-tracking --no-progress --run-dir "/tmp/gemrec-$tag-run" --metrics-out "$out/${tag}_train.json" $steps \
    --set train.compile=true --set train.local_mfu=false --set checkpoint.every=0 --set data.eval_max_examples=1024
  ps -o pid,rss,cputime,args -p "$data_pid,$features_pid" > "$out/${tag}_ps.txt"
  kill "$data_pid" "$features_pid"
  wait "$data_pid" "$features_pid"
  # the trainer's own 40 batches (the data service's epoch order is the in-process stream's), timed on the same 32
  run ${tag}_staged python3 -m $T.gpu_bench --recipe "$recipe" --dataset "$data" --out "$out/${tag}_staged" \
    --set train.compile=true --set bench.warmup_steps=8 --set bench.steps=32 --set bench.distinct_batches=40
  python3 - "$out" "$tag" <<'PY' 2>&1 | tee "$out/${tag}_report.txt"
import json, sys
from pathlib import Path
out, tag = Path(sys.argv[1]), sys.argv[2]
train = json.loads((out / f"{tag}_train.json").read_text())
staged = json.loads((out / f"{tag}_staged" / "gpu_bench.json").read_text())
report = {
    "mfu_e2e_services": train["mfu"]["e2e"],
    "mfu_e2e_staged": staged["mfu_e2e"],
    "services_over_staged": train["mfu"]["e2e"] / staged["mfu_e2e"],  # target >= 0.97
    "data_wait_share": train["data"]["wait_share"],  # target < 0.02
    "data_wait_ms_p50": train["data"]["wait_ms_p50"],
    "data_wait_ms_p99": train["data"]["wait_ms_p99"],
    "batches_in_flight": train["data"]["batches_in_flight"],
    "data_service_cpu_ms_per_batch": train["data"]["service_cpu_ms_per_batch"],
    "step_ms_services": 1000 * train["train_seconds"] / train["timed_steps"],
    "step_ms_staged": staged["step_ms"],
    "qps_services": train["qps"],
    "qps_staged": staged["qps"],
    "mfu_local_compiled": staged["mfu_local"],
    "scaling_ratio_staged": staged["scaling_ratio"],  # <= 1 with compiled layers
    "flop_count": staged["flop_count"],  # model / FlopCounterMode within 1%
    "mean_tokens_per_batch_staged": staged["mean_tokens_per_batch"],
    "device": staged["device"],
}
(out / f"{tag}_report.json").write_text(json.dumps(report, indent=2))
print(json.dumps(report, indent=2))
PY
  unset CUDA_VISIBLE_DEVICES
}
if want services || want services-long; then  # the feed's CUDA path (pinned batches, copies on a side stream), once
  run services_tests python3 -m pytest -q -p no:cacheprovider -m gpu tests/components/trainer/test_trainer_data.py
fi
if want services; then real_path services h200-bench 50061; fi
if want services-long; then real_path services_long h200-long 50071; fi

cat "$out/status.txt"
# written beside OUT, then moved in: an archive growing inside the folder it reads makes tar exit 1 ("file changed")
tar czf "$out.tgz" -C "$out" --exclude=all.tgz . && mv "$out.tgz" "$out/all.tgz"
