"""What this CPU can do natively, read at run time (never decided by the CPU's name)."""

from __future__ import annotations

import os
import re
from pathlib import Path

# oneDNN's instruction sets, lowest first (its ONEDNN_MAX_CPU_ISA values, AVX10 names beside their AVX512 aliases):
# a process capped below AVX512_CORE_BF16 runs bf16 products emulated, below the AMX sets without AMX
_ONEDNN_ISAS = (
    "SSE41 AVX AVX2 AVX2_VNNI AVX2_VNNI_2 AVX512_CORE AVX512_CORE_VNNI AVX512_CORE_BF16 AVX10_1_512 AVX512_CORE_FP16 "
    "AVX10_1_512_AMX AVX512_CORE_AMX AVX10_1_512_AMX_FP16 AVX512_CORE_AMX_FP16"
).split()
_NEEDS = {"AVX512_BF16": "AVX512_CORE_BF16", "AMX_BF16": "AVX10_1_512_AMX"}


def onednn_isa_cap() -> str | None:
    """The instruction set oneDNN is capped at (ONEDNN_MAX_CPU_ISA, or its older name DNNL_MAX_CPU_ISA), when set
    to one it knows below ALL; None otherwise."""
    cap = (os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or "").strip().upper()
    return cap if cap in _ONEDNN_ISAS else None


def cpu_bf16_instructions() -> list[str]:
    """The native bfloat16 instructions this CPU has (AVX512_BF16, AMX-BF16) and oneDNN may use, from
    /proc/cpuinfo's flags and ONEDNN_MAX_CPU_ISA; none known elsewhere. Without them bf16 products are emulated,
    and slower than float32."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    found = {m.upper() for m in re.findall(r"\b(avx512_bf16|amx_bf16)\b", flags)}
    cap = onednn_isa_cap()
    if cap is not None:
        found = {f for f in found if _ONEDNN_ISAS.index(cap) >= _ONEDNN_ISAS.index(_NEEDS[f])}
    return sorted(found)


def compiler_march() -> str:
    """gcc's -march for C loops built on this machine: native, or, where ONEDNN_MAX_CPU_ISA caps the process below
    AVX-512, the x86-64 level the cap allows (a capped run measures the CPU as one without the instructions above)."""
    cap = onednn_isa_cap()
    if cap is None or _ONEDNN_ISAS.index(cap) >= _ONEDNN_ISAS.index("AVX512_CORE"):
        return "-march=native"
    return "-march=x86-64-v3" if _ONEDNN_ISAS.index(cap) >= _ONEDNN_ISAS.index("AVX2") else "-march=x86-64-v2"
