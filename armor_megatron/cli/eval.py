"""``armor-eval``: avg@k and pass@k of a model on JSONL / Parquet datasets.

    armor-eval --model HF_DIR --dataset aime24=/data/aime24.jsonl --dataset math500=/data/math500.parquet \
               --k 16 --pass-k 1 16 --temperature 0.6 --output results.json
    armor-eval --config configs/qwen25_math_7b_dapo_armor.yaml [--model CKPT_HF_DIR]   # the config's eval section

Local engine (transformers, in process) by default; ``--url`` evaluates through a running
SGLang server instead. Each row is scored by the verifier its ``type`` column names (``math``,
``safety``, ``knowledge``...; ``--verifier`` for rows without one); ``--prompt-key`` and
``--answer-key`` name the columns of ``--dataset`` files (a verl Parquet's, for instance). Prints a table per
dataset and one of accuracy per domain (the verifier); ``--output`` writes metrics, domain
accuracy and every sample as JSON.
"""

from __future__ import annotations

import json
import os
import sys

from armor_megatron.cli.common import EXIT_OK, OneLineArgumentParser, fail
from armor_megatron.errors import MissingInputError, UserInputError

PROG = "armor-eval"
DEFAULT_COLUMNS = ("prompt", "answer", "type")


def build_parser() -> OneLineArgumentParser:
    """The ``armor-eval`` argument parser."""
    p = OneLineArgumentParser(prog=PROG, description="Evaluate a model: avg@k and unbiased pass@k per dataset.")
    p.add_argument("--config", help="run config; its eval section and model are the defaults")
    p.add_argument("--model", help="HF model directory (weights and tokenizer)")
    p.add_argument("--dataset", action="append", default=[], metavar="NAME=PATH", help="repeatable")
    p.add_argument("--k", type=int, default=None, help="samples per prompt")
    p.add_argument("--pass-k", type=int, nargs="+", default=None)
    p.add_argument("--temperature", type=float, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--max-new-tokens", type=int, default=None)
    p.add_argument("--verifier", default=None, help="registered name or module:function")
    p.add_argument(
        "--prompt-key", default=None, help="prompt column of the --dataset files (default: the config's, else prompt)"
    )
    p.add_argument(
        "--answer-key", default=None, help="answer column of the --dataset files (default: the config's, else answer)"
    )
    p.add_argument("--url", help="evaluate through a running SGLang server at this URL")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", help="write metrics and samples as JSON here")
    return p


def _columns(cfg, name: str, args) -> tuple[str, str, str]:
    """The prompt, answer and type keys of evaluation set ``name``.

    Sets given by ``--dataset``: ``--prompt-key`` / ``--answer-key``, else the config's ``data``
    keys, else the row defaults. A config's ``eval.datasets`` entry: its own keys, else ``data``'s.
    """
    if not args.dataset:
        own = next(d for d in cfg.eval.datasets if d.name == name)
        return own.prompt_key or cfg.data.prompt_key, own.answer_key or cfg.data.answer_key, cfg.data.type_key
    prompt, answer, kind = (cfg.data.prompt_key, cfg.data.answer_key, cfg.data.type_key) if cfg else DEFAULT_COLUMNS
    return args.prompt_key or prompt, args.answer_key or answer, kind


def main(argv: list[str] | None = None) -> int:
    """Run ``armor-eval``; returns the exit code."""
    args = build_parser().parse_args(argv)
    from armor_megatron.config import ConfigError, load_config

    try:
        cfg = load_config(args.config) if args.config else None
    except ConfigError as err:
        return fail(PROG, f"config: {err}")
    ev = cfg.eval if cfg else None
    model = args.model or (cfg.model.path if cfg else None)
    if not model:
        return fail(PROG, "--model (or --config) is required")
    given = [tuple(d.split("=", 1)) for d in args.dataset]
    malformed = next((d for d, pair in zip(args.dataset, given) if len(pair) != 2 or not all(pair)), None)
    if malformed is not None:
        return fail(PROG, f"--dataset {malformed!r} is not NAME=PATH")
    if (args.prompt_key or args.answer_key) and not given:
        return fail(
            PROG, "--prompt-key and --answer-key name the columns of --dataset files (eval.datasets have their own)"
        )
    sets = given or ([(d.name, d.path) for d in ev.datasets] if ev else [])
    if not sets:
        return fail(PROG, "give at least one --dataset NAME=PATH (or a config with eval.datasets)")
    k = args.k or (max(d.k for d in ev.datasets) if ev and ev.datasets else 1)
    pass_k = args.pass_k or (ev.pass_k if ev else [1])
    if any(j < 1 or j > k for j in pass_k):
        return fail(PROG, f"--pass-k values must be in [1, k={k}]")
    try:
        from armor_megatron.data.prompts import PromptDataset, encode_prompt
        from armor_megatron.rewards import scorable
        from armor_megatron.rollout.engine import SamplingParams
        from armor_megatron.trainer.evaluation import EvalSet, evaluate, format_table

        verifier = args.verifier or (cfg.reward.verifier if cfg else "math")
        allowed = cfg.reward.verifiers if cfg else []
        eval_sets = [
            EvalSet(name, scorable(PromptDataset(path, *_columns(cfg, name, args)), verifier, allowed), k)
            for name, path in sets
        ]
        sampling = SamplingParams(
            max_new_tokens=args.max_new_tokens or (ev.max_response_len if ev else 1024),
            temperature=args.temperature if args.temperature is not None else (ev.temperature if ev else 0.0),
            top_p=args.top_p or (ev.top_p if ev else 1.0),
            seed=args.seed,
        )
        engine, tokenizer = _engine(model, args.url)
        from armor_megatron.trainer.components import multi_turn_rollout

        environment = multi_turn_rollout(cfg, tokenizer) if cfg else None  # the config's rollout.environment
    except UserInputError as err:  # anything else is a bug and keeps its traceback
        return fail(PROG, str(err))
    data = cfg.data if cfg else None
    encode = lambda prompt: encode_prompt(  # noqa: E731
        tokenizer,
        prompt,
        apply_chat_template=data.apply_chat_template if data else True,
        template=data.prompt_template if data else None,
    )
    with engine:
        result = evaluate(
            engine, encode, eval_sets, sampling, verifier=verifier, pass_k=pass_k, environment=environment
        )
    domains = domain_accuracy(result.records, eval_sets, verifier)
    print(format_table(result.metrics))
    print()
    print(format_domain_table(domains))
    if args.output:
        payload = {"model": model, "k": k, "metrics": result.metrics, "domains": domains, "samples": result.records}
        _write_json(args.output, payload)
    return EXIT_OK


def domain_accuracy(records: list[dict], eval_sets, default_verifier: str) -> dict[str, dict[str, float]]:
    """Accuracy per domain over every scored sample.

    A sample's domain is the verifier its row was scored with (the row's ``type``, else
    ``default_verifier``).
    """
    from armor_megatron.rewards.metrics import accuracy_by_domain

    domain_of = {(es.name, row.index): row.verifier or default_verifier for es in eval_sets for row in es.dataset.rows}
    return accuracy_by_domain((domain_of[(r["dataset"], r["index"])], r["score"]) for r in records)


def format_domain_table(domains: dict[str, dict[str, float]]) -> str:
    """``domain  samples  accuracy``, one row per domain."""
    rows = [["domain", "samples", "accuracy"]]
    rows += [[d, f"{int(v['num_samples'])}", f"{v['accuracy']:.4f}"] for d, v in domains.items()]
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows)


def _engine(model: str, url: str | None):
    from armor_megatron.models.tokenizer import load_tokenizer

    if not os.path.isdir(model):
        raise MissingInputError(f"model directory not found: {model}")
    tokenizer = load_tokenizer(model)
    if url:
        from armor_megatron.rollout.sglang.engine import SGLangEngine

        return SGLangEngine(worker_urls=[url]), tokenizer
    from armor_megatron.rollout.local import LocalEngine

    return LocalEngine.from_pretrained(model), tokenizer


def _write_json(path: str, payload: dict) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(payload, f, indent=1, default=str)
    os.replace(tmp, path)


if __name__ == "__main__":
    sys.exit(main())
