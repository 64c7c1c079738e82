"""Model tensors in torch_dist checkpoints.

Sharded state dicts of model chunks, and loading model weights (any TP/PP/EP layout) from a
converter output or a training checkpoint.

Public interface (every rank calls every function)::

    sd = chunks_sharded_state_dict(model_chunks, prefix="")     # {"chunk<i>": sharded state dict}
    load_chunks_state(model_chunks, loaded, prefix="", exclude=())
    load_model_weights(model_chunks, mcore_dir, exclude=())     # model tensors only, resharding
    path = resolve_checkpoint_dir(path_or_root)                  # a torch_dist dir, or the one `latest` names
    path = find_latest(root)                                     # the dir ``{root}/latest`` names, or None
    use_safe_checkpoint_reader(path)                             # megatron's loads run no code a checkpoint carries
"""

from __future__ import annotations

import os
from typing import Any

from armor_megatron.errors import MissingInputError, UserInputError

LATEST = "latest"  # text file in a checkpoint root naming its newest complete checkpoint


def chunks_sharded_state_dict(chunks: list[Any], prefix: str = "") -> dict[str, Any]:
    """{"chunk<i>": sharded state dict} of model chunks; tensor keys are global (chunk-independent)."""
    return {f"chunk{i}": c.sharded_state_dict(prefix=prefix) for i, c in enumerate(chunks)}


def load_chunks_state(
    chunks: list[Any], loaded: dict[str, Any], prefix: str = "", exclude: tuple[str, ...] = ()
) -> None:
    """Load what dist_checkpointing returned for `chunks_sharded_state_dict(chunks, prefix)`.

    Module keys starting with one of `exclude` may be absent (they keep their values).
    """
    for i, c in enumerate(chunks):
        state = {k.removeprefix(prefix): v for k, v in loaded[f"chunk{i}"].items()}
        result = c.load_state_dict(state, strict=not exclude)
        missing = [k for k in result.missing_keys if not k.startswith(exclude)] if exclude else []
        if missing or (exclude and result.unexpected_keys):
            raise RuntimeError(
                f"checkpoint does not match the model: missing {missing[:3]}, unexpected {result.unexpected_keys[:3]}"
            )


def load_model_weights(chunks: list[Any], mcore_dir: str, exclude: tuple[str, ...] = ()) -> None:
    """Load model tensors (unprefixed keys) from a torch_dist checkpoint into `chunks`, resharding.

    Tensors whose keys start with one of `exclude` are not read (e.g. the critic's value head).
    """
    from megatron.core import dist_checkpointing

    from armor_megatron.megatron.checkpoint_manifest import read_as_checkpoint

    path = resolve_checkpoint_dir(mcore_dir)
    with read_as_checkpoint(path):
        common = dist_checkpointing.load_common_state_dict(path)
    if isinstance(common, dict) and "lora_base" in common:  # `base_source.LORA_BASE`: a LoRA run's checkpoint
        raise UserInputError(
            f"{path} holds LoRA adapters without their base (that is {common['lora_base']['path']}): "
            "load the base from there, or a checkpoint saved after a reference reset merged into it"
        )
    use_safe_checkpoint_reader(path)
    state = {
        name: {k: v for k, v in sd.items() if not k.startswith(exclude)}
        for name, sd in chunks_sharded_state_dict(chunks).items()
    }
    with read_as_checkpoint(path):
        loaded = dist_checkpointing.load(state, path)
    load_chunks_state(chunks, loaded, exclude=exclude)


def use_safe_checkpoint_reader(path: str) -> None:
    """Make megatron's torch_dist loads read through `convert.dcp_safety`'s reader; check ``path``'s ``.metadata``.

    megatron-core 0.16.1 builds the reader of every torch_dist load (``dist_checkpointing.load``,
    its tensor and object metadata reads) in ``strategies.torch._get_filesystem_reader``; DCP's own
    reader unpickles ``.metadata`` and stored objects with plain pickle. Replaced by one that admits
    only checkpoint data, a checkpoint from elsewhere cannot run code. ``path``'s ``.metadata`` is
    read here first, so that a refusal is its own one-line error (DCP would fold it into an
    AssertionError's text).
    """
    from megatron.core.dist_checkpointing.strategies import torch as torch_strategy

    from armor_megatron.convert.dcp_safety import read_metadata, safe_reader_class

    reader = safe_reader_class()
    torch_strategy._get_filesystem_reader = lambda checkpoint_dir, cache_metadata=False: reader(checkpoint_dir)
    read_metadata(path)


def latest_name(root: str) -> str | None:
    """What ``{root}/latest`` says (bytes that are not UTF-8 read as U+FFFD); None without one."""
    try:
        with open(os.path.join(root, LATEST), "rb") as f:
            return f.read().decode("utf-8", errors="replace").strip()
    except FileNotFoundError:
        return None


def find_latest(root: str) -> str | None:
    """Path of the checkpoint ``{root}/latest`` names; None when there is no ``latest`` yet."""
    name = latest_name(root)
    if name is None:
        return None
    if not name or os.sep in name or name in (".", ".."):
        raise MissingInputError(f"{os.path.join(root, LATEST)} is damaged: it names {name!r}, not a checkpoint")
    path = os.path.join(root, name)
    if not os.path.isdir(path):
        raise MissingInputError(f"{os.path.join(root, LATEST)} names {name!r}, which is not a directory")
    return path


def resolve_checkpoint_dir(path_or_root: str) -> str:
    """A checkpoint directory as given, or the one a root's ``latest`` names."""
    latest = find_latest(path_or_root) if os.path.isfile(os.path.join(path_or_root, LATEST)) else None
    if latest is not None:
        return latest
    if os.path.isfile(os.path.join(path_or_root, "metadata.json")):
        return path_or_root
    raise MissingInputError(f"{path_or_root} is neither a torch_dist checkpoint nor a root with a `{LATEST}` file")
