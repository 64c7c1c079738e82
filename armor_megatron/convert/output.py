"""Output directories written atomically, the converter's metadata file and the copied HF side files."""

from __future__ import annotations

import contextlib
import datetime
import glob
import json
import os
import shutil
import tempfile
from collections.abc import Iterator

import armor_megatron
from armor_megatron.convert.errors import CheckpointError
from armor_megatron.convert.hf_io import INDEX_FILE
from armor_megatron.errors import MissingInputError, OutputExistsError

METADATA_FILE = "armor_convert.json"
HF_FILES_DIR = "hf_config"


@contextlib.contextmanager
def staged_dir(out_dir: str, overwrite: bool = False, sources: tuple[str, ...] = ()) -> Iterator[str]:
    """Yield a fresh temporary directory next to ``out_dir``; rename it to ``out_dir`` on success.

    An existing ``out_dir`` raises FileExistsError unless ``overwrite``; an ``out_dir`` that is
    one of ``sources``, inside one or holds one is refused (replacing it would delete the input).
    On any error, KeyboardInterrupt included, the temporary directory is removed and ``out_dir``
    is left as it was; the leftovers of a killed conversion to the same ``out_dir`` are removed
    when the next one starts. The directory gets the permissions the umask gives a new one.
    """
    out_dir = os.path.abspath(out_dir)
    _refuse_overlap(out_dir, sources)
    if os.path.lexists(out_dir) and not overwrite:
        raise OutputExistsError(f"{out_dir}: output directory already exists (pass --overwrite to replace it)")
    parent = os.path.dirname(out_dir)
    if not os.path.isdir(parent):
        raise MissingInputError(f"{parent}: parent of the output directory does not exist")
    prefix = f".{os.path.basename(out_dir)}."
    for kind in ("tmp-", "old-"):  # what a killed conversion to the same out_dir left behind
        for stale in glob.glob(os.path.join(glob.escape(parent), glob.escape(prefix + kind) + "*")):
            shutil.rmtree(stale, ignore_errors=True)
    try:
        tmp = tempfile.mkdtemp(prefix=f"{prefix}tmp-", dir=parent)
    except OSError as e:
        raise CheckpointError(f"{parent}: cannot write the output there ({e.strerror or e})") from None
    try:
        os.chmod(tmp, 0o777 & ~current_umask())  # mkdtemp makes it 0700; the output is a plain directory
        yield tmp
        if os.path.lexists(out_dir):
            old = tempfile.mkdtemp(prefix=f"{prefix}old-", dir=parent)
            os.rename(out_dir, os.path.join(old, "x"))
            os.rename(tmp, out_dir)
            shutil.rmtree(old)
        else:
            os.rename(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _refuse_overlap(out_dir: str, sources: tuple[str, ...]) -> None:
    real_out = os.path.realpath(out_dir)
    for source in sources:
        real_src = os.path.realpath(source)
        if os.path.commonpath([real_out, real_src]) in (real_out, real_src):
            raise CheckpointError(
                f"{out_dir}: the output directory is, contains or lies inside the input {source}; "
                "choose another output directory"
            )


def current_umask() -> int:
    """The process umask (read by setting it and putting it back at once)."""
    mask = os.umask(0o077)
    os.umask(mask)
    return mask


def copy_side_files(src_dir: str, dst_dir: str) -> list[str]:
    """Copy config, generation config and tokenizer files (everything but the weights)."""
    os.makedirs(dst_dir, exist_ok=True)
    copied = []
    for name in sorted(os.listdir(src_dir)):
        path = os.path.join(src_dir, name)
        if (
            os.path.isfile(path)
            and not name.endswith((".safetensors", ".bin", ".pt", ".pth"))
            and name not in (INDEX_FILE, METADATA_FILE)
        ):
            shutil.copy2(path, os.path.join(dst_dir, name))
            copied.append(name)
    return copied


def write_metadata(out_dir: str, **fields) -> None:
    """Write the conversion's metadata file (``METADATA_FILE``) into ``out_dir``: converter, version, time, ``fields``."""
    meta = {
        "converter": "armor_megatron.convert",
        "converter_version": armor_megatron.__version__,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        **fields,
    }
    with open(os.path.join(out_dir, METADATA_FILE), "w") as f:
        json.dump(meta, f, indent=2, sort_keys=True)
        f.write("\n")
