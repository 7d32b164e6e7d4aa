#!/usr/bin/env bash
# What a GPU machine runs, from the repository root, with the wheels of bench/gpu_wheels.sh in .whl/; one or more
# parts in one call, in the order given (a device call costs a machine start: put the parts that fit in one):
#   bash bench/gpu_call.sh bench [bench.gpu's options]   # bench.gpu: 8b, 8b-nf4, 1b, 135m (timeout 540 s)
#   bash bench/gpu_call.sh tests                         # the CUDA tests and the compile / decoding tests (420 s)
#   bash bench/gpu_call.sh rl                            # bench.grpo against trl, bench.decode's figures inside (450 s)
#   bash bench/gpu_call.sh tests rl                      # both, one after the other
# Each part's timeout can be set (BENCH_S, TESTS_S, RL_S, in seconds) to fit the call's limit.
# Each figure line and log lands in $OUT (or ./gpu-out) as it is written, so a call cut short keeps what finished.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu-out}
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"

bench() {
  # its own --budget ends the runs 30 s before the timeout, so the summaries of what ran are written
  timeout "${BENCH_S:-540}" python3 -m bench.gpu --out "$out" --budget $(( ${BENCH_S:-540} - 30 )) "$@" 2>&1 \
    | tail -60 | tee "$out/bench-gpu.log"
}
rl() {
  python3 -c "from pathlib import Path; from transformers import AutoTokenizer; from bench.gpu import SMOLLM2_135M, \
random_model; AutoTokenizer.from_pretrained('.whl/smol-tokenizer').save_pretrained(random_model(Path('/tmp/smol'), \
SMOLLM2_135M, 'cuda'))"
  timeout "${RL_S:-450}" python3 -m bench.grpo --device cuda --precision bf16-mixed --source /tmp/smol \
    --data .whl/prompts.jsonl --steps 6 2>&1 | tail -30 | tee "$out/bench-grpo.log"
  cp bench/results/decode.jsonl bench/results/grpo.jsonl "$out/" 2>/dev/null || true
}
tests() {
  timeout "${TESTS_S:-420}" python3 -m pytest -q -x -p no:cacheprovider tests/test_cuda.py tests/test_compile.py \
    tests/test_decoding.py 2>&1 | tail -40 | tee "$out/tests.log"
}

[ $# -gt 0 ] || set -- bench
parts=()
for arg in "$@"; do  # a part's name starts a part; anything else is an option of the part before it (bench's)
  case "$arg" in
    bench | rl | tests) parts+=("$arg") ;;
    *)
      [ "${#parts[@]}" -gt 0 ] && [ "${parts[-1]%% *}" = bench ] \
        || { echo "usage: bash bench/gpu_call.sh bench [options] | rl | tests ..." >&2; exit 2; }
      parts[-1]+=" $arg" ;;
  esac
done
for part in "${parts[@]}"; do
  $part
done
