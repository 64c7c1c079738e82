"""Turn a TP/PP/EP-sharded Megatron model into HF-named full tensors, streamed bucket by bucket.

Used for weight sync (trainer -> rollout engine) and for exporting a reference policy.
`HFWeightExport` is read once, either gathered on global rank 0 (every rank iterates it to the
end, it drives collectives; rank 0 gets ``(hf_name, tensor)`` pairs, the others nothing;
`export_hf_weights` is that iterator) or delivered (:meth:`HFWeightExport.deliver`): each
owner rank streams its own tensors straight to the rollout engines, nothing through rank 0.

Per parameter of this rank's model chunks (and per buffer that is an HF tensor: DeepSeek-V3's
router ``expert_bias``, HF ``e_score_correction_bias``):

1. it is split into Megatron tensors of one layer (and one expert) with global indices:
   ``decoder.layers.{i}`` -> the layer's global index (``layer_number − 1``); a local expert j
   -> ``ep_rank · E_local + j`` (E_local = num_experts / ep). Experts come in the three layouts
   megatron-core builds:

   * SequentialMLP: ``experts.local_experts.{j}.linear_fc{1,2}.weight``, one expert each;
   * TEGroupedMLP: ``experts.linear_fc{1,2}.weight{j}``, one expert each, same shapes;
   * GroupedMLP (legacy grouped GEMM): ``experts.weight1`` [h, E_local·2f/etp] and
     ``experts.weight2`` [E_local·f/etp, h] hold all local experts. Expert j's fc1 shard is
     ``weight1.view(E_local, h, 2f/etp)[j].T`` and its fc2 shard ``weight2.view(E_local, f/etp,
     h)[j].T``, the SequentialMLP shards (how GroupedMLP's forward and sharded_state_dict read them);

2. tensor-parallel shards are gathered onto the owner (below) in its TP group (expert-TP group
   for experts; the TP groups of the other data-parallel replicas move nothing) and merged
   with the converter's layout rules (``convert.tp_gather``); the padded vocabulary is
   trimmed. A parameter its rule splits but every TP rank holds whole is taken as it is: the TE
   spec's MLA down projections (``TELinear(parallel_mode="duplicated")``; the local spec splits
   them by rows). Any other shape that is not the rule's TP shard refuses the export;
3. one replica owns each full tensor: TP rank 0 of data-parallel (with context-parallel) rank 0,
   or for experts expert-TP rank 0 of expert-data-parallel rank 0 (so one owner per pipeline
   stage, plus one per expert-parallel rank). The owner maps it to HF names (the converter's
   rules) and hands it on in buckets of at most ``bucket_bytes``: to the delivery's sink, or
   to rank 0 as raw bytes (see `HFWeightExport`).

Completeness: before any tensor moves, rank 0 collects every rank's owned HF names and checks
them against ``rules.hf_tensor_names(arch)``; a missing, duplicated or unknown name raises
`WeightExportError` on every rank, so nothing is pushed from an incomplete export.

Memory: an owner holds one bucket of its stage's full (TP-gathered) tensors at a time (plus,
when sending to rank 0 or to its stage's sender, that bucket's bytes); rank 0 holds at most one
other rank's bucket, and a stage's sender (a delivery ``per_stage``) one bucket at a time, its
own or one peer's.
With tied embeddings the last pipeline stage's copy of the output layer is skipped (the
embedding is the HF tensor).

LoRA (`megatron.lora`): adapter parameters are never exported; each adapted weight's shard is
replaced, as the export reaches it, by W + s·B·A of that shard (`lora.export_merges`), so the
engines get the policy's merged weights and no merged copy of the model is ever held. A
`lora.BaseWeights` chunk (the reference) exports the base as it is.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from armor_megatron.convert import ParamRef, resolve_param, tp_gather, tp_split
from armor_megatron.convert.rules import hf_tensor_names, mcore_to_hf
from armor_megatron.megatron.collective_export import CollectiveExport
from armor_megatron.megatron.dist import global_rank, is_distributed
from armor_megatron.megatron.lora import export_merges
from armor_megatron.models.arch import ModelArch

if TYPE_CHECKING:
    from armor_megatron.rollout.engine import ShardDelivery

DEFAULT_BUCKET_BYTES = 256 << 20
_LAYER = re.compile(r"decoder\.layers\.(\d+)\.")
_SEQUENTIAL_EXPERT = re.compile(r"\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.weight\Z")
_TE_GROUPED_EXPERT = re.compile(r"\.experts\.(linear_fc[12])\.weight(\d+)\Z")
_LEGACY_GROUPED_EXPERTS = re.compile(r"\.experts\.weight([12])\Z")
_LISTED = 8  # names shown per kind in an incompleteness error
_EXPORTED_BUFFERS = (".router.expert_bias",)  # buffers that are HF tensors (e_score_correction_bias)


class WeightExportError(RuntimeError):
    """The export would not hold every HF tensor of the model exactly once."""


@dataclasses.dataclass(frozen=True)
class _Piece:
    """One Megatron tensor (one layer, one expert) inside a parameter.

    Its global name resolved to a rule, and how to take its TP shard from the parameter's TP shard
    (None: the whole).
    """

    ref: ParamRef
    take: Callable[[torch.Tensor], torch.Tensor] | None = None


@dataclasses.dataclass(frozen=True)
class _Param:
    """One parameter (or exported buffer) and the Megatron tensors it holds.

    ``gather``: its TP ranks hold shards to gather (False: each holds the whole tensor).
    """

    tensor: torch.Tensor
    expert: bool
    pieces: tuple[_Piece, ...]
    gather: bool = True
    merge: Callable[[torch.Tensor], torch.Tensor] | None = None  # LoRA: shard -> W + s·B·A (`lora.export_merges`)


def export_hf_weights(
    model_chunks: Sequence[torch.nn.Module], arch: ModelArch, bucket_bytes: int = DEFAULT_BUCKET_BYTES
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield every HF tensor of the model on global rank 0 (full, detached, on CPU).

    Raises `WeightExportError` on every rank, before any tensor is gathered or yielded, when
    the ranks' owned tensors do not cover the model's HF tensors exactly once or a rank holds a
    parameter the family's rules do not know.
    """
    return iter(HFWeightExport(model_chunks, arch, bucket_bytes))


class HFWeightExport(CollectiveExport):
    """The model's HF tensors, spread over the ranks that own them; read once, in one of two ways.

    Every rank makes one and hands it on; global rank 0 (the driver) decides how it is read,
    and every other rank follows when it iterates its own (``list(export)``):

    * **iterated on rank 0** -- gathered there: rank 0 yields every ``(hf_name, tensor)``
      (full, on CPU), the other ranks yield nothing. The owners send their buckets to rank 0
      as raw bytes (``dist.send`` of one uint8 tensor per bucket, after a small metadata
      message: names, dtypes, shapes), in rounds: in round k every rank produces its k-th bucket
      (TP/EP gathers inside its own groups only), then rank 0 yields its own and receives
      each owner's in rank order. No rank is in a collective while another waits on a send, so
      an owner that is rank 0's TP partner cannot deadlock it; rank 0 holds one other rank's
      bucket at a time.
    * **delivered** (:meth:`deliver`, on rank 0, by a rollout engine that knows how, e.g.
      SGLang's ``tensor``/``disk``/``distributed`` sync) -- every owner streams its own buckets
      straight to the engines through the delivery's sink; nothing goes through rank 0. The
      sinks' reports are gathered on rank 0 (small objects: file names, counts) and returned
      there. A *coordinated* delivery (``delivery.coordinated``, e.g. ``distributed``: the
      engines must be told of each owner's broadcast) runs in rounds: in round k every rank
      makes its k-th bucket, the owners' descriptions of them (names, dtypes, shapes) are
      gathered on rank 0, which conducts the round while each owner puts its own bucket.

    Either way each owner holds one bucket of at most ``bucket_bytes`` (a larger tensor goes
    alone) plus the tensor being gathered, never its whole stage, and the completeness check
    runs on every rank before any tensor moves.

    A `CollectiveExport`: each rank reads its export once and to the end (a second read, or a
    ``with`` block / :meth:`close` before the end, raises `ExportReadError`); a rank without use
    for the tensors calls :meth:`drain`.
    """

    def __init__(
        self, model_chunks: Sequence[torch.nn.Module], arch: ModelArch, bucket_bytes: int = DEFAULT_BUCKET_BYTES
    ):
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
        super().__init__()
        self.model_chunks, self.arch, self.bucket_bytes = list(model_chunks), arch, bucket_bytes

    def _items(self) -> Iterator[tuple[str, torch.Tensor]]:
        how = _driver_says(("gather", None))
        if how[0] == "deliver":  # only on ranks other than 0: the driver delivers
            self._deliver_share(how[1])
            return
        yield from self._gather_on_rank0()

    def deliver(self, delivery: ShardDelivery) -> list[Any]:
        """Deliver every owner's tensors to the engines (rank 0 conducts).

        Rank 0: every owner streams its own tensors into ``delivery.open(rank)``'s sink
        (:class:`~armor_megatron.rollout.engine.ShardDelivery`); returns each rank's report
        (None for ranks that own nothing), in rank order. The other ranks take part when they
        iterate their own export. A sink that fails on any rank fails every rank with
        `~armor_megatron.rollout.engine.WeightUpdateError` once all ranks are done.
        """
        if global_rank() != 0:
            raise RuntimeError("HFWeightExport.deliver runs on global rank 0; the other ranks iterate the export")
        self._begin("delivered")
        _driver_says(("deliver", delivery))
        reports = self._deliver_share(delivery)
        assert reports is not None  # rank 0 gathers every rank's
        self._read_to_end()
        return reports

    # ------------------------------------------------------------------ the two reads
    def _prepare(self, bucket_bytes: int) -> tuple[list[list[_Param]], list[int], int]:
        """This rank's parameters cut into buckets; the completeness check (every rank).

        The owner ranks and the number of rounds (the most buckets any rank has).
        """
        try:
            params = _plan(self.model_chunks, self.arch)
            owned_names = [n for p in params if _owns(p.expert) for piece in p.pieces for n in piece.ref.hf_names]
            problem = None
        except (KeyError, ValueError) as e:  # reported through the collective check: no rank is left waiting
            params, owned_names, problem = [], [], e.args[0] if e.args else repr(e)
        chunks = _param_buckets(params, bucket_bytes)
        owners, rounds = _check_complete(self.arch, owned_names, problem, len(chunks))
        return chunks, owners, rounds

    def _gather_on_rank0(self) -> Iterator[tuple[str, torch.Tensor]]:
        chunks, owners, rounds = self._prepare(self.bucket_bytes)
        rank = global_rank()
        for k in range(rounds):
            bucket = list(_owned_hf_tensors(chunks[k], self.arch, "cpu")) if k < len(chunks) else []
            if not is_distributed():
                yield from bucket
                continue
            if rank == 0:
                yield from bucket
                del bucket
                for src in owners:
                    if src != 0:
                        yield from _receive_bucket(src)
            elif rank in owners:
                _send_bucket(bucket, dst=0)

    def _deliver_share(self, delivery: ShardDelivery) -> list[Any] | None:
        from armor_megatron.rollout.engine import WeightUpdateError

        chunks, owners, rounds = self._prepare(getattr(delivery, "bucket_bytes", None) or self.bucket_bytes)
        if getattr(delivery, "coordinated", False):
            return self._deliver_coordinated(delivery, chunks, owners, rounds)
        rank = global_rank()
        sink, error, report = None, None, None
        if rank in owners:
            try:
                sink = delivery.open(rank)
            except Exception as e:  # noqa: BLE001 - reported to every rank below
                error = f"{type(e).__name__}: {e}"
        for chunk in chunks:  # every rank: its groups' gathers run whether or not its sink failed
            bucket = list(_owned_hf_tensors(chunk, self.arch, None))
            if sink is not None and bucket and error is None:
                try:
                    sink.put(bucket)
                except Exception as e:  # noqa: BLE001
                    error = f"{type(e).__name__}: {e}"
            del bucket
        if sink is not None and error is None:
            try:
                report = sink.close()
            except Exception as e:  # noqa: BLE001
                error = f"{type(e).__name__}: {e}"
        reports = _gather_to_rank0((report, error))
        verdict: list[Any] = [None]
        if reports is not None:
            failed = [f"rank {r}: {err}" for r, (_, err) in enumerate(reports) if err]
            verdict = ["; ".join(failed) or None]
        if is_distributed():
            dist.broadcast_object_list(verdict, src=0)
        if verdict[0]:
            raise WeightUpdateError(f"weight delivery failed: {verdict[0]}")
        return [r for r, _ in reports] if reports is not None else None

    def _deliver_coordinated(
        self, delivery: ShardDelivery, chunks: list[list[_Param]], owners: list[int], rounds: int
    ) -> list[Any] | None:
        """A delivery the driver conducts step by step (``delivery.coordinated``).

        The owners' announcements, then their joins while the driver conducts them; then per round k
        every rank makes its k-th bucket (TP/EP gathers in its own groups), the owners' descriptions
        reach the driver (small objects), and each owner puts its bucket while the driver conducts
        the round. Tensors never leave their owner but through its sink.

        ``delivery.per_stage``: only each pipeline stage's sender (its lowest owner rank) has a sink.
        In round k each other owner of the stage sends the sender its bucket's layout (names,
        dtypes, shapes, offsets) before the descriptions are gathered, so the sender describes its
        own bucket and theirs together; after the verdict the sender puts its own bucket, frees it,
        then receives and puts each peer's bucket in rank order (point to point on the default
        group; the peer sends it while the sender is still broadcasting its own). The sender thus
        holds one bucket at a time, its own or one peer's, as every owner does in the per-owner
        layout, and its peers hold only their own.

        Each step begins with a verdict: a failure anywhere (a sink, the driver's conducting)
        fails every rank at the same step, with every rank's message.
        """
        rank = global_rank()
        state: dict[str, Any] = {"error": None}

        def attempt(fn: Callable[..., Any], *args: Any) -> Any:
            if state["error"] is None:
                try:
                    return fn(*args)
                except Exception as e:  # noqa: BLE001 - reported to every rank by the next step
                    state["error"] = f"{type(e).__name__}: {e}"
            return None

        sender_of = _stage_senders(owners) if getattr(delivery, "per_stage", False) else {r: r for r in owners}
        peers = [r for r in owners if sender_of[r] == rank and r != rank]  # whose buckets this sender puts
        sink = attempt(delivery.open, rank) if sender_of.get(rank) == rank else None
        announcement = attempt(sink.announce) if sink is not None else None
        self._step(delivery, announcement, state, lambda notes: delivery.conduct_join(notes))
        if sink is not None:
            attempt(sink.join)
        self._settle(delivery, state)
        for k in range(rounds):
            bucket = list(_owned_hf_tensors(chunks[k], self.arch, None)) if k < len(chunks) else []
            # a peer's bucket reaches its sender in two parts: its layout now, its bytes after the verdict
            if rank in owners and sender_of[rank] != rank:
                layout = _bucket_layout(bucket)
                dist.send_object_list([layout], dst=sender_of[rank])
            forwarded = [_receive_layout(src) for src in peers]
            stand_ins = [
                [(n, torch.empty(shape, dtype=d, device="meta")) for n, d, shape, _ in m] for m, _, _ in forwarded
            ]
            described = [b for b in (bucket, *stand_ins) if b]
            description = attempt(sink.describe, *described) if sink is not None and described else None
            del described  # the sender's own bucket must go once it is put
            last = k == rounds - 1
            self._step(delivery, description, state, functools.partial(delivery.conduct_bucket, last=last))
            if sink is not None and bucket:
                attempt(sink.put, bucket)
            elif rank in owners and sender_of[rank] != rank and bucket:
                _send_bucket_bytes(bucket, layout, dst=sender_of[rank])
            del bucket
            for src, received in zip(peers, forwarded):  # one peer's bucket at a time
                if received[0]:
                    theirs = list(_receive_bucket_bytes(received, src))
                    if sink is not None:
                        attempt(sink.put, theirs)
                    del theirs
            self._settle(delivery, state)
        report = attempt(sink.close) if sink is not None else None
        reports = _gather_to_rank0(report)
        self._step(delivery, None, state, None)
        return reports

    @staticmethod
    def _step(
        delivery: ShardDelivery,
        note: Any,
        state: dict[str, Any],
        conduct: Callable[[dict[int, Any]], None] | None,
    ) -> None:
        """Gather every rank's ``note`` and error on the driver.

        Unless some rank failed, the driver starts ``conduct(notes)`` (owner rank -> note, None left
        out); the verdict reaches every rank, which raises `WeightUpdateError` if anything failed.
        """
        from armor_megatron.rollout.engine import WeightUpdateError

        gathered = _gather_to_rank0((note, state["error"]))
        verdict: list[Any] = [None]
        if gathered is not None:
            failed = [f"rank {r}: {err}" for r, (_, err) in enumerate(gathered) if err]
            if not failed and conduct is not None:
                try:
                    conduct({r: n for r, (n, _) in enumerate(gathered) if n is not None})
                except Exception as e:  # noqa: BLE001
                    failed.append(f"rank 0: {type(e).__name__}: {e}")
            verdict = ["; ".join(failed) or None]
        if is_distributed():
            dist.broadcast_object_list(verdict, src=0)
        if verdict[0]:
            if gathered is not None:
                try:
                    delivery.settle()  # what the driver started ends before the error leaves it
                except Exception:  # noqa: BLE001 - the verdict already names a failure
                    pass
            raise WeightUpdateError(f"weight delivery failed: {verdict[0]}")

    @staticmethod
    def _settle(delivery: ShardDelivery, state: dict[str, Any]) -> None:
        """Driver: wait for what it started (always, also after a failure of its own)."""
        if global_rank() == 0:
            try:
                delivery.settle()
            except Exception as e:  # noqa: BLE001 - reported to every rank by the next step
                state["error"] = state["error"] or f"{type(e).__name__}: {e}"


def _driver_says(message: tuple[str, ShardDelivery | None]) -> tuple[str, Any]:
    """Rank 0's ``message`` on every rank (how the export is read: ("gather", None) or ("deliver", delivery)).

    A small object broadcast, no tensors.
    """
    if not is_distributed():
        return message
    box: list[Any] = [message if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    said: tuple[str, Any] = box[0]
    return said


def _gather_to_rank0(obj: Any) -> list[Any] | None:
    if not is_distributed():
        return [obj]
    gathered: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(obj, gathered, dst=0)
    return gathered


def _param_buckets(params: list[_Param], limit: int) -> list[list[_Param]]:
    """Consecutive parameters whose gathered (full-TP) bytes stay within ``limit`` (a larger one alone).

    Every rank of a pipeline stage has the same parameter shapes, hence the same cuts, so the
    gathers of a bucket run in lockstep within each TP / expert-TP group.
    """
    from megatron.core import parallel_state as ps

    tp, etp = ps.get_tensor_model_parallel_world_size(), ps.get_expert_tensor_parallel_world_size()
    buckets: list[list[_Param]] = []
    bucket: list[_Param] = []
    size = 0
    for p in params:
        nbytes = p.tensor.numel() * p.tensor.element_size() * ((etp if p.expert else tp) if p.gather else 1)
        if bucket and size + nbytes > limit:
            buckets.append(bucket)
            bucket, size = [], 0
        bucket.append(p)
        size += nbytes
    if bucket:
        buckets.append(bucket)
    return buckets


_ALIGN = 16  # byte offset of each tensor in a sent bucket: any dtype can be viewed in place
# a sent bucket's layout: ([(name, dtype, shape, byte offset), ...], total bytes, device type)
_Layout = tuple[list[tuple[str, torch.dtype, tuple[int, ...], int]], int, str]


def _send_bucket(bucket: list[tuple[str, torch.Tensor]], dst: int) -> None:
    """Metadata (names, dtypes, shapes: a small object), then the tensors' bytes as one uint8 tensor."""
    layout = _bucket_layout(bucket, "cpu")
    dist.send_object_list([layout], dst=dst)
    _send_bucket_bytes(bucket, layout, dst)


def _receive_bucket(src: int) -> Iterator[tuple[str, torch.Tensor]]:
    return _receive_bucket_bytes(_receive_layout(src), src)


def _bucket_layout(bucket: list[tuple[str, torch.Tensor]], device: str | None = None) -> _Layout:
    """Where each tensor of ``bucket`` sits in its sent bytes.

    ``([(name, dtype, shape, byte offset), ...], total bytes, device type)``; each offset a multiple
    of ``_ALIGN``. The bytes go on ``device`` (None: the tensors' own; CPU when empty).
    """
    meta: list[tuple[str, torch.dtype, tuple[int, ...], int]] = []
    offset = 0
    for name, t in bucket:
        meta.append((name, t.dtype, tuple(t.shape), offset))
        offset += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
    return meta, offset, device or (bucket[0][1].device.type if bucket else "cpu")


def _receive_layout(src: int) -> _Layout:
    box: list[Any] = [None]
    dist.recv_object_list(box, src=src)
    layout: _Layout = box[0]
    return layout


def _send_bucket_bytes(bucket: list[tuple[str, torch.Tensor]], layout: _Layout, dst: int) -> None:
    """``bucket``'s bytes as one uint8 tensor laid out by ``layout`` (nothing when it is empty)."""
    meta, nbytes, device = layout
    if not meta:
        return
    flat = torch.empty(nbytes, dtype=torch.uint8, device=_device(device))
    for (_, t), (_, _, _, start) in zip(bucket, meta):
        flat[start : start + t.numel() * t.element_size()] = t.contiguous().reshape(-1).view(torch.uint8)
    dist.send(flat, dst=dst)


def _receive_bucket_bytes(layout: _Layout, src: int) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors ``src`` sends laid out by ``layout``: views of one received uint8 tensor."""
    meta, nbytes, device = layout
    if not meta:
        return
    flat = torch.empty(nbytes, dtype=torch.uint8, device=_device(device))
    dist.recv(flat, src=src)
    for name, dtype, shape, start in meta:
        size = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        yield name, flat[start : start + size].view(dtype).view(shape)


def _device(kind: str) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if kind == "cuda" else torch.device(kind)


def _stage_senders(owners: list[int]) -> dict[int, int]:
    """Owner rank -> the sender of its pipeline stage (the stage's lowest owner rank), on every rank.

    A collective: every rank's pipeline rank is gathered on rank 0 (small objects).
    """
    from megatron.core import parallel_state as ps

    stages = _gather_to_rank0(ps.get_pipeline_model_parallel_rank())
    verdict: list[Any] = [None]
    if stages is not None:
        sender: dict[int, int] = {}
        for r in owners:
            sender.setdefault(stages[r], r)
        verdict = [{r: sender[stages[r]] for r in owners}]
    if is_distributed():
        dist.broadcast_object_list(verdict, src=0)
    senders: dict[int, int] = verdict[0]
    return senders


# ---------------------------------------------------------------------- names -> global tensors
def _plan(model_chunks: Sequence[torch.nn.Module], arch: ModelArch) -> list[_Param]:
    """This rank's parameters, each split into its global (layer, expert) Megatron tensors."""
    params = []
    for chunk in model_chunks:
        module = getattr(chunk, "module", chunk)
        layer_of = (
            {i: layer.layer_number - 1 for i, layer in enumerate(getattr(module.decoder, "layers", []))}
            if hasattr(module, "decoder")
            else {}
        )
        adapters, merges = export_merges(chunk)
        for name, param in _exported(module):
            if (arch.tie_word_embeddings and name == "output_layer.weight") or name in adapters:
                continue
            merge = merges.get(name)
            match = _LAYER.search(name)
            if match:
                name = name.replace(match.group(0), f"decoder.layers.{layer_of[int(match.group(1))]}.", 1)
            tensor = param.detach()
            pieces = _expert_pieces(arch, name, tensor)
            if pieces is not None:
                params.append(_Param(tensor, True, pieces))
            else:
                ref = resolve_param(arch, name)
                gather = _is_tp_shard(arch, ref, name, tensor)
                params.append(_Param(tensor, False, (_Piece(ref),), gather, merge))
    return params


def _exported(module: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The parameters, then the buffers that are HF tensors too (DeepSeek-V3's router bias)."""
    yield from module.named_parameters()
    yield from ((n, b) for n, b in module.named_buffers() if n.endswith(_EXPORTED_BUFFERS) and b is not None)


def _is_tp_shard(arch: ModelArch, ref: ParamRef, name: str, tensor: torch.Tensor) -> bool:
    """Whether this (non-expert) parameter is this rank's TP shard of ``ref``'s tensor.

    False when the rule replicates it, and when a column/row rule's tensor is whole on every TP rank
    -- the TE spec builds the MLA down projections as TELinear(parallel_mode="duplicated"), the
    local spec splits them by rows. Any other shape is an error (a layout the rules do not
    describe).
    """
    from megatron.core import parallel_state as ps

    rule, tp = ref.rule, ps.get_tensor_model_parallel_world_size()
    if rule.tp == "replicated" or tp == 1:
        return rule.tp != "replicated"
    if rule.tp == "vocab":  # padded rows: checked by the gather
        return True
    shard = tuple(tp_split(arch, rule, torch.empty(rule.shape, device="meta"), tp)[0].shape)
    if tuple(tensor.shape) == shard:
        return True
    if rule.tp in ("column", "row") and tuple(tensor.shape) == rule.shape:
        return False
    raise ValueError(
        f"{name}: shape {tuple(tensor.shape)} is neither the tp={tp} shard {shard} of {rule.ckpt_key} nor its whole "
        f"{rule.shape}"
    )


def _expert_pieces(arch: ModelArch, name: str, tensor: torch.Tensor) -> tuple[_Piece, ...] | None:
    """The global experts an expert parameter holds (None: not an expert parameter)."""
    sequential, te_grouped = _SEQUENTIAL_EXPERT.search(name), _TE_GROUPED_EXPERT.search(name)
    legacy = _LEGACY_GROUPED_EXPERTS.search(name)
    if not (sequential or te_grouped or legacy):
        return None
    local = _local_expert_count(arch)
    offset = _ep_rank() * local

    def piece(
        match: re.Match[str],
        local_index: int,
        fc: str,
        take: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> _Piece:
        if local_index >= local:
            raise ValueError(f"{name}: local expert {local_index} >= num_experts/ep = {local}")
        global_name = name[: match.start()] + f".experts.local_experts.{offset + local_index}.{fc}.weight"
        return _Piece(resolve_param(arch, global_name), take)

    if sequential:
        return (piece(sequential, int(sequential.group(1)), sequential.group(2)),)
    if te_grouped:
        return (piece(te_grouped, int(te_grouped.group(2)), te_grouped.group(1)),)
    assert legacy is not None  # one of the three matched
    h, fc1 = arch.hidden_size, legacy.group(1) == "1"
    stacked_dim = 1 if fc1 else 0  # weight1 [h, E_local·2f/etp], weight2 [E_local·f/etp, h]
    if tensor.dim() != 2 or tensor.shape[1 - stacked_dim] != h or tensor.shape[stacked_dim] % local:
        raise ValueError(f"{name}: shape {tuple(tensor.shape)} is not GroupedMLP's for {local} experts of hidden {h}")
    view = (local, h, -1) if fc1 else (local, -1, h)

    def expert(j: int) -> Callable[[torch.Tensor], torch.Tensor]:
        """Expert j's shard of the stacked parameter's shard."""
        return lambda shard: shard.reshape(view)[j].t()

    return tuple(piece(legacy, j, "linear_fc1" if fc1 else "linear_fc2", expert(j)) for j in range(local))


def _local_expert_count(arch: ModelArch) -> int:
    from megatron.core import parallel_state as ps

    ep = ps.get_expert_model_parallel_world_size()
    if arch.num_experts % ep:
        raise ValueError(f"num_experts={arch.num_experts} is not divisible by ep={ep}")
    return int(arch.num_experts // ep)


def _ep_rank() -> int:
    from megatron.core import parallel_state as ps

    return int(ps.get_expert_model_parallel_rank())


def _in_owner_replica(expert: bool) -> bool:
    """Whether this rank's TP group (expert-TP group) is the data-parallel replica that exports.

    Every rank of a TP group has the same data-parallel (and context-parallel) rank.
    """
    from megatron.core import parallel_state as ps

    if expert:
        return bool(ps.get_expert_data_parallel_rank() == 0)
    return bool(ps.get_data_parallel_rank(with_context_parallel=True) == 0)


def _owns(expert: bool) -> bool:
    """Whether this rank exports a (TP-gathered) tensor: TP rank 0 of the exporting replica."""
    from megatron.core import parallel_state as ps

    tp_rank = ps.get_expert_tensor_parallel_rank() if expert else ps.get_tensor_model_parallel_rank()
    return tp_rank == 0 and _in_owner_replica(expert)


# ---------------------------------------------------------------------- completeness
def _check_complete(
    arch: ModelArch, owned_names: list[str], problem: str | None = None, buckets: int = 0
) -> tuple[list[int], int]:
    """Refuse, on every rank, an export that would miss or repeat HF tensors.

    Raise `WeightExportError` on every rank unless the ranks' owned HF names are exactly
    ``hf_tensor_names(arch)``, each once, and no rank met a ``problem`` reading its parameters
    (a collective when distributed). Returns the ranks that own tensors and the largest number
    of parameter ``buckets`` any rank has (the rounds of a gather on rank 0).
    """
    gathered = _gather_to_rank0((owned_names, problem, buckets))
    verdict: list[Any] = [None]
    if gathered is not None:
        reports = dict(enumerate(gathered))
        problems = [f"rank {r}: {p}" for r, (_, p, _) in reports.items() if p]
        names = {r: n for r, (n, _, _) in reports.items()}
        shown = "; ".join(problems[:_LISTED]) + (
            f"; … (+{len(problems) - _LISTED} more ranks)" if len(problems) > _LISTED else ""
        )
        error = shown if problems else incompleteness(hf_tensor_names(arch), names)
        owners = [r for r, n in names.items() if n]
        verdict = [(error, owners, max(b for _, _, b in reports.values()))]
    if is_distributed():
        dist.broadcast_object_list(verdict, src=0)
    error, owners, rounds = verdict[0]
    if error:
        raise WeightExportError(f"weight export of {arch.family} refused, nothing was pushed: {error}")
    return owners, rounds


def incompleteness(expected: Sequence[str], names_by_rank: dict[int, list[str]]) -> str | None:
    """What keeps the ranks' names from being ``expected`` exactly once (None: nothing).

    One line: missing names, duplicated names (with the ranks that export them) and names not
    in ``expected``, each list cut to its first few with the count of the rest.
    """
    ranks_of: dict[str, list[int]] = {}
    for rank, names in sorted(names_by_rank.items()):
        for name in names:
            ranks_of.setdefault(name, []).append(rank)
    known = set(expected)
    missing = [n for n in expected if n not in ranks_of]
    duplicated = [f"{n} (ranks {', '.join(map(str, r))})" for n, r in ranks_of.items() if len(r) > 1 and n in known]
    unknown = [n for n in ranks_of if n not in known]
    parts = [
        _listing(kind, names)
        for kind, names in (("missing", missing), ("duplicated", duplicated), ("unexpected", unknown))
        if names
    ]
    return "; ".join(parts) or None


def _listing(kind: str, names: list[str]) -> str:
    shown = ", ".join(names[:_LISTED])
    rest = f", … (+{len(names) - _LISTED} more)" if len(names) > _LISTED else ""
    return f"{len(names)} {kind}: {shown}{rest}"


# ---------------------------------------------------------------------- gather and map
def _owned_hf_tensors(params: list[_Param], arch: ModelArch, device: str | None) -> Iterator[tuple[str, torch.Tensor]]:
    """This rank's share of ``params``: full-TP tensors, only where it is the owner.

    Each contiguous, on ``device`` (None: where the parameters are), never sharing a parameter's
    memory. At most about twice the largest full tensor is alive at once: the gathered shards are
    dropped once merged, and a merged tensor is copied only where it is not contiguous (fused QKV /
    fc1 split into HF tensors) or is the parameter itself (no TP).
    """
    from megatron.core import parallel_state as ps

    for p in params:
        if not _in_owner_replica(p.expert):
            continue  # another data-parallel replica exports it: no collective in this TP group
        group = ps.get_expert_tensor_parallel_group() if p.expert else ps.get_tensor_model_parallel_group()
        shard = _staged(p.tensor) if p.merge is None else p.merge(_staged(p.tensor))
        shards = _gather_to_owner(shard, group) if p.gather else [shard]
        if shards is None or not _owns(p.expert):  # None: not this group's owner
            continue
        for views in _merged_pieces(p, shards, arch):
            out = [(name, _detached_copy(hf, p.tensor, device)) for name, hf in views]
            del views  # the merged tensor goes before its copies are handed on
            while out:
                yield out.pop(0)


def _merged_pieces(p: _Param, shards: list[torch.Tensor], arch: ModelArch) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Per piece of ``p``: its HF ``(name, view)`` pairs, merged from the TP ``shards`` (TP rank order).

    ``shards``: the parameter's TP shards as its group gathered them, rank 0 first (one, the whole,
    when ``p.gather`` is False); emptied once the last piece has taken its views of them.
    """
    for i, piece in enumerate(p.pieces):
        rule = piece.ref.rule
        taken = [piece.take(s) if piece.take else s for s in shards]
        if i == len(p.pieces) - 1:
            shards.clear()  # the pieces' own views keep what they still need
        tensor = tp_gather(arch, rule, taken) if p.gather else taken[0]
        del taken
        if rule.tp == "vocab":
            tensor = tensor[: arch.vocab_size]
        views = list(zip(piece.ref.hf_names, mcore_to_hf(arch, rule, tensor)))
        del tensor
        yield views


def _staged(tensor: torch.Tensor) -> torch.Tensor:
    """A parameter's tensor where the export reads it (host copy or device).

    A parameter read from host memory (a trainer offloaded during the weight sync, a reference
    kept on the host) goes to the GPU one at a time: gathers then run over NCCL, and the sync's
    device memory is one parameter and one bucket. On CPU-only machines it stays.
    """
    if tensor.device.type == "cpu" and torch.cuda.is_available():
        return tensor.to(torch.cuda.current_device(), non_blocking=tensor.is_pinned())
    return tensor


def _detached_copy(tensor: torch.Tensor, param: torch.Tensor, device: str | None) -> torch.Tensor:
    """``tensor`` contiguous on ``device``, copied where it would share the parameter's memory."""
    target = torch.device(device) if device else tensor.device
    if tensor.device != target:
        return tensor.to(target).contiguous()
    if tensor.untyped_storage().data_ptr() == param.untyped_storage().data_ptr():
        return tensor.clone(memory_format=torch.contiguous_format)
    return tensor.contiguous()


def _gather_to_owner(shard: torch.Tensor, group: Any) -> list[torch.Tensor] | None:
    """Gather a parameter's shards on the group's owner (rank 0).

    Every rank's shard of a parameter (rank order in ``group``) on the group's rank 0, the
    owner; None on the others (they only send theirs).
    """
    size = dist.get_world_size(group) if dist.is_initialized() else 1
    if size == 1:
        return [shard]
    owner = dist.get_global_rank(group, 0)
    shards = [torch.empty_like(shard) for _ in range(size)] if dist.get_rank() == owner else None
    dist.gather(shard.contiguous(), shards, dst=owner, group=group)
    return shards


def export_to_list(model_chunks: Sequence[torch.nn.Module], arch: ModelArch) -> list[tuple[str, torch.Tensor]] | None:
    """The whole export as a list on rank 0, None elsewhere (all ranks must call it)."""
    items = list(export_hf_weights(model_chunks, arch))
    return items if not dist.is_initialized() or dist.get_rank() == 0 else None
