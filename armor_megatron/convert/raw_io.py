"""Byte-level helpers for streaming big tensors through files without extra copies.

Measured on the development machines (2 GB, warm page cache): one ``write()`` of 2 GB took
2-3 s where 8 MiB writes of the same bytes took ~0.8 s (as fast as ``cp``), so big writes are
issued in 8 MiB slices.
"""

from __future__ import annotations

import ctypes
import io

import torch

WRITE_SLICE_BYTES = 8 * 2**20


def byte_view(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor as a writable memoryview, without copying.

    Built from the data pointer rather than ``tensor.numpy()``, which would mark the storage
    non-resizable. Valid only while ``tensor`` is alive.
    """
    if not tensor.is_contiguous():
        raise ValueError("byte_view needs a contiguous tensor")
    if tensor.nbytes == 0:
        return memoryview(bytearray())
    return memoryview((ctypes.c_char * tensor.nbytes).from_address(tensor.data_ptr())).cast("B")


def write_sliced(write, data) -> int:
    """``write(data)`` in slices of at most WRITE_SLICE_BYTES; returns the bytes written."""
    view = memoryview(data).cast("B")
    done = 0
    while done < len(view):
        done += write(view[done:done + WRITE_SLICE_BYTES])
    return done


class SlicedFileIO(io.FileIO):
    """A raw file whose big writes go to the kernel in slices (see module docstring)."""

    def write(self, data) -> int:
        return write_sliced(super().write, data)


def open_sliced(path, mode: str = "wb") -> io.BufferedWriter:
    """``open(path, "wb")`` with sliced big writes."""
    return io.BufferedWriter(SlicedFileIO(path, mode))
