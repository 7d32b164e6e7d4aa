"""`make bench`: every benchmark whose rows the tables show, run again with the arguments of each of its rows (the
newest line per argument list in bench/results/, as bench.report reads them), then the tables regenerated. Rows a
GPU measured are bench.gpu's and `make bench-gpu`'s, on a GPU machine.

    python -m bench.all [--list]"""

from __future__ import annotations

import argparse
import subprocess
import sys

from bench.common import ROOT
from bench.report import PAGES, newest_per_args


def runs() -> list[list[str]]:
    """[module, *args] of every CPU row the tables show, each benchmark once per argument list."""
    names = dict.fromkeys(name for shown in PAGES.values() for name in shown)
    every = [
        [f"bench.{name}", *line.get("args", [])]
        for name in names
        for line in newest_per_args(name)
        if "gpu" not in line
    ]
    return [list(run) for run in dict.fromkeys(map(tuple, every))]  # a row measured on several CPUs runs once here


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--list", action="store_true", help="print the commands and run none")
    args = parser.parse_args()
    for run in runs():
        print("python -m " + " ".join(run), flush=True)
        if not args.list and subprocess.run([sys.executable, "-m", *run], cwd=ROOT).returncode:
            sys.exit(f"{run[0]} failed")
    if not args.list:
        subprocess.run([sys.executable, "-m", "bench.report"], cwd=ROOT, check=True)


if __name__ == "__main__":
    main()
