"""The three expert layouts megatron-core 0.16.1 builds, on CPU, with their exact parameter names.

* SequentialMLP (local spec, what ``build_model_chunks`` gives here): one MLP per local expert,
  ``mlp.experts.local_experts.{j}.linear_fc1.weight`` [2·fe/etp, h] and ``linear_fc2.weight``
  [h, fe/etp].
* TEGroupedMLP (TE spec on GPU): TE's GroupedLinear registers one parameter per GEMM,
  ``mlp.experts.linear_fc1.weight{j}`` (TEColumnParallelGroupedLinear, [2·fe/etp, h]) and
  ``mlp.experts.linear_fc2.weight{j}`` (TERowParallelGroupedLinear, [h, fe/etp]). Transformer
  Engine needs CUDA, so `use_te_grouped_experts` swaps each SequentialMLP for a module with
  exactly these names and shapes, holding the same expert values.
* GroupedMLP (legacy grouped GEMM): ``mlp.experts.weight1`` [h, E_local·2·fe/etp] and
  ``mlp.experts.weight2`` [E_local·fe/etp, h], all local experts stacked. Its constructor only
  asserts that the grouped_gemm kernels import and allocates on CPU under
  ``use_cpu_initialization``, so `build_legacy_grouped_chunks` builds the real module with the
  assertion lifted (forward is never run): names, shapes and checkpoint loading (its
  ``sharded_state_dict``) are megatron-core's own.
"""

from __future__ import annotations

from unittest import mock

import torch


class TEGroupedExperts(torch.nn.Module):
    """A SequentialMLP's local experts under TEGroupedMLP's parameter names (same values)."""

    def __init__(self, sequential: torch.nn.Module):
        super().__init__()
        self.linear_fc1 = torch.nn.Module()
        self.linear_fc2 = torch.nn.Module()
        for j, expert in enumerate(sequential.local_experts):
            for fc in ("linear_fc1", "linear_fc2"):
                weight = getattr(expert, fc).weight.detach().clone()
                getattr(self, fc).register_parameter(f"weight{j}", torch.nn.Parameter(weight))


def use_te_grouped_experts(chunks: list) -> None:
    """Replace every SequentialMLP of ``chunks`` by its TEGroupedMLP-named equivalent, in place."""
    from megatron.core.transformer.moe.experts import SequentialMLP

    for chunk in chunks:
        for layer in getattr(chunk, "module", chunk).decoder.layers:
            if isinstance(layer.mlp.experts, SequentialMLP):
                layer.mlp.experts = TEGroupedExperts(layer.mlp.experts)


def build_legacy_grouped_chunks(arch, parallel) -> list:
    """This rank's model (pp stage, no VPP) with megatron-core's legacy GroupedMLP experts."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel, gpt_layer_specs
    from megatron.core.transformer.moe import grouped_gemm_util

    from armor_megatron.megatron.model import padded_vocab_size, transformer_config_from_arch

    config = transformer_config_from_arch(arch, parallel, use_te=False, moe_grouped_gemm=True)
    spec = gpt_layer_specs.get_gpt_layer_local_spec(
        num_experts=arch.num_experts, moe_grouped_gemm=True, qk_layernorm=arch.qk_norm, normalization="RMSNorm"
    )
    keys_map = dict(spec.submodules.sharded_state_dict_keys_map)  # the project's MoE norm key (see model.py)
    keys_map.pop("pre_mlp_layernorm.", None)
    spec.submodules.sharded_state_dict_keys_map = keys_map
    with mock.patch.object(grouped_gemm_util, "assert_grouped_gemm_is_available", lambda: None):
        model = GPTModel(
            config=config,
            transformer_layer_spec=spec,
            vocab_size=padded_vocab_size(arch, parallel.tp),
            max_sequence_length=arch.max_position_embeddings,
            pre_process=parallel_state.is_pipeline_first_stage(),
            post_process=parallel_state.is_pipeline_last_stage(),
            share_embeddings_and_output_weights=arch.tie_word_embeddings,
            position_embedding_type="rope",
            rotary_base=arch.rope_theta,
        )
    return [model.eval()]
