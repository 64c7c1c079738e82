"""Log-probs at TP=2, PP=2, TP=2×PP=2, PP=2×VPP=2 and (MoE) EP=2 equal TP=1 on the same weights.

One spawn per model: every rank first builds the TP=1 model, saves it with megatron's
dist_checkpointing and computes reference log-probs; then the same processes switch to each
layout, load that checkpoint (megatron reshards it) and compare. fp32 throughout.
"""

import pytest
import torch

from armor_megatron.megatron import dist as mdist
from armor_megatron.megatron.dist import ParallelConfig
from armor_megatron.models.arch import ModelArch
from tests.megatron.spawn import run_ranks

# vocab 125 is padded to 128 columns: the padding must stay out of the softmax.
QWEN3 = ModelArch(
    family="qwen3",
    vocab_size=125,
    hidden_size=32,
    num_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    ffn_hidden_size=48,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    max_position_embeddings=64,
    qk_norm=True,
    tie_word_embeddings=True,
    dtype="float32",
)
QWEN2 = ModelArch(
    family="qwen2",
    vocab_size=125,
    hidden_size=32,
    num_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    ffn_hidden_size=48,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    max_position_embeddings=64,
    qkv_bias=True,
    dtype="float32",
)
QWEN3_MOE = ModelArch(
    family="qwen3_moe",
    vocab_size=125,
    hidden_size=32,
    num_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    ffn_hidden_size=48,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    max_position_embeddings=64,
    qk_norm=True,
    num_experts=4,
    moe_router_topk=2,
    moe_ffn_hidden_size=16,
    dtype="float32",
)

LENGTHS = torch.tensor([12, 7, 3, 12, 9])


def _batch(arch):
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, arch.vocab_size, (len(LENGTHS), int(LENGTHS.max())), generator=g)
    return ids.masked_fill(torch.arange(ids.shape[1]) >= LENGTHS[:, None], -100)  # any pad id is fine


def _load_chunks(arch, parallel, ckpt_dir):
    from megatron.core import dist_checkpointing

    from armor_megatron.megatron.model import build_model_chunks

    chunks = build_model_chunks(arch, parallel)
    sharded = {f"chunk{i}": c.sharded_state_dict() for i, c in enumerate(chunks)}
    loaded = dist_checkpointing.load(sharded, ckpt_dir)
    for i, c in enumerate(chunks):
        c.load_state_dict(loaded[f"chunk{i}"])
    return chunks


def _logprobs(chunks, arch):
    from armor_megatron.megatron.logprobs import compute_logprobs

    out = compute_logprobs(
        chunks,
        _batch(arch),
        LENGTHS,
        micro_batch_size=2,
        vocab_size=arch.vocab_size,
        with_entropy=True,
        chunk_elements=4 * 128,
    )
    return out.logprobs, out.entropy


def parity_worker(rank, arch, layouts, ckpt_dir):
    from megatron.core import dist_checkpointing

    from armor_megatron.megatron.model import build_gpt_model

    mdist.initialize(ParallelConfig(), arch, seed=11)
    try:
        model = build_gpt_model(arch)
        dist_checkpointing.save(model.sharded_state_dict(), ckpt_dir)
        ref_lp, ref_ent = _logprobs([model], arch)
        # Sanity of the reference itself: a distribution over 125 tokens, zero where undefined.
        valid = torch.arange(1, LENGTHS.max())[None] < LENGTHS[:, None]
        assert (ref_lp[:, 1:][valid] < 0).all() and (ref_lp[:, 1:][~valid] == 0).all() and (ref_lp[:, 0] == 0).all()
        assert (ref_ent[:, 1:][valid] > 0).all() and (
            ref_ent[:, 1:][valid] <= torch.log(torch.tensor(125.0)) + 1e-5
        ).all()
        errors = {}
        for name, parallel in layouts.items():
            mdist.set_model_parallel(parallel, arch, seed=11)
            lp, ent = _logprobs(_load_chunks(arch, parallel, ckpt_dir), arch)
            errors[name] = max((lp - ref_lp).abs().max().item(), (ent - ref_ent).abs().max().item())
        return errors
    finally:
        mdist.shutdown()


def _check(errors_per_rank, layouts):
    for errors in errors_per_rank:
        assert set(errors) == set(layouts)
        for name, err in errors.items():
            assert err < 1e-5, f"{name}: max |Δ| = {err}"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_dense_tp_pp_vpp_match_tp1(tmp_path):
    # 4 ranks: the TP=1 reference runs at DP=4 (each rank computes its share of the 5 rows, then
    # all-gather), tp2 / pp2 at DP=2, tp2pp2 at DP=1 (every row on every rank)
    layouts = {
        "tp2": ParallelConfig(tp=2),
        "pp2": ParallelConfig(pp=2),
        "tp2pp2": ParallelConfig(tp=2, pp=2),
        "pp2vpp2": ParallelConfig(pp=2, vpp=2),
    }
    _check(run_ranks(parity_worker, 4, QWEN3, layouts, str(tmp_path), timeout=280), layouts)


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_qkv_bias_untied_tp2_matches_tp1(tmp_path):
    layouts = {"tp2": ParallelConfig(tp=2)}
    _check(run_ranks(parity_worker, 2, QWEN2, layouts, str(tmp_path), timeout=180), layouts)


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_moe_ep2_matches_ep1(tmp_path):
    layouts = {"ep2": ParallelConfig(ep=2), "pp2": ParallelConfig(pp=2)}
    _check(run_ranks(parity_worker, 2, QWEN3_MOE, layouts, str(tmp_path), timeout=180), layouts)
