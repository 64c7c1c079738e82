"""Host bytes in use, sampled after every torch op: how the tests measure a computation's peak on CPU.

glibc's ``mallinfo2`` (``hblkhd`` + ``uordblks``: mmap'd and heap blocks in use) read by a
``TorchDispatchMode`` after each op, so a peak between two Python lines is seen too.

    with OpPeak() as peak:
        ...
    peak.bytes   # the most in use at any op, above what was in use when the block began
"""

import ctypes

from torch.utils._python_dispatch import TorchDispatchMode


class _MallInfo(ctypes.Structure):
    _fields_ = [
        (n, ctypes.c_size_t)
        for n in "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()
    ]


def available() -> bool:
    """Whether this C library has ``mallinfo2`` (glibc 2.33 and newer)."""
    return hasattr(ctypes.CDLL("libc.so.6"), "mallinfo2")


def in_use() -> int:
    """Bytes malloc has handed out and not had back."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _MallInfo
    info = libc.mallinfo2()
    return info.hblkhd + info.uordblks


class OpPeak(TorchDispatchMode):
    """The peak of `in_use` over the ops run inside the block, above the baseline (`rebase`: now)."""

    def __enter__(self):
        self.base = self.peak = in_use()
        return super().__enter__()

    def rebase(self) -> None:
        """Measure from here (after one-off allocations of a first op)."""
        self.base = self.peak = in_use()

    @property
    def bytes(self) -> int:
        return self.peak - self.base

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.peak = max(self.peak, in_use())
        return out
