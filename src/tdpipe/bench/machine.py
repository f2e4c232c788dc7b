"""What ran a benchmark: CPU model, cores and the instruction sets the kernels can use.

Every bench writes this into its JSON and table, so numbers from different hosts are never compared
blindly: bf16 throughput on a CPU with AMX (amx_bf16) or avx512_bf16 and on one without (emulated bf16,
or float32 under --dtype auto) differ by several times.
"""
from __future__ import annotations

import os
import platform
from typing import Any

from tdpipe.config import cpu_flags, cpu_name

# the /proc/cpuinfo flags that decide which matmul and attention kernels run (x86 "flags", Arm "Features")
ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16", "avx_vnni", "amx_tile",
             "amx_bf16", "amx_int8", "asimd", "sve", "sve2", "bf16", "i8mm")


def isa_flags() -> list[str]:
    """The ISA_FLAGS this CPU reports, in ISA_FLAGS' order; [] where /proc/cpuinfo is unreadable."""
    have = cpu_flags()
    return [x for x in ISA_FLAGS if x in have]


def machine_info() -> dict[str, Any]:
    """CPU model, core counts, ISA flags, torch's CPU kernel level, platform and torch version."""
    import torch  # here, not at import: bench serve's client names its machine without loading torch first

    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    try:
        capability = torch.backends.cpu.get_cpu_capability()
    except AttributeError:  # older torch
        capability = None
    return {"cpu": cpu_name(), "cpu_count": os.cpu_count(), "usable_cores": usable, "isa": isa_flags(),
            "torch_cpu_capability": capability, "platform": platform.platform(), "torch": torch.__version__}


def write_json(path: str, result: dict[str, Any]) -> None:
    """A bench's figures as JSON, with the machine that measured them."""
    import json

    with open(path, "w") as f:
        json.dump({**result, "machine": machine_info()}, f, indent=1)


def describe(m: dict[str, Any]) -> str:
    """One line for a table header: 'Intel Xeon ... (2 usable cores of 2; avx512_bf16 amx_bf16 ...)'."""
    isa = " ".join(m.get("isa") or []) or "ISA flags unknown"
    cores = f"{m.get('usable_cores')} usable cores" + (f" of {m['cpu_count']}" if m.get("cpu_count") else "")
    return f"{m.get('cpu')} ({cores}; {isa})"


__all__ = ["ISA_FLAGS", "describe", "isa_flags", "machine_info", "write_json"]
