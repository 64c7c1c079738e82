"""Byte-level helpers: zero-copy views, sliced writes, reading a torch.save archive in place."""

import io
import os

import pytest
import torch

from armor_megatron.convert.raw_io import (
    ChunkBuffer,
    FileRange,
    byte_view,
    open_sliced,
    pread_into,
    torch_save_storage_offset,
    write_sliced,
)


def test_byte_view_is_the_tensor_memory():
    t = torch.zeros(4, dtype=torch.int16)
    byte_view(t)[2:4] = b"\x01\x02"  # element 1, little-endian
    assert t.tolist() == [0, 0x0201, 0, 0]
    with pytest.raises(ValueError, match="contiguous"):
        byte_view(torch.zeros(4, 4).t())


def test_write_sliced_writes_everything_in_bounded_calls(monkeypatch):
    import armor_megatron.convert.raw_io as raw_io

    monkeypatch.setattr(raw_io, "WRITE_SLICE_BYTES", 3)
    calls, sink = [], io.BytesIO()

    def write(view):
        calls.append(len(view))
        return sink.write(view)

    assert write_sliced(write, b"abcdefgh") == 8 and sink.getvalue() == b"abcdefgh" and calls == [3, 3, 2]


@pytest.mark.parametrize("crc32", [True, False])
def test_storage_offset_of_a_torch_save_archive_inside_a_file(tmp_path, crc32):
    path, t = tmp_path / "blob", torch.arange(10, dtype=torch.float32)
    before = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(crc32)
    try:
        with open_sliced(path) as f:
            f.write(b"x" * 100)  # the archive sits 100 bytes into the file, as in a .distcp file
            torch.save(t, f)
            length = f.tell() - 100
    finally:
        torch.serialization.set_crc32_options(before)
    with open(path, "rb") as f:
        assert torch.equal(torch.load(FileRange(f, 100, length), weights_only=True), t)
        start = torch_save_storage_offset(f, 100, length, t.nbytes)
        assert torch_save_storage_offset(f, 100, length, t.nbytes + 4) is None  # size must match exactly
    out = ChunkBuffer(64).get((10,), torch.float32, offset=8)
    fd = os.open(path, os.O_RDONLY)
    try:
        pread_into(fd, out, start)
        with pytest.raises(EOFError):
            pread_into(fd, torch.empty(100), os.path.getsize(path) - 8)
    finally:
        os.close(fd)
    assert torch.equal(out, t)


def test_chunk_buffer_hands_out_exact_storages_over_shared_memory():
    buffer = ChunkBuffer(16)
    a = buffer.get((2,), torch.float32)
    b = buffer.get((1,), torch.int64, offset=8)
    assert a.untyped_storage().nbytes() == 8 and b.untyped_storage().nbytes() == 8
    a.fill_(1.0)
    assert buffer.get((2,), torch.float32).tolist() == [1.0, 1.0]  # same memory
    with pytest.raises(ValueError, match="do not fit"):
        buffer.get((3,), torch.float64)
