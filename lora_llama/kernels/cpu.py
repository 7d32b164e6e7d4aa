"""What this CPU can do natively, read at run time (never decided by the CPU's name), and the package's C loops built
for it.

A C loop is compiled on first use for this CPU (`-march=native`, or the level ONEDNN_MAX_CPU_ISA caps it at; about a
second) with the C compiler inductor's loops need too, linked against the OpenMP runtime torch loaded (so its parallel
regions run on torch's own threads), and kept under ~/.cache/lora-llama.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import re
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

import torch

# oneDNN's instruction sets, lowest first (its ONEDNN_MAX_CPU_ISA values, AVX10 names beside their AVX512 aliases):
# a process capped below AVX512_CORE_BF16 runs bf16 products emulated, below the AMX sets without AMX
_ONEDNN_ISAS = (
    "SSE41 AVX AVX2 AVX2_VNNI AVX2_VNNI_2 AVX512_CORE AVX512_CORE_VNNI AVX512_CORE_BF16 AVX10_1_512 AVX512_CORE_FP16 "
    "AVX10_1_512_AMX AVX512_CORE_AMX AVX10_1_512_AMX_FP16 AVX512_CORE_AMX_FP16"
).split()
_NEEDS = {"AVX512_BF16": "AVX512_CORE_BF16", "AMX_BF16": "AVX10_1_512_AMX"}
# -ffast-math lets sums vectorize; it is given to the compile step only: linked with it, gcc adds crtfastmath.o,
# whose loading turns on flush-to-zero for the whole process
C_FLAGS = ("-O3", "-ffast-math", "-fPIC", "-fopenmp")


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


def c_library(source: Path, defines: tuple[str, ...] = ()) -> ctypes.CDLL:
    """`source` compiled with `defines` for this CPU, once into the cache (written atomically), and loaded. Raises
    OSError or subprocess.SubprocessError where that fails (no compiler, a compiler error)."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not compiler:
        raise OSError("no C compiler (cc, gcc, or CC) found")
    defines = (compiler_march(), *defines)
    runtime = openmp_runtime()
    link = [runtime] if runtime else ["-fopenmp"]
    key = b"\0".join([source.read_bytes(), *map(str.encode, (compiler, *C_FLAGS, *defines, *link, _cpu()))])
    folder = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "lora-llama" / "kernels"
    target = folder / f"{source.stem}-{hashlib.sha256(key).hexdigest()[:16]}.so"
    if not target.exists():
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=folder) as tmp:
            built, objects = Path(tmp) / target.name, Path(tmp) / f"{source.stem}.o"
            for command in (
                [compiler, *C_FLAGS, *defines, "-c", str(source), "-o", str(objects)],
                [compiler, "-shared", str(objects), *link, "-o", str(built), "-lm"],
            ):
                done = subprocess.run(command, capture_output=True, text=True, timeout=300)
                if done.returncode:
                    raise OSError(f"{Path(compiler).name} failed: {(done.stderr or done.stdout).strip()[-300:]}")
            os.replace(built, target)
    return ctypes.CDLL(str(target))


def c_library_or_none(
    source: Path, instead: str, signatures: dict[str, list], defines: tuple[str, ...] = ()
) -> ctypes.CDLL | None:
    """c_library(source, defines) with each function's argument types set (`signatures`: name -> ctypes types), or
    None and one warning where building fails: what runs `instead`, and why."""
    try:
        lib = c_library(source, defines)
    except (OSError, subprocess.SubprocessError) as e:
        cause = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        warnings.warn(f"{instead}: building {source.name} failed ({cause})", stacklevel=3)
        return None
    for name, types in signatures.items():
        getattr(lib, name).argtypes = types
    return lib


def pointers(*tensors: torch.Tensor) -> list[ctypes.c_void_p]:
    """The tensors' data addresses, as a C loop takes them."""
    return [ctypes.c_void_p(t.data_ptr()) for t in tensors]


def openmp_runtime() -> str | None:
    """The GNU OpenMP library this process has loaded (torch's, where another is loaded too), by path, where /proc
    says; linked against it by path, a C loop needs it by its own name and so shares its threads even where torch's
    copy is renamed."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split(maxsplit=5)[-1].strip() for line in f if "libgomp" in line}
    except OSError:
        return None
    torch_lib = str(Path(torch.__file__).parent)
    return min(paths, key=lambda path: (not path.startswith(torch_lib), path)) if paths else None


def _cpu() -> str:
    """What -march=native compiles for: the CPU's flags (the cache may be shared by machines)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), platform.processor())
    except OSError:
        return platform.processor() + platform.machine()
