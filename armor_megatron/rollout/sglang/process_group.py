"""A process group for broadcasting weights from the trainer to SGLang engines.

SGLang's ``/init_weights_update_group`` joins a group built by its
``init_custom_process_group``: a ``tcp://master_address:master_port`` rendezvous (a ``TCPStore``
whose server is rank 0, the trainer), wrapped in ``PrefixStore(group_name)``, handed to torch's
``_new_process_group_helper``, which prefixes ``"<group_name>/"`` and ``"<device>/"`` again
(``cuda`` for NCCL, ``cpu`` for gloo). Each layer joins with ``/``, so every rendezvous key is
``"<group_name>/<group_name>//<device>//<key>"``: a group missing one layer never meets SGLang's.
:func:`weight_update_group` builds the same group directly as a backend object, so it
touches no global ``torch.distributed`` state: the trainer's own (Megatron) groups stay as
they are, and both ends may even live in one process (the test server does that).
"""

from __future__ import annotations

import datetime
from typing import Any

BACKEND_DEVICE = {"nccl": "cuda", "gloo": "cpu"}


class WeightUpdateGroup:
    """Rank ``rank`` of a ``world_size`` group; :meth:`broadcast` sends rank 0's tensor to all."""

    def __init__(
        self,
        master_address: str,
        master_port: int,
        rank: int,
        world_size: int,
        group_name: str,
        backend: str = "nccl",
        timeout: float = 600.0,
    ):
        import torch.distributed as dist

        if backend not in BACKEND_DEVICE:
            raise ValueError(f"weight update backend must be one of {sorted(BACKEND_DEVICE)}, got {backend!r}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside a group of {world_size}")
        delta = datetime.timedelta(seconds=timeout)
        self.rank, self.world_size, self.group_name, self.backend = rank, world_size, group_name, backend
        self._store = dist.TCPStore(master_address, int(master_port), world_size, is_master=rank == 0, timeout=delta)
        store = dist.PrefixStore(group_name, self._store)  # init_custom_process_group's own layer
        store = dist.PrefixStore(f"{BACKEND_DEVICE[backend]}/", dist.PrefixStore(f"{group_name}/", store))
        if backend == "gloo":
            self._pg = dist.ProcessGroupGloo(store, rank, world_size, delta)
        else:
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = delta
            self._pg = dist.ProcessGroupNCCL(store, rank, world_size, options)

    def broadcast(self, tensor: Any, src: int = 0) -> Any:
        import torch.distributed as dist

        opts = dist.BroadcastOptions()
        opts.rootRank = src
        self._pg.broadcast([tensor], opts).wait()
        return tensor

    def destroy(self) -> None:
        self._pg = None
        self._store = None
