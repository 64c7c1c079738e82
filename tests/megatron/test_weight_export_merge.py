"""The weight export's merge of TP shards, in one process: the shards of every parameter of a TP=1
model, split as a TP=2 layout holds them (the converter's rules), merge back into the HF tensors
the TP=1 export gives, rank 0's shard first. The multi-rank exports (test_weight_export.py) gather
real shards; this catches a merge in the wrong order without starting ranks."""

import dataclasses

import pytest
import torch

from armor_megatron.convert import tp_split
from armor_megatron.megatron import dist as mdist
from armor_megatron.megatron.dist import ParallelConfig
from tests.megatron.test_parallel_logprobs import QWEN3

ARCH = dataclasses.replace(QWEN3, vocab_size=128)  # the vocabulary splits over 2 ranks too

pytestmark = pytest.mark.timeout(120)


def test_tp_shards_merge_in_rank_order_into_the_whole_tensors(world_of_one):
    from armor_megatron.megatron.reference import ReferenceModel
    from armor_megatron.megatron.trained_model import ModelSettings
    from armor_megatron.megatron.weight_export import _merged_pieces, _plan

    mdist.set_model_parallel(ParallelConfig(), ARCH, seed=5)
    model = ReferenceModel(ModelSettings(ARCH, ParallelConfig(), dtype="float32", micro_batch_size=2))
    kinds = set()
    for p in _plan(model.model_chunks, ARCH):
        whole = [v for views in _merged_pieces(p, [p.tensor], ARCH) for v in views]
        if not p.gather:
            continue
        (piece,) = p.pieces  # a dense model: one Megatron tensor per parameter
        rule = piece.ref.rule
        kinds.add(rule.tp)
        shards = tp_split(ARCH, rule, p.tensor, 2)
        assert not torch.equal(shards[0], shards[1]), piece.ref  # the order is visible in the result
        merged = [v for views in _merged_pieces(p, list(shards), ARCH) for v in views]
        assert [n for n, _ in merged] == [n for n, _ in whole]
        for (name, a), (_, b) in zip(merged, whole):
            assert torch.equal(a, b), name
    # fused QKV and embeddings split by rows, the gated MLP's halves, the row-parallel projections
    assert {"glu", "row", "vocab"} <= kinds, kinds
