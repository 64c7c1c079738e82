"""Prepare a tiny CPU run: tokenizer, a warmed-up tiny HF model and the task's data.

The architecture is the config's ``model.arch`` (an HF config dict), so ``configs/tiny_cpu.yaml``
alone describes the model that the trainer then converts and trains. Warm-up is short
supervised training on correct solutions, enough for the reference policy to solve part of
the task — anchors need a reference that sometimes succeeds.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable

import torch

from armor_megatron.config.schema import RunConfig
from armor_megatron.errors import UserInputError
from armor_megatron.tasks import arithmetic, noisy_cue, tagged_addition, tool_lookup, worked_addition
from armor_megatron.tasks.arithmetic import solution, write_jsonl
from armor_megatron.tasks.warmup import supervised_warmup


def _arithmetic_split(num_val: int, *, seed: int, max_operand: int):
    train, val = arithmetic.split_problems(num_val, seed=seed, max_operand=max_operand)
    return train, val, train


RECIPE = "armor_tiny_run.json"  # beside the model: what it was made from

# task name -> (tokenizer builder, split(num_val, seed=, max_operand=, **options) -> (train, val, warm-up rows));
# a warm-up row may carry its own "response" (otherwise the task's reference solution is taught)
TASKS = {
    "arithmetic": (arithmetic.build_tokenizer, _arithmetic_split),
    "tagged_addition": (tagged_addition.build_tokenizer, tagged_addition.split_problems),
    "worked_addition": (worked_addition.build_tokenizer, worked_addition.split_problems),
    "noisy_cue": (noisy_cue.build_tokenizer, noisy_cue.split_problems),
    "tool_lookup": (tool_lookup.build_tokenizer, tool_lookup.split_problems),
}


def tiny_hf_config(cfg: RunConfig, tokenizer) -> dict:
    """The HF config of the run's tiny model (``model.arch``), checked against the tokenizer."""
    hf = dict(cfg.model.arch)
    if len(tokenizer) > hf["vocab_size"]:
        raise UserInputError(
            f"model.arch.vocab_size={hf['vocab_size']} is smaller than the tokenizer ({len(tokenizer)})"
        )
    if "architectures" not in hf:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        hf["architectures"] = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[hf["model_type"]]]
    hf.update(
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.eos_token_id,
        torch_dtype="float32",
        use_cache=True,
    )
    return hf


def prepare_tiny_run(
    cfg: RunConfig,
    *,
    task: str = "arithmetic",
    num_val: int = 64,
    max_operand: int = 30,
    warmup_steps: int = 400,
    seed: int = 0,
    options: dict | None = None,
    warmup_lr: float = 3e-3,
    log: Callable[[str], None] | None = print,
) -> dict:
    """Write the tiny run's HF model, tokenizer and datasets named by ``cfg``.

    Write ``cfg.model.path`` (HF model + tokenizer) and the train / val JSONL files named by the
    config. The model is kept when ``armor_tiny_run.json`` there records the same recipe (task,
    sizes, warm-up corpus and settings, seed, architecture), and rebuilt otherwise. ``task`` names
    an entry of ``TASKS``; ``options`` go to its split. Returns {"train": rows, "val": rows}.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    if task not in TASKS:
        raise UserInputError(f"unknown tiny task {task!r}; known: {', '.join(TASKS)}")
    build_tokenizer, split = TASKS[task]
    val_path = cfg.eval.datasets[0].path if cfg.eval.datasets else None
    train_rows, val_rows, warmup_rows = split(num_val, seed=seed, max_operand=max_operand, **(options or {}))
    write_jsonl(cfg.data.train_path, train_rows)
    if val_path:
        write_jsonl(val_path, val_rows)
    tokenizer = build_tokenizer()
    hf = tiny_hf_config(cfg, tokenizer)
    responses = [r.get("response") or solution(r) for r in warmup_rows]
    corpus = hashlib.sha256(json.dumps([[r["prompt"] for r in warmup_rows], responses]).encode()).hexdigest()
    recipe = {"task": task, "warmup_steps": warmup_steps, "warmup_lr": warmup_lr, "seed": seed}
    recipe.update(max_operand=max_operand, warmup_corpus_sha256=corpus, arch=hf)
    recorded = _recorded_recipe(cfg.model.path)
    if recorded == recipe:
        return {"train": train_rows, "val": val_rows}
    if recorded is not None and log:
        log(f"rebuilding {cfg.model.path}: it was made for another recipe")

    torch.manual_seed(seed)
    config = AutoConfig.for_model(**hf)
    model = AutoModelForCausalLM.from_config(config)
    # Warm up on the task's warm-up corpus (validation prompts stay unseen).
    supervised_warmup(
        model,
        tokenizer,
        [r["prompt"] for r in warmup_rows],
        responses,
        steps=warmup_steps,
        lr=warmup_lr,
        seed=seed,
        log=log,
    )
    tmp = f"{cfg.model.path}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    with open(os.path.join(tmp, RECIPE), "w") as f:
        json.dump(recipe, f)
    if os.path.isdir(cfg.model.path):
        shutil.rmtree(cfg.model.path)  # the model of another recipe: rebuilt, not mixed
    os.replace(tmp, cfg.model.path)
    return {"train": train_rows, "val": val_rows}


def _recorded_recipe(path: str) -> dict | None:
    """The recipe ``armor_tiny_run.json`` in ``path`` records.

    What ``armor_tiny_run.json`` in ``path`` records (JSON types), {} for a model without one,
    None when there is no model.
    """
    if not os.path.isfile(os.path.join(path, "config.json")):
        return None
    try:
        with open(os.path.join(path, RECIPE)) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError):
        return {}
