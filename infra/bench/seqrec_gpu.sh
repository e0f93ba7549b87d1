#!/usr/bin/env bash
# `gemrec bench seqrec` on one GPU (device kind nvidia-h200): both protocols on Amazon Beauty and Sports, the
# numbers of docs/benchmarks.md "Sequential recommendation", plus their wall times.
#
#   bash infra/bench/seqrec_gpu.sh RAW OUT [RECIPE] [PARTS [SEQREC_ARGS...]]
# RAW: a folder with S3-Rec's Beauty.txt, Beauty_item2attributes.json, Sports_and_Outdoors.txt and
# Sports_and_Outdoors_item2attributes.json (not in the repository: carry it). RECIPE default s3rec.
# PARTS default beauty-full,beauty-sampled99,sports-full,sports-sampled99 (one process per part and arm, all at once);
# a part DATA-PROTOCOL-ARM (e.g. sports-sampled99-gem) runs that arm only. SEQREC_ARGS (e.g. --set
# seqrec.ranker_patience=8) go to every run. SEQREC_LIMIT (seconds) stops each run that takes longer (its log stays).
# No MLflow on the device (--no-tracking): the results are the JSON files and logs in OUT/seqrec.tgz.
set -u
raw=${1:?usage: seqrec_gpu.sh RAW OUT [RECIPE] [PARTS]}
out=${2:?usage: seqrec_gpu.sh RAW OUT [RECIPE] [PARTS]}
out=${out%/}
recipe=${3:-s3rec}
parts=${4:-beauty-full,beauty-sampled99,sports-full,sports-sampled99}
shift $(( $# < 4 ? $# : 4 ))
extra=("$@")
root=$(cd "$(dirname "$0")/../.." && pwd)
mkdir -p "$out" /tmp/gemrec-seqrec-path
ln -sfn "$root" /tmp/gemrec-seqrec-path/gemrec
export PYTHONPATH=/tmp/gemrec-seqrec-path PYTHONUNBUFFERED=1
if [[ -f $root/COMMIT ]]; then export GEMREC_GIT_COMMIT=$(cat "$root/COMMIT"); fi
nvidia-smi --query-gpu=name --format=csv,noheader > "$out/gpu.txt"
declare -A names=([beauty]=Beauty [sports]=Sports_and_Outdoors)
for data in beauty sports; do
  if [[ $parts == *$data* && ! -d $out/data/$data ]]; then
    python3 -m gemrec data prepare s3rec --raw "$raw" --name "${names[$data]}" --out "$out/data/$data" \
      > "$out/prepare-$data.log" 2>&1
  fi
done
# Every part's arms at once, one process each (small models: the GPU has room; the wall times are then upper bounds).
for part in ${parts//,/ }; do
  IFS=- read -r data protocol arms <<< "$part"
  part=$data-$protocol
  for arm in ${arms:-gem sasrec}; do
    (
      start=$(date +%s)
      timeout "${SEQREC_LIMIT:-0}" python3 -m gemrec bench seqrec --dataset "$out/data/$data" --protocol "$protocol" --recipe "$recipe" \
        --arms $arm --device cuda --no-tracking --metrics-out "$out/$part-$arm.json" ${extra[@]+"${extra[@]}"} \
        > "$out/$part-$arm.log" 2>&1
      echo "$part-$arm: exit $? in $(( $(date +%s) - start )) s" >> "$out/status.txt"
    ) &
  done
done
wait
rm -rf "$out/data"
cat "$out/status.txt"
# one file: a device call brings back only a few files
tar czf "$out.tgz" -C "$out" --exclude=seqrec.tgz . && mv "$out.tgz" "$out/seqrec.tgz" \
  && find "$out" -type f ! -name seqrec.tgz -delete  # archived beside OUT: tar exits 1 on a folder that grows
