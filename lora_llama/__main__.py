"""`python -m lora_llama ...` (what torchrun runs: `torchrun --nproc-per-node N -m lora_llama train R.yaml`)."""

import sys

from lora_llama.cli import main

sys.exit(main())
