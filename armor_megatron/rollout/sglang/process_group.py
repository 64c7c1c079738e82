"""A process group for broadcasting weights from a trainer rank to SGLang engines.

SGLang's ``/init_weights_update_group`` joins a group built by its
``init_custom_process_group``: a ``tcp://master_address:master_port`` rendezvous (a ``TCPStore``
whose server is rank 0, the trainer), wrapped in ``PrefixStore(group_name)``, handed to torch's
``_new_process_group_helper``, which prefixes ``"<group_name>/"`` and ``"<device>/"`` again
(``cuda`` for NCCL, ``cpu`` for gloo). Each layer joins with ``/``, so every rendezvous key is
``"<group_name>/<group_name>//<device>//<key>"``: a group missing one layer never meets SGLang's.
:class:`WeightUpdateGroup` builds the same group directly as a backend object, so it
touches no global ``torch.distributed`` state: the trainer's own (Megatron) groups stay as
they are, and both ends may even live in one process (the test server does that).

An engine keeps each group under its name (SGLang's ``_model_update_group`` is a dict, and each
``/update_weights_from_distributed`` names its group), so several trainer ranks can each be
rank 0 of a group of their own and broadcast to the same engines.

The trainer's end binds its rendezvous port *before* the engines are told it
(:func:`listen`; port 0 lets the OS pick one), so no other process can take it in between.
"""

from __future__ import annotations

import datetime
import socket
import threading
from collections.abc import Callable
from typing import Any

BACKEND_DEVICE = {"nccl": "cuda", "gloo": "cpu"}
_ABANDONED: list[Any] = []  # aborted groups' backends, never destroyed while their collectives may hang


def listen(world_size: int, port: int = 0, timeout: float = 600.0) -> Any:
    """Bind rank 0's rendezvous store now; the engines connect to it as clients.

    The server listens on every interface; with ``port`` 0 the OS picks one (read it from
    ``.port``).
    """
    import torch.distributed as dist

    return dist.TCPStore(
        "127.0.0.1",  # where this process's own client reaches the server
        int(port),
        world_size,
        is_master=True,
        timeout=datetime.timedelta(seconds=timeout),
        wait_for_workers=False,
    )


def address_towards(peer: str) -> str:
    """This host's address on the route to ``peer`` (what a process there can reach us at).

    The source address the kernel picks for it (no packet is sent); this host's name when that is a
    loopback address (``peer`` names this host through a hosts-file alias) and ``peer`` itself is
    not one.
    """
    if peer in ("localhost", "") or peer.startswith("127."):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((peer, 9))
        address = s.getsockname()[0]
    return socket.gethostname() if address.startswith("127.") else address


class WeightUpdateGroup:
    """Rank ``rank`` of a ``world_size`` group; :meth:`broadcast` sends rank 0's tensor to all.

    Rank 0 hosts the rendezvous: pass the ``store`` :func:`listen` bound (else it binds
    ``master_port`` here). Building the group waits until every rank has joined (gloo; NCCL
    meets at the first collective).
    """

    def __init__(
        self,
        master_address: str,
        master_port: int,
        rank: int,
        world_size: int,
        group_name: str,
        backend: str = "nccl",
        timeout: float = 600.0,
        store: Any = None,
    ):
        import torch.distributed as dist

        if backend not in BACKEND_DEVICE:
            raise ValueError(f"weight update backend must be one of {sorted(BACKEND_DEVICE)}, got {backend!r}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside a group of {world_size}")
        if store is not None and rank != 0:
            raise ValueError("only rank 0 hosts the rendezvous store")
        delta = datetime.timedelta(seconds=timeout)
        self.rank, self.world_size, self.group_name, self.backend = rank, world_size, group_name, backend
        if store is None:
            store = (
                listen(world_size, master_port, timeout)
                if rank == 0
                else dist.TCPStore(master_address, int(master_port), world_size, is_master=False, timeout=delta)
            )
        self.store: Any = store  # the rendezvous store (rank 0 hosts it); also a side channel to rank 0
        prefixed = dist.PrefixStore(group_name, store)  # init_custom_process_group's own layer
        prefixed = dist.PrefixStore(f"{BACKEND_DEVICE[backend]}/", dist.PrefixStore(f"{group_name}/", prefixed))
        self._pg: Any  # a c10d backend: ProcessGroupGloo or ProcessGroupNCCL, None once dropped
        if backend == "gloo":
            self._pg = dist.ProcessGroupGloo(prefixed, rank, world_size, delta)
        else:
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = delta
            self._pg = dist.ProcessGroupNCCL(prefixed, rank, world_size, options)

    def broadcast(self, tensor: Any, src: int = 0, cancelled: Callable[[], str | None] | None = None) -> Any:
        """Broadcast ``tensor`` from ``src``.

        ``cancelled()`` (checked about twice a second while the broadcast is under way) may return a
        reason to give up: then `RuntimeError`, and the group is unusable (a peer may be left in the
        collective).
        """
        import torch.distributed as dist

        opts = dist.BroadcastOptions()
        opts.rootRank = src
        if self._pg is None:
            raise RuntimeError(f"weight update group {self.group_name!r} was destroyed or abandoned")
        work = self._pg.broadcast([tensor], opts)
        if cancelled is not None:
            done = threading.Event()
            work.get_future().add_done_callback(lambda _: done.set())
            while not done.wait(0.5):
                reason = cancelled()
                if reason:
                    self._abandon()
                    raise RuntimeError(f"broadcast over {self.group_name!r} cancelled: {reason}")
        work.wait()
        return tensor

    def _abandon(self) -> None:
        """Abort the group (its peers may be stuck in a collective).

        Its backend object is kept alive: dropping it would wait for the pending collective until
        the group's timeout.
        """
        pg, self._pg = self._pg, None
        if pg is None:
            return
        try:
            pg.abort()
        except Exception:  # noqa: BLE001 - best effort
            pass
        _ABANDONED.append(pg)

    def destroy(self) -> None:
        """Drop this rank's group and store references."""
        self._pg = None
        self.store = None
