"""Tensor bytes moved file to file inside the kernel.

Every layout the converter handles is a permutation of row blocks (``rules.row_blocks``), so an
output tensor is the concatenation of byte ranges of the input files: a list of
``FileSegment``. ``copy_segments`` hands them to ``copy_file_range(2)``, which copies page
cache to page cache (or lets the file system copy server-side / share extents) without the
bytes ever entering this process: measured on the development machines (ext4, 2 GB, warm
cache), 0.60-0.70 s against 0.65 s for ``cp`` and 1.8-2.4 s for ``read``/``write`` through
a buffer. Where the kernel refuses (copies across file systems before Linux 5.3 or between
different file-system types since 5.19, some network and FUSE file systems), the bytes go
through one bounded buffer instead.

``HoleFillingWriter`` lets ``torch.save`` write an archive around such a copy: under
``torch.serialization.skip_data()`` torch writes a tensor's metadata and seeks over its data
record; the writer fills that hole from the segments it was handed. (This is how DCP's
torch_dist items are written without the tensor passing through memory.)
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import io
import math
import os
from collections.abc import Iterator, Sequence

import torch

# copy_file_range errors that mean "not here", not "broken input": fall back to read/write.
_UNSUPPORTED = {errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL, errno.EPERM}
FALLBACK_BUFFER_BYTES = 64 * 2**20


@dataclasses.dataclass(frozen=True)
class FileSegment:
    """``nbytes`` bytes at ``offset`` of the open file descriptor ``fd``."""

    fd: int
    offset: int
    nbytes: int

    def rows(self, first: int, count: int, total_rows: int) -> FileSegment:
        """Rows ``first:first+count`` of a row-major tensor of ``total_rows`` rows stored here."""
        if self.nbytes % total_rows or not 0 <= first <= first + count <= total_rows:
            raise ValueError(f"rows {first}:{first + count} of a {total_rows}-row, {self.nbytes}-byte segment")
        row_bytes = self.nbytes // total_rows
        return FileSegment(self.fd, self.offset + first * row_bytes, count * row_bytes)


def total_bytes(segments: Sequence[FileSegment]) -> int:
    """The bytes of all ``segments`` together."""
    return sum(s.nbytes for s in segments)


def read_chunks(segment: FileSegment, buffer: memoryview) -> Iterator[memoryview]:
    """Read a segment into ``buffer``, one buffer-full at a time.

    The segment's bytes read into `buffer`, a buffer-full at a time (each view is valid until
    the next one); EOFError if the file is shorter than the segment.
    """
    done = 0
    while done < segment.nbytes:
        n = os.preadv(segment.fd, [buffer[: segment.nbytes - done]], segment.offset + done)
        if n <= 0:
            raise EOFError(f"file ended {segment.offset + done} bytes in, {segment.nbytes - done} bytes short")
        yield buffer[:n]
        done += n


def _copy_through_buffer(segment: FileSegment, dst_fd: int, dst_offset: int) -> int:
    buffer = memoryview(bytearray(min(segment.nbytes, FALLBACK_BUFFER_BYTES)))
    done = 0
    for view in read_chunks(segment, buffer):
        written = 0
        while written < len(view):
            written += os.pwrite(dst_fd, view[written:], dst_offset + done + written)
        done += len(view)
    return done


def copy_segments(segments: Sequence[FileSegment], dst_fd: int, dst_offset: int) -> int:
    """Write the segments, concatenated, at ``dst_offset`` of ``dst_fd`` (whose file position is left alone).

    Returns the bytes written. EOFError if a source file is shorter than claimed.
    """
    at, kernel = dst_offset, hasattr(os, "copy_file_range")
    for segment in segments:
        done = 0
        while done < segment.nbytes:
            src, dst, left = segment.offset + done, at + done, segment.nbytes - done
            if kernel:
                try:
                    n = os.copy_file_range(segment.fd, dst_fd, left, src, dst)
                except OSError as e:
                    if e.errno not in _UNSUPPORTED:
                        raise
                    kernel = False  # for the rest of this call; the next one asks the kernel again
                    continue
            else:
                n = _copy_through_buffer(FileSegment(segment.fd, src, left), dst_fd, dst)
            if n == 0:
                raise EOFError(f"file ended {src} bytes in, {left} bytes short")
            done += n
        at += segment.nbytes
    return at - dst_offset


@contextlib.contextmanager
def _torch_save_without_data() -> Iterator[None]:
    """Run torch.save with the tensor data left out (a hole in the file).

    torch.save writes an archive's records but seeks over the tensor data and leaves the zip
    CRC-32 empty (torch.load does not check it).
    """
    before = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    try:
        with torch.serialization.skip_data():
            yield
    finally:
        torch.serialization.set_crc32_options(before)


class HoleFillingWriter(io.BufferedWriter):
    """A buffered file writer that appends ``torch.save`` archives whose tensor data are file segments.

    Torch writes the archive around a hole (``skip_data``) and the seek over the hole is turned into
    ``copy_segments``.
    """

    def __init__(self, path: str):
        super().__init__(io.FileIO(path, "wb"))
        self._pending: Sequence[FileSegment] | None = None
        self._error: Exception | None = None

    def save_tensor(self, shape: Sequence[int], dtype: torch.dtype, segments: Sequence[FileSegment]) -> None:
        """Append a ``torch.save`` archive of a tensor whose data are file segments.

        Append what ``torch.save(tensor, self)`` would, for the row-major tensor of ``shape``
        and ``dtype`` whose bytes are the segments, concatenated.
        """
        nbytes = math.prod(shape) * dtype.itemsize
        if total_bytes(segments) != nbytes:
            raise ValueError(f"segments of {total_bytes(segments)} bytes for a {list(shape)} {dtype} tensor")
        self._pending, self._error = segments, None
        try:
            with _torch_save_without_data():
                torch.save(torch.empty(shape, dtype=dtype), self)  # its memory is never touched
        except RuntimeError:
            if self._error is not None:  # torch reports a failed seek by its own symptom
                raise self._error from None
            raise
        if self._pending is not None:
            self._pending = None
            raise RuntimeError("torch.save wrote the tensor data instead of skipping it")

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        """Seek as a file does; a forward seek over a tensor's hole copies in the pending segments."""
        if whence == io.SEEK_CUR and offset > 0:
            segments, self._pending = self._pending, None
            if segments is None or total_bytes(segments) != offset:
                got = "nothing" if segments is None else f"{total_bytes(segments)} bytes"
                self._error = RuntimeError(f"a {offset}-byte hole was skipped with {got} to fill it")
                raise self._error
            self.flush()
            at = self.tell()
            copy_segments(segments, self.fileno(), at)
            return super().seek(at + offset)
        return super().seek(offset, whence)
