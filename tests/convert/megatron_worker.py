"""Worker for the Megatron parity tests (not collected by pytest): the tests run `check_cases` on
the ranks of `tests.megatron.spawn.run_ranks`; by hand it runs under torchrun:

    torchrun --nproc-per-node N megatron_worker.py --tp T --pp P --ep E [--check-keys] CASE...

CASE is ``HF_DIR,MCORE_DIR,EXPECTED_LOGITS``. For each case this rank builds the project's
local-spec GPTModel stage (fp32) at the given parallelism and checks that:

* (``--check-keys``, world size 1) the checkpoint holds exactly the tensors and objects of
  ``model.sharded_state_dict()``: same keys, same global shapes;
* every rank-local parameter equals ``tp_split`` of the HF tensors merged by the rules, at the
  parameter's global layer / expert index (the weight-sync direction of the same rules);
* the last stage's logits match transformers' (EXPECTED_LOGITS) within 1e-4;
* (``--save-dir DIR``) then saves the model with Megatron's own ``dist_checkpointing.save`` at
  this parallelism into DIR/<name of HF_DIR>, for the test to convert back to HF.
"""

from __future__ import annotations

import argparse
import os
import re
import sys

import torch


def checkpoint_entries(mcore_dir: str) -> dict[str, tuple]:
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    meta = FileSystemReader(mcore_dir).read_metadata()
    return {
        k: tuple(v.size) if isinstance(v, TensorStorageMetadata) else "object"
        for k, v in meta.state_dict_metadata.items()
    }


def model_entries(model) -> dict[str, tuple]:
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, ShardedTensorFactory

    out = {}
    for v in model.sharded_state_dict().values():
        if isinstance(v, ShardedTensorFactory):  # swiglu fc1: two halves of one global tensor
            built = v.build()
            v = built[next(iter(built))] if isinstance(built, dict) else built
            v = v[0] if isinstance(v, list) else v
        if isinstance(v, ShardedTensor):
            out[v.key] = tuple(v.global_shape)
        elif isinstance(v, ShardedObject):
            out[v.unique_key] = "object"
    return out


def global_name(model, name: str, arch) -> str:
    """Parameter name with this rank's local layer / expert indices made global."""
    from megatron.core import parallel_state as ps

    layers = model.decoder.layers

    def layer(m):
        return f"decoder.layers.{layers[int(m.group(1))].layer_number - 1}."

    name = re.sub(r"^decoder\.layers\.(\d+)\.", layer, name)
    local_experts = arch.num_experts // ps.get_expert_model_parallel_world_size() if arch.is_moe else 0
    offset = ps.get_expert_model_parallel_rank() * local_experts if arch.is_moe else 0
    return re.sub(r"local_experts\.(\d+)\.", lambda m: f"local_experts.{int(m.group(1)) + offset}.", name)


def check_case(args, hf_dir: str, mcore_dir: str, expected_path: str) -> str:
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    from armor_megatron.convert import hf_to_mcore, resolve_param, tp_split
    from armor_megatron.convert.hf_io import HFCheckpoint
    from armor_megatron.convert.verify import prompts
    from armor_megatron.megatron import dist
    from armor_megatron.megatron.model import build_gpt_model
    from armor_megatron.megatron.verify import megatron_logits

    hf = HFCheckpoint(hf_dir)
    arch = hf.arch
    parallel = dist.ParallelConfig(tp=args.tp, pp=args.pp, ep=args.ep)
    dist.initialize(parallel, arch)
    # allgather dispatcher: the alltoall one needs a CPU work-around cpu_compat lacks (split sizes
    # as tensors for all_to_all_single), and it needs fixed sequence lengths; neither touches weights.
    model = build_gpt_model(
        arch, parallel, dtype=torch.float32, use_te=False, moe_token_dispatcher="allgather", variable_seq_lengths=False
    )
    if args.check_keys:
        ours, theirs = checkpoint_entries(mcore_dir), model_entries(model)
        assert ours == theirs, (
            f"{arch.family}: checkpoint keys differ from GPTModel.sharded_state_dict(): "
            f"only in checkpoint {sorted(set(ours.items()) - set(theirs.items()))}, "
            f"only in model {sorted(set(theirs.items()) - set(ours.items()))}"
        )
    model.load_state_dict(dist_checkpointing.load(model.sharded_state_dict(), mcore_dir))

    tp_rank, checked = ps.get_tensor_model_parallel_rank(), 0
    expert_tp_rank = ps.get_expert_tensor_parallel_rank()
    for name, param in model.named_parameters():
        if name == "output_layer.weight" and arch.tie_word_embeddings:
            continue  # last-stage copy of the tied embedding
        ref = resolve_param(arch, global_name(model, name, arch))
        full = hf_to_mcore(arch, ref.rule, [hf.read(n) for n in ref.hf_names])
        rank = expert_tp_rank if ref.expert is not None else tp_rank
        size = ps.get_expert_tensor_parallel_world_size() if ref.expert is not None else args.tp
        assert torch.equal(param.detach(), tp_split(arch, ref.rule, full, size)[rank]), f"{arch.family}: {name}"
        checked += 1

    logits = megatron_logits(model, arch, prompts(arch))
    result = f"{arch.family} rank {torch.distributed.get_rank()}: {checked} params match tp_split"
    if logits is not None:
        diff = (logits - torch.load(expected_path)).abs().max().item()
        assert diff <= 1e-4, f"{arch.family}: logits differ from transformers by {diff}"
        result += f", logits max diff {diff:.2e}"
    if args.save_dir:
        out = os.path.join(args.save_dir, os.path.basename(os.path.normpath(hf_dir)))  # the test's model name
        if torch.distributed.get_rank() == 0:
            os.makedirs(out)
        torch.distributed.barrier()
        dist_checkpointing.save(model.sharded_state_dict(), out)
        torch.distributed.barrier()
        result += f", saved by megatron to {out}"
    ps.destroy_model_parallel()
    return result


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    for axis in ("tp", "pp", "ep"):
        parser.add_argument(f"--{axis}", type=int, default=1)
    parser.add_argument("--check-keys", action="store_true")
    parser.add_argument("--save-dir")
    parser.add_argument("cases", nargs="+")
    return parser.parse_args(argv)


def check_cases(argv: list[str] | None = None) -> list[str]:
    """One ``WORKER OK ...`` line per case, checked in order on this rank (then the group is shut down)."""
    from armor_megatron.megatron import dist

    args = parse_args(argv)
    try:
        return [f"WORKER OK {check_case(args, *case.split(','))}" for case in args.cases]
    finally:
        dist.shutdown()


def main() -> int:
    for line in check_cases():
        print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
