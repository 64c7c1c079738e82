"""Llama (Llama-2, Llama-3): the base layout; Llama-3's ``llama3`` rope scaling."""

from armor_megatron.models.arch import FAMILIES
from armor_megatron.models.family import Family


@FAMILIES.register("llama")
class Llama(Family):
    """The Llama family (HF ``llama``)."""

    model_types = ("llama",)
    architectures = ("LlamaForCausalLM",)
