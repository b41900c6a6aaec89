"""The few CUDA driver calls the bench's probes need and torch does not offer: sharing a
buffer with another process (IPC) and copying between two GPUs' buffers on a stream that may
be capturing (torch's cross-device copy also orders both devices' current streams, which a
capture refuses).

The probes only: smfree's own code never comes here.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from functools import cache

import torch

_SUCCESS = 0
_IPC_LAZY_ENABLE_PEER_ACCESS = 1


class _IpcHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_ubyte * 64)]  # c_char would cut the bytes at a NUL


@cache
def driver() -> ctypes.CDLL:
    return ctypes.CDLL("libcuda.so.1")


def check(status: int, call: str) -> None:
    if status == _SUCCESS:
        return
    name = ctypes.c_char_p()
    driver().cuGetErrorName(status, ctypes.byref(name))
    raise RuntimeError(f"smfree bench: {call} failed: "
                       f"{(name.value or b'CUDA error').decode()} ({status})")


@dataclass(frozen=True)
class Exported:
    """What another process needs to map `bytes` bytes of a buffer: its allocation's IPC
    handle and the buffer's offset in that allocation."""

    handle: bytes
    offset: int
    bytes: int


def export(tensor: torch.Tensor) -> Exported:
    """The IPC export of `tensor`'s bytes (memory from torch's default allocator: cudaMalloc
    blocks, not expandable segments)."""
    with torch.cuda.device(tensor.device):
        base, size = ctypes.c_uint64(), ctypes.c_size_t()
        check(driver().cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size),
                                                  ctypes.c_uint64(tensor.data_ptr())),
               "cuMemGetAddressRange")
        handle = _IpcHandle()
        check(driver().cuIpcGetMemHandle(ctypes.byref(handle), base), "cuIpcGetMemHandle")
    return Exported(bytes(handle), tensor.data_ptr() - base.value,
                    tensor.numel() * tensor.element_size())


class Mapping:
    """Another process's exported buffer, mapped into this process on `device`; a device
    address. close() unmaps it."""

    def __init__(self, exported: Exported, device: torch.device) -> None:
        self.device = device
        handle = _IpcHandle.from_buffer_copy(exported.handle)
        base = ctypes.c_uint64()
        with torch.cuda.device(device):
            check(driver().cuIpcOpenMemHandle_v2(ctypes.byref(base), handle,
                                                    _IPC_LAZY_ENABLE_PEER_ACCESS),
                   "cuIpcOpenMemHandle")
        self.base = base.value
        self.address = self.base + exported.offset
        self.bytes = exported.bytes

    def close(self) -> None:
        if self.base:
            with torch.cuda.device(self.device):
                check(driver().cuIpcCloseMemHandle(ctypes.c_uint64(self.base)),
                       "cuIpcCloseMemHandle")
            self.base = 0


def copy_async(dst: int, src: int, size: int, stream: torch.cuda.Stream) -> None:
    """Copies `size` bytes between device addresses of any two GPUs on `stream` (a memcpy node
    when the stream captures)."""
    with torch.cuda.device(stream.device):
        check(driver().cuMemcpyAsync(ctypes.c_uint64(dst), ctypes.c_uint64(src),
                                       ctypes.c_size_t(size), ctypes.c_void_p(stream.cuda_stream)),
               "cuMemcpyAsync")
