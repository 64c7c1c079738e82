"""The policy as HF model directories beside a run's checkpoints, and the HF files a run started from.

Public interface::

    record_hf_files(model_path, checkpoint_dir)      # driver, at start: <checkpoint_dir>/hf_config/
    path = save_hf(export, checkpoint_dir, step)     # every rank: <checkpoint_dir>/hf/step_<step>
    due = save_hf_due(cfg.checkpoint.save_hf, step, last_step)
    removed = prune_hf(checkpoint_dir, keep_last)    # driver
    if export_unfinished(cfg.checkpoint.save_hf, checkpoint_dir, step, last_step): ...  # a resumed run
    removed = remove_export_leftovers(checkpoint_dir)   # driver: staging directories of killed exports

Layout of ``<checkpoint_dir>``::

    hf_config/          config.json, generation config and tokenizer files of ``model.path``
                        (what ``armor-convert mcore-to-hf`` of a checkpoint here reads)
    hf/step_0000010/    model-rank<r>-<i>.safetensors + model.safetensors.index.json + the
                        files of hf_config/: an HF model directory of the policy after step 10

Writing (`save_hf`): the weight export (`megatron.weight_export.HFWeightExport`) gathers each
tensor's TP shards onto its owner rank (one per pipeline stage and expert-parallel rank), maps it
to HF names with the converter's rules and hands it, bucket by bucket, to that rank's sink (the
``disk`` weight sync's: one safetensors file per bucket); nothing passes through rank 0. Rank 0 then writes the
index from the owners' reports, copies ``hf_config/`` in and renames the staging directory
``hf/.step_<N>.tmp-<id>`` into place, so a reader sees a complete directory or none. The tensors
are the model's own (its dtype; the padded vocabulary trimmed): the same bytes ``armor-convert
mcore-to-hf`` writes from a checkpoint of the same step.

A kill during an export: a step's checkpoint is saved before its HF copy, so a run killed while
exporting resumes from that step's checkpoint with the copy missing (and, after the last step,
has no step left to write it in). A resume therefore finishes it (`export_unfinished`: the copy
was due at the checkpoint's step and is absent) before training on, and removes the staging
directories killed exports left (`remove_export_leftovers`, also before every export), each with
a log line.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import uuid
from collections.abc import Callable
from typing import Any, TypeVar

import torch.distributed as dist

from armor_megatron.config.schema import SaveHFConfig
from armor_megatron.convert.hf_io import INDEX_FILE
from armor_megatron.convert.output import HF_FILES_DIR, copy_side_files
from armor_megatron.megatron.dist import global_rank, is_distributed
from armor_megatron.megatron.weight_export import DEFAULT_BUCKET_BYTES, HFWeightExport
from armor_megatron.rollout.sglang.weight_sync import DiskDelivery

HF_DIR = "hf"
_T = TypeVar("_T")


def step_name(step: int) -> str:
    """The directory name of the HF save at ``step``: ``step_0000042``."""
    return f"step_{step:07d}"


def save_hf_due(cfg: SaveHFConfig, step: int, last_step: int) -> bool:
    """Whether the policy after ``step`` is written: every ``every_steps``, and after the last step."""
    return bool(cfg.every_steps and step % cfg.every_steps == 0) or (cfg.at_end and step == last_step)


def record_hf_files(model_path: str, checkpoint_dir: str) -> str:
    """Record the HF config and tokenizer files a run started from.

    Copy ``model_path``'s config and tokenizer files into ``<checkpoint_dir>/hf_config`` (through a
    temporary directory renamed into place; an earlier record is replaced). Returns its path.
    """
    final = os.path.join(checkpoint_dir, HF_FILES_DIR)
    os.makedirs(checkpoint_dir, exist_ok=True)
    tmp = f"{final}.tmp-{uuid.uuid4().hex[:12]}"
    try:
        copy_side_files(model_path, tmp)
        _replace_dir(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def save_hf(export: HFWeightExport, checkpoint_dir: str, step: int, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> str:
    """Save the exported policy as an HF checkpoint.

    Write the exported policy (``export``: every rank's `HFWeightExport` of the actor) as
    ``<checkpoint_dir>/hf/step_<step>``; every rank calls it, and every rank raises if it failed.
    An owner holds one bucket of at most ``bucket_bytes`` (one file). Returns the directory's path.
    """
    root = os.path.join(checkpoint_dir, HF_DIR)
    final = _step_dir(checkpoint_dir, step)
    staging = _on_every_rank(lambda: _new_staging_dir(root, step))
    outcome: list[str | None] = [None]
    try:
        if global_rank() == 0:
            reports = export.deliver(DiskDelivery(staging, bucket_bytes))
            weight_map, total = {}, 0
            for report in filter(None, reports):
                total += report["bytes"]
                for fname, names in report["files"].items():
                    weight_map.update(dict.fromkeys(names, fname))
            with open(os.path.join(staging, INDEX_FILE), "w") as f:
                json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1, sort_keys=True)
            copy_side_files(os.path.join(checkpoint_dir, HF_FILES_DIR), staging)
            _replace_dir(staging, final)
        else:
            export.drain()  # the driver delivers: this rank's owned tensors go to its own sink
    except Exception as e:
        outcome[0] = f"{type(e).__name__}: {e}"
        if global_rank() == 0:
            shutil.rmtree(staging, ignore_errors=True)
        if not is_distributed():
            raise
    if is_distributed():
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, outcome[0])
        failed = [f"rank {r}: {e}" for r, e in enumerate(gathered) if e]
        if failed:
            raise RuntimeError(f"saving the HF copy of step {step} failed: {'; '.join(failed)}")
    return final


def export_unfinished(cfg: SaveHFConfig, checkpoint_dir: str, step: int, last_step: int) -> bool:
    """Whether the HF copy of ``step`` (a checkpoint's step) was due and is not there: a killed export."""
    return step > 0 and save_hf_due(cfg, step, last_step) and not os.path.isdir(_step_dir(checkpoint_dir, step))


def remove_export_leftovers(checkpoint_dir: str) -> list[str]:
    """Delete the staging directories of exports that never finished (and old copies being replaced).

    Each removal is logged; returns the removed paths. The driver calls it, never while an export runs.
    """
    root = os.path.join(checkpoint_dir, HF_DIR)
    patterns = (".step_*.tmp-*", "step_*.tmp-old-*")
    removed = sorted(p for pattern in patterns for p in glob.glob(os.path.join(glob.escape(root), pattern)))
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
        print(f"[armor] removed {path}, left by an HF export that did not finish", flush=True)
    return removed


def _step_dir(checkpoint_dir: str, step: int) -> str:
    return os.path.join(checkpoint_dir, HF_DIR, step_name(step))


def _new_staging_dir(root: str, step: int) -> str:
    os.makedirs(root, exist_ok=True)
    remove_export_leftovers(os.path.dirname(root))
    staging = os.path.join(root, f".{step_name(step)}.tmp-{uuid.uuid4().hex[:12]}")
    os.makedirs(staging)
    return staging


def _on_every_rank(make: Callable[[], _T]) -> _T:
    """``make()`` run on rank 0; its result, or its error, on every rank."""
    box: list[Any] = [None]
    if global_rank() == 0:
        try:
            box[0] = make()
        except OSError as e:
            box[0] = e
    if is_distributed():
        dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], Exception):
        raise box[0]
    made: _T = box[0]
    return made


def prune_hf(checkpoint_dir: str, keep_last: int) -> list[str]:
    """Remove all but the newest ``keep_last`` HF directories (0 keeps all); returns the removed."""
    root = os.path.join(checkpoint_dir, HF_DIR)
    if keep_last < 1 or not os.path.isdir(root):
        return []
    saved = sorted(n for n in os.listdir(root) if n.startswith("step_") and ".tmp-" not in n)
    removed = [os.path.join(root, n) for n in saved[:-keep_last]]
    for path in removed:
        shutil.rmtree(path)
    return removed


def _replace_dir(tmp: str, final: str) -> None:
    """Rename ``tmp`` to ``final``; an existing ``final`` is moved aside first and then removed."""
    if os.path.lexists(final):
        old = f"{final}.tmp-old-{uuid.uuid4().hex[:12]}"
        os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, final)
