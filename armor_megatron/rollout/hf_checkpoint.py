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
from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from armor_megatron.errors import MissingInputError

if TYPE_CHECKING:
    import torch

SAFETENSORS_INDEX = "model.safetensors.index.json"


def build_causal_lm(hf_config: Mapping[str, Any], dtype: torch.dtype | None = None) -> Any:
    """A randomly initialised ``AutoModelForCausalLM`` of ``hf_config`` (eager attention, eval mode)."""
    import torch
    import transformers

    cfg = dict(hf_config)
    model_type = cfg.pop("model_type", None)
    if model_type is None:
        raise ValueError("HF config has no 'model_type'")
    config = transformers.AutoConfig.for_model(model_type, **cfg)
    config._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(  # type: ignore[no-untyped-call]  # transformers leaves it untyped
        config, dtype=dtype or torch.float32
    )
    return model.eval()


def load_named_tensors(model: torch.nn.Module, named_tensors: Iterable[tuple[str, Any]], strict: bool = True) -> int:
    """Copy HF-named tensors into ``model`` in place; returns how many were loaded.

    All or nothing: names and shapes are checked before anything is copied. Unknown names and
    shape mismatches raise ``KeyError``/``ValueError``; with ``strict`` every parameter must be
    given (a tied ``lm_head`` may be omitted, as in HF checkpoints).
    """
    import torch

    state = model.state_dict()
    named = list(named_tensors)
    for name, tensor in named:
        if name not in state:
            raise KeyError(f"weight {name!r} does not exist in {type(model).__name__}")
        if tuple(state[name].shape) != tuple(tensor.shape):
            raise ValueError(f"weight {name!r}: shape {tuple(tensor.shape)} != model's {tuple(state[name].shape)}")
    seen = {name for name, _ in named}
    if len(seen) != len(named):
        raise ValueError("a weight is given twice in one update")
    if strict:
        loaded_storage = {state[n].data_ptr() for n in seen}
        missing = sorted(n for n, p in model.named_parameters() if n not in seen and p.data_ptr() not in loaded_storage)
        if missing:
            raise KeyError(f"{len(missing)} weights missing from the update, first: {missing[0]!r}")
    with torch.no_grad():
        for name, tensor in named:
            state[name].copy_(tensor.to(device=state[name].device, dtype=state[name].dtype))
    return len(named)


def load_through_transformers(
    model: torch.nn.Module, weights: Iterable[tuple[str, Any]] | str | os.PathLike[str], hf_config: Mapping[str, Any]
) -> int:
    """Load a full set of HF checkpoint tensors via ``from_pretrained`` and copy them into ``model``.

    For names the in-memory model does not have: transformers 5 fuses MoE experts in memory
    (``mlp.experts.gate_up_proj``) while checkpoints keep ``mlp.experts.{e}.gate_proj``; its
    loader converts. ``weights``: a checkpoint directory or ``(name, tensor)`` pairs.
    Returns the number of model tensors set; raises ``KeyError`` if any stayed uninitialised.
    """
    import transformers

    from armor_megatron.convert.hf_io import safetensors_files

    with tempfile.TemporaryDirectory() as tmp:
        path: str | os.PathLike[str]
        if isinstance(weights, (str, os.PathLike)):
            path = weights
            safetensors_files(os.fspath(path))  # the index's shard names stay inside: transformers opens them
            for _ in read_hf_checkpoint(os.fspath(path), keys_only=True):  # dtypes and lengths checked
                pass
        else:
            path = write_hf_checkpoint(os.path.join(tmp, "ckpt"), weights, hf_config)
        try:
            # (model, loading info): transformers types the result as the model alone
            result: Any = transformers.AutoModelForCausalLM.from_pretrained(
                os.fspath(path), dtype=next(model.parameters()).dtype, output_loading_info=True
            )
            loaded, info = result
        except RuntimeError as e:
            raise ValueError(f"transformers could not load the update (incomplete or mis-shaped weights): {e}") from e
    unexpected = sorted(info.get("unexpected_keys") or ())
    if unexpected:
        raise KeyError(f"weight {unexpected[0]!r} does not exist in {type(model).__name__}")
    missing = sorted(info.get("missing_keys") or ())
    if missing:
        raise KeyError(f"{len(missing)} weights missing from the update, first: {missing[0]!r}")
    state = loaded.state_dict()
    model.load_state_dict(state, strict=True)
    return len(state)


def write_hf_checkpoint(
    directory: str,
    named_tensors: Iterable[tuple[str, Any]],
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
        shard_files: list[tuple[str, list[str]]] = []
        weight_map: dict[str, str] = {}
        shard: dict[str, Any] = {}
        shard_bytes = 0

        def flush() -> None:
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


def read_hf_checkpoint(directory: str, keys_only: bool = False) -> Iterator[tuple[str, Any]]:
    """Yield ``(name, tensor)`` from every ``*.safetensors`` file in ``directory``, one tensor at a time.

    ``keys_only``: yield ``(name, None)`` without reading any tensor data.
    """
    from safetensors import safe_open

    from armor_megatron.confined import inside
    from armor_megatron.convert.hf_io import declared_dtype, read_header
    from armor_megatron.models import load_hf_config

    if not os.path.isdir(directory):
        raise MissingInputError(f"checkpoint directory {directory} does not exist")
    files = sorted(f for f in os.listdir(directory) if f.endswith(".safetensors"))
    if not files:
        raise MissingInputError(f"no .safetensors files in {directory}")
    declared = (
        declared_dtype(load_hf_config(directory)) if os.path.isfile(os.path.join(directory, "config.json")) else None
    )
    paths = [inside(directory, fname, directory) for fname in files]  # a link pointing out is refused
    for path in paths:
        read_header(path, declared)  # dtypes and byte lengths, before any tensor is used
    for path in paths:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                yield name, None if keys_only else f.get_tensor(name)
