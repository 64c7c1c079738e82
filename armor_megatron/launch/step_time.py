"""Step time of a layout with launched SGLang engines, and the engine/trainer GPU split that balances it.

What ``armor-train --config F --plan`` prints after the memory plan:

    plan = plan_step_time(cfg, arch)     # StepTimePlan: as configured, the split for one_step, the one for off
    print(plan.table())

Notation: P = rollout.prompts_per_step, G = rollout.group_size, L = f · rollout.max_response_len
the mean response length (f = launch.step_time.response_len_fraction, 1 by default: every response
at the limit), s = rollout.max_prompt_len + L the length of a trained row, W the weights a token
goes through (``models.flops``: matmul weights, the LM head included; for MoE the router, the k
routed and the shared experts), F(s) = ``models.flops.train_flops_per_token`` (forward + backward =
3 forwards), a = anchor.max_tries (0 without anchors), E_p / E_r the GPUs of the policy / reference
engine groups, T the trainer GPUs, r the tokens one engine GPU decodes per second at a full batch,
R = peak · mfu the FLOP/s one trainer GPU achieves, B = e · (parameters) the bytes of the weights
(e bytes per element of model.dtype), bw the weight-sync bandwidth.

**Generation** (anchors first, then the on-policy samples: ``trainer.rollout_phase``)::

    t_gen = a·P·L / (E_r·r) + (G − 1)·P·L / (E_p·r)

with E_r = E_p when anchor.source is swap (anchors come from the policy engines holding π_ref),
no anchor term without anchors (the policy then draws G·P responses) or when anchor.reference_urls
names servers outside the job.

**Training** (the log-prob forwards and the update, at MFU ``mfu``)::

    t_train = n · P·G·s·F(s)/3 / (T·R),    n = 1 (π_old) + 1 (π_ref, when algorithm.alpha < 1 or
                                               logging.reference_kl) + 3·train.epochs_per_step
                                               (+ 1 + 3·epochs for the critic of estimator gae)

``mfu`` is what a run logs as perf/mfu (model FLOPs, recompute not counted), so full recompute's
extra forward lowers it rather than adding passes here.

**Weight sync**::

    t_sync = k · B / bw,    k = 1 (+ 2 with anchor.source swap: π_ref in and the policy back)

**Step**, ``rollout.overlap``::

    off       = t_gen + t_train + t_sync        (the engines wait for the trainer and back)
    one_step  = max(t_gen, t_train) + t_sync    (the engines generate step t+1 while the trainer
                                                 trains on step t; the push waits for both)
    ratio     = one_step / off                  (1/2 at best: t_gen = t_train, t_sync = 0)

Colocated engines share the trainer's GPUs, so only ``off`` applies to them (T = every GPU).

**Split**: with N GPUs in the job, every disaggregated layout E_p = n_p·t, E_r = n_r·t (t =
tp_per_engine, n_r ≥ 1 when a reference group is launched), T = N − E_p − E_r that ``--check`` and
the SLURM plan accept and whose memory plan fits; the one with the least ``one_step`` time is the
suggested split (it balances t_gen against t_train), the one with the least ``off`` time is shown
beside it. A weight_sync of ``tensor`` whose engines leave the driver's node is planned as
``distributed``.

**Balance point** (any engine count, ignoring the layout's divisibility and memory): with
A = (√(a·P·L) + √((G − 1)·P·L))² / r the GPU-seconds of generation when the engine GPUs are shared
between the groups in proportion to √(their tokens) (which minimises t_gen at a given E = E_p + E_r;
(a + G − 1)·P·L / r for swapped anchors, G·P·L / r without) and B = n·P·G·s·F(s)/3 / R those of
training, t_gen = A/E and t_train = B/(N − E), so::

    E*          = N·A / (A + B)                 t_gen = t_train = (A + B)/N there
    one_step(E*) = (A + B)/N + t_sync           (the least one_step time of any split)
    off best at E = N·√A / (√A + √B):  off = (√A + √B)²/N + t_sync

**Decode rate default**: r = 4000 · W_8B / W tokens/s per GPU, W_8B = 7.50e9 the weights a token
of Llama-3-8B goes through: SGLang's published offline output throughput of Llama-3-8B in bf16 on
one A100-80GB, about 4000 tokens/s (LMSYS blog, 2024-07-25, "Achieving Faster Open-Source Llama3
Serving with SGLang Runtime (vs. TensorRT-LLM, vLLM)", section "Llama-8B on 1 x A100 (bf16)",
https://lmsys.org/blog/2024-07-25-sglang-llama3/; reproduction scripts in SGLang's
benchmark/blog_v0_2),
scaled by the weights a token goes through (at a full batch decoding is bound by the 2·W FLOPs
and the weight reads per token, both ∝ W). H100s decode faster; measured rates replace it
(launch.step_time.decode_tokens_per_s_per_gpu).

**Partial rollouts** (rollout.partial on): the plan adds the expected generation time of partial
rollouts over that of waiting for the step's longest response, E[L] / E[max of P·G lengths] for
lognormal lengths of shape launch.step_time.response_len_sigma truncated at max_response_len with
mean L (derivation and limits: :mod:`armor_megatron.launch.partial_gain`).

Left out: prefill of the prompts; the long tail (a step waits for its longest response, which a
mean rate hides; long responses also decode slower as their KV cache grows); DAPO's refill rounds
and anchors retried after a failed first request; colocated engines' memory release and resume;
reference resets' pushes to the reference group; evaluation and checkpoints.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import sys

from armor_megatron.algo.advantages import needs_critic
from armor_megatron.config.schema import RunConfig, needs_reference_logprobs
from armor_megatron.config.typed import ConfigError
from armor_megatron.config.validate import launched_reference_engines, validate_run_config
from armor_megatron.launch.memory import plan_memory, total_params
from armor_megatron.launch.partial_gain import lognormal_lengths, partial_generation_ratio
from armor_megatron.launch.plan import LaunchPlanError, plan_job, preview_allocation
from armor_megatron.models.arch import ModelArch
from armor_megatron.models.flops import train_flops_per_token

# SGLang's offline output throughput, Llama-3-8B bf16 on one A100-80GB (LMSYS blog 2024-07-25,
# https://lmsys.org/blog/2024-07-25-sglang-llama3/: "TensorRT-LLM and SGLang can both reach a
# throughput of around 4000 tokens per second").
REFERENCE_DECODE_TOKENS_PER_S = 4000.0
# weights_per_token(Llama-3-8B): 32·(4096·48·128 + 32·128·4096 + 3·4096·14336) + 4096·128256
REFERENCE_WEIGHTS_PER_TOKEN = 7_504_658_432
DEFAULT_PEAK_TFLOPS = 989.0  # H100/H200 SXM dense bf16, when launch.gpu_peak_tflops is unset
# GB/s by rollout.sglang.weight_sync when launch.step_time.sync_gb_per_s is unset (assumptions)
DEFAULT_SYNC_GB_PER_S = {"tensor": 100.0, "distributed": 25.0, "disk": 2.0}
_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


# ----------------------------------------------------------------------------- the formulas
def weights_per_token(arch: ModelArch) -> float:
    """W: the weights a token's forward goes through (F(0)/6: no attention scores at length 0)."""
    return train_flops_per_token(arch, 0) / 6.0


def default_decode_rate(arch: ModelArch) -> float:
    """The decode rate r = 4000 · W_8B / W tokens/s per engine GPU (module docstring)."""
    return REFERENCE_DECODE_TOKENS_PER_S * REFERENCE_WEIGHTS_PER_TOKEN / weights_per_token(arch)


@dataclasses.dataclass(frozen=True)
class Workload:
    """One step's work, in counts: tokens to decode, FLOPs of one forward over the batch, bytes to push."""

    policy_tokens: float  # (G − 1)·P·L, or G·P·L without anchors
    anchor_tokens: float  # a·P·L from the anchor source (0: none, or servers outside the job)
    anchors_on_policy: bool  # anchor.source swap: the anchor tokens run on the policy engines
    forward_flops: float  # P·G·s·F(s)/3
    forward_passes: float  # n
    weight_bytes: float  # B
    syncs: int  # k


@dataclasses.dataclass(frozen=True)
class Rates:
    """Speeds: decode tokens/s per engine GPU (r), trainer FLOP/s per GPU (R), weight-sync bytes/s (bw)."""

    decode_tokens_per_s_per_gpu: float  # r
    trainer_flops_per_s_per_gpu: float  # R = peak · mfu
    sync_bytes_per_s: float  # bw


@dataclasses.dataclass(frozen=True)
class Split:
    """Where the GPUs go: engine groups and the trainer."""

    policy_gpus: int
    reference_gpus: int
    trainer_gpus: int
    placement: str  # colocated | disaggregated
    weight_sync: str

    @property
    def engine_gpus(self) -> int:
        """The GPUs of both engine groups."""
        return self.policy_gpus + self.reference_gpus


@dataclasses.dataclass(frozen=True)
class StepTime:
    """Seconds of each phase of a step and the step under each rollout.overlap mode."""

    generation: float
    train: float
    sync: float

    @property
    def off(self) -> float:
        """Seconds of a step under rollout.overlap off."""
        return off_step_seconds(self.generation, self.train, self.sync)

    @property
    def one_step(self) -> float:
        """Seconds of a step under rollout.overlap one_step."""
        return one_step_seconds(self.generation, self.train, self.sync)

    @property
    def ratio(self) -> float:
        """one_step / off."""
        return self.one_step / self.off


def generation_seconds(work: Workload, rates: Rates, policy_gpus: int, reference_gpus: int) -> float:
    """t_gen = a·P·L / (E_r·r) + (G − 1)·P·L / (E_p·r); E_r = E_p for swapped anchors."""
    r = rates.decode_tokens_per_s_per_gpu
    t = work.policy_tokens / (policy_gpus * r)
    if work.anchor_tokens:
        t += work.anchor_tokens / ((policy_gpus if work.anchors_on_policy else reference_gpus) * r)
    return t


def train_seconds(work: Workload, rates: Rates, trainer_gpus: int) -> float:
    """t_train = n · P·G·s·F(s)/3 / (T·R)."""
    return work.forward_passes * work.forward_flops / (trainer_gpus * rates.trainer_flops_per_s_per_gpu)


def sync_seconds(work: Workload, rates: Rates) -> float:
    """t_sync = k · B / bw."""
    return work.syncs * work.weight_bytes / rates.sync_bytes_per_s


def off_step_seconds(generation: float, train: float, sync: float = 0.0) -> float:
    """rollout.overlap off: generation, then training, then the push, one after another."""
    return generation + train + sync


def one_step_seconds(generation: float, train: float, sync: float = 0.0) -> float:
    """rollout.overlap one_step: generation of step t+1 runs beside training on step t; then the push."""
    return max(generation, train) + sync


def overlap_ratio(generation: float, train: float, sync: float = 0.0) -> float:
    """one_step / off for measured phase times: (max(g, u) + s) / (g + u + s)."""
    if min(generation, train, sync) < 0 or generation + train + sync <= 0:
        raise ValueError(f"phase times must be >= 0 and not all 0, got {generation}, {train}, {sync}")
    return one_step_seconds(generation, train, sync) / off_step_seconds(generation, train, sync)


def generation_gpu_seconds(work: Workload, rates: Rates) -> float:
    """A: (√anchor + √policy tokens)² / r; (anchor + policy) / r when both run on the policy engines."""
    if work.anchors_on_policy or not work.anchor_tokens:
        return (work.anchor_tokens + work.policy_tokens) / rates.decode_tokens_per_s_per_gpu
    return (work.anchor_tokens**0.5 + work.policy_tokens**0.5) ** 2 / rates.decode_tokens_per_s_per_gpu


def train_gpu_seconds(work: Workload, rates: Rates) -> float:
    """B: n · P·G·s·F(s)/3 / R."""
    return train_seconds(work, rates, 1)


@dataclasses.dataclass(frozen=True)
class Balance:
    """The continuous optimum of the module docstring for N GPUs."""

    gpus: int  # N
    generation_gpu_s: float  # A
    train_gpu_s: float  # B
    sync: float  # t_sync

    @property
    def engine_gpus(self) -> float:
        """E* = N·A / (A + B): generation and training take equally long."""
        return self.gpus * self.generation_gpu_s / (self.generation_gpu_s + self.train_gpu_s)

    @property
    def one_step(self) -> float:
        """Step seconds of the one_step optimum: (A + B) / N + t_sync."""
        return (self.generation_gpu_s + self.train_gpu_s) / self.gpus + self.sync

    @property
    def off_engine_gpus(self) -> float:
        """N·√A / (√A + √B): where off is least."""
        a, b = self.generation_gpu_s**0.5, self.train_gpu_s**0.5
        return self.gpus * a / (a + b)

    @property
    def off(self) -> float:
        """Step seconds of the off optimum: (√A + √B)² / N + t_sync."""
        return (self.generation_gpu_s**0.5 + self.train_gpu_s**0.5) ** 2 / self.gpus + self.sync


def step_time(work: Workload, rates: Rates, split: Split) -> StepTime:
    """The phase and step seconds of ``work`` at ``rates`` on ``split``."""
    return StepTime(
        generation=generation_seconds(work, rates, split.policy_gpus, split.reference_gpus),
        train=train_seconds(work, rates, split.trainer_gpus),
        sync=sync_seconds(work, rates),
    )


# ----------------------------------------------------------------------------- from a run config
def workload_of(cfg: RunConfig, arch: ModelArch) -> Workload:
    """The step's counts of the module docstring for `cfg`."""
    ro, anchor = cfg.rollout, cfg.anchor
    P, G = ro.prompts_per_step, ro.group_size
    L = cfg.launch.step_time.response_len_fraction * ro.max_response_len
    anchors = anchor.enabled and (anchor.source == "swap" or launched_reference_engines(cfg) > 0)
    external = anchor.enabled and not anchors  # anchors from servers outside the job: not timed here
    s = ro.max_prompt_len + L
    passes = 1 + (1 if needs_reference_logprobs(cfg) else 0) + 3 * cfg.train.epochs_per_step
    if needs_critic(cfg.algorithm.estimator):
        passes += 1 + 3 * cfg.train.epochs_per_step
    return Workload(
        policy_tokens=(G - 1 if anchors or external else G) * P * L,
        anchor_tokens=anchor.max_tries * P * L if anchors else 0.0,
        anchors_on_policy=anchor.source == "swap",
        forward_flops=P * G * s * train_flops_per_token(arch, round(s)) / 3.0,
        forward_passes=float(passes),
        weight_bytes=float(_BYTES[cfg.model.dtype] * total_params(arch)),
        syncs=3 if anchors and anchor.source == "swap" else 1,
    )


def rates_of(cfg: RunConfig, arch: ModelArch, weight_sync: str) -> Rates:
    """The rates of ``cfg`` (launch.step_time, GPU peak, weight-sync bandwidth) for ``arch``."""
    st = cfg.launch.step_time
    peak = cfg.launch.gpu_peak_tflops or DEFAULT_PEAK_TFLOPS
    gbps = st.sync_gb_per_s or DEFAULT_SYNC_GB_PER_S.get(weight_sync)
    if gbps is None:
        raise ConfigError(
            "launch.step_time.sync_gb_per_s",
            f"no default bandwidth for weight-sync mode {weight_sync!r} (defaults exist for {', '.join(sorted(DEFAULT_SYNC_GB_PER_S))}); set it to plan this run",
        )
    return Rates(
        decode_tokens_per_s_per_gpu=st.decode_tokens_per_s_per_gpu or default_decode_rate(arch),
        trainer_flops_per_s_per_gpu=peak * 1e12 * st.mfu,
        sync_bytes_per_s=gbps * 1e9,
    )


@dataclasses.dataclass(frozen=True)
class PlannedLayout:
    """One row of the plan: a label, its GPU split and its step time."""

    label: str
    split: Split
    time: StepTime


@dataclasses.dataclass
class StepTimePlan:
    """The step-time plan: workload, rates, the configured layout and the balanced splits."""

    work: Workload
    rates: dict[str, Rates]  # by weight_sync mode of the rows
    configured: PlannedLayout
    for_one_step: PlannedLayout | None  # the balanced split (None: no disaggregated layout fits)
    for_off: PlannedLayout | None
    balance: Balance
    note: str
    overrides: str = ""  # the suggested split as ``key=value`` overrides of the run config ("": as configured)
    partial: str = ""  # with rollout.partial on: the expected generation time against waiting for the longest

    def table(self) -> str:
        """The plan as a text table, one row per layout."""
        head = [
            "layout",
            "engine GPUs (policy + reference)",
            "trainer GPUs",
            "generation s",
            "train s",
            "sync s",
            "off s",
            "one_step s",
            "one_step / off",
        ]
        rows = [head, ["---"] + ["---:"] * (len(head) - 1)]
        labelled: dict[Split, tuple[list[str], StepTime]] = {}  # one row per split, its labels joined
        for row in (self.configured, self.for_one_step, self.for_off):
            if row is not None:
                labelled.setdefault(row.split, ([], row.time))[0].append(row.label)
        for sp, (labels, t) in labelled.items():
            colocated = sp.placement == "colocated"
            rows.append(
                [
                    f"{', '.join(labels)} ({sp.placement}, sync {sp.weight_sync})",
                    f"{sp.engine_gpus} ({sp.policy_gpus} + {sp.reference_gpus})",
                    str(sp.trainer_gpus),
                    f"{t.generation:.1f}",
                    f"{t.train:.1f}",
                    f"{t.sync:.1f}",
                    f"{t.off:.1f}",
                    "-" if colocated else f"{t.one_step:.1f}",
                    "-" if colocated else f"{t.ratio:.2f}",
                ]
            )
        lines = ["| " + " | ".join(r) + " |" for r in rows]
        b = self.balance
        balance = (
            f"balance point (any engine count): {b.engine_gpus:.1f} of {b.gpus} GPUs to the engines, "
            f"generation = train = {b.one_step - b.sync:.1f} s: one_step {b.one_step:.1f} s; off is least with "
            f"{b.off_engine_gpus:.1f} engine GPUs: {b.off:.1f} s"
        )
        partial = [self.partial] if self.partial else []
        return "\n".join(["step-time model: " + self.note, "", *lines, "", balance, *partial, self.verdict()])

    def verdict(self) -> str:
        """One line suggesting the engine/trainer split."""
        best = self.for_one_step
        if best is None:
            return "suggested split: none (no disaggregated layout of this job passes the checks and fits its GPUs)"
        sp, same = best.split, best.split == self.configured.split
        line = (
            f"suggested split: {sp.engine_gpus} engine GPUs ({sp.policy_gpus} policy + {sp.reference_gpus} "
            f"reference), {sp.trainer_gpus} trainer GPUs{' (as configured)' if same else ''}: one_step "
            f"{best.time.one_step:.1f} s per step, {best.time.ratio:.2f} of off at that split"
        )
        return line + (f"\nto run it, add: {self.overrides}" if self.overrides else "")


def plan_step_time(cfg: RunConfig, arch: ModelArch) -> StepTimePlan | None:
    """The step-time rows of `cfg` (module docstring); None without launched GPU engines."""
    sg = cfg.rollout.sglang
    if cfg.rollout.engine != "sglang" or sg.urls or cfg.launch.gpus_per_node == 0:
        return None
    work = workload_of(cfg, arch)
    rates: dict[str, Rates] = {}

    def timed(label: str, split: Split) -> PlannedLayout:
        r = rates.setdefault(split.weight_sync, rates_of(cfg, arch, split.weight_sync))
        return PlannedLayout(label, split, step_time(work, r, split))

    t, total = sg.tp_per_engine, cfg.launch.nodes * cfg.launch.gpus_per_node
    n_r = launched_reference_engines(cfg)
    trainer = total - cfg.launch.engine_gpus
    configured = timed("as configured", Split(sg.num_engines * t, n_r * t, trainer, sg.placement, sg.weight_sync))
    candidates = [timed("", split) for split in disaggregated_splits(cfg, arch)]
    by_one_step = min(candidates, key=lambda p: (p.time.one_step, p.split.engine_gpus), default=None)
    by_off = min(candidates, key=lambda p: (p.time.off, p.split.engine_gpus), default=None)
    relabel = dataclasses.replace
    st = cfg.launch.step_time
    r = rates_of(cfg, arch, sg.weight_sync)
    note = (
        f"{cfg.rollout.prompts_per_step} prompts x {cfg.rollout.group_size} responses of "
        f"{st.response_len_fraction * cfg.rollout.max_response_len:.0f} tokens"
        + (f" + {cfg.anchor.max_tries} anchor tries per prompt" if work.anchor_tokens else "")
        + f"; decode {r.decode_tokens_per_s_per_gpu:.0f} tokens/s per engine GPU, trainer "
        f"{r.trainer_flops_per_s_per_gpu / 1e12:.0f} TFLOP/s per GPU (mfu {st.mfu:g} x peak "
        f"{cfg.launch.gpu_peak_tflops or DEFAULT_PEAK_TFLOPS:g}), {work.weight_bytes / 1e9:.1f} GB of weights per push "
        "(launch.step_time.*; the model: armor_megatron/launch/step_time.py)"
    )
    return StepTimePlan(
        work=work,
        rates=rates,
        configured=configured,
        for_one_step=None if by_one_step is None else relabel(by_one_step, label="split for one_step"),
        for_off=None if by_off is None else relabel(by_off, label="split for off"),
        balance=Balance(total, generation_gpu_seconds(work, r), train_gpu_seconds(work, r), sync_seconds(work, r)),
        note=note,
        overrides="" if by_one_step is None else split_overrides(cfg, by_one_step.split),
        partial=partial_gain_line(cfg) if cfg.rollout.partial.enabled else "",
    )


def partial_gain_line(cfg: RunConfig) -> str:
    """The generation-time ratio of partial rollouts vs waiting for the step's longest response, in words."""
    ro, st = cfg.rollout, cfg.launch.step_time
    n = ro.prompts_per_step * ro.group_size
    lengths = lognormal_lengths(
        st.response_len_fraction * ro.max_response_len, st.response_len_sigma, ro.max_response_len
    )
    ratio = partial_generation_ratio(lengths, n)
    return (
        f"partial rollouts: generation {ratio:.2f} x the time of waiting for the longest of the step's {n} "
        f"responses (lognormal lengths, σ {st.response_len_sigma:g}, mean {lengths.mean():.0f} of at most "
        f"{ro.max_response_len} tokens, the {n} running at once; the t_gen above, a mean rate, leaves that tail "
        "out: armor_megatron/launch/partial_gain.py)"
    )


def split_overrides(cfg: RunConfig, split: Split) -> str:
    """The overrides turning ``cfg`` into ``split`` under ``rollout.overlap: one_step``, the keys that change."""
    sg, t = cfg.rollout.sglang, cfg.rollout.sglang.tp_per_engine
    wanted = {
        "rollout.overlap": ("one_step", cfg.rollout.overlap),
        "algorithm.tis.enabled": ("true", str(cfg.algorithm.tis.enabled).lower()),
        "rollout.sglang.placement": (split.placement, sg.placement),
        "rollout.sglang.weight_sync": (split.weight_sync, sg.weight_sync),
        "rollout.sglang.num_engines": (str(split.policy_gpus // t), str(sg.num_engines)),
        "launch.engine_gpus": (str(split.engine_gpus), str(cfg.launch.engine_gpus)),
    }
    if split.reference_gpus:
        wanted["anchor.reference_engines"] = (str(split.reference_gpus // t), str(cfg.anchor.reference_engines))
    return " ".join(f"{key}={new}" for key, (new, old) in wanted.items() if new != old)


def disaggregated_splits(cfg: RunConfig, arch: ModelArch) -> list[Split]:
    """Every disaggregated split of the job's GPUs that the checks accept and whose memory plan fits."""
    sg = cfg.rollout.sglang
    t, total = sg.tp_per_engine, cfg.launch.nodes * cfg.launch.gpus_per_node
    reference_group = launched_reference_engines(cfg) > 0
    out = []
    for engines in range(1 + reference_group, total // t):
        for n_r in range(1, engines) if reference_group else (0,):
            split = _accepted(cfg, arch, engines - n_r, n_r)
            if split is not None:
                out.append(split)
    return out


def _accepted(cfg: RunConfig, arch: ModelArch, n_p: int, n_r: int) -> Split | None:
    """The split of n_p policy and n_r reference engines, or None when a check or the memory plan refuses it."""
    cand = copy.deepcopy(cfg)
    sg = cand.rollout.sglang
    sg.placement, sg.num_engines = "disaggregated", n_p
    if n_r:
        cand.anchor.reference_engines = n_r
    cand.launch.engine_gpus = (n_p + n_r) * sg.tp_per_engine
    try:
        validate_run_config(cand)
    except ConfigError:
        return None
    try:
        plan_job(cand, preview_allocation(cand), train_args=[])
    except LaunchPlanError:
        if sg.weight_sync != "tensor":
            return None
        sg.weight_sync = "distributed"  # CUDA IPC cannot reach engines on other nodes
        try:
            plan_job(cand, preview_allocation(cand), train_args=[])
        except LaunchPlanError:
            return None
    if plan_memory(cand, arch).problem() is not None:
        return None
    total = cand.launch.nodes * cand.launch.gpus_per_node
    t = sg.tp_per_engine
    return Split(n_p * t, n_r * t, total - cand.launch.engine_gpus, "disaggregated", sg.weight_sync)


# ----------------------------------------------------------------------------- measured phases
def main(argv: list[str] | None = None) -> int:
    """``python -m armor_megatron.launch.step_time --generation-s G --train-s U [--sync-s S]``.

    The ratio the model predicts for measured phase times (e.g. a CPU bench's engine and trainer).
    """
    parser = argparse.ArgumentParser(prog="python -m armor_megatron.launch.step_time", description=main.__doc__)
    parser.add_argument("--generation-s", type=float, required=True, help="seconds the engines generate a step")
    parser.add_argument("--train-s", type=float, required=True, help="seconds the trainer takes on a step")
    parser.add_argument(
        "--sync-s",
        type=float,
        default=0.0,
        help="seconds serial in both modes: the weight push and any other per-step work",
    )
    args = parser.parse_args(argv)
    g, u, s = args.generation_s, args.train_s, args.sync_s
    try:
        ratio = overlap_ratio(g, u, s)
    except ValueError as err:
        parser.error(str(err))
    print(
        f"predicted off_s={off_step_seconds(g, u, s):.4f} one_step_s={one_step_seconds(g, u, s):.4f} "
        f"step_time_ratio_overlap_vs_off={ratio:.4f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
