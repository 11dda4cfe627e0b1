"""Peak memory of one call beyond what existed before it, measured the same way by every benchmark.

CUDA: the allocator's peak over what was allocated before the call. CPU (Linux): the process's peak RSS (VmHWM,
reset to the current RSS first, so that the setup's transients do not hide the call's) over its RSS before the
call; run it in a fresh process, so that nothing else the process did counts.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def status_kib(field: str) -> int:
    """A field of /proc/self/status in KiB (VmRSS, VmHWM)."""
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith(field + ":"))


def reset_peak_rss() -> int:
    """Reset the peak RSS (VmHWM) to the current RSS; returns that RSS in KiB."""
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")
    return status_kib("VmRSS")


def peak_extra_bytes(run: Callable[[], object], device: torch.device | None = None) -> int:
    """Bytes `run()` adds at its peak: on `device` when it is CUDA (default: CUDA when available), else peak RSS."""
    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        run()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - base
    base = reset_peak_rss()
    run()
    return (status_kib("VmHWM") - base) * 1024
