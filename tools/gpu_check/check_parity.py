"""Check 1: the trainer's log-probs on the device, in bf16, against an fp32 CPU reference.

    python tools/gpu_check/check_parity.py --hf HF_DIR --work DIR [--device cuda|cpu] [--json PATH]

The HF checkpoint is converted to torch_dist (``convert_hf_to_mcore``) and loaded into the
package's Megatron GPTModel (local spec, world size 1, NCCL on CUDA / gloo on CPU) twice, in
fp32 and in bf16; ``compute_logprobs`` (the path of lp_old and lp_ref) gives
``log π(x_t | x_<t)`` for random token sequences of several lengths. The reference is transformers'
fp32 model on the CPU: ``log_softmax(logits[t-1])[x_t]``, 1 <= t < length.

Tolerances, over the compared tokens (Δ = device − reference):

* fp32: max |Δ| <= 1e-4, the converter's logit check (convert/verify.py); fp32 kernels on any
  device agree to ~1e-6 here, so this catches layout and host/device bugs that bf16 would hide.
* bf16: ‖Δ‖₂/‖ref‖₂ <= 1e-2 and mean |Δ| <= 0.02. bf16 keeps 8 significant bits (unit
  roundoff u = 2^-8 ≈ 3.9e-3); every matmul output, residual add and the logits themselves are
  rounded once each, so a log-prob carries an error of a few u relative to the logits' size:
  1e-2 (≈ 2.6u) is METHOD.md's upper band for bf16 operands. The absolute bound is what RL
  cares about: exp(Δ) is the error of the importance ratio, and a mean |Δ| of 0.02 is a 2%
  ratio error, a tenth of the clip range ε_low = 0.2. It holds for this check's model (the
  warmed-up tiny model, logits within about ±8, random tokens: measured 1e-3 to 8e-3 on the
  CPU); a model with much larger logits needs a bound scaled with them. The largest |Δ| is
  printed, not bounded: a token whose two best logits nearly tie can move by more, harmlessly.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from check_lines import report, select_device, single_process_env  # noqa: E402

FP32_MAX_ABS = 1e-4
BF16_MEAN_ABS = 0.02
BF16_REL_L2 = 1e-2


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hf", required=True, help="HF checkpoint directory (config.json + safetensors)")
    p.add_argument("--work", required=True, help="scratch directory (the converted checkpoint goes here)")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--json", default=None, help="write the result here")
    p.add_argument("--batch", type=int, default=8, help="sequences")
    p.add_argument("--length", type=int, default=48, help="longest sequence; the others are shorter")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def reference_logprobs(hf_dir: str, tokens, lengths):
    """transformers fp32 on the CPU: [B, T] with log π(x_t | x_<t) at 1 <= t < length, 0 elsewhere."""
    import torch

    from armor_megatron.convert.verify import hf_logits

    logp = torch.log_softmax(hf_logits(hf_dir, tokens), dim=-1)  # right padding: causal, so rows < length are exact
    out = torch.zeros(tokens.shape, dtype=torch.float32)
    out[:, 1:] = logp[:, :-1].gather(-1, tokens[:, 1:, None]).squeeze(-1)
    return out * response_positions(tokens, lengths)


def response_positions(tokens, lengths):
    """1.0 at the compared positions 1 <= t < length (t = 0 has no prediction)."""
    import torch

    t = torch.arange(tokens.shape[1])[None, :]
    return ((t >= 1) & (t < lengths[:, None])).float()


def megatron_logprobs(arch, mcore_dir: str, tokens, lengths, dtype):
    """The package's GPTModel in `dtype` on this process's device, through ``compute_logprobs``."""
    from armor_megatron.megatron.logprobs import compute_logprobs
    from armor_megatron.megatron.model import build_gpt_model
    from armor_megatron.megatron.model_state import load_model_weights

    model = build_gpt_model(arch, dtype=dtype, use_te=False)
    load_model_weights([model], mcore_dir)
    out = compute_logprobs([model], tokens, lengths, micro_batch_size=len(tokens), vocab_size=arch.vocab_size)
    return out.logprobs.float().cpu(), str(next(model.parameters()).device)


def parity_inputs(hf_dir: str, mcore_dir: str, batch: int, length: int, seed: int = 0):
    """(arch, tokens, lengths, mask): the model's architecture, ragged random sequences (padding
    in play) and their compared positions; converts ``hf_dir`` to ``mcore_dir`` when not done yet."""
    import torch

    from armor_megatron.convert import convert_hf_to_mcore
    from armor_megatron.convert.verify import prompts
    from armor_megatron.models import ModelArch

    arch = ModelArch.from_hf_dir(hf_dir)
    if not os.path.isdir(mcore_dir):
        convert_hf_to_mcore(hf_dir, mcore_dir, progress_stream=None)
    tokens = prompts(arch, batch=batch, length=length, seed=seed)
    lengths = length - torch.arange(batch) * (length // (2 * batch))
    return arch, tokens, lengths, response_positions(tokens, lengths)


def compare(device_lp, reference_lp, mask) -> dict:
    diff = (device_lp - reference_lp).abs() * mask
    n = mask.sum().clamp(min=1)
    return {
        "max_abs": float(diff.max()),
        "mean_abs": float(diff.sum() / n),
        "rel_l2": float(diff.norm() / (reference_lp * mask).norm().clamp(min=1e-30)),
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    select_device(args.device)
    single_process_env()
    import torch

    from armor_megatron.megatron import dist

    mcore_dir = os.path.join(args.work, "parity_mcore")
    arch, tokens, lengths, mask = parity_inputs(args.hf, mcore_dir, args.batch, args.length, args.seed)
    reference = reference_logprobs(args.hf, tokens, lengths)

    ctx = dist.initialize(dist.ParallelConfig(), arch)
    torch.set_float32_matmul_precision("highest")  # fp32 means fp32 on the GPU too (no TF32)
    try:
        fp32, where = megatron_logprobs(arch, mcore_dir, tokens, lengths, torch.float32)
        bf16, _ = megatron_logprobs(arch, mcore_dir, tokens, lengths, torch.bfloat16)
    finally:
        dist.shutdown()
    f, b = compare(fp32, reference, mask), compare(bf16, reference, mask)
    ok = f["max_abs"] <= FP32_MAX_ABS and b["mean_abs"] <= BF16_MEAN_ABS and b["rel_l2"] <= BF16_REL_L2
    ok = ok and bool(torch.isfinite(bf16).all() and torch.isfinite(fp32).all())
    line = (
        f"logprob parity {where}/{ctx.backend} vs cpu fp32 (transformers), {int(mask.sum())} tokens: "
        f"bf16 mean|d|={b['mean_abs']:.2e} (<= {BF16_MEAN_ABS}) rel_l2={b['rel_l2']:.2e} (<= {BF16_REL_L2}) "
        f"max|d|={b['max_abs']:.2e}; fp32 max|d|={f['max_abs']:.2e} (<= {FP32_MAX_ABS})"
    )
    report(args.json, "parity", ok, line, device=where, backend=ctx.backend, bf16=b, fp32=f, tokens=int(mask.sum()))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
