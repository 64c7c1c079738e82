"""Optional check "te": the Transformer Engine layer spec against the local one, when TE is importable.

    python tools/gpu_check/check_te.py --hf HF_DIR --work DIR [--device cuda] [--json PATH]

Skipped, in one line naming what is missing, without Transformer Engine or without CUDA (TE's
kernels need a GPU). Otherwise, on the device in bf16:

* HF-direct load into TE layers (``megatron.hf_weights``, each rank its slices) must give tensors
  bit-equal to the converted torch_dist checkpoint loaded into TE layers (``convert_hf_to_mcore``):
  the two loading paths and TE's fused names (``linear_qkv.layer_norm_weight`` ...) agree exactly;
* log-probs of the TE model (HF-direct) against the local spec's (HF-direct) on the same tokens:
  mean |Δ| <= 0.02 and ‖Δ‖₂/‖ref‖₂ <= 1e-2, the bf16 bounds of check_parity.py (TE fuses the norms
  into the linear layers and rounds at other points, so bf16 ties move: not bit-equal).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from check_lines import model_check_parser, report, skipped_or_ready  # noqa: E402
from check_parity import BF16_MEAN_ABS, BF16_REL_L2, compare, parity_inputs  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = model_check_parser(__doc__)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--length", type=int, default=48)
    return p.parse_args(argv)


def missing(device: str) -> str | None:
    """What this machine lacks for the TE check, or None."""
    absent = [m for m in ("transformer_engine", "transformer_engine_torch") if importlib.util.find_spec(m) is None]
    if absent:
        return f"{', '.join(absent)} not importable by {sys.executable}"
    return "Transformer Engine needs CUDA (--device cpu)" if device == "cpu" else None


def main(argv=None) -> int:
    args = parse_args(argv)
    if skipped_or_ready(args.json, "te", missing(args.device), args.device):
        return 0
    import torch

    from armor_megatron.megatron import dist
    from armor_megatron.megatron.hf_weights import load_weights
    from armor_megatron.megatron.logprobs import compute_logprobs
    from armor_megatron.megatron.model import build_gpt_model
    from armor_megatron.megatron.model_state import load_model_weights

    mcore_dir = os.path.join(args.work, "te_mcore")
    arch, tokens, lengths, mask = parity_inputs(args.hf, mcore_dir, args.batch, args.length)
    dist.initialize(dist.ParallelConfig(), arch)
    try:
        direct = build_gpt_model(arch, dtype=torch.bfloat16, use_te=True)
        load_weights([direct], args.hf)
        converted = build_gpt_model(arch, dtype=torch.bfloat16, use_te=True)
        load_model_weights([converted], mcore_dir)
        a, b = direct.state_dict(), converted.state_dict()
        tensors = [k for k, v in a.items() if torch.is_tensor(v) and "_extra_state" not in k]
        unequal = [k for k in tensors if not torch.equal(a[k], b[k])]
        local = build_gpt_model(arch, dtype=torch.bfloat16, use_te=False)
        load_weights([local], args.hf)

        def logprobs(model):
            out = compute_logprobs([model], tokens, lengths, micro_batch_size=len(tokens), vocab_size=arch.vocab_size)
            return out.logprobs.float().cpu()

        d = compare(logprobs(direct), logprobs(local), mask)
    finally:
        dist.shutdown()
    ok = not unequal and d["mean_abs"] <= BF16_MEAN_ABS and d["rel_l2"] <= BF16_REL_L2
    line = (
        f"TE spec, bf16: HF-direct vs converted checkpoint {len(tensors) - len(unequal)}/{len(tensors)} tensors "
        f"bit-equal{' (differ: ' + ', '.join(unequal[:3]) + ')' if unequal else ''}; log-probs vs local spec "
        f"mean|d|={d['mean_abs']:.2e} (<= {BF16_MEAN_ABS}) rel_l2={d['rel_l2']:.2e} (<= {BF16_REL_L2})"
    )
    report(args.json, "te", ok, line, unequal=unequal, logprobs=d)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
