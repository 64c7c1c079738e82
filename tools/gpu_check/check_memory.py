"""Check 4: the colocated step's trainer phases on the device, the ledger's bytes beside the measured.

    python tools/gpu_check/check_memory.py [--device cuda|cpu] [--shape qwen2.5-0.5b|tiny]
        [--seq-len 2048] [--batch 4] [--json PATH]

The trainer side of the colocated memory order (trainer/device_memory.py), on a randomly initialised model
of ``--shape`` (bf16 actor with its Adam state after one update, and a bf16 reference): trainer
on the device → the actor's and the reference's log-probs → an update → trainer to the host and
``empty_cache`` (`HostOffload`) → the weight export streamed from the host copy, bucket by bucket
(``rollout.sglang.bucket_mb``), into a sink that drops each bucket → trainer back, bit for bit.
Each phase prints the `DeviceLedger`'s total (the planner's formulas, `armor-train --plan`, for
this model and batch) beside ``torch.cuda.memory_allocated()`` / ``max_memory_allocated()`` of
that phase. SGLang is absent on the device image, so engines are not part of it; their side of
the order is the CPU ledger test's (tests/trainer/test_colocated_memory.py).

ok=1 when: the offloaded trainer leaves < 64 MiB allocated and the cache empty, the export's peak
stays under one bucket plus twice the largest tensor, the reload is bit-exact, and (on CUDA) the
measured trainer state is within 15 % of the ledger's. The activation peaks are printed as
measured / planned, not judged (the planner's spec terms are measured on CPU, tests/launch).
Also printed: a fresh process's CUDA context (``mem_get_info`` before and after CUDA's first use).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from check_lines import report, select_device, single_process_env  # noqa: E402
from check_throughput import SHAPES, random_actor, random_batch  # noqa: E402

GIB = 2**30


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--json", default=None)
    p.add_argument("--shape", default=None, choices=sorted(SHAPES), help="qwen2.5-0.5b (cpu: tiny)")
    p.add_argument("--seq-len", type=int, default=None, help="2048 (cpu: 64)")
    p.add_argument("--batch", type=int, default=None, help="rows per update, one micro-batch each (4; cpu: 2)")
    p.add_argument("--bucket-mb", type=int, default=64)
    args = p.parse_args(argv)
    cpu = args.device == "cpu"
    args.shape = args.shape or ("tiny" if cpu else "qwen2.5-0.5b")
    args.seq_len = args.seq_len or (64 if cpu else 2048)
    args.batch = args.batch or (2 if cpu else 4)
    return args


def planned_sizes(shape: dict, seq_len: int, batch: int, bucket_mb: int):
    """The ledger's sizes for this model and batch: `plan_memory` of the GPU check's config."""
    from armor_megatron.config import load_config
    from armor_megatron.config.validate import model_arch_of
    from armor_megatron.launch.memory import plan_memory

    def scalar(v):  # floats with a mantissa dot: YAML reads "1e-06" as a string
        return f"{v:.6e}" if isinstance(v, float) else str(v).lower() if isinstance(v, bool) else str(v)

    arch = "{" + ", ".join(f"{k}: {scalar(v)}" for k, v in shape.items()) + "}"
    cfg = load_config(
        "configs/gpu_check.yaml",
        [
            "model.path=/nonexistent/model",  # the shape below describes it
            f"model.arch={arch}",
            f"rollout.max_prompt_len={seq_len // 2}",
            f"rollout.max_response_len={seq_len - seq_len // 2}",
            "rollout.prompts_per_step=1",
            f"rollout.group_size={batch}",
            "train.micro_batch_size=1",
            f"rollout.sglang.bucket_mb={bucket_mb}",
        ],
    )
    stage = plan_memory(cfg, model_arch_of(cfg)).stages[0]
    return dataclasses.replace(stage.sizes, engines={}, contexts=0.0, bucket=bucket_mb * 2**20)


def context_bytes() -> float:
    """CUDA context of this process: device memory taken by CUDA's first use, nothing allocated."""
    import torch

    free, total = torch.cuda.mem_get_info()  # initialises the context
    return total - free - torch.cuda.memory_reserved()


class _DropSink:
    def __init__(self):
        self.buckets, self.peak = 0, 0

    def put(self, bucket):
        import torch

        self.buckets += 1
        if torch.cuda.is_available():
            self.peak = max(self.peak, torch.cuda.max_memory_allocated())

    def close(self):
        return self.buckets


class _DropDelivery:
    def __init__(self, bucket_bytes: int):
        self.bucket_bytes, self.sink = bucket_bytes, _DropSink()

    def open(self, rank: int):
        return self.sink


def main(argv=None) -> int:
    args = parse_args(argv)
    select_device(args.device)
    single_process_env()
    import torch

    from armor_megatron.launch.device_ledger import DeviceLedger
    from armor_megatron.megatron import dist
    from armor_megatron.megatron.offload import HostOffload
    from armor_megatron.megatron.reference import ReferenceModel
    from armor_megatron.megatron.trained_model import ModelSettings
    from armor_megatron.megatron.weight_export import HFWeightExport
    from armor_megatron.models import ModelArch

    cuda = args.device == "cuda"
    context = context_bytes() if cuda else 0.0
    shape = SHAPES[args.shape]
    arch = ModelArch.from_hf_config(shape)
    sizes = planned_sizes(shape, args.seq_len, args.batch, args.bucket_mb)
    ledger = DeviceLedger(sizes, trainer_on_device=True)
    measured: list[tuple[str, float, float]] = []  # (phase, ledger's bytes, measured bytes)

    def allocated(peak=False) -> float:
        if not cuda:
            return float("nan")
        torch.cuda.synchronize()
        return float(torch.cuda.max_memory_allocated() if peak else torch.cuda.memory_allocated())

    def phase(peak=False):
        measured.append((ledger.phases[-1].label, ledger.phases[-1].total, allocated(peak)))
        if cuda:
            torch.cuda.reset_peak_memory_stats()

    parallel = dist.ParallelConfig()
    dist.initialize(parallel, arch, seed=0)
    try:
        actor = random_actor(arch, parallel, total_steps=4, seed=0)
        reference = ReferenceModel(ModelSettings(arch, parallel, dtype=torch.bfloat16))
        reference.reset_from(actor)
        batch = random_batch(arch, args.batch, args.seq_len, seed=0)
        lp = actor.compute_logprobs(batch["input_ids"], batch["lengths"]).logprobs.cpu()
        actor.train_step({**batch, "old_logprobs": lp, "ref_logprobs": lp})  # Adam's state exists from here
        memory = HostOffload.of(actor, reference)
        memory.ledger = ledger
        memory.offload()  # as between steps: the trainer waits on the host
        memory.reload()
        phase()
        ledger.compute("logprobs")
        old = actor.compute_logprobs(batch["input_ids"], batch["lengths"]).logprobs.cpu()
        phase(peak=True)
        ledger.compute("logprobs")
        ref = reference.compute_logprobs(batch["input_ids"], batch["lengths"]).logprobs.cpu()
        phase(peak=True)
        ledger.compute("update")
        actor.train_step({**batch, "old_logprobs": old, "ref_logprobs": ref})
        phase(peak=True)
        before = [t.detach().clone() for t in actor.model_chunks[0].parameters()]
        memory.offload()
        phase()
        offloaded = allocated()
        reserved = float(torch.cuda.memory_reserved()) if cuda else 0.0
        ledger.weights_pushed("policy")
        delivery = _DropDelivery(args.bucket_mb << 20)
        with memory.host_views(actor):
            HFWeightExport(actor.model_chunks, arch).deliver(delivery)
        export_peak = allocated(peak=True)
        measured.append((ledger.phases[-1].label, ledger.phases[-1].total, export_peak))
        largest = max(p.numel() * p.element_size() for p in actor.model_chunks[0].parameters())
        memory.reload()
        exact = all(torch.equal(a, b) for a, b in zip(before, actor.model_chunks[0].parameters()))
    finally:
        dist.shutdown()

    rows = [
        f"{label}: ledger {planned / GIB:.2f} GiB" + (f", measured {value / GIB:.2f} GiB" if cuda else "")
        for label, planned, value in measured
    ]
    state_ok = True
    if cuda:
        state_ratio = measured[0][2] / sizes.trainer_state
        state_ok = abs(state_ratio - 1) <= 0.15
    freed = not cuda or (offloaded < 64 * 2**20 and reserved < 64 * 2**20)
    export_ok = not cuda or export_peak <= delivery.bucket_bytes + 2 * largest
    ok = freed and export_ok and exact and state_ok and delivery.sink.buckets > 0
    line = (
        f"{args.shape} bf16 actor + reference, {args.batch} x {args.seq_len} tokens on {args.device}: "
        + "; ".join(rows)
        + f"; {delivery.sink.buckets} buckets of <= {args.bucket_mb} MiB streamed from the host copy"
        + (f"; CUDA context {context / GIB:.2f} GiB" if cuda else "")
        + ("" if exact else "; reload NOT bit-exact")
        + (
            ""
            if freed
            else f"; offloaded trainer still holds {offloaded / 2**20:.0f} MiB ({reserved / 2**20:.0f} reserved)"
        )
        + ("" if state_ok else "; trainer state off the ledger by more than 15 %")
    )
    report(
        args.json,
        "memory",
        ok,
        line,
        phases=[{"phase": label, "ledger": planned, "measured": value} for label, planned, value in measured],
        context=context,
        device=args.device,
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
