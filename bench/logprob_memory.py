"""Peak memory and time of our chunked vocab-parallel log-probs vs a naive log_softmax + gather.

Workload: 4,096 tokens × vocabulary 151,936 (Qwen2/3), logits in bf16 (what the model emits
on GPU; ``--dtype float32`` for fp32 logits), forward and backward (the train step
differentiates through the log-probs), TP = 1, on the CPU.

* naive: ``torch.log_softmax(logits.float(), -1).gather(-1, labels)``, then ``.sum().backward()``.
* ours:  ``vocab_parallel_logprobs(logits, labels)``, then ``.sum().backward()``.

How peak memory is measured: each variant runs in its own fresh subprocess. The subprocess
creates (and touches) the logits, reads its peak resident set size ``ru_maxrss``, runs the
forward + backward once, and reads ``ru_maxrss`` again; the difference is the peak extra
memory of the variant (its work tensors, the saved tensors and the logits' gradient; the input
logits exist in both variants and are not counted). torch's CPU allocator returns large blocks
to the OS on free (glibc serves them with mmap), so the resident set follows live tensors; a
Python-level tracer such as tracemalloc would not see torch allocations at all. Time is the best
of ``--repeats`` further forward + backward runs in the same subprocess, so the first run's page
faults do not count against either variant.

The last line is exactly ``peak_ratio=<ours/naive> time_ratio=<ours/naive>``. Targets: peak ≤ 0.35,
time ≤ 1.2.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

TOKENS = 4096
VOCAB = 151_936


def _rss_peak_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def run_variant(variant: str, dtype_name: str, repeats: int) -> dict:
    import torch

    from armor_megatron.megatron.logprobs import vocab_parallel_logprobs

    torch.manual_seed(0)
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[dtype_name]
    logits = torch.randn(TOKENS, VOCAB, dtype=dtype).requires_grad_()
    labels = torch.randint(0, VOCAB, (TOKENS,))

    def step():
        if variant == "naive":
            lp = torch.log_softmax(logits.float(), dim=-1).gather(-1, labels[:, None]).squeeze(-1)
        else:
            lp, _ = vocab_parallel_logprobs(logits, labels)
        lp.sum().backward()
        logits.grad = None
        return lp

    before = _rss_peak_bytes()
    step()
    peak = _rss_peak_bytes() - before
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return {"variant": variant, "peak_bytes": peak, "seconds": min(times)}


def measure(variant: str, dtype: str, repeats: int) -> dict:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    out = subprocess.run(
        [sys.executable, __file__, "--variant", variant, "--dtype", dtype, "--repeats", str(repeats)],
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    if out.returncode != 0:
        raise RuntimeError(f"{variant} run failed:\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--repeats", type=int, default=2, help="timed runs per variant (best counts)")
    parser.add_argument("--variant", choices=["naive", "ours"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.variant:  # child process
        print(json.dumps(run_variant(args.variant, args.dtype, args.repeats)))
        return
    print(f"tokens={TOKENS} vocab={VOCAB} logits={args.dtype} forward+backward, one subprocess per variant")
    results = {v: measure(v, args.dtype, args.repeats) for v in ("naive", "ours")}
    for r in results.values():
        print(f"{r['variant']:>5}: peak extra {r['peak_bytes'] / 2**30:.2f} GiB, best time {r['seconds']:.2f} s")
    peak_ratio = results["ours"]["peak_bytes"] / results["naive"]["peak_bytes"]
    time_ratio = results["ours"]["seconds"] / results["naive"]["seconds"]
    print(f"peak_ratio={peak_ratio:.3f} time_ratio={time_ratio:.3f}")


if __name__ == "__main__":
    main()
