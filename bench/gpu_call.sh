#!/usr/bin/env bash
# What a GPU machine runs, from the repository root, with the wheels of bench/gpu_wheels.sh in .whl/:
#   bash bench/gpu_call.sh                 # call 1: every part in order, the whole inside CALL_S seconds (default 450)
#   bash bench/gpu_call.sh 8b-nf4 grpo     # call 2: the parts named (what failed, was mended or did not fit)
# Parts, in call 1's order:
#   tests                   the CUDA tests (families too), each listed with its outcome, each stopped after TEST_S s
#   135m, 8b, 8b-nf4, 1b    bench.gpu's configurations, each against transformers+peft (with and without liger-kernel;
#                           for nf4, peft on bitsandbytes' 4-bit base)
#   moe                     bench.gpu's moe-int8: Qwen3-30B-A3B shapes (8 layers), int8 experts, against peft's
#                           target_parameters on bf16 experts (liger-kernel has no Qwen3-MoE kernels)
#   grpo                    bench.grpo against trl's GRPOTrainer, bench.decode's figures inside its line
# A part gets the seconds PART_S gives it, at most what is left of CALL_S; a part that cannot get MIN_S is not
# started and is listed in $OUT/left.txt, the parts to name in call 2. A part that fails costs its own lines only.
# Back in $OUT (or ./gpu-out): call.log (everything printed), tests.txt, gpu.jsonl (each run's line as it ends and
# each configuration's summary), and bench/results' gpu, grpo and decode files with this call's lines appended:
# copy those three over bench/results/ and run `python -m bench.report`.
# DEVICE=cpu rehearses every part on the CPU (tiny shapes, two steps) without touching bench/results.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu-out}
device=${DEVICE:-cuda}
mkdir -p "$out"
: >"$out/left.txt"
declare -A PART_S=([tests]=120 [135m]=90 [8b]=240 [8b-nf4]=240 [1b]=150 [moe]=200 [grpo]=180)
MIN_S=${MIN_S:-45}
start=$SECONDS
log() { echo "gpu_call: $*" | tee -a "$out/call.log"; }

if [ "$device" = cuda ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { log "the wheels of .whl/ do not install (run bench/gpu_wheels.sh here first)"; exit 1; }
  export PYTHONPATH=/tmp/site:.
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee -a "$out/call.log"
  PY=python3
  results=bench/results
else  # the rehearsal: this checkout's environment, results into a scratch folder
  PY=${PY:-.venv/bin/python}
  results=$(mktemp -d)
  cp bench/results/*.jsonl "$results/"
  export BENCH_RESULTS=$results
fi
export PYTHONUNBUFFERED=1

tests() {
  $PY -m pytest -p no:cacheprovider --timeout "${TEST_S:-90}" -q -rA tests/test_cuda.py tests/test_cuda_families.py 2>&1 \
    | tee -a "$out/call.log" | grep -E "^(PASSED|FAILED|ERROR|SKIPPED)|passed|failed|skipped" >"$out/tests.txt"
  cat "$out/tests.txt"
}
config() {  # one bench.gpu configuration; its own --budget writes the summary before the part's time is up
  local name=$1 seconds=$2 args=(--configs "$1") tiny="tiny${1#*[0-9][bm]}"
  [ "$name" != moe ] || { args=(--configs moe-int8 --peers transformers+peft); tiny=tiny-moe-int8; }
  [ "$device" = cuda ] || args=(--device cpu --configs "$tiny" --peers transformers+peft --steps 1 --warmup 1)
  $PY -m bench.gpu "${args[@]}" --out "$out" --budget $((seconds - 15)) 2>&1 | tee -a "$out/call.log" | tail -5
}
grpo() {
  local model=/tmp/lora-llama-grpo-model
  if [ "$device" = cuda ]; then
    $PY -m bench.gpu --make-model 135m --device cuda --tokenizer .whl/smol-tokenizer --to "$model" || return 1
    $PY -m bench.grpo --device cuda --precision bf16-mixed --source "$model" --data .whl/prompts.jsonl --steps 6 2>&1 \
      | tee -a "$out/call.log" | tail -12
  else
    $PY -m bench.gpu --make-model tiny --device cpu --to "$model" || return 1
    $PY -m bench.grpo --source "$model" --steps 2 --no-peer train.grpo.max_new_tokens=4 train.batch_size=2 \
      data.max_examples=8 2>&1 | tee -a "$out/call.log" | tail -4
  fi
}

[ $# -gt 0 ] || set -- tests 135m 8b 8b-nf4 1b moe grpo
CALL_S=${CALL_S:-450}
for part in "$@"; do
  [ -n "${PART_S[$part]:-}" ] || { log "unknown part $part (use ${!PART_S[*]})"; exit 2; }
  left=$((CALL_S - (SECONDS - start)))
  seconds=$((PART_S[$part] < left ? PART_S[$part] : left))
  if [ "$seconds" -lt "$MIN_S" ]; then
    log "$part not started: ${left} s left of CALL_S; name it in the next call"
    echo "$part" >>"$out/left.txt"
    continue
  fi
  log "$part: up to $seconds s"
  case $part in
    tests) timeout "$seconds" bash -c "set -o pipefail; $(declare -f tests); out=$out PY=$PY; tests" ;;
    grpo) timeout "$seconds" bash -c "set -o pipefail; $(declare -f grpo); out=$out PY=$PY device=$device; grpo" ;;
    *) timeout "$seconds" bash -c "set -o pipefail; $(declare -f config); out=$out PY=$PY device=$device; config $part $seconds" ;;
  esac
  code=$?
  log "$part: exit $code after $((SECONDS - start)) s in all"
done
for name in gpu grpo decode; do
  [ -f "$results/$name.jsonl" ] && cp "$results/$name.jsonl" "$out/$name-results.jsonl"
done
log "done in $((SECONDS - start)) s; not started: $(tr '\n' ' ' <"$out/left.txt")"
