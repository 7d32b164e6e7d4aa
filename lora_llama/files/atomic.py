"""Outputs written atomically (a temporary beside the target, renamed into place), never over a result without
--force."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path

from lora_llama.errors import UserError


def refuse_existing(path: Path, force: bool) -> None:
    """Outputs never replace an existing result unless the user passed --force."""
    if Path(path).exists() and not force:
        raise UserError(f"{path} already exists (pass --force to overwrite)")


@contextlib.contextmanager
def atomic_dir(out: str | os.PathLike, force: bool = False):
    """Yield a temporary folder beside `out`; rename it to `out` only when the block succeeds.

    An existing `out` is refused unless `force`; with `force` it is replaced only
    after the new one is complete, so a crash never leaves a half-written folder.
    A failed write (disk full, file too large, no permission) is one UserError naming
    `out` and the cause; the temporary folder is removed and an existing `out` kept.
    """
    from safetensors import SafetensorError

    out = Path(out)
    refuse_existing(out, force)
    tmp = None
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
        tmp.chmod(0o755)  # mkdtemp makes it private; the result is an ordinary folder
        yield tmp
        if out.exists():
            old = out.with_name(f".{out.name}.old-{os.getpid()}")
            out.rename(old)
            tmp.rename(out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(out)
    except (OSError, SafetensorError) as e:
        cause = f"{e.strerror} ({e.filename})" if getattr(e, "strerror", None) and e.filename else str(e)
        raise UserError(f"cannot write {out}: {cause}") from None
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def atomic_file(path: Path):
    """Yield a hidden temporary path beside `path`, renamed over it when the block succeeds and removed
    when it fails: a reader (or a kill) never sees half a file under the final name."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_text_atomic(path: Path, text: str) -> None:
    with atomic_file(path) as tmp:
        tmp.write_text(text)
