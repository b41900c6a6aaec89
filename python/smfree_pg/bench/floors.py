"""The copy floors of ranks that share a GPU: what the bare copies cost that an exchange between
them could at best be made of, timed on that GPU in the same run.

With one GPU, smfree's default copies within it (SMFREE_LOCAL_COPIES=peer_gpu, no peer GPU)
bounce through pinned host memory on copy engines: a device-to-host copy, then a host-to-device
one. With SMFREE_LOCAL_COPIES=driver they are one copy within the GPU, which the driver runs on
SMs. So the floors of one message are: D2H then H2D in turn; D2H and H2D overlapped (two
streams: what a pipelined bounce could reach); one device-local copy.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

FLOORS = {
    "d2h_h2d": "one D2H then one H2D pinned copy, in turn",
    "d2h_h2d_overlapped": "one D2H and one H2D pinned copy at once, on two streams",
    "device_local": "one copy within the GPU (on SMs)",
}
# Their column titles.
FLOOR_TITLES = {"d2h_h2d": "D2H+H2D", "d2h_h2d_overlapped": "D2H||H2D",
                "device_local": "device-local"}


class CopyFloors:
    """Buffers of `size` bytes on `device` and in pinned host memory, and the timed copies."""

    def __init__(self, device: torch.device, size: int) -> None:
        self.device = device
        self.src = torch.ones(size, dtype=torch.uint8, device=device)
        self.dst = torch.empty(size, dtype=torch.uint8, device=device)
        self.host_out = torch.empty(size, dtype=torch.uint8).pin_memory()
        self.host_in = torch.ones(size, dtype=torch.uint8).pin_memory()
        self.streams = (torch.cuda.Stream(device), torch.cuda.Stream(device))

    def _copies(self, floor: str) -> Callable[[], None]:
        first, second = self.streams

        def d2h_h2d():
            with torch.cuda.stream(first):
                self.host_out.copy_(self.src, non_blocking=True)
                self.dst.copy_(self.host_out, non_blocking=True)

        def d2h_h2d_overlapped():
            with torch.cuda.stream(first):
                self.host_out.copy_(self.src, non_blocking=True)
            with torch.cuda.stream(second):
                self.dst.copy_(self.host_in, non_blocking=True)

        def device_local():
            with torch.cuda.stream(first):
                self.dst.copy_(self.src, non_blocking=True)

        return {"d2h_h2d": d2h_h2d, "d2h_h2d_overlapped": d2h_h2d_overlapped,
                "device_local": device_local}[floor]

    def seconds(self, floor: str, iters: int) -> float:
        """Seconds per pass of `floor`'s copies, over `iters` passes queued back to back (each
        pass after the last one's copies, CUDA events on the GPU's clock)."""
        copies = self._copies(floor)
        main = torch.cuda.current_stream(self.device)
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(self.device)
        start.record(main)
        for _ in range(iters):
            for stream in self.streams:
                stream.wait_stream(main)
            copies()
            for stream in self.streams:
                main.wait_stream(stream)
        end.record(main)
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / iters


def measure_floors(device: torch.device, size: int, iters: int, repeats: int
                   ) -> dict[str, list[float]]:
    """Per floor, `repeats` samples of seconds per pass (`iters` passes each), the floors taking
    turns, after one untimed pass each."""
    floors = CopyFloors(device, size)
    for floor in FLOORS:
        floors.seconds(floor, 1)
    samples: dict[str, list[float]] = {floor: [] for floor in FLOORS}
    for _ in range(repeats):
        for floor in FLOORS:
            samples[floor].append(floors.seconds(floor, iters))
    return samples
