"""Trainer memory released for a colocated engine comes back bit for bit (megatron/offload.py)."""

import pytest
import torch

from armor_megatron.megatron.dist import ParallelConfig
from armor_megatron.megatron.offload import HostOffload
from tests.megatron.spawn import run_ranks
from tests.megatron.test_actor import OPTIM, _actor, _logprobs, make_batch

LOSS_INPUTS = ("old_logprobs", "ref_logprobs")


def test_storages_are_freed_and_restored_with_their_views():
    buffer = torch.arange(12, dtype=torch.float32)
    view, other = buffer[4:8].view(2, 2), torch.randn(3, 5)
    memory = HostOffload([buffer, view, other])
    assert memory.nbytes == (12 + 15) * 4  # the view shares the buffer's storage: counted once
    before = [buffer.clone(), other.clone()]
    memory.offload()
    assert buffer.untyped_storage().nbytes() == 0 and other.untyped_storage().nbytes() == 0
    memory.reload()
    assert torch.equal(buffer, before[0]) and torch.equal(other, before[1])
    view.add_(100)  # still a view into the same buffer
    assert buffer[4:8].tolist() == [104.0, 105.0, 106.0, 107.0]


def test_released_reloads_after_an_error():
    t = torch.ones(4)
    memory = HostOffload([t])
    with pytest.raises(RuntimeError, match="engine died"), memory.released():
        raise RuntimeError("engine died")
    assert torch.equal(t, torch.ones(4))


def _snapshot(memory_models):
    from armor_megatron.megatron.offload import model_tensors

    return [(t, t.detach().clone()) for m in memory_models for t in model_tensors(m)]


def offload_worker(rank, dtype):
    from armor_megatron.megatron import dist as mdist
    from armor_megatron.megatron.reference import ReferenceModel
    from tests.megatron.test_actor import ARCH

    mdist.initialize(ParallelConfig())
    try:
        batch = make_batch()
        results = []
        for offload in (False, True):
            actor = _actor(ParallelConfig()) if dtype == "float32" else _bf16_actor()
            reference = ReferenceModel(ARCH, ParallelConfig(), dtype=dtype, micro_batch_size=2)
            reference.reset_from(actor)
            memory = HostOffload.of(actor, reference)
            freed = restored = None
            for step in range(2):
                if offload and step == 1:  # optimizer state, grads and master weights exist by now
                    snapshot = _snapshot([actor, reference])
                    memory.offload()
                    freed = all(t.untyped_storage().nbytes() == 0 for t, _ in snapshot)
                    memory.reload()
                    restored = all(
                        torch.equal(t.reshape(-1).view(torch.uint8), s.reshape(-1).view(torch.uint8))
                        for t, s in snapshot
                    )
                full = {**batch, "old_logprobs": _logprobs(actor, batch), "ref_logprobs": _logprobs(reference, batch)}
                actor.train_step(full)
            params = [p.detach().clone() for p in actor.model_chunks[0].parameters()]
            results.append((params, freed, restored, memory.nbytes))
        return results
    finally:
        mdist.shutdown()


def _bf16_actor():
    from armor_megatron.megatron.actor import MegatronActor
    from tests.megatron.test_actor import ARCH, LOSS

    return MegatronActor(
        ARCH, ParallelConfig(), dtype="bfloat16", optimizer=OPTIM, loss=LOSS, micro_batch_size=2, total_steps=10, seed=5
    )


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_step_after_offload_matches_a_step_without(dtype):
    (plain, _, _, _), (offloaded, freed, restored, nbytes) = run_ranks(offload_worker, 1, dtype, timeout=280)[0]
    assert freed and restored and nbytes > 0
    assert all(torch.equal(a, b) for a, b in zip(plain, offloaded))
