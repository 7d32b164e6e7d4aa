"""What this CPU can do natively, read at run time (never decided by the CPU's name)."""

from __future__ import annotations

import re
from pathlib import Path


def cpu_bf16_instructions() -> list[str]:
    """The native bfloat16 instructions this CPU has (AVX512_BF16, AMX-BF16), from /proc/cpuinfo's flags; none
    known elsewhere. Without them bf16 products are emulated, and slower than float32."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    return sorted({m.upper() for m in re.findall(r"\b(avx512_bf16|amx_bf16)\b", flags)})
