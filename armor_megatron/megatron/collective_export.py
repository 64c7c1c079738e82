"""Exports whose reading runs collectives: every rank reads its own once, to the end.

A Megatron weight export (`weight_export.HFWeightExport`) gathers tensor-parallel shards and sends
buckets between ranks *while it is read*: reading it is a fixed sequence of collectives. Every
rank therefore reads its own export exactly once and completely (rank 0 may :meth:`deliver
<weight_export.HFWeightExport.deliver>` it instead). A rank that reads part of it (a ``break``,
``itertools.islice``, a consumer that fails silently) or skips it leaves the other ranks waiting
in a collective it never joins, and the job hangs until the collective timeout.
`CollectiveExport` turns those mistakes into an `ExportReadError` on the rank that makes them:

* a second read (iteration, delivery) raises: a spent export is not an empty one;
* :meth:`~CollectiveExport.close`, and leaving a ``with export:`` block without an exception,
  raise unless the export was read to the end; the message names the rank and how far it read;
* :meth:`~CollectiveExport.drain` reads what is left and drops it: the way for a rank to take
  part when it has no use for the tensors (or when a consumer may or may not have read them);
* an export garbage-collected part-read (a ``for`` loop left by ``break``, outside ``with``)
  writes the same message to stderr, since Python ignores exceptions raised there.

Usage, on every rank::

    with HFWeightExport(model_chunks, arch) as export:
        if rank == 0:
            engine.update_weights(export, version)   # iterates it, or delivers it
        else:
            export.drain()                           # this rank's gathers and sends

The check is per rank and needs no communication: the rank that stops early raises, its process
exits, and the launcher (torchrun, SLURM) ends the job instead of letting it hang.
"""

from __future__ import annotations

import abc
import sys
from collections.abc import Generator, Iterator
from types import TracebackType

import torch

from armor_megatron.megatron.dist import global_rank

NamedTensor = tuple[str, torch.Tensor]


class ExportReadError(RuntimeError):
    """A collective export read twice, or left before its end (a caller's bug that would hang the job)."""


class CollectiveExport(abc.ABC):
    """``(name, tensor)`` pairs streamed by collectives: iterable once, to be read to the end on every rank.

    Subclasses implement :meth:`_items` (the stream: every collective of this rank's read, in
    order); a subclass offering another way to read (a delivery) brackets it with
    :meth:`_begin` and :meth:`_read_to_end`. See the module docstring for the contract.
    """

    def __init__(self) -> None:
        self._reader: Generator[NamedTensor, None, None] | None = None
        self._read_as: str | None = None  # how the read began: "iterated", "delivered", "drained"
        self._taken = 0  # pairs this rank has been handed so far
        self._finished = False
        self._closed = False

    @abc.abstractmethod
    def _items(self) -> Iterator[NamedTensor]:
        """This rank's stream: runs its collectives as it is advanced, yields what this rank receives."""

    # ------------------------------------------------------------------ reading
    def __iter__(self) -> Iterator[NamedTensor]:
        self._begin("iterated")
        self._reader = self._reading()
        return self._reader

    def _reading(self) -> Generator[NamedTensor, None, None]:
        for item in self._items():
            self._taken += 1
            yield item
        self._finished = True

    def drain(self) -> None:
        """Read whatever is left of this rank's stream, dropping the tensors (a no-op once it is read).

        Raises `ExportReadError` if the export was closed before its end, or a delivery of it failed.
        """
        if self._finished:
            return
        if self._closed:
            raise ExportReadError(f"rank {global_rank()}: cannot drain a weight export closed before its end")
        if self._read_as is None:
            iter(self)
            self._read_as = "drained"
        if self._reader is None:
            raise ExportReadError(
                f"rank {global_rank()}: the weight export's delivery did not finish; nothing to drain"
            )
        for _ in self._reader:
            pass

    @property
    def finished(self) -> bool:
        """Whether this rank has read the export to its end (every collective of its read done)."""
        return self._finished

    def _begin(self, how: str) -> None:
        """Start this rank's one read (``how``: "iterated", "delivered"); refuse a second or a closed one."""
        if self._read_as is not None or self._closed:
            state = f"already {self._read_as}" if self._read_as else "closed"
            raise ExportReadError(
                f"rank {global_rank()}: this weight export was {state}; it streams once (reading it runs "
                "collectives on every rank): export the model again to read the weights again"
            )
        self._read_as = how

    def _read_to_end(self) -> None:
        """Record that this rank's read finished (for reads other than iteration)."""
        self._finished = True

    # ------------------------------------------------------------------ leaving
    def close(self) -> None:
        """End this rank's use of the export; raise `ExportReadError` unless it was read to the end."""
        if self._closed:
            return
        self._closed = True
        if not self._finished:
            if self._reader is not None:
                self._reader.close()
            raise ExportReadError(self._left_early())

    def __enter__(self) -> CollectiveExport:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is None:
            self.close()
        else:  # the exception in flight says more than an unfinished read would
            self._closed = True

    def __del__(self) -> None:
        if self._read_as is not None and not (self._finished or self._closed):
            self._closed = True
            sys.stderr.write(f"{ExportReadError.__name__}: {self._left_early()}\n")

    def _left_early(self) -> str:
        read = "unread" if self._read_as is None else f"after {self._taken} tensors ({self._read_as})"
        return (
            f"rank {global_rank()} left its weight export {read}: every rank must read it to the end "
            "(iterate it, deliver it on rank 0, or drain() it); its reads are collectives the other ranks "
            "now wait in"
        )
