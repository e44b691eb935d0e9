#!/usr/bin/env bash
# Every lesson on a GPU in one run: each example on CUDA beside its stock twin, the two
# gradient tables diffed; the CUDA tests; the benchmarks' GPU rows; then the whole suite.
#
#     bash tests/gpu/run_all.sh OUT                      # on a machine with CUDA, its own torch
#     MINDDP_GPU_DEVICE=cpu bash tests/gpu/run_all.sh OUT --quick   # tried on a CPU first
#
# OUT gets summary.txt (one line per step: its exit status and, for a pair, the diff's
# verdict) and logs.tar.gz (every step's output). nccl runs at 1 rank (one GPU); 2 and 4
# ranks share the GPU over gloo (--backend gloo --device cuda), as docs/tests.md says.
# --quick: 2 ranks only, no 4-rank meshes, no whole suite (the CPU try). Budget: the suite runs
# last, under what is left of MINDDP_GPU_BUDGET_S (default 540 s).
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${1:?usage: bash tests/gpu/run_all.sh OUT [--quick]}
quick=${2:-}
device=${MINDDP_GPU_DEVICE:-cuda}
budget=${MINDDP_GPU_BUDGET_S:-540}
start=$(date +%s)
mkdir -p "$out/logs" "$out/tables"
export OMP_NUM_THREADS=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
py=${PYTHON:-python}
summary="$out/summary.txt"
$py -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda,
      'gpu', torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)" \
    | tee "$summary"

step() {  # step NAME SECONDS COMMAND...: run it, note its status
  local name=$1 limit=$2
  shift 2
  timeout -k 10 "$limit" "$@" >"$out/logs/$name.log" 2>&1
  local rc=$?
  echo "$name rc=$rc $(tail -n 1 "$out/logs/$name.log" | cut -c1-120)" | tee -a "$summary"
}

pair() {  # pair NAME RANKS BACKEND "MINDDP'S COMMAND" "STOCK'S COMMAND" [COMMON FLAGS...]
  # RANKS: N for both runs, or N:M (minddp's at N ranks, the reference at M)
  local name=$1 n=${2%%:*} m=${2##*:} backend=$3 mine=$4 theirs=$5
  shift 5
  local a="$out/tables/$name-minddp.txt" b="$out/tables/$name-stock.txt"
  # shellcheck disable=SC2086  # a command's string splits into its script and flags
  timeout -k 10 240 torchrun --standalone --nproc_per_node="$n" $mine "$@" \
    --backend "$backend" --device "$device" --grad-table "$a" >"$out/logs/$name-minddp.log" 2>&1
  local rc_a=$?
  # shellcheck disable=SC2086
  timeout -k 10 240 torchrun --standalone --nproc_per_node="$m" $theirs "$@" \
    --backend "$backend" --device "$device" --grad-table "$b" >"$out/logs/$name-stock.log" 2>&1
  local rc_b=$?
  local verdict
  verdict=$($py -m minddp diff "$a" "$b" 2>&1 | grep -m1 -o "verdict: [A-Z_]*")
  echo "$name ranks=$2 $backend/$device rc=$rc_a/$rc_b ${verdict:-no diff}" | tee -a "$summary"
}

nccl=nccl
[ "$device" = cuda ] || nccl=gloo  # the CPU try: gloo where a GPU run takes nccl
sizes="2 4"
rounds=()
[ "$quick" = --quick ] && sizes=2 && rounds=(--rounds 3)

pair ddp-1 1 "$nccl" examples/manual_ddp.py examples/stock_ddp.py --epochs 1
for n in $sizes; do
  pair "ddp-$n" "$n" gloo examples/manual_ddp.py examples/stock_ddp.py --epochs 1
  pair "zero1-$n" "$n" gloo "examples/zero1.py --zero manual" "examples/zero1.py --zero stock" \
    --epochs 1
  pair "fsdp-$n" "$n" gloo "examples/fsdp.py --fsdp manual" "examples/fsdp.py --fsdp stock" \
    --epochs 1
  pair "tp-$n" "$n" gloo "examples/tp.py --tp manual" "examples/tp.py --tp stock" --epochs 1
  for schedule in gpipe 1f1b interleaved-1f1b zb1p zbv dualpipev; do
    pair "pp-$schedule-$n" "$n" gloo "examples/pipeline.py --pp manual" \
      "examples/pipeline.py --pp stock" --epochs 1 --schedule "$schedule" --microbatches 4
  done
  # the ordered reduction at N ranks against the same at 1 rank (the claim: any world size
  # gives the same bits); each run its own checkpoints, or the second would resume the first
  pair "elastic-$n" "$n:1" gloo \
    "examples/elastic.py --reduce ordered --checkpoint-dir $out/ckpt-$n-minddp" \
    "examples/elastic.py --reduce ordered --checkpoint-dir $out/ckpt-$n-one" --epochs 1
  pair "context-$n" "$n" gloo "examples/context.py --cp manual" "examples/context.py --cp reference"
  pair "experts-$n" "$n" gloo "examples/experts.py --ep manual" \
    "examples/experts.py --ep reference"
  pair "recompute-$n" "$n" gloo "examples/gpt_nd.py --impl manual" \
    "examples/gpt_nd.py --impl stock" --mesh "dp=$n" --recompute selective --dropout 0.1
done
if [ "$quick" != --quick ]; then
  pair mesh-dp2-tp2 4 gloo "examples/gpt_nd.py --impl manual" "examples/gpt_nd.py --impl stock" \
    --mesh dp=2,tp=2
  pair mesh-pp2-dp2 4 gloo "examples/gpt_nd.py --impl manual" "examples/gpt_nd.py --impl stock" \
    --mesh pp=2,dp=2 --untied
fi

step test_gpu 300 $py -m pytest -q -p no:cacheprovider tests/test_gpu.py
for bench in bench fsdp-bench tp-bench pp-bench; do  # world size 1: nccl on the GPU
  step "$bench" 240 $py -m minddp "$bench" --world-sizes 1 --backend "$nccl" --device "$device" \
    --format github "${rounds[@]}"
done
if [ "$quick" != --quick ]; then
  left=$(( budget - ($(date +%s) - start) ))
  [ "$left" -gt 60 ] && step suite "$left" $py -m pytest -q -p no:cacheprovider -x
fi
tar -czf "$out/logs.tar.gz" -C "$out" logs tables
echo "done in $(( $(date +%s) - start )) s" | tee -a "$summary"
