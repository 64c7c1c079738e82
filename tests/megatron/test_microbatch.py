import pytest
import torch

from armor_megatron.megatron.microbatch import split_microbatches


def test_microbatches_trim_to_their_longest_sequence_and_zero_the_padding():
    ids = torch.arange(20).view(4, 5)
    ids[0, 2:] = -100  # a pad id outside the vocabulary
    mbs = split_microbatches(ids, torch.tensor([2, 3, 5, 1]), micro_batch_size=3)
    assert [mb.index.tolist() for mb in mbs] == [[0, 1, 2], [3]]
    assert mbs[0].tokens.tolist() == [[0, 1, 0, 0, 0], [5, 6, 7, 0, 0], [10, 11, 12, 13, 14]]
    assert mbs[1].tokens.tolist() == [[15]] and mbs[1].position_ids.tolist() == [[0]]
    with pytest.raises(ValueError, match="B >= 1"):
        split_microbatches(ids[:0], torch.tensor([], dtype=torch.long), 2)
    with pytest.raises(ValueError, match=r"lengths must lie in \[1, 5\]"):
        split_microbatches(ids, torch.tensor([0, 1, 1, 1]), 2)


def test_microbatch_lengths_round_up_to_the_sequence_parallel_multiple():
    ids = torch.arange(20).view(4, 5) + 1
    mbs = split_microbatches(ids, torch.tensor([2, 3, 5, 1]), micro_batch_size=3, multiple_of=4)
    # longest 5 -> 8 (3 zero columns past T = 5), longest 1 -> 4
    assert [tuple(mb.tokens.shape) for mb in mbs] == [(3, 8), (1, 4)]
    assert mbs[0].tokens[2].tolist() == [11, 12, 13, 14, 15, 0, 0, 0] and mbs[1].tokens.tolist() == [[16, 0, 0, 0]]


def test_host_tensors_go_to_a_gpu_through_pinned_memory_and_nowhere_else():
    from armor_megatron.megatron.microbatch import pinned_copy, to_device

    host = torch.ones(3)
    # a pageable host-to-GPU copy makes the host wait for the GPU's queue; pinned memory needs a GPU
    assert pinned_copy(host, "cuda") and pinned_copy(host, torch.device("cuda", 1))
    assert not pinned_copy(host, "cpu") and not pinned_copy(host, "meta") and not pinned_copy(host, None)
    assert not pinned_copy(host.to("meta"), "cuda")  # device memory is not the host's to pin
    assert to_device(host, "cpu") is host and to_device(host, None) is host  # no copy, no pinning on CPU
    moved = to_device(host, "meta")
    assert moved.device.type == "meta" and not host.is_pinned()
