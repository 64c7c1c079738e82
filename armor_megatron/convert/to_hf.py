"""Megatron torch_dist checkpoint (any training parallelism) -> HF safetensors directory.

The HF config comes from ``hf_config_dir`` or, for checkpoints this converter wrote, from
``MCORE_DIR/hf_config``, or, for a training run's checkpoint, from the ``hf_config`` the run
recorded beside it. Tensors are written layer by layer into size-capped shards
(``model-0000i-of-0000n.safetensors`` + index, or one ``model.safetensors``), with config.json
and the tokenizer files copied alongside. A tensor stored as one plain item (this converter's
output, a layer saved without TP) is copied by the kernel, row block by row block; pieces a
training run stored at its TP/EP are assembled by DCP, in buckets of about ``bucket_bytes``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator, Sequence
from typing import TextIO

import armor_megatron.convert.torch_dist as torch_dist
from armor_megatron.convert.errors import CheckpointError
from armor_megatron.convert.hf_io import PlannedTensor, SafetensorsWriter
from armor_megatron.convert.output import HF_FILES_DIR, copy_side_files, staged_dir
from armor_megatron.convert.progress import Progress, Summary
from armor_megatron.convert.rules import hf_shapes, mcore_to_hf_blocks, row_blocks
from armor_megatron.convert.segments import FileSegment, total_bytes
from armor_megatron.models import ModelArch

DEFAULT_MAX_SHARD_BYTES = 5 * 10**9
DEFAULT_BUCKET_BYTES = 64 * 2**20


def hf_config_dir_of(mcore_dir: str, hf_config_dir: str | None = None) -> str:
    """The directory with the HF config files for a torch_dist checkpoint.

    ``hf_config_dir``, else ``MCORE_DIR/hf_config`` (this converter's output), else
    ``hf_config`` beside MCORE_DIR (a training run records the files it started from there).
    """
    if hf_config_dir:
        candidates = [hf_config_dir]
    else:
        candidates = [
            os.path.join(mcore_dir, HF_FILES_DIR),
            os.path.join(os.path.dirname(os.path.abspath(mcore_dir)), HF_FILES_DIR),
        ]
    for path in candidates:
        if os.path.isfile(os.path.join(path, "config.json")):
            return path
    if hf_config_dir:
        raise CheckpointError(f"{hf_config_dir}: no config.json")
    raise CheckpointError(
        f"{mcore_dir}: no {HF_FILES_DIR}/config.json in it or beside it; pass --hf-config DIR with the HF config"
    )


def layer_major(chunks: Sequence[torch_dist.Chunk]) -> list[torch_dist.Chunk]:
    """HF order: embedding, then layer by layer, then the final norm and output layer."""

    def order(c: torch_dist.Chunk):
        if c.layer is not None:
            return (1, c.layer)
        return (0, 0) if c.rule.ckpt_key.startswith("embedding") else (2, 0)

    return sorted(chunks, key=order)  # stable: keeps rule and expert order inside a layer


def buckets(chunks: Sequence[torch_dist.Chunk], nbytes, limit: int) -> Iterator[list[torch_dist.Chunk]]:
    """Consecutive chunks, about ``limit`` bytes per bucket (a bigger chunk goes alone)."""
    bucket: list[torch_dist.Chunk] = []
    size = 0
    for chunk in chunks:
        if bucket and size + nbytes(chunk) > limit:
            yield bucket
            bucket, size = [], 0
        bucket.append(chunk)
        size += nbytes(chunk)
    if bucket:
        yield bucket


def convert_mcore_to_hf(
    mcore_dir: str,
    out_dir: str,
    *,
    hf_config_dir: str | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    overwrite: bool = False,
    progress_stream: TextIO | None = sys.stderr,
) -> Summary:
    """Convert the torch_dist checkpoint ``mcore_dir`` into an HF model directory ``out_dir``."""
    if not os.path.isdir(mcore_dir):
        raise CheckpointError(f"{mcore_dir}: not a directory")
    config_dir = hf_config_dir_of(mcore_dir, hf_config_dir)
    arch = ModelArch.from_hf_dir(config_dir)
    with staged_dir(out_dir, overwrite, sources=tuple({mcore_dir, config_dir})) as tmp:
        reader = torch_dist.TorchDistReader(mcore_dir, arch, buffer_bytes=bucket_bytes)
        chunks = layer_major(torch_dist.chunks(arch))
        planned = [
            PlannedTensor(name, shape, reader.dtypes[c.rule])
            for c in chunks
            for name, shape in zip(c.rule.hf(c.layer, c.expert), hf_shapes(arch, c.rule))
        ]
        writer = SafetensorsWriter(tmp, planned, max_shard_bytes)
        progress = Progress("mcore-to-hf", len(planned), sum(t.nbytes for t in planned), progress_stream)
        for bucket in buckets(chunks, reader.chunk_bytes, bucket_bytes):
            stored = [reader.stored_segment(chunk) for chunk in bucket]
            resharded = iter(reader.read([c for c, segment in zip(bucket, stored) if segment is None]))
            for chunk, segment in zip(bucket, stored):
                names, shapes = chunk.rule.hf(chunk.layer, chunk.expert), hf_shapes(arch, chunk.rule)
                if segment is not None:  # one plain item on disk: the kernel copies its row blocks
                    dtype, rows = reader.dtypes[chunk.rule], chunk.rule.shape[0] if chunk.rule.shape else 1
                    per_hf: list[list[FileSegment]] = [[] for _ in names]
                    for i, _, row, count in row_blocks(arch, chunk.rule):
                        per_hf[i].append(segment.rows(row, count, rows))
                    for name, shape, segments in zip(names, shapes, per_hf):
                        writer.write_segments(name, shape, dtype, segments)
                        progress.advance(total_bytes(segments))
                else:  # pieces of a training run's TP/EP shards, assembled in memory by DCP
                    for name, shape, blocks in zip(
                        names, shapes, mcore_to_hf_blocks(arch, chunk.rule, next(resharded))
                    ):
                        writer.write_blocks(name, shape, blocks)
                        progress.advance(sum(b.nbytes for b in blocks))
        writer.close()
        reader.close()
        copy_side_files(config_dir, tmp)
    return progress.summary(os.path.abspath(out_dir))
