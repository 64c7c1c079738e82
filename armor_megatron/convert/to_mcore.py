"""HF safetensors directory -> Megatron torch_dist checkpoint, one tensor at a time.

Output layout::

    OUT_DIR/                      torch_dist checkpoint (.metadata, __0_0.distcp, metadata.json, common.pt)
    OUT_DIR/armor_convert.json    family, HF config, converter version, source checksum
    OUT_DIR/hf_config/            config.json, tokenizer and generation files of the source
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Callable
from typing import TextIO

import torch

import armor_megatron.convert.torch_dist as torch_dist
from armor_megatron.convert.errors import CheckpointError
from armor_megatron.convert.hf_io import HFCheckpoint, TensorDigest
from armor_megatron.convert.output import HF_FILES_DIR, copy_side_files, staged_dir, write_metadata
from armor_megatron.convert.progress import Progress, Summary
from armor_megatron.convert.rules import TensorRule, hf_shapes, is_mtp_tensor, row_blocks, tensor_rules
from armor_megatron.convert.segments import FileSegment, total_bytes
from armor_megatron.models import ModelArch

# HF tensors that carry no weights of their own.
_IGNORED = re.compile(r"(.*\.rotary_emb\.inv_freq)\Z")


def plan_hf_tensors(hf: HFCheckpoint, notice: Callable[[str], None] | None = None) -> dict[TensorRule, torch.dtype]:
    """Plan the HF tensors of a conversion: check them and return each rule's dtype.

    Check every HF tensor the rules need (present, right shape, one dtype per rule) and that
    no weight would be dropped; return the dtype of each rule. DeepSeek-V3's multi-token-prediction
    layers are left out, said in one line to ``notice``.
    """
    arch, used = hf.arch, set()
    dtypes: dict[TensorRule, torch.dtype] = {}
    mtp = [n for n in hf.tensors if is_mtp_tensor(arch, n)]
    if mtp and notice is not None:
        last = arch.num_layers + arch.mtp_layers - 1
        layers = f"model.layers.{arch.num_layers}" + (f"..{last}" if last > arch.num_layers else "")
        notice(
            f"{hf.path}: ignoring the {len(mtp)} tensors of {arch.mtp_layers} multi-token-prediction "
            f"layer(s) ({layers}): they are not part of the converted model"
        )
    used.update(mtp)
    for rule in tensor_rules(arch):
        for layer, expert in rule.indices(arch):
            for name, shape in zip(rule.hf(layer, expert), hf_shapes(arch, rule)):
                info = hf.check(name, shape)
                if dtypes.setdefault(rule, info.dtype) != info.dtype:
                    raise CheckpointError(
                        f"{hf.path}: tensor {name} is {info.dtype}, other parts of {rule.ckpt_key} are {dtypes[rule]}"
                    )
                used.add(name)
    if arch.tie_word_embeddings:
        used.add("lm_head.weight")  # some tied checkpoints store the copy anyway
    unexpected = sorted(n for n in hf.tensors if n not in used and not _IGNORED.match(n))
    if unexpected:
        raise CheckpointError(
            f"{hf.path}: tensor {unexpected[0]} is not part of a {arch.family} model "
            f"({len(unexpected)} unexpected tensors)"
        )
    return dtypes


def convert_hf_to_mcore(
    hf_dir: str,
    out_dir: str,
    *,
    tp: int = 1,
    pp: int = 1,
    ep: int = 1,
    overwrite: bool = False,
    progress_stream: TextIO | None = sys.stderr,
) -> Summary:
    """Convert ``hf_dir`` into a torch_dist checkpoint at ``out_dir``.

    ``tp``/``pp``/``ep`` are only checked (the checkpoint loads at any parallelism whose sizes
    divide the model), so that a model that cannot run at the intended sizes fails here,
    before any work.
    """
    hf = HFCheckpoint(hf_dir)
    arch: ModelArch = hf.arch
    arch.validate_parallelism(tp, pp, ep)
    if arch.vocab_size % tp:  # megatron pads the vocabulary to a multiple of tp; this writes it unpadded
        raise CheckpointError(
            f"vocab_size={arch.vocab_size} is not divisible by tp={tp}: the model would pad "
            f"its embedding and this checkpoint (unpadded) would not load"
        )
    dtypes = plan_hf_tensors(hf, None if progress_stream is None else lambda line: print(line, file=progress_stream))
    chunks = torch_dist.chunks(arch)
    names = {c: c.rule.hf(c.layer, c.expert) for c in chunks}
    count = sum(len(n) for n in names.values())
    total = sum(hf.info(n).nbytes for c in chunks for n in names[c])
    progress = Progress("hf-to-mcore", count, total, progress_stream)
    digest = TensorDigest()

    def produce(chunk: torch_dist.Chunk) -> list[FileSegment]:
        """The chunk's bytes as segments of the HF shards, in Megatron row order.

        Its HF tensors are queued for the source checksum (read again from the page cache).
        """
        hf_segments = [hf.segment(name) for name in names[chunk]]
        for name, segment in zip(names[chunk], hf_segments):
            info = hf.info(name)
            digest.update_file(name, info.dtype, info.shape, segment)
        hf_rows = [info.shape[0] if info.shape else 1 for info in map(hf.info, names[chunk])]
        blocks = sorted(row_blocks(arch, chunk.rule), key=lambda block: block[2])
        progress.advance(total_bytes(hf_segments), tensors=len(hf_segments))
        return [hf_segments[i].rows(hf_row, rows, hf_rows[i]) for i, hf_row, _, rows in blocks]

    with hf, staged_dir(out_dir, overwrite, sources=(hf_dir,)) as tmp:
        torch_dist.write_checkpoint(tmp, arch, dtypes.__getitem__, produce)
        digest.wait()
        copy_side_files(hf_dir, os.path.join(tmp, HF_FILES_DIR))
        algorithm = TensorDigest.ALGORITHM
        write_metadata(
            tmp,
            family=arch.family,
            hf_config=hf.config,
            source={
                "path": os.path.abspath(hf_dir),
                "tensors_checksum": digest.hexdigest(),
                "checksum": f"{algorithm} of sorted 'name dtype shape {algorithm}(bytes)' lines",
                "tensors": count,
                "bytes": total,
            },
        )
    return progress.summary(os.path.abspath(out_dir))
