"""``armor-convert``: HF safetensors <-> Megatron torch_dist checkpoints, streaming on CPU.

    armor-convert hf-to-mcore HF_DIR OUT_DIR [--tp N --pp N --ep N] [--overwrite]
    armor-convert mcore-to-hf MCORE_DIR OUT_DIR [--hf-config DIR] [--max-shard-size 5GB] [--overwrite]
    armor-convert verify HF_DIR MCORE_DIR [--no-logits] [--atol 1e-4]
    armor-convert lora-to-peft CHECKPOINT OUT_DIR [--overwrite]
    armor-convert tiny-model OUT_DIR [--family qwen2|llama] [--hidden-size 64] [--layers 2] [--context 2048] [--overwrite]

Exit status: 0 success, 2 bad input (one line on stderr, nothing written), 1 failed
verification, 130 interrupted (Ctrl-C or SIGTERM; the partial output is removed). Conversions print progress on long runs and a summary line at the end.
"""

from __future__ import annotations

import argparse
import re
import signal
import sys
from collections.abc import Sequence

from armor_megatron.cli.common import OneLineArgumentParser, quiet_third_party_warnings
from armor_megatron.errors import UserInputError

# What a user can get wrong: missing/truncated files, wrong tensors, unsupported models,
# parallel sizes that do not divide, an existing output directory.
PROG = "armor-convert"
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """'5GB' -> 5·10⁹, '512MiB' -> 512·2²⁰, '1000' -> 1000 bytes."""
    match = _SIZE.match(text)
    if not match:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 5GB, 512MiB, 1000000)")
    number, unit = float(match.group(1)), (match.group(2) or "B").upper()
    base = 1024 if "I" in unit else 1000
    power = "BKMGT".index(unit[0]) if unit != "B" else 0
    size = int(number * base**power)
    if size < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive size (examples: 5GB, 512MiB, 1000000)")
    return size


def build_parser() -> argparse.ArgumentParser:
    """The ``armor-convert`` argument parser (hf-to-mcore, mcore-to-hf, verify, lora-to-peft, tiny-model)."""
    parser = OneLineArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("hf-to-mcore", help="HF safetensors directory -> Megatron torch_dist checkpoint")
    p.add_argument("hf_dir")
    p.add_argument("out_dir")
    for axis in ("tp", "pp", "ep"):
        p.add_argument(
            f"--{axis}",
            type=int,
            default=1,
            help=f"check that the model divides for this {axis.upper()} size (the checkpoint loads at any)",
        )
    p.add_argument("--overwrite", action="store_true", help="replace an existing OUT_DIR")
    p.add_argument("--quiet", action="store_true", help="no progress lines")

    p = sub.add_parser("mcore-to-hf", help="Megatron torch_dist checkpoint -> HF safetensors directory")
    p.add_argument("mcore_dir")
    p.add_argument("out_dir")
    p.add_argument(
        "--hf-config",
        help="HF directory with config.json/tokenizer (default: MCORE_DIR/hf_config, or the hf_config a training "
        "run recorded beside MCORE_DIR)",
    )
    p.add_argument("--max-shard-size", type=parse_size, default="5GB", help="largest safetensors shard (default 5GB)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing OUT_DIR")
    p.add_argument("--quiet", action="store_true", help="no progress lines")

    p = sub.add_parser("verify", help="round trip bit-for-bit and Megatron vs transformers logits")
    p.add_argument("hf_dir")
    p.add_argument("mcore_dir")
    p.add_argument("--no-logits", action="store_true", help="only the round trip (no model forward)")
    p.add_argument("--atol", type=float, default=1e-4, help="largest allowed logit difference (fp32)")

    p = sub.add_parser(
        "lora-to-peft",
        help="a LoRA training checkpoint's adapters -> HF PEFT adapter directory (peft.PeftModel.from_pretrained)",
    )
    p.add_argument("checkpoint", help="a checkpoint (<checkpoint.dir>/iter_N) or a run's checkpoint directory")
    p.add_argument("out_dir")
    p.add_argument("--overwrite", action="store_true", help="replace an existing OUT_DIR")

    p = sub.add_parser(
        "tiny-model",
        help="a random tiny HF model with a chat-template tokenizer (printable ASCII), to try a dataset on a CPU",
    )
    p.add_argument("out_dir")
    p.add_argument("--family", choices=("qwen2", "llama"), default="qwen2")
    p.add_argument("--hidden-size", type=int, default=64, help="hidden size (4 heads of hidden/4; default 64)")
    p.add_argument("--layers", type=int, default=2, help="decoder layers (default 2)")
    p.add_argument("--context", type=int, default=2048, help="max_position_embeddings (default 2048)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    p.add_argument("--overwrite", action="store_true", help="replace an existing OUT_DIR")
    return parser


def _run(args: argparse.Namespace) -> int:
    from armor_megatron.convert import convert_hf_to_mcore, convert_mcore_to_hf
    from armor_megatron.convert.progress import release_large_frees_to_os

    release_large_frees_to_os()
    progress = None if getattr(args, "quiet", False) else sys.stderr
    if args.command == "hf-to-mcore":
        summary = convert_hf_to_mcore(
            args.hf_dir,
            args.out_dir,
            tp=args.tp,
            pp=args.pp,
            ep=args.ep,
            overwrite=args.overwrite,
            progress_stream=progress,
        )
        print(summary.line())
        return 0
    if args.command == "mcore-to-hf":
        summary = convert_mcore_to_hf(
            args.mcore_dir,
            args.out_dir,
            hf_config_dir=args.hf_config,
            max_shard_bytes=args.max_shard_size,
            overwrite=args.overwrite,
            progress_stream=progress,
        )
        print(summary.line())
        return 0
    if args.command == "lora-to-peft":
        from armor_megatron.megatron.lora_peft import lora_checkpoint_to_peft

        print(lora_checkpoint_to_peft(args.checkpoint, args.out_dir, overwrite=args.overwrite).line())
        return 0
    if args.command == "tiny-model":
        return _tiny_model(args)
    return _verify(args)


def _tiny_model(args: argparse.Namespace) -> int:
    import os

    from armor_megatron.rollout.testing.tiny_models import make_tiny_chat_model

    if args.hidden_size < 4 or args.hidden_size % 4:
        raise UserInputError(f"--hidden-size {args.hidden_size}: must be a positive multiple of 4 (4 attention heads)")
    for name, value, least in (("--layers", args.layers, 1), ("--context", args.context, 2)):
        if value < least:
            raise UserInputError(f"{name} {value}: must be >= {least}")
    if os.path.exists(args.out_dir) and os.listdir(args.out_dir) and not args.overwrite:
        raise UserInputError(f"{args.out_dir} exists and is not empty; pass --overwrite to replace it")
    cfg = make_tiny_chat_model(
        args.out_dir,
        family=args.family,
        hidden_size=args.hidden_size,
        num_layers=args.layers,
        context=args.context,
        seed=args.seed,
    )
    print(
        f"wrote {args.out_dir}: a random tiny {args.family} (hidden {cfg['hidden_size']}, {cfg['num_hidden_layers']} "
        f"layers, context {cfg['max_position_embeddings']}, vocabulary {cfg['vocab_size']}: printable ASCII and "
        "ChatML's markers, with a chat template); try it: armor-train --config configs/tiny_cpu.yaml "
        f"model.path={args.out_dir} data.train_path=YOUR.jsonl data.apply_chat_template=true eval.datasets=[] --check"
    )
    return 0


def _verify(args: argparse.Namespace) -> int:
    import contextlib

    from armor_megatron.megatron.verify import single_process_megatron, verify

    with contextlib.nullcontext() if args.no_logits else single_process_megatron():
        report = verify(args.hf_dir, args.mcore_dir, logits=not args.no_logits, atol=args.atol)
    print("\n".join(report.lines()))
    return 0 if report.ok else 1


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``armor-convert``; returns the exit code."""
    args = build_parser().parse_args(argv)
    quiet_third_party_warnings()
    previous = signal.signal(signal.SIGTERM, _interrupt)  # clean up like Ctrl-C does
    try:
        return _run(args)
    except UserInputError as e:  # anything else is a bug and keeps its traceback
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted; the partial output was removed", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)


def _interrupt(signum, frame):
    raise KeyboardInterrupt


if __name__ == "__main__":
    sys.exit(main())
