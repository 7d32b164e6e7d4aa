"""What the studio's browser tests share besides their fixtures (conftest.py: the studio serving a runs folder, a
headless Chromium page): a short run of the tiny model through the CLI, and the page's screenshots."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from lora_llama.cli import main

CHROMIUM = shutil.which("chromium")
ROOT = Path(__file__).resolve().parents[1]
needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium (apt-get install chromium)")


def tiny_run(ckpt, out, *extra, process=False):
    """A short SFT run of the tiny model through the CLI (in a process of its own, as the studio runs one)."""
    (out.parent / "empty.yaml").write_text("")
    args = [
        "train",
        str(out.parent / "empty.yaml"),
        f"model.source={ckpt}",
        "data.source=chatterbot-corpus",
        "data.max_examples=40",
        "data.max_seq_len=64",
        "train.max_steps=3",
        "train.eval_every=3",
        "train.save_every=3",
        "train.precision=fp32",
        "lora.dropout=0.0",
        f"output.dir={out}",
        *extra,
    ]
    if process:
        assert (
            subprocess.run([sys.executable, "-m", "lora_llama", *args], cwd=ROOT, capture_output=True).returncode == 0
        )
    else:
        assert main(args) == 0


def shot(page, name: str, tmp_path: Path) -> None:
    """A screenshot for docs/studio.md when LORA_LLAMA_SCREENSHOTS names a folder (else into the test's folder)."""
    folder = Path(os.environ.get("LORA_LLAMA_SCREENSHOTS") or tmp_path)
    folder.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(folder / f"studio-{name}.png"), full_page=False)
