"""Model builder: HF logits parity, checkpoint key names, dtype, vocab padding, config errors.

Megatron-touching checks run in one spawned single-rank process so the CPU work-arounds never
patch the pytest process itself.
"""

import os

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from armor_megatron.megatron.model import llama3_inv_freq, padded_vocab_size
from armor_megatron.models.arch import ModelArch
from tests.megatron.spawn import run_ranks

SMALL = dict(
    vocab_size=125,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=48,
    max_position_embeddings=64,
)
LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}


def _hf_models():
    torch.manual_seed(0)
    llama = LlamaForCausalLM(LlamaConfig(**SMALL, rope_theta=500000.0, rope_scaling=LLAMA3_SCALING, rms_norm_eps=1e-5))
    qwen3 = Qwen3ForCausalLM(Qwen3Config(**SMALL, head_dim=16, rms_norm_eps=1e-6, tie_word_embeddings=True))
    return [m.float().eval() for m in (llama, qwen3)]


def _megatron_state_from_hf(hf_state, arch, padded_vocab):
    """TP=1 local-spec state dict from HF tensors (fused QKV per query group, fc1 = [gate; up])."""
    d, nkv, qpg = arch.head_dim, arch.num_key_value_heads, arch.queries_per_group

    def pad(w):
        return torch.cat([w, w.new_zeros(padded_vocab - w.shape[0], w.shape[1])])

    out = {
        "embedding.word_embeddings.weight": pad(hf_state["model.embed_tokens.weight"]),
        "decoder.final_layernorm.weight": hf_state["model.norm.weight"],
    }
    if not arch.tie_word_embeddings:
        out["output_layer.weight"] = pad(hf_state["lm_head.weight"])
    for i in range(arch.num_layers):
        hf, mg = f"model.layers.{i}.", f"decoder.layers.{i}."
        q = hf_state[hf + "self_attn.q_proj.weight"].view(nkv, qpg * d, -1)
        k = hf_state[hf + "self_attn.k_proj.weight"].view(nkv, d, -1)
        v = hf_state[hf + "self_attn.v_proj.weight"].view(nkv, d, -1)
        out[mg + "self_attention.linear_qkv.weight"] = torch.cat([q, k, v], dim=1).reshape(-1, arch.hidden_size)
        out[mg + "self_attention.linear_proj.weight"] = hf_state[hf + "self_attn.o_proj.weight"]
        out[mg + "input_layernorm.weight"] = hf_state[hf + "input_layernorm.weight"]
        out[mg + "pre_mlp_layernorm.weight"] = hf_state[hf + "post_attention_layernorm.weight"]
        out[mg + "mlp.linear_fc1.weight"] = torch.cat(
            [hf_state[hf + "mlp.gate_proj.weight"], hf_state[hf + "mlp.up_proj.weight"]]
        )
        out[mg + "mlp.linear_fc2.weight"] = hf_state[hf + "mlp.down_proj.weight"]
        if arch.qk_norm:
            out[mg + "self_attention.q_layernorm.weight"] = hf_state[hf + "self_attn.q_norm.weight"]
            out[mg + "self_attention.k_layernorm.weight"] = hf_state[hf + "self_attn.k_norm.weight"]
    return out


def _checkpoint_keys(model):
    """{key: global shape} of the tensors a torch_dist checkpoint of `model` holds."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    keys = {}
    for item in model.sharded_state_dict().values():
        built = item.build() if isinstance(item, ShardedTensorFactory) else item
        for t in built.values() if isinstance(built, dict) else built if isinstance(built, list) else [built]:
            if isinstance(t, ShardedTensor) and not t.key.endswith("_extra_state"):
                keys[t.key] = tuple(t.global_shape)
    return keys


def _hf_token_logprobs(logits, ids, lengths):
    """[B, T]: log_softmax(logits[b, t-1])[ids[b, t]] for 1 <= t < lengths[b], else 0."""
    lp = torch.log_softmax(logits.double(), -1)[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)
    lp = torch.nn.functional.pad(lp, (1, 0))
    return torch.where(torch.arange(ids.shape[1])[None] < lengths[:, None], lp, 0.0).float()


def model_worker(rank, hf_models, moe_arch):
    from armor_megatron.megatron import dist
    from armor_megatron.megatron.logprobs import compute_logprobs
    from armor_megatron.megatron.model import build_gpt_model, transformer_config_from_arch

    dist.initialize(dist.ParallelConfig())
    try:
        result = {"logit_errors": [], "logprob_errors": []}
        ids = torch.randint(0, 125, (2, 20), generator=torch.Generator().manual_seed(1))
        pos = torch.arange(20).expand(2, 20)
        lengths = torch.tensor([20, 13])
        for hf in hf_models:
            arch = ModelArch.from_hf_config(hf.config.to_dict())
            model = build_gpt_model(arch, dtype=torch.float32)
            model.load_state_dict(_megatron_state_from_hf(hf.state_dict(), arch, padded_vocab_size(arch)), strict=False)
            with torch.no_grad():
                ours = model(ids, pos, None)[..., : arch.vocab_size]
                ref = hf(ids).logits
            result["logit_errors"].append((ours - ref).abs().max().item())
            lp = compute_logprobs([model], ids, lengths, micro_batch_size=1, vocab_size=arch.vocab_size).logprobs
            result["logprob_errors"].append((lp - _hf_token_logprobs(ref, ids, lengths)).abs().max().item())
            bf16 = build_gpt_model(arch, dtype=torch.bfloat16)
            bf16.load_state_dict(model.state_dict())
            lp16 = compute_logprobs([bf16], ids, lengths, micro_batch_size=2, vocab_size=arch.vocab_size).logprobs
            result.setdefault("bf16_logprob_errors", []).append((lp16 - lp).abs().max().item())
            if arch.rope_scaling:
                result["inv_freq"] = (model.rotary_pos_emb.inv_freq.clone(), llama3_inv_freq(arch))
        dense = ModelArch.from_hf_config(hf_models[0].config.to_dict())
        result["dense_keys"] = _checkpoint_keys(build_gpt_model(dense))
        result["moe_keys"] = _checkpoint_keys(build_gpt_model(moe_arch))
        bf16 = build_gpt_model(dense, dtype="bfloat16")
        with torch.no_grad():
            result["bf16"] = ({p.dtype for p in bf16.parameters()}, bf16(ids, pos, None).dtype)
        for bad in (dict(dtype=torch.float16), dict(sequence_parallel=True)):
            try:
                transformer_config_from_arch(dense, **bad)
            except ValueError as e:
                result.setdefault("errors", []).append(str(e))
        return result
    finally:
        dist.shutdown()


MOE = ModelArch(
    family="qwen3_moe",
    vocab_size=125,
    hidden_size=32,
    num_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    ffn_hidden_size=48,
    rms_norm_eps=1e-6,
    rope_theta=1e6,
    max_position_embeddings=64,
    qk_norm=True,
    num_experts=4,
    moe_router_topk=2,
    moe_ffn_hidden_size=16,
)


@pytest.fixture(scope="module")
def built():
    return run_ranks(model_worker, 1, _hf_models(), MOE, timeout=150)[0]


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_logits_and_logprobs_match_hf_llama3_scaled_rope_and_qwen3_qk_norm_tied(built):
    assert all(err < 1e-4 for err in built["logit_errors"]), built["logit_errors"]
    assert all(err < 1e-5 for err in built["logprob_errors"]), built["logprob_errors"]
    # a bf16 copy of the same weights: log-probs of a 125-token vocabulary agree to bf16 precision
    assert all(err < 0.02 for err in built["bf16_logprob_errors"]), built["bf16_logprob_errors"]
    ours, formula = built["inv_freq"]
    torch.testing.assert_close(ours, formula)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_checkpoint_keys_are_the_documented_ones(built):
    L, h, d = 2, 32, 8
    # llama config: head_dim = 32 / 4 = 8, 4 heads, 2 groups -> qkv rows (4 + 2·2)·8 = 64; ffn 48
    assert built["dense_keys"] == {
        "embedding.word_embeddings.weight": (128, h),
        "decoder.layers.self_attention.linear_qkv.layer_norm_weight": (L, h),
        "decoder.layers.self_attention.linear_qkv.weight": (L, 64, h),
        "decoder.layers.self_attention.linear_proj.weight": (L, h, 32),
        "decoder.layers.mlp.linear_fc1.layer_norm_weight": (L, h),
        "decoder.layers.mlp.linear_fc1.weight": (L, 96, h),
        "decoder.layers.mlp.linear_fc2.weight": (L, h, 48),
        "decoder.final_layernorm.weight": (h,),
        "output_layer.weight": (128, h),
    }
    assert built["moe_keys"] == {
        "embedding.word_embeddings.weight": (128, h),
        "decoder.layers.self_attention.linear_qkv.layer_norm_weight": (L, h),
        "decoder.layers.self_attention.linear_qkv.weight": (L, 64, h),
        "decoder.layers.self_attention.q_layernorm.weight": (L, d),
        "decoder.layers.self_attention.k_layernorm.weight": (L, d),
        "decoder.layers.self_attention.linear_proj.weight": (L, h, 32),
        "decoder.layers.pre_mlp_layernorm.weight": (L, h),
        "decoder.layers.mlp.router.weight": (L, 4, h),
        "decoder.layers.mlp.experts.experts.linear_fc1.weight": (L, 4, 32, h),
        "decoder.layers.mlp.experts.experts.linear_fc2.weight": (L, 4, h, 16),
        "decoder.final_layernorm.weight": (h,),
        "output_layer.weight": (128, h),
    }


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_bf16_and_config_errors(built):
    assert built["bf16"] == ({torch.bfloat16}, torch.bfloat16)
    assert built["errors"] == [
        "dtype torch.float16 is not supported (float32 or bfloat16)",
        "sequence parallelism needs the Transformer Engine spec (the local spec's torch norms refuse it)",
    ]


def test_padded_vocab_is_the_same_for_power_of_two_tp():
    arch = ModelArch.from_hf_config({"model_type": "qwen2", **{**SMALL, "num_hidden_layers": 2}})
    assert [padded_vocab_size(arch, tp) for tp in (1, 2, 8)] == [128, 128, 128]
    assert padded_vocab_size(arch, 3) == 384
    qwen = ModelArch.from_hf_config({"model_type": "qwen2", **{**SMALL, "vocab_size": 151936}})
    assert padded_vocab_size(qwen, 8) == 151936


def test_llama3_inv_freq_matches_transformers():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = LlamaConfig(**SMALL, rope_theta=500000.0, rope_scaling=LLAMA3_SCALING)
    ref, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    torch.testing.assert_close(llama3_inv_freq(ModelArch.from_hf_config(config.to_dict())), ref.float())


def test_deepseek_v3_router_bias_is_enabled_and_frozen():
    """The V3 selection bias is loaded (router.expert_bias) and megatron's aux-loss-free balancing
    leaves it alone (update rate 0); V2 has none."""
    from transformers import DeepseekV2Config, DeepseekV3Config

    from armor_megatron.megatron.model import transformer_config_from_arch
    from tests.convert.conftest import DEEPSEEK_V2_LITE_TINY, DEEPSEEK_V3_TINY

    v3 = ModelArch.from_hf_config(DeepseekV3Config(**{**SMALL, **DEEPSEEK_V3_TINY}).to_dict())
    config = transformer_config_from_arch(v3, use_te=False)
    assert (config.moe_router_enable_expert_bias, config.moe_router_bias_update_rate) == (True, 0.0)
    assert (config.moe_router_score_function, config.moe_router_topk_scaling_factor) == ("sigmoid", 2.5)
    v2 = ModelArch.from_hf_config(DeepseekV2Config(**{**SMALL, **DEEPSEEK_V2_LITE_TINY}).to_dict())
    assert not transformer_config_from_arch(v2, use_te=False).moe_router_enable_expert_bias


def test_train_deterministic_turns_on_megatrons_deterministic_mode_on_gpus(monkeypatch):
    """dist.set_deterministic (train.deterministic) also sets TE's switch; the builder then asks megatron
    for its deterministic kernels on a GPU (faked here), not on the CPU, whose kernels already are."""
    from armor_megatron.megatron import dist
    from armor_megatron.megatron.model import transformer_config_from_arch

    dense = ModelArch.from_hf_config(LlamaConfig(**SMALL).to_dict())
    monkeypatch.setenv("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "1")  # restored afterwards
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    monkeypatch.setenv("NCCL_ALGO", "Ring")
    cudnn = torch.backends.cudnn
    before = torch.are_deterministic_algorithms_enabled(), cudnn.deterministic, cudnn.benchmark
    try:
        assert not transformer_config_from_arch(dense, use_te=False).deterministic_mode
        dist.set_deterministic()
        assert os.environ["NVTE_ALLOW_NONDETERMINISTIC_ALGO"] == "0"
        assert not transformer_config_from_arch(dense, use_te=False).deterministic_mode  # CPU
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        assert transformer_config_from_arch(dense, use_te=False).deterministic_mode
        torch.use_deterministic_algorithms(False)
        assert not transformer_config_from_arch(dense, use_te=False).deterministic_mode
    finally:
        torch.use_deterministic_algorithms(before[0])
        cudnn.deterministic, cudnn.benchmark = before[1:]
