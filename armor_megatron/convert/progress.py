"""Progress lines and the end-of-run summary of a conversion (tensors, bytes, seconds, peak RSS)."""

from __future__ import annotations

import dataclasses
import resource
import sys
import time
from typing import TextIO


def release_large_frees_to_os(threshold: int = 1 << 20) -> bool:
    """Make glibc serve allocations >= ``threshold`` with their own mmap, returned on free.

    By default glibc raises its mmap threshold to the size of the largest block freed so far,
    so after one big tensor every later tensor comes from the heap and stays resident when
    freed: a streaming conversion's RSS then grows with every distinct tensor size (measured:
    1.2 GiB instead of ~0.6 GiB for a 2 GB checkpoint). A fixed threshold turns that off.
    Process-wide, so only the command-line tools call it. Returns False where it does not apply.
    """
    import ctypes
    import ctypes.util

    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.mallopt(-3, threshold))  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        return False


def peak_rss_bytes() -> int:
    """Peak resident set size of this process so far.

    Linux: ``VmHWM`` of /proc/self/status -- ``ru_maxrss`` would also count the parent's peak,
    which a child inherits across fork and exec. Elsewhere ``ru_maxrss`` (KiB on Linux, bytes on macOS).
    """
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024


@dataclasses.dataclass
class Summary:
    """What a conversion moved and how long it took."""

    direction: str
    tensors: int
    bytes: int
    seconds: float
    peak_rss: int
    output: str

    def line(self) -> str:
        """The summary as one line: tensors, GiB, seconds, GiB/s, peak RSS and the output."""
        gib = 2**30
        return (
            f"{self.direction}: {self.tensors} tensors, {self.bytes / gib:.3f} GiB in {self.seconds:.1f} s "
            f"({self.bytes / gib / max(self.seconds, 1e-9):.2f} GiB/s), peak RSS {self.peak_rss / gib:.2f} GiB "
            f"-> {self.output}"
        )


class Progress:
    """Counts tensors and bytes; prints a line at most every ``every_s`` seconds to ``stream``."""

    def __init__(
        self,
        direction: str,
        total_tensors: int,
        total_bytes: int,
        stream: TextIO | None = sys.stderr,
        every_s: float = 10.0,
    ):
        self.direction, self.total_tensors, self.total_bytes = direction, total_tensors, total_bytes
        self.stream, self.every_s = stream, every_s
        self.tensors = self.bytes = 0
        self.start = self._last = time.monotonic()

    def advance(self, nbytes: int, tensors: int = 1) -> None:
        """Count ``tensors`` tensors of ``nbytes`` bytes done; print a progress line every ``every_s`` seconds."""
        self.tensors += tensors
        self.bytes += nbytes
        now = time.monotonic()
        if self.stream is not None and now - self._last >= self.every_s:
            self._last = now
            print(
                f"[{self.direction}] {self.tensors}/{self.total_tensors} tensors, "
                f"{self.bytes / 2**30:.2f}/{self.total_bytes / 2**30:.2f} GiB, {now - self.start:.0f} s",
                file=self.stream,
                flush=True,
            )

    def summary(self, output: str) -> Summary:
        """The :class:`Summary` of the conversion, written to ``output``."""
        return Summary(
            self.direction, self.tensors, self.bytes, time.monotonic() - self.start, peak_rss_bytes(), output
        )
