"""Trainer memory released for a colocated engine comes back bit for bit (megatron/offload.py)."""

import pytest
import torch

from armor_megatron.megatron.dist import ParallelConfig
from armor_megatron.megatron.offload import HostOffload
from tests.megatron.spawn import run_ranks
from tests.megatron.test_actor import OPTIM, _actor, _logprobs, make_batch, settings

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


def test_scratch_storages_are_freed_without_a_host_copy_and_come_back_zeroed():
    weights, grads = torch.randn(6), torch.randn(10)
    grad_view = grads[2:4]
    memory = HostOffload([weights, grads, grad_view], scratch=[grads])
    assert memory.nbytes == 6 * 4  # only the weights travel
    before = weights.clone()
    memory.offload()
    assert grads.untyped_storage().nbytes() == 0 and memory.nbytes == 6 * 4
    memory.reload()
    assert torch.equal(weights, before) and not grads.any() and grad_view.data_ptr() == grads.data_ptr() + 8


def test_storages_off_the_compute_device_stay_where_they_are():
    """A reference kept in host memory (reference.offload) is not copied again."""
    on_host = torch.randn(4)
    memory = HostOffload([on_host], device=torch.device("cuda", 0))
    memory.offload()
    assert on_host.untyped_storage().nbytes() == 16 and memory.nbytes == 0
    memory.reload()


def test_host_copies_have_the_exact_size_and_are_reused():
    a, b = torch.randn(3), torch.randn(7, dtype=torch.float64)
    memory = HostOffload([a, b])
    memory.offload()
    copies = list(memory._host)
    assert [c.numel() for c in copies] == [12, 56]
    memory.reload()
    memory.offload()
    assert all(x is y for x, y in zip(memory._host, copies))  # same sizes: the same buffers
    memory.reload()


def test_host_views_let_a_model_read_its_weights_while_offloaded():
    chunk = torch.nn.Linear(3, 2)
    model = type("Model", (), {"model_chunks": [chunk]})()
    memory = HostOffload.of(model)
    expected = {k: v.detach().clone() for k, v in chunk.state_dict().items()}
    weight = chunk.weight
    memory.offload()
    with memory.host_views(model):
        assert all(torch.equal(v, expected[k]) for k, v in chunk.state_dict().items())
        assert chunk.weight is weight  # the same parameter, reading the host copy
    assert weight.untyped_storage().nbytes() == 0  # back to the freed device storage
    memory.reload()
    assert torch.equal(chunk.weight, expected["weight"])
    with memory.host_views(model):  # not offloaded: nothing to swap
        assert chunk.weight.untyped_storage().nbytes() > 0


def test_released_reloads_after_an_error():
    t = torch.ones(4)
    memory = HostOffload([t])
    with pytest.raises(RuntimeError, match="engine died"), memory.released():
        raise RuntimeError("engine died")
    assert torch.equal(t, torch.ones(4))


def _snapshot(memory_models):
    """(tensor, copy) of what an offload keeps, and the gradient buffers it only frees."""
    from armor_megatron.megatron.offload import model_scratch_tensors, model_tensors

    scratch = [t for m in memory_models for t in model_scratch_tensors(m)]
    pointers = {t.untyped_storage().data_ptr() for t in scratch}
    kept = [t for m in memory_models for t in model_tensors(m) if t.untyped_storage().data_ptr() not in pointers]
    return [(t, t.detach().clone()) for t in kept], scratch


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
            reference = ReferenceModel(settings(ARCH, ParallelConfig(), dtype=dtype))
            reference.reset_from(actor)
            memory = HostOffload.of(actor, reference)
            freed = restored = None
            for step in range(2):
                if offload and step == 1:  # optimizer state, grads and master weights exist by now
                    snapshot, scratch = _snapshot([actor, reference])
                    assert scratch and any(g.abs().sum() > 0 for g in scratch)  # last step's gradients
                    memory.offload()
                    freed = all(t.untyped_storage().nbytes() == 0 for t, _ in snapshot)
                    freed = freed and all(g.untyped_storage().nbytes() == 0 for g in scratch)
                    memory.reload()
                    restored = all(
                        torch.equal(t.reshape(-1).view(torch.uint8), s.reshape(-1).view(torch.uint8))
                        for t, s in snapshot
                    )
                    restored = restored and all(not g.any() for g in scratch)  # zeroed, as every update starts
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
        settings(ARCH, ParallelConfig(), dtype="bfloat16"), optimizer=OPTIM, loss=LOSS, total_steps=10, seed=5
    )


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_step_after_offload_matches_a_step_without(dtype):
    (plain, _, _, _), (offloaded, freed, restored, nbytes) = run_ranks(offload_worker, 1, dtype, timeout=280)[0]
    assert freed and restored and nbytes > 0
    assert all(torch.equal(a, b) for a, b in zip(plain, offloaded))
