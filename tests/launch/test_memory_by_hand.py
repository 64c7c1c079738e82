"""Activation bytes of one configuration counted by hand, tensor by tensor, against the planner.

Qwen3-8B (h 4096, 32 query heads and 8 key/value heads of d 128, SwiGLU f 12288, q/k RMSNorm, 36
layers), one micro-batch of b = 4 rows of s = 9216 tokens, bf16 (e = 2), TP = 2 with sequence
parallelism, Transformer Engine's layer (what GPU runs build), no recompute. Per token and layer,
what autograd keeps for backward in megatron-core's TE layer:

attention block
  linear_qkv (TE LayerNormLinear, input_layernorm fused in): the norm input x            h
                                                   and the normalised x (the GEMM input)  h
  q_layernorm / k_layernorm (TE RMSNorm per head): their inputs, the projected q and k     q + kv
  core attention (TE fused / flash): the rotated q and k, and v (RoPE keeps only the
                                     cos/sin tables, dropout is 0: no mask)                q + kv + kv
                                     its output O                                          q
  linear_proj (TE Linear): its input, the same tensor as O (counted once)                  0
MLP block
  linear_fc1 (TE LayerNormLinear, pre_mlp_layernorm fused in): norm input, normalised x    h + h
  fused SwiGLU (bias_activation_fusion, on with the TE spec): its input, fc1's output       2f
  linear_fc2 (TE Linear): its input, the SwiGLU output                                      f
residual adds, bias-dropout-add at p = 0: nothing.

Sequence parallelism splits every one of them over the TP ranks: the norms' tensors are
sequence-sharded [s/t, b, h] (TE keeps the local shard and gathers it again in backward), the
others head- or column-sharded [s, b, ·/t].

Also kept, in fp32, and not in the planner (`launch.memory.layer_bytes_per_token`): 1 value per
token of each fused norm's 1/rms (2), 1 per head of the q/k norms' 1/rms (nq + nkv), flash
attention's softmax log-sum-exp (nq): 296 bytes per token and layer here, 0.22 % of the layer.
"""

import pytest

from armor_megatron.config import load_config
from armor_megatron.config.validate import model_arch_of
from armor_megatron.launch.memory import ActivationSettings, activation_bytes

H, NQ, NKV, D, F, LAYERS = 4096, 32, 8, 128, 12288, 36
S, B, TP, E = 9216, 4, 2, 2  # sequence, micro-batch rows, tensor parallel, bf16 bytes
Q, KV = NQ * D, NKV * D  # 4096, 1024

# (what, elements per token) of one layer, kept in bf16
LAYER_TENSORS = [
    ("input_layernorm input", H),
    ("input_layernorm output = linear_qkv input", H),
    ("q_layernorm input", Q),
    ("k_layernorm input", KV),
    ("rotated q", Q),
    ("rotated k", KV),
    ("v", KV),
    ("attention output = linear_proj input", Q),
    ("pre_mlp_layernorm input", H),
    ("pre_mlp_layernorm output = linear_fc1 input", H),
    ("linear_fc1 output = SwiGLU input", 2 * F),
    ("SwiGLU output = linear_fc2 input", F),
]
# (what, fp32 values per token) of one layer, left out by the planner
LAYER_STATISTICS = [
    ("1/rms of the two fused layer norms", 2),
    ("1/rms of the q and k norms, per head", NQ + NKV),
    ("flash attention's log-sum-exp, per head", NQ),
]


def _qwen3_8b():
    arch = model_arch_of(load_config("configs/qwen3_8b_base_two_stage.yaml"))
    shape = (arch.hidden_size, arch.num_attention_heads, arch.num_key_value_heads, arch.head_dim)
    assert shape + (arch.ffn_hidden_size, arch.num_layers) == (H, NQ, NKV, D, F, LAYERS) and arch.qk_norm
    return arch


def test_qwen3_8b_tp2_sp_activations_match_the_hand_count():
    arch = _qwen3_8b()
    per_token = sum(n for _, n in LAYER_TENSORS)  # 68608 elements = 16.75·h
    hand = LAYERS * S * B * per_token * E / TP  # every tensor split over the TP ranks (SP)
    settings = ActivationSettings(seq_len=S, micro_batch_size=B, tp=TP, sequence_parallel=True)
    planned = activation_bytes(arch, range(LAYERS), settings, in_flight=1)
    assert planned == pytest.approx(hand, rel=1e-12)  # 84.8 GiB on each GPU

    statistics = LAYERS * S * B * sum(n for _, n in LAYER_STATISTICS) * 4 / TP
    assert statistics / (hand + statistics) < 0.0025  # the fp32 vectors the planner leaves out


def test_qwen3_8b_full_recompute_keeps_layer_inputs_and_one_layer():
    """Full recompute (uniform, 1 layer per unit): each layer keeps only its input, the residual
    stream [s/t, b, h] under SP, and the layer being recomputed holds all of the above once."""
    arch = _qwen3_8b()
    layer_input = S * B * H * E / TP
    one_layer = S * B * sum(n for _, n in LAYER_TENSORS) * E / TP
    settings = ActivationSettings(seq_len=S, micro_batch_size=B, tp=TP, sequence_parallel=True, recompute="full")
    planned = activation_bytes(arch, range(LAYERS), settings, in_flight=1)
    assert planned == pytest.approx(LAYERS * layer_input + one_layer, rel=1e-12)


# ----------------------------------------------------------------------------- the local spec, measured
# megatron's local spec (torch norms and attention, what CPU runs build) on one Qwen3 layer with
# h 64, 4 query heads and 2 key/value heads of d 16, f 192, s = 128, b = 2: bytes per token the
# layer keeps for backward, by hand, for e = 4 (fp32) and e = 2 (bf16).
h, nq, nkv, d, f, s, b = 64, 4, 2, 16, 192, 128, 2
q, kv = nq * d, nkv * d


def local_layer_tensors(e: int) -> list[tuple[str, float]]:
    """(what, bytes per token) of one local-spec Qwen3 layer."""
    return [
        # torch RMSNorm computes in fp32: keeps its fp32 input, 1/rms and the normalised input
        ("input_layernorm fp32 input", 4 * h),
        ("input_layernorm 1/rms", 4),
        ("input_layernorm normalised input", 4 * h),
        ("linear_qkv input (normalised x weight)", e * h),
        ("q_layernorm fp32 input", 4 * q),
        ("q_layernorm 1/rms, per head", 4 * nq),
        ("q_layernorm normalised", 4 * q),
        # fp32: k is a view of the whole qkv output and keeps it alive; bf16: its fp32 copy
        ("k_layernorm input", 4 * (q + 2 * kv) if e == 4 else 4 * kv),
        ("k_layernorm 1/rms, per head", 4 * nkv),
        ("k_layernorm normalised", 4 * kv),
        ("RoPE cos and sin tables [s, 1, 1, d] in e, made for q and again for k", 4 * s * d * e / (s * b)),
        ("rotated q", e * q),
        ("k expanded to the query heads", e * q),
        ("boolean causal mask [s, s]", s * s / (s * b)),
        ("softmax output, fp32 [nq, s] per token", 4 * nq * s),
        *([("softmax output cast to bf16", e * nq * s)] if e < 4 else []),
        ("v expanded to the query heads", e * q),
        ("linear_proj input", e * q),
        ("pre_mlp_layernorm fp32 input", 4 * h),
        ("pre_mlp_layernorm 1/rms", 4),
        ("pre_mlp_layernorm normalised input", 4 * h),
        ("linear_fc1 input", e * h),
        ("linear_fc1 output (gate | up)", e * 2 * f),
        ("silu input (the gate half)", e * f),
        ("silu output", e * f),
        ("linear_fc2 input (silu x up)", e * f),
    ]


def local_layer_omitted(e: int) -> float:
    """Bytes per token of the tensors above that `layer_bytes_per_token` leaves out: the fp32 1/rms
    vectors (2 per token, 1 per head of the q and k norms), the boolean causal mask, the RoPE
    tables, and in fp32 the part of the qkv output that k's view keeps beyond the 2·kv fp32 values
    the planner gives k."""
    rms = 4 * (2 + nq + nkv)
    mask = s * s / (s * b)
    rope = 4 * s * d * e / (s * b)
    view = 4 * (q + 2 * kv) - 2 * 4 * kv if e == 4 else 0
    return rms + mask + rope + view


def measure_layer_worker(rank):
    import dataclasses

    import torch
    from megatron.core import tensor_parallel

    from armor_megatron.megatron import dist as mdist
    from armor_megatron.megatron.dist import ParallelConfig
    from armor_megatron.megatron.model import build_gpt_model
    from tests.megatron.test_parallel_logprobs import QWEN3
    from tests.megatron.test_recompute import SavedActivations

    arch = dataclasses.replace(
        QWEN3, hidden_size=h, head_dim=d, ffn_hidden_size=f, num_layers=1, max_position_embeddings=2 * s
    )
    assert (arch.num_attention_heads, arch.num_key_value_heads, arch.qk_norm) == (nq, nkv, True)
    mdist.initialize(ParallelConfig(), arch, seed=1)
    try:
        out = {}
        for e, dtype in ((4, "float32"), (2, "bfloat16")):
            torch.manual_seed(0)
            tensor_parallel.model_parallel_cuda_manual_seed(1)
            model = build_gpt_model(arch, ParallelConfig(), dtype=dtype, use_te=False)
            model.train()
            tracker = SavedActivations(model.parameters())
            handles = tracker.track(model.decoder.layers[0])
            tokens = torch.randint(0, arch.vocab_size, (b, s))
            logits = model(tokens, torch.arange(s)[None].expand(b, s), None)  # its graph holds what was saved
            out[e] = (tracker.current, arch)
            for handle in handles:
                handle.remove()
            del logits
        return out
    finally:
        mdist.shutdown()


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_local_spec_layer_matches_the_hand_count_and_the_planner_leaves_out_only_the_listed_tensors():
    from armor_megatron.launch.memory import layer_bytes_per_token
    from tests.megatron.spawn import run_ranks

    measured = run_ranks(measure_layer_worker, 1, timeout=200)[0]
    for e, (kept, arch) in measured.items():
        hand = sum(n for _, n in local_layer_tensors(e))  # 9824 (fp32) and 7712 (bf16) bytes per token
        assert kept == hand * s * b, (e, kept / (s * b), hand)
        planned = layer_bytes_per_token(arch, 0, spec="local", dtype_bytes=e, seq_len=s)
        assert planned == hand - local_layer_omitted(e), (e, planned, hand)  # 480 and 160 bytes less
