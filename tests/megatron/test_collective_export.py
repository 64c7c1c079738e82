"""The weight export's read-once contract: a second read, a rank that stops early and a rank that
skips it fail on that rank with `ExportReadError`, instead of leaving the others in a collective."""

import pytest

from armor_megatron.megatron.collective_export import CollectiveExport, ExportReadError
from tests.convert.conftest import save_tiny_model
from tests.megatron.spawn import run_ranks
from tests.megatron.test_weight_export import hf_tensors


class Steps(CollectiveExport):
    """A stream of ``n`` pairs whose every step is counted, as every step of an export is a collective."""

    def __init__(self, n: int = 3):
        super().__init__()
        self.n, self.steps = n, 0

    def _items(self):
        for i in range(self.n):
            self.steps += 1
            yield f"t{i}", None


def test_a_second_iteration_raises_instead_of_being_empty():
    export = Steps()
    assert [name for name, _ in export] == ["t0", "t1", "t2"]
    with pytest.raises(ExportReadError, match="already iterated.*streams once"):
        iter(export)
    assert export.steps == 3


def test_leaving_the_block_before_the_end_raises_and_names_the_rank_and_how_far():
    with pytest.raises(ExportReadError, match=r"rank 0 left its weight export after 1 tensors"):
        with Steps() as export:
            for _ in export:
                break


def test_a_rank_that_skips_the_export_raises_on_close():
    export = Steps()
    with pytest.raises(ExportReadError, match="left its weight export unread"):
        export.close()
    with pytest.raises(ExportReadError, match="closed"):
        iter(export)  # and a closed export cannot be read afterwards


def test_drain_finishes_a_part_read_export_and_then_the_block_is_left_cleanly():
    with Steps() as export:
        next(iter(export))
        export.drain()  # the rest of the stream: every step runs once
        export.drain()  # read to the end: nothing left
    assert export.finished and export.steps == 3
    with Steps() as unread:
        unread.drain()
    assert unread.steps == 3


def test_an_exception_in_the_block_is_not_masked():
    with pytest.raises(KeyError):
        with Steps() as export:
            next(iter(export))
            raise KeyError("the consumer's own failure")


def test_an_export_collected_part_read_says_so_on_stderr(capfd):
    export = Steps()
    for _ in export:
        break
    export.__del__()  # what the garbage collector calls
    assert "ExportReadError: rank 0 left its weight export after 1 tensors" in capfd.readouterr().err


def stopping_rank_worker(rank, hf_dir, mcore_dir, early):
    """PP=2: rank 0 reads its export, rank 1 drains it, but rank ``early`` leaves it early (rank 0:
    after one tensor; rank 1: unread; -1: no rank does)."""
    import torch.distributed as dist

    from armor_megatron.megatron.weight_export import HFWeightExport
    from tests.megatron.test_weight_export import loaded_model

    arch, _, chunks = loaded_model(hf_dir, mcore_dir, dict(pp=2))
    names = []
    try:
        with HFWeightExport(chunks, arch, bucket_bytes=4 << 10) as export:
            if rank == early:
                if rank == 0:
                    next(iter(export))
            elif rank == 0:
                names = sorted(n for n, _ in export)
            else:
                export.drain()
    except ExportReadError as e:
        return f"ExportReadError: {e}"
    except RuntimeError as e:  # the peer's process ended: a collective with it fails
        return f"peer gone: {type(e).__name__}"
    finally:
        if rank == early:
            dist.destroy_process_group()  # as its process would end, closing its connections
    return names


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("early", [0, 1, -1], ids=["rank0-after-one-tensor", "rank1-unread", "none"])
def test_a_rank_that_stops_early_fails_loudly_rather_than_hanging(tmp_path, early):
    from armor_megatron.convert import convert_hf_to_mcore

    hf_dir = save_tiny_model("qwen2", str(tmp_path / "hf"))
    convert_hf_to_mcore(hf_dir, str(tmp_path / "mcore"), progress_stream=None)
    results = run_ranks(stopping_rank_worker, 2, hf_dir, str(tmp_path / "mcore"), early, timeout=120, fresh=True)
    if early < 0:  # the contract kept: rank 0 gets every tensor, the drained rank 1 none
        assert results == [sorted(hf_tensors(hf_dir)), []]
        return
    left = "after 1 tensors (iterated)" if early == 0 else "unread"
    assert results[early] == f"ExportReadError: rank {early} left its weight export {left}: " + (
        "every rank must read it to the end (iterate it, deliver it on rank 0, or drain() it); its reads are "
        "collectives the other ranks now wait in"
    )
    assert results[1 - early].startswith("peer gone"), results
