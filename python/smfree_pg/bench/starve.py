"""Starvation: the test that tells whether an operation needs an SM.

A profiler shows every `cudaMemcpy*` as a memcpy row, whether the driver moved the bytes with
a copy engine or with a copy kernel of its own (CUDA 13.0 drivers run every device-local copy
as a kernel). So instead a kernel holds every SM of the GPU for `ms` milliseconds (2 CTAs of
1024 threads and 100 KB of shared memory per SM, spinning on %globaltimer: no other CTA fits
anywhere until it ends), the operation is queued on another stream, and CUDA events say when
it ended: during the hold (copy engines, stream memory operations) or only after it (it needed
an SM). A control kernel queued the same way must end after the hold, or the GPU was not held.

The kernel is PTX, compiled by the driver at load: no compiler and no package beyond torch.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from functools import cache

import torch

from smfree_pg.bench.cuda_driver import check, driver

# Each thread spins until %globaltimer has advanced `ns`; thread 0 of each CTA stores what it
# saw, so the loop cannot be dropped.
_PTX = rb"""
.version 7.0
.target sm_70
.address_size 64

.visible .entry smfree_hold(.param .u64 ns, .param .u64 out)
.maxntid 1024, 1, 1
{
  .reg .pred p;
  .reg .u64 t0, t, d, limit, base, at;
  .reg .u32 tid, cta;
  ld.param.u64 limit, [ns];
  ld.param.u64 base, [out];
  mov.u64 t0, %globaltimer;
SPIN:
  mov.u64 t, %globaltimer;
  sub.u64 d, t, t0;
  setp.lt.u64 p, d, limit;
  @p bra SPIN;
  mov.u32 tid, %tid.x;
  setp.ne.u32 p, tid, 0;
  @p bra END;
  mov.u32 cta, %ctaid.x;
  cvta.to.global.u64 base, base;
  mul.wide.u32 at, cta, 8;
  add.u64 at, base, at;
  st.global.u64 [at], d;
END:
  ret;
}
"""
_THREADS = 1024
_CTAS_PER_SM = 2
_SHARED_BYTES = 100 * 1024
_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES


@dataclass(frozen=True)
class _Kernel:
    function: ctypes.c_void_p
    ctas: int
    out: torch.Tensor


@cache
def _kernel(device: int) -> _Kernel:
    with torch.cuda.device(device):
        torch.cuda.init()
        torch.zeros(1, device=device)  # the primary context, current on this thread
        module = ctypes.c_void_p()
        check(driver().cuModuleLoadData(ctypes.byref(module), ctypes.c_char_p(_PTX + b"\0")),
              "cuModuleLoadData (the SM-holding kernel)")
        function = ctypes.c_void_p()
        check(driver().cuModuleGetFunction(ctypes.byref(function), module, b"smfree_hold"),
              "cuModuleGetFunction")
        check(driver().cuFuncSetAttribute(function, _MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                          _SHARED_BYTES), "cuFuncSetAttribute")
        ctas = _CTAS_PER_SM * torch.cuda.get_device_properties(device).multi_processor_count
        out = torch.zeros(ctas, dtype=torch.int64, device=device)
    return _Kernel(function, ctas, out)


def launch(stream: torch.cuda.Stream, ms: float) -> None:
    """Queues on `stream` a kernel that holds every SM of its GPU for `ms` milliseconds."""
    kernel = _kernel(stream.device.index)
    ns = ctypes.c_uint64(int(ms * 1e6))
    out = ctypes.c_uint64(kernel.out.data_ptr())
    params = (ctypes.c_void_p * 2)(ctypes.cast(ctypes.byref(ns), ctypes.c_void_p),
                                   ctypes.cast(ctypes.byref(out), ctypes.c_void_p))
    with torch.cuda.device(stream.device):
        check(driver().cuLaunchKernel(kernel.function, kernel.ctas, 1, 1, _THREADS, 1, 1,
                                      _SHARED_BYTES, ctypes.c_void_p(stream.cuda_stream),
                                      params, None), "cuLaunchKernel (the SM-holding kernel)")


class Hold:
    """A hold of every SM of one GPU, and the clock to tell what ended during it.

        hold = Hold(device, ms=400)     # queued now on a stream of its own
        ... queue the operations on other streams ...
        hold.mark(stream)               # after each, on its stream: its end
        hold.control(stream)            # a kernel queued the same way: must end after
        ends = hold.finish()            # ms after the hold began, per mark; and the hold's
    """

    def __init__(self, device: int | torch.device, ms: float) -> None:
        self.device = torch.device("cuda", torch.device(device).index
                                   if isinstance(device, torch.device) else device)
        self.ms = ms
        _kernel(self.device.index)  # loaded before the clock starts
        self.stream = torch.cuda.Stream(device=self.device)
        self.start = torch.cuda.Event(enable_timing=True)
        self.end = torch.cuda.Event(enable_timing=True)
        self.marks: list[tuple[str, torch.cuda.Event]] = []
        with torch.cuda.device(self.device):
            self.start.record(self.stream)
            launch(self.stream, ms)
            self.end.record(self.stream)

    def mark(self, name: str, stream: torch.cuda.Stream | None = None) -> None:
        """Records, on `stream` (the current one by default), when what it holds so far ended."""
        event = torch.cuda.Event(enable_timing=True)
        with torch.cuda.device(self.device):
            event.record(stream or torch.cuda.current_stream(self.device))
        self.marks.append((name, event))

    def control(self, stream: torch.cuda.Stream | None = None) -> None:
        """Queues a one-CTA kernel on `stream` and marks its end as "control"."""
        stream = stream or torch.cuda.current_stream(self.device)
        with torch.cuda.stream(stream):
            torch.empty(1, device=self.device).fill_(1.0)
        self.mark("control", stream)

    def finish(self) -> "HoldResult":
        self.end.synchronize()
        for _, event in self.marks:
            event.synchronize()
        held = self.start.elapsed_time(self.end)
        ends = {name: self.start.elapsed_time(event) for name, event in self.marks}
        return HoldResult(held, ends)


@dataclass(frozen=True)
class HoldResult:
    held_ms: float            # when the hold ended, ms after it began
    ends: dict[str, float]    # per mark, ms after the hold began

    def during(self, name: str) -> bool:
        """Whether the marked work ended while every SM was held (with a margin of a tenth)."""
        return self.ends[name] < 0.9 * self.held_ms
