"""File segments copied by the kernel (or through a buffer where it refuses), and torch.save
archives whose data a HoleFillingWriter copies in."""

import contextlib
import errno
import io
import os

import pytest
import torch

from armor_megatron.convert import segments as segments_module
from armor_megatron.convert.hf_io import TensorDigest
from armor_megatron.convert.segments import FileSegment, HoleFillingWriter, copy_segments, total_bytes


@pytest.fixture
def source(tmp_path):
    path = tmp_path / "src.bin"
    path.write_bytes(bytes(range(256)) * 64)  # 16 KiB
    fd = os.open(path, os.O_RDONLY)
    yield fd, path.read_bytes()
    os.close(fd)


def refuse_kernel_copy(monkeypatch, code=errno.EXDEV):
    calls = []

    def refuse(*args):
        calls.append(args)
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(os, "copy_file_range", refuse)
    return calls


def copied(tmp_path, segments, dst_offset=0) -> bytes:
    path = tmp_path / "dst.bin"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        assert copy_segments(segments, fd, dst_offset) == total_bytes(segments)
        assert os.lseek(fd, 0, os.SEEK_CUR) == 0  # the destination's file position is left alone
    finally:
        os.close(fd)
    return path.read_bytes()


@pytest.mark.parametrize("kernel", [True, False], ids=["copy_file_range", "buffer-fallback"])
def test_segments_are_concatenated_at_the_offset(kernel, source, tmp_path, monkeypatch):
    fd, data = source
    calls = [] if kernel else refuse_kernel_copy(monkeypatch)
    monkeypatch.setattr(segments_module, "FALLBACK_BUFFER_BYTES", 1000)  # several buffer rounds
    parts = [FileSegment(fd, 5000, 3000), FileSegment(fd, 0, 7), FileSegment(fd, 100, 0), FileSegment(fd, 9, 4096)]
    out = copied(tmp_path, parts, dst_offset=10)
    assert out == b"\0" * 10 + data[5000:8000] + data[:7] + data[9:4105]
    assert len(calls) == (0 if kernel else 1)  # refused once per call, then buffered


def test_real_errors_are_not_swallowed(source, tmp_path, monkeypatch):
    fd, _ = source
    refuse_kernel_copy(monkeypatch, errno.EIO)
    with pytest.raises(OSError, match="Input/output error"):
        copied(tmp_path, [FileSegment(fd, 0, 10)])


@pytest.mark.parametrize("kernel", [True, False], ids=["copy_file_range", "buffer-fallback"])
def test_a_short_source_is_an_eof_error(kernel, source, tmp_path, monkeypatch):
    fd, data = source
    if not kernel:
        refuse_kernel_copy(monkeypatch)
    with pytest.raises(EOFError, match="bytes short"):
        copied(tmp_path, [FileSegment(fd, len(data) - 10, 20)])


def test_rows_of_a_segment():
    segment = FileSegment(3, 100, 40)  # 4 rows of 10 bytes
    assert segment.rows(1, 2, 4) == FileSegment(3, 110, 20)
    with pytest.raises(ValueError, match="rows 3:5"):
        segment.rows(3, 2, 4)
    with pytest.raises(ValueError):
        segment.rows(0, 1, 3)  # 40 bytes are not 3 rows


def save_around(path, shape, dtype, segments) -> bytes:
    """The archive HoleFillingWriter appends after a few unrelated bytes."""
    with HoleFillingWriter(str(path)) as stream:
        stream.write(b"before")  # an archive need not start its file
        stream.save_tensor(shape, dtype, segments)
    return path.read_bytes()[len(b"before") :]


def test_torch_save_archive_gets_its_data_from_segments(tmp_path):
    expected = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    src = tmp_path / "rows.bin"
    src.write_bytes(expected[2:].numpy().tobytes() + expected[:2].numpy().tobytes())  # rows out of order
    fd = os.open(src, os.O_RDONLY)
    try:
        archive = save_around(
            tmp_path / "out.bin", (4, 6), torch.float32, [FileSegment(fd, 48, 48), FileSegment(fd, 0, 48)]
        )
    finally:
        os.close(fd)
    assert torch.equal(torch.load(io.BytesIO(archive), weights_only=True), expected)
    assert torch.serialization.get_crc32_options()  # the global option is restored


def test_segments_must_match_the_tensor_and_fill_exactly_its_hole(tmp_path, source, monkeypatch):
    fd, _ = source
    with pytest.raises(ValueError, match=r"segments of 10 bytes for a \[4, 6\] torch.float32 tensor"):
        save_around(tmp_path / "out.bin", (4, 6), torch.float32, [FileSegment(fd, 0, 10)])
    with HoleFillingWriter(str(tmp_path / "unarmed.bin")) as stream:
        with pytest.raises(RuntimeError, match="8-byte hole was skipped with nothing"):
            stream.seek(8, io.SEEK_CUR)
    monkeypatch.setattr(segments_module, "_torch_save_without_data", contextlib.nullcontext)  # torch writes data
    with pytest.raises(RuntimeError, match="wrote the tensor data instead of skipping it"):
        save_around(tmp_path / "out.bin", (4, 6), torch.float32, [FileSegment(fd, 0, 96)])


def test_digest_of_file_bytes_equals_digest_of_the_tensor(tmp_path, monkeypatch):
    monkeypatch.setattr(TensorDigest, "READ_BYTES", 64)  # several reads per tensor
    tensor = torch.randn(10, 30)
    path = tmp_path / "t.bin"
    path.write_bytes(b"xx" + tensor.numpy().tobytes())
    fd = os.open(path, os.O_RDONLY)
    try:
        from_file = TensorDigest()
        from_file.update_file("w", tensor.dtype, tensor.shape, FileSegment(fd, 2, tensor.nbytes))
        from_file_digest = from_file.hexdigest()
    finally:
        os.close(fd)
    from_tensor = TensorDigest()
    from_tensor.update([("w", tensor)])
    assert from_file_digest == from_tensor.hexdigest()
