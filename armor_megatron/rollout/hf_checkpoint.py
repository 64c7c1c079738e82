"""HF checkpoints as the engines see them: a ``config.json`` and safetensors shards.

The trainer hands the rollout side HF-named tensors (the converter's family rules turned
Megatron shards into HF names); this module builds a transformers model from them and writes
or reads checkpoint directories for the ``disk`` weight-sync mode. Writes are atomic: a
reader sees either the previous checkpoint or the complete new one, never a half-written one.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from typing import Any, Iterable, Iterator, Mapping, Tuple

SAFETENSORS_INDEX = "model.safetensors.index.json"


def build_causal_lm(hf_config: Mapping[str, Any], dtype=None):
    """A randomly initialised ``AutoModelForCausalLM`` of ``hf_config`` (eager attention, eval mode)."""
    import torch
    import transformers

    cfg = dict(hf_config)
    model_type = cfg.pop("model_type", None)
    if model_type is None:
        raise ValueError("HF config has no 'model_type'")
    config = transformers.AutoConfig.for_model(model_type, **cfg)
    config._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype or torch.float32)
    return model.eval()


def load_named_tensors(model, named_tensors: Iterable[Tuple[str, Any]], strict: bool = True) -> int:
    """Copy HF-named tensors into ``model`` in place; returns how many were loaded.

    With ``strict`` every parameter must be given once (a tied ``lm_head`` may be omitted, as
    in HF checkpoints). Unknown names and shape mismatches always raise ``KeyError``/``ValueError``.
    """
    import torch

    state = model.state_dict()
    seen = set()
    with torch.no_grad():
        for name, tensor in named_tensors:
            if name not in state:
                raise KeyError(f"weight {name!r} does not exist in {type(model).__name__}")
            target = state[name]
            if tuple(target.shape) != tuple(tensor.shape):
                raise ValueError(f"weight {name!r}: shape {tuple(tensor.shape)} != model's {tuple(target.shape)}")
            target.copy_(tensor.to(device=target.device, dtype=target.dtype))
            seen.add(name)
    if strict:
        loaded_storage = {state[n].data_ptr() for n in seen}
        missing = sorted(n for n, p in model.named_parameters() if n not in seen and p.data_ptr() not in loaded_storage)
        if missing:
            raise KeyError(f"{len(missing)} weights missing from the update, first: {missing[0]!r}")
    return len(seen)


def write_hf_checkpoint(
    directory: str,
    named_tensors: Iterable[Tuple[str, Any]],
    hf_config: Mapping[str, Any],
    max_shard_bytes: int = 2 << 30,
) -> str:
    """Stream ``(name, tensor)`` into safetensors shards + index + ``config.json`` at ``directory``.

    Tensors are written shard by shard (at most ``max_shard_bytes`` held in memory). The
    directory is assembled under a temporary name beside it and renamed into place; an old
    checkpoint at ``directory`` is replaced. Returns ``directory``.
    """
    from safetensors.torch import save_file

    directory = os.path.abspath(directory)
    parent = os.path.dirname(directory)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=os.path.basename(directory) + ".tmp-", dir=parent)
    try:
        shard_files, weight_map = [], {}
        shard, shard_bytes = {}, 0

        def flush():
            nonlocal shard, shard_bytes
            if shard:
                fname = f"shard-{len(shard_files):05d}.safetensors"
                save_file(shard, os.path.join(tmp, fname), metadata={"format": "pt"})
                shard_files.append((fname, list(shard)))
                shard, shard_bytes = {}, 0

        for name, tensor in named_tensors:
            if name in weight_map or name in shard:
                raise ValueError(f"weight {name!r} given twice")
            nbytes = tensor.numel() * tensor.element_size()
            if shard and shard_bytes + nbytes > max_shard_bytes:
                flush()
            shard[name] = tensor.detach().to("cpu").contiguous()
            shard_bytes += nbytes
        flush()
        if not shard_files:
            raise ValueError("no weights to write")
        total = len(shard_files)
        for i, (fname, names) in enumerate(shard_files):
            final = f"model-{i + 1:05d}-of-{total:05d}.safetensors"
            os.rename(os.path.join(tmp, fname), os.path.join(tmp, final))
            weight_map.update({n: final for n in names})
        with open(os.path.join(tmp, SAFETENSORS_INDEX), "w") as f:
            json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=1, sort_keys=True)
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(dict(hf_config), f, indent=1, sort_keys=True)
        _replace_dir(tmp, directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return directory


def _replace_dir(src: str, dst: str) -> None:
    """Move directory ``src`` to ``dst``; an existing ``dst`` is swapped out, then deleted."""
    if os.path.exists(dst):
        old = tempfile.mkdtemp(prefix=os.path.basename(dst) + ".old-", dir=os.path.dirname(dst))
        os.rename(dst, os.path.join(old, "ckpt"))
        os.rename(src, dst)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(src, dst)


def read_hf_checkpoint(directory: str) -> Iterator[Tuple[str, Any]]:
    """Yield ``(name, tensor)`` from every ``*.safetensors`` file in ``directory``, one tensor at a time."""
    from safetensors import safe_open

    files = sorted(f for f in os.listdir(directory) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors files in {directory}")
    for fname in files:
        with safe_open(os.path.join(directory, fname), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)
