"""A watchdog for memory that grows step after step: the leak that ends a long run in an out-of-memory crash.

After each optimizer step it records allocated and reserved memory (CUDA), or on CPU the bytes malloc has handed
out (glibc) and the process's resident memory; every sample stays in `samples`. Past a warm-up it fits a line to the recent steps; memory in use that
keeps rising (a steady slope over a window of steps) is reported with its growth per step, the allocator's
growth beside it, and the step at which memory would run out — as a warning, or, with
`memory_watchdog: error`, by stopping the run.
"""

from __future__ import annotations

import ctypes
import logging
import os
from dataclasses import dataclass, field

from transformers import TrainerCallback

from hellbender.errors import UserError

logger = logging.getLogger("hellbender")
MIB = 1024**2
WARMUP_STEPS = 2
WINDOW = 6  # steps fitted at once
MIN_SLOPE = 1 * MIB  # growth per step worth reporting
MIN_FIT = 0.9  # r^2: growth must be steady, not noise


class MemoryLeak(UserError):
    """Memory grew steadily from step to step and `memory_watchdog: error` asked to stop."""


def _cpu_resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class _Mallinfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks")
    ] + [("keepcost", ctypes.c_size_t)]


def _cpu_allocated_bytes() -> int | None:
    """Bytes malloc has handed out and not taken back (glibc >= 2.33), the CPU's counterpart of CUDA's allocated
    memory; None elsewhere. Resident memory alone misses growth served from memory freed earlier."""
    try:
        mallinfo2 = ctypes.CDLL(None).mallinfo2
    except AttributeError:
        return None
    mallinfo2.restype = _Mallinfo2
    info = mallinfo2()
    return info.uordblks + info.hblkhd


def _cpu_available_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares slope and r^2 of ys over xs."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True))
    syy = sum((y - my) ** 2 for y in ys)
    if sxx == 0 or syy == 0:
        return 0.0, 0.0
    slope = sxy / sxx
    return slope, (sxy * sxy) / (sxx * syy)


@dataclass
class MemoryWatchdog(TrainerCallback):
    mode: str = "warn"  # "warn" or "error"
    samples: list[tuple[int, int, int]] = field(default_factory=list)  # (step, bytes in use, bytes reserved)
    reported: bool = False

    def measure(self) -> tuple[int, int, int, str]:
        """(bytes in use, bytes held by the allocator, bytes left, what was measured). On CPU: malloc's bytes in
        use and the process's resident memory (resident memory for both where malloc cannot say)."""
        import torch

        if torch.cuda.is_available():
            free, _total = torch.cuda.mem_get_info()
            allocated, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
            return allocated, reserved, free + reserved - allocated, "allocated GPU memory"
        resident = _cpu_resident_bytes()
        allocated = _cpu_allocated_bytes()
        if allocated is None:
            return resident, resident, _cpu_available_bytes(), "resident memory"
        return allocated, resident, _cpu_available_bytes(), "allocated memory (malloc)"

    def on_step_end(self, args, state, control, **kwargs):
        used, reserved, left, what = self.measure()
        self.samples.append((state.global_step, used, reserved))
        recent = [s for s in self.samples if s[0] > WARMUP_STEPS][-WINDOW:]
        if self.reported or len(recent) < WINDOW:
            return
        slope, fit = fit_line([float(s[0]) for s in recent], [float(s[1]) for s in recent])
        if slope < MIN_SLOPE or fit < MIN_FIT:
            return
        self.reported = True
        reserved_slope, _ = fit_line([float(s[0]) for s in recent], [float(s[2]) for s in recent])
        runs_out = state.global_step + int(left / slope)
        message = (
            f"Memory grows by {slope / MIB:.1f} MiB per step ({what}: {used / MIB:.0f} MiB at step "
            f"{state.global_step}, steady over the last {WINDOW} steps; held by the allocator: {reserved / MIB:.0f} "
            f"MiB, {reserved_slope / MIB:+.1f} MiB per step); at this rate it runs out around step {runs_out}. "
            "Likely causes: tensors kept across steps (a list of losses or outputs that are not `.item()`-ed or "
            "detached), or a mutable container of tensors captured by activation checkpointing. Set "
            "`memory_watchdog: off` to silence this, or `error` to stop runs that leak."
        )
        if self.mode == "error":
            raise MemoryLeak(message)
        logger.warning(message)
