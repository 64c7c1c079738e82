"""Llama (Llama-2, Llama-3): the base layout; Llama-3's ``llama3`` rope scaling."""

from armor_megatron.models.arch import FAMILIES
from armor_megatron.models.family import Family
from armor_megatron.models.tensors import AttentionNames, MLPNames

# HF names of one decoder layer, under ``model.layers.{layer}.`` (the Megatron tensor of each
# name: the field comments of `models.tensors.AttentionNames` / `MLPNames`)
ATTENTION = AttentionNames(
    input_norm="input_layernorm.weight",
    q="self_attn.q_proj",
    k="self_attn.k_proj",
    v="self_attn.v_proj",
    o="self_attn.o_proj.weight",
)
MLP = MLPNames(
    pre_mlp_norm="post_attention_layernorm.weight",
    gate="mlp.gate_proj.weight",
    up="mlp.up_proj.weight",
    down="mlp.down_proj.weight",
)


@FAMILIES.register("llama")
class Llama(Family):
    """The Llama family (HF ``llama``)."""

    model_types = ("llama",)
    architectures = ("LlamaForCausalLM",)
    attention_names = ATTENTION
    mlp_names = MLP
