"""Run a function on N local ranks (spawned processes, gloo) with a hard timeout.

`run_ranks(fn, world_size, *args, timeout=...)` sets the torchrun variables for each child,
calls ``fn(rank, *args)`` there and returns the per-rank results; a rank that raises, dies
or outlives the timeout fails the caller with its traceback.

No port race: the parent hosts the rendezvous store itself, bound to port 0 and held for the
whole run, and the children join it as clients, exactly as under torchrun, whose agent hosts the
store and sets ``TORCHELASTIC_USE_AGENT_STORE=True`` (torch.distributed then connects every rank,
rank 0 included, to ``MASTER_ADDR:MASTER_PORT`` instead of starting a server there). A port picked
free, released and bound again seconds later by a child can be taken in between by another test.
"""

import datetime
import os
import pickle
import tempfile
import time
import traceback

import torch.distributed
import torch.multiprocessing as mp

HOST = "127.0.0.1"


def rendezvous_store(timeout_s: float = 300.0) -> torch.distributed.TCPStore:
    """A TCPStore server on a port the OS picked (held until the store is dropped); children reach
    it through ``MASTER_PORT=store.port`` with ``TORCHELASTIC_USE_AGENT_STORE=True``."""
    return torch.distributed.TCPStore(
        HOST, 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=timeout_s)
    )


def _entry(fn, rank, world_size, port, out_dir, args):
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),  # one node, as torchrun sets it
        MASTER_ADDR=HOST,
        MASTER_PORT=str(port),
        TORCHELASTIC_USE_AGENT_STORE="True",
        OMP_NUM_THREADS="1",
    )
    try:
        result = ("ok", fn(rank, *args))
    except BaseException:  # noqa: BLE001 - report everything to the parent
        result = ("error", traceback.format_exc())
    with open(os.path.join(out_dir, f"{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)


def run_ranks(fn, world_size, *args, timeout=240):
    ctx = mp.get_context("spawn")
    store = rendezvous_store(timeout)
    with tempfile.TemporaryDirectory() as out_dir:
        procs = [
            ctx.Process(target=_entry, args=(fn, r, world_size, store.port, out_dir, args)) for r in range(world_size)
        ]
        try:
            for p in procs:
                p.start()
            deadline = time.monotonic() + timeout
            for p in procs:
                p.join(max(0.0, deadline - time.monotonic()))
            alive = [r for r, p in enumerate(procs) if p.is_alive()]
        finally:  # also when the caller is interrupted (Ctrl-C, pytest-timeout) while it waits
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join()
        del store  # the port is held until every rank is gone
        results, errors = [], []
        for r in range(world_size):
            path = os.path.join(out_dir, f"{r}.pkl")
            if not os.path.exists(path):
                errors.append(
                    f"rank {r}: " + ("timed out" if r in alive else f"died with exit code {procs[r].exitcode}")
                )
                continue
            with open(path, "rb") as f:
                status, value = pickle.load(f)
            if status == "error":
                errors.append(f"rank {r}:\n{value}")
            results.append(value)
        if errors:
            raise AssertionError("\n".join(errors))
        return results
