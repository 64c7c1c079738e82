"""Device memory of a run, per GPU of its layout: what ``armor-train --config F --plan`` prints.

    plan = plan_memory(cfg, arch)          # MemoryPlan: one StageMemory per pipeline stage
    print(plan.table())                    # GiB per term and stage, the rollout phase, the verdict
    plan.problem()                         # None, or one line naming the stage and its largest term

Every GPU of a pipeline stage holds the same (TP, DP, EP ranks are alike), so a stage is a
column. Notation: h hidden, q = nq·d query width, kv = nkv·d key/value width, f dense FFN,
fe / fs expert / shared-expert FFN, E experts, k router top-k, V_p padded vocabulary, L layers,
s = max_prompt_len + max_response_len (micro-batches are padded to their longest row: the
worst case is a full-length row), b = micro_batch_size, e bytes per element of model.dtype
(bf16: 2), t = tp, p = pp, v = vpp (1 without), dp = trainer GPUs / (t·p).

Token-budget micro-batches (``train.max_tokens_per_micro_batch`` = B): a packed micro-batch
holds B tokens at most, so every s·b below reads B, while attention scores stay per sequence
(at most s long: packed rows never attend to each other). The micro-batch count of a step is
taken at its worst, full-length rows: floor(B / s) rows per micro-batch.

**Parameters** of a stage (``params_per_gpu``): its L/p layers (the first stage also the
embedding [V_p/t, h], the last the output layer [V_p/t, h], also when tied and p > 1) with
attention h·(q + 2kv) + q·h (+ q + 2kv qkv bias), dense MLP 3·h·f, MoE router E·h + experts
E·3·h·fe + shared 3·h·fs, MLA per `ModelArch`'s shapes (counted from the family's declared
tensors, `models.family`); matrices split over t (experts over ep·etp), norms replicated.

**Bytes per parameter** (megatron DDP keeps fp32 gradient buffers, ``grad_reduce_in_fp32``):
weights e, gradients 4, optimizer: Adam's two fp32 moments 8, plus an fp32 master copy 4 when
e < 4. GPU runs use megatron's distributed optimizer: the optimizer bytes are divided by dp
(expert parameters by their expert-data-parallel size trainer GPUs / (ep·etp·p)); CPU runs
(``launch.gpus_per_node: 0``) do not shard it. bf16 + distributed optimizer: 2 + 4 + 12/dp.

**Activations** (Korthikanti et al. 2022, "Reducing activation recomputation in large
transformer models"): per layer and token, a standard GPT layer (MHA, 4h GeLU MLP, dropout)
keeps s·b·h·(34 + 5·a·s/h) bytes at e = 2; with sequence parallelism all of it is divided by t
(without it the norm inputs and dropout masks, 10·s·b·h, are not). Our layers have no dropout,
SwiGLU and GQA, so the terms are counted from the shapes (``layer_bytes_per_token``), elements
kept for backward per token:

    te (Transformer Engine: fused norms, flash attention, what GPUs run)
      attention  2h (norm input, qkv input) + q + 2kv (q, k, v) [+ q + kv q/k-norm outputs] + q (attention output)
      MLP        2h + 2f (SwiGLU input) + f (fc2 input)
      scores     none: flash attention keeps only [nq] softmax statistics per token
    local (megatron's local spec: torch norms and attention; CPU runs; measured, see below)
      attention  h (qkv input) + 8/e·(h [+ q + kv]) (torch RMSNorm keeps fp32 copies of input and
                 normalised input) + 3q (rotated q, k and v expanded to nq heads) [+ kv at fp32 with
                 q/k norms; + q + 2kv without them: the qkv output] + q (projection input)
      MLP        h + 8/e·h (norm) + 5f (fc1 output 2f, silu and gate halves 2f, fc2 input f)
      scores     nq·s·(4 + e if e < 4 else 4) bytes: fp32 softmax output (+ its cast to e)

 (bytes: elements × e, scores as stated; a standard GPT layer in these terms is Korthikanti's
 32·s·b·h + the 2·s·b·h of dropout masks we do not have). MoE layers replace the MLP with the
 router input h, and per routed copy (k of them) h + 3fe (+ h of the weighted output), plus a
 shared expert's 3h-free 3fs; averaged over experts (balanced routing). MLA counts its latent
 and per-head widths in place of q, kv.

Recompute (``train.recompute``): ``selective`` drops the scores term (te has none);
``full`` keeps e·h per token for each unit of ``recompute_num_layers`` layers (uniform), or
for the first ``recompute_num_layers`` layers of a chunk and everything for the rest (block),
and adds one unit's full activations while it is recomputed in backward.

Pipeline: 1F1B keeps min(m, p − i) micro-batches in flight on stage i (m micro-batches per
data-parallel rank and optimizer step); interleaved (v chunks), megatron's estimate for the
first stage, p·(1 + (p − 1)/(p·v)), shifted by i. The first stage adds the embedding output
e·s·b·h/t per micro-batch in flight.

**Log-prob / entropy chunk** (last stage, one micro-batch: 1F1B alternates there): the logits
[s, b, V_p/t] in e, their gradient (same size; `logprobs` writes it into one buffer) and the two
fp32 work buffers of ``vocab_parallel_logprobs``, 2·min(s·b, 2^26 / (V_p/t))·(V_p/t)·4 bytes.
GPTModel's ``logits.transpose(0, 1).contiguous()`` copy lives beside the output layer's logits
only while it is made, before the gradient and the work buffers exist: it does not raise the
peak (measured in megatron's forward and backward, tests/launch/test_memory.py).

**LoRA** (``lora.enabled``, `megatron.lora`): the base keeps e bytes per parameter and nothing
else (frozen: no gradient buffer, no master copy, no Adam moments); the adapters A and B (per
targeted linear and projection p: r·in + out_p·r, the TP-split one of the two divided by t) hold
e + 4 + the optimizer's bytes each, like any trained parameter; the reference is the base itself:
0 bytes. Activations add the r-wide products x·Aᵀ kept for B's gradient, e·r per token and
projection (whole on every TP rank).

**Reference model**: e bytes per parameter, no gradients or optimizer; 0 with
``reference.offload`` (then on the device only while it computes log-probs, not while the actor
trains). **Critic** (``algorithm.estimator: gae``): the actor's parameters without the LM head,
with gradients and optimizer; it trains after the actor, so its activations do not add.

**Phases** (`armor_megatron.launch.device_ledger`): a step holds different things at different
moments, so the plan replays the step's memory order through a `DeviceLedger` per pipeline stage
and a layout fits when every phase fits ``launch.gpu_memory_gib``. With colocated SGLang engines
(``rollout.sglang.placement: colocated``) the order is the trainer's (trainer/device_memory.py): rollout
(engines hold ``mem_fraction_static`` of the GPU, weights + KV cache, and their CUDA graphs; the
trainer is on the host when it offloads, ``train.offload_during_rollout``, default when colocated)
→ engines released (the policy group every tag; a frozen-reference group its KV cache and graphs:
its weights, e·P/tp_per_engine, stay) → trainer to the device → log-probs, update → trainer to the
host and ``empty_cache`` → policy weights resumed → weights pushed bucket by bucket
(``rollout.sglang.bucket_mb``; `STAGED_BUCKETS` of them on the device at the push's peak) from the
host copy → ``empty_cache`` → KV cache and graphs resumed; a reference
reset or a checkpoint brings the trainer back while engines keep only their weights. The start-up
is replayed too (`replay_colocated_start`): engines up with every tag → every tag released →
trainer built on the device → trainer to the host → per group weights resumed, pushed, KV cache and
graphs resumed; a layout whose start does not fit is refused like one whose step does not.
Disaggregated (or local engines):
a trainer GPU holds the trainer throughout, plus the export's bucket at the sync; an engine GPU
its static region, graphs and a received bucket.

Allowances (not derived from shapes): ``CUDA_CONTEXT_GIB`` per process on a GPU (the trainer's
and, colocated, the engine's: CUDA context, cuBLAS workspace, NCCL buffers), and
``ENGINE_CUDA_GRAPH_GIB``, SGLang's CUDA-graph pool outside ``mem_fraction_static``, released
with the ``cuda_graph`` tag while the trainer computes. Neither is measured with SGLang here
(``tools/gpu_check`` check 4 prints a torch process's CUDA context on the device).

Validation (tests/launch/test_memory.py): the local-spec activation terms against the bytes
autograd keeps for backward in megatron's own forward on CPU (saved-tensor hooks, peak over
forward and backward, parameters excluded), Qwen3 / Qwen2 / Qwen3-MoE tiny models, fp32 and
bf16, none / selective / full: planned / measured − 1 between −5.4 % and +11.7 % (most within
±5 %; the unaccounted bytes are small saved views and rstd vectors); parameter counts against
built models exactly. The te terms cannot be measured here
(no Transformer Engine on CPU): they follow the same counting with TE's fused modules.
"""

from __future__ import annotations

import dataclasses
import math

from armor_megatron.algo.advantages import needs_critic
from armor_megatron.config.schema import RunConfig, needs_reference_logprobs
from armor_megatron.config.validate import launched_reference_engines
from armor_megatron.launch.device_ledger import (
    DeviceLedger,
    DeviceSizes,
    EngineSizes,
    Phase,
    replay_colocated_start,
    replay_colocated_step,
    replay_disaggregated_step,
)
from armor_megatron.models.arch import ModelArch
from armor_megatron.models.family import layer_rules

GIB = 2**30
CUDA_CONTEXT_GIB = 0.75  # one process's CUDA context + cuBLAS workspace + NCCL buffers (allowance)
ENGINE_CUDA_GRAPH_GIB = 2.0  # SGLang's CUDA-graph memory outside mem_fraction_static (allowance)
# What a weight push stages on the sending GPU at its peak, in buckets (``rollout.sglang.bucket_mb``):
# the export's bucket being handed over, the driver's held-back previous one, and the packed copy
# of the bucket being posted (``tensor_payload.pack`` concatenates it). Measured op by op on CPU:
# tests/rollout/sglang/test_weight_sync_memory.py. ``distributed`` stages at most two on a sender:
# one bucket (its own, or one handed over by an expert owner of its stage) and its flattened copy.
STAGED_BUCKETS = 3
LOGPROB_CHUNK_ELEMENTS = 2**26  # logprobs.DEFAULT_CHUNK_ELEMENTS (launch/ does not import megatron/)
_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}

TERMS = (
    ("weights", "weights"),
    ("gradients", "gradients (fp32)"),
    ("optimizer", "optimizer state"),
    ("activations", "activations"),
    ("logits", "log-prob/entropy chunk"),
    ("reference", "reference model"),
    ("critic", "critic"),
    ("engine", "colocated engine kept while training"),
    ("contexts", "CUDA contexts"),
)
TRAINER_TERMS = ("weights", "gradients", "optimizer", "reference", "critic")


# ----------------------------------------------------------------------------- parameters
def layer_params(arch: ModelArch, layer: int) -> tuple[int, int, int]:
    """Parameter counts of decoder layer ``layer``: (tensor-parallel-split, replicated, expert).

    (tensor-parallel-split, replicated, expert) parameters of decoder layer `layer`, from its
    family's declared tensors (buffers, such as a router's selection bias, are not parameters).
    """
    split = replicated = expert = 0
    for rule in layer_rules(arch, layer):
        if rule.buffer:
            continue
        if rule.per_expert:
            expert += rule.numel * arch.num_experts
        elif rule.tp == "replicated":
            replicated += rule.numel
        else:
            split += rule.numel
    return split, replicated, expert


def padded_vocab(arch: ModelArch, tp: int) -> int:
    """Megatron's padded vocabulary (`megatron.model.padded_vocab_size`): a multiple of lcm(128, tp)."""
    multiple = math.lcm(128, tp)
    return -(-arch.vocab_size // multiple) * multiple


def stage_layers(arch: ModelArch, pp: int, stage: int) -> range:
    """The layers of pipeline stage ``stage`` of ``pp`` (equal consecutive shares)."""
    per = arch.num_layers // pp
    return range(stage * per, (stage + 1) * per)


def params_per_gpu(arch: ModelArch, tp: int, pp: int, ep: int, stage: int, etp: int | None = None, lm_head=True):
    """(dense, expert) parameters held by one GPU of pipeline `stage` (module docstring)."""
    dense = expert = 0.0
    for layer in stage_layers(arch, pp, stage):
        split, replicated, experts = layer_params(arch, layer)
        dense += split / tp + replicated
        expert += experts / (ep * (etp or tp))
    vocab = padded_vocab(arch, tp) * arch.hidden_size / tp
    if stage == 0:
        dense += vocab
    if stage == pp - 1:
        dense += arch.hidden_size  # final norm
        if lm_head and (not arch.tie_word_embeddings or pp > 1):
            dense += vocab
        elif not lm_head:
            dense += arch.hidden_size + 1  # the critic's value head
    return dense, expert


def total_params(arch: ModelArch) -> int:
    """Parameters of the whole model (unpadded vocabulary), e.g. 8.19e9 for Qwen3-8B."""
    n = sum(sum(layer_params(arch, i)) for i in range(arch.num_layers))
    return n + arch.vocab_size * arch.hidden_size * (1 if arch.tie_word_embeddings else 2) + arch.hidden_size


def lora_params_per_gpu(arch: ModelArch, targets, rank: int, tp: int, pp: int, stage: int) -> tuple[float, int]:
    """(adapter parameters, r-wide activations per token) of one GPU of pipeline `stage` (module docstring).

    Per layer of the stage and targeted linear, one adapter per logical projection: ``linear_qkv``
    q [nq·d], k and v [nkv·d] from h; ``linear_proj`` h from nq·d; ``linear_fc1`` gate and up [f]
    from h; ``linear_fc2`` h from f. Column-parallel B and row-parallel A are split over tp.
    """
    h, q, kv, f = (
        arch.hidden_size,
        arch.num_attention_heads * arch.head_dim,
        arch.num_key_value_heads * arch.head_dim,
        arch.ffn_hidden_size,
    )
    shapes = {  # target: (input width, [output width per projection], column-parallel)
        "linear_qkv": (h, [q, kv, kv], True),
        "linear_proj": (q, [h], False),
        "linear_fc1": (h, [f, f], True),
        "linear_fc2": (f, [h], False),
    }
    params, width = 0.0, 0
    for _ in stage_layers(arch, pp, stage):
        for target in targets:
            fan_in, outs, column = shapes[target]
            for out in outs:
                params += rank * fan_in + out * rank / tp if column else rank * fan_in / tp + out * rank
                width += rank
    return params, width


# ----------------------------------------------------------------------------- activations
def layer_bytes_per_token(arch: ModelArch, layer: int, *, spec: str, dtype_bytes: int, seq_len: int, scores=True):
    """Bytes one decoder layer keeps for backward per token (module docstring), undivided by tp."""
    e, h = dtype_bytes, arch.hidden_size
    nq, nkv, d = arch.num_attention_heads, arch.num_key_value_heads, arch.head_dim
    # per-head widths (MLA: as many kv heads as q heads, values of their own width); the latents
    # (kv_lora_rank + its rope key, q_lora_rank) are kept too, where the family has them
    q, kv, v_out = nq * d, nkv * d, nq * arch.value_head_dim
    latent = arch.mla.latent_width if arch.mla else 0
    local = spec == "local"
    if local:  # torch RMSNorm keeps fp32 copies of its input and normalised input, whatever e
        norms = 8 * (h + (q + kv if arch.qk_norm else 0)) / e
        qkv = 3 * q + (kv if arch.qk_norm and e == 4 else 0 if arch.qk_norm else q + 2 * kv)
        attn = h + norms + qkv + v_out + latent
    else:
        attn = 2 * h + q + 2 * kv + (q + kv if arch.qk_norm else 0) + v_out + latent
    if arch.is_moe_layer(layer):
        fe, fs, k = arch.moe_ffn_hidden_size, arch.moe_shared_expert_ffn_hidden_size, arch.moe_router_topk
        per_ffn = 5 if local else 3
        norm = h + 8 * h / e if local else 2 * h
        mlp = norm + k * (2 * h + per_ffn * fe) + per_ffn * fs
    else:
        mlp = (h + 8 * h / e if local else 2 * h) + (5 if local else 3) * arch.ffn_hidden_size
    total = e * (attn + mlp)
    if scores and local:
        total += nq * seq_len * (4 + (e if e < 4 else 0))
    return total


@dataclasses.dataclass(frozen=True)
class ActivationSettings:
    """What decides a stage's activation memory (see `activation_bytes`)."""

    seq_len: int
    micro_batch_size: int
    tp: int
    sequence_parallel: bool
    spec: str = "te"  # te | local
    dtype_bytes: int = 2
    recompute: str = "none"  # none | selective | full
    recompute_method: str = "uniform"
    recompute_num_layers: int = 1
    packed_tokens: int | None = None  # token-budget micro-batches: tokens per micro-batch

    @property
    def tokens(self) -> int:
        """Tokens of one micro-batch: the budget when packed, else micro_batch_size full rows."""
        return self.packed_tokens if self.packed_tokens is not None else self.seq_len * self.micro_batch_size


def activation_bytes(arch: ModelArch, layers: range, a: ActivationSettings, in_flight: float) -> float:
    """Activation bytes of one pipeline stage's layers.

    Activations of `layers` (one pipeline stage, all its chunks) with `in_flight` micro-batches
    kept, plus one recomputed unit under full recompute.
    """
    tokens = a.tokens
    keep_scores = a.recompute != "selective"  # a fully recomputed layer keeps them while it runs again
    per_layer = [
        tokens
        * layer_bytes_per_token(arch, i, spec=a.spec, dtype_bytes=a.dtype_bytes, seq_len=a.seq_len, scores=keep_scores)
        for i in layers
    ]
    if not a.sequence_parallel and a.tp > 1:  # norm inputs (and the layer input) stay whole on every TP rank
        whole = tokens * a.dtype_bytes * arch.hidden_size * (6 if a.spec == "local" else 4)
        per_layer = [whole + (x - whole) / a.tp for x in per_layer]
    else:
        per_layer = [x / a.tp for x in per_layer]
    layer_input = tokens * a.dtype_bytes * arch.hidden_size / (a.tp if a.sequence_parallel else 1)
    if a.recompute != "full":
        return in_flight * sum(per_layer)
    n = a.recompute_num_layers
    if a.recompute_method == "block":
        kept = [layer_input if j < n else x for j, x in enumerate(per_layer)]
        return in_flight * sum(kept) + (max(per_layer[:n]) if n else 0.0)
    units = math.ceil(len(per_layer) / n)
    unit = max(sum(per_layer[j : j + n]) for j in range(0, len(per_layer), n))
    return in_flight * units * layer_input + unit


def in_flight_microbatches(pp: int, vpp: int | None, stage: int, microbatches: int) -> float:
    """Micro-batches whose activations stage `stage` holds at its peak (1F1B / interleaved)."""
    if pp == 1:
        return 1.0
    held = (pp - stage) + ((pp - 1) / vpp if vpp else 0.0)
    return float(min(held, max(microbatches, 1)))


def logits_bytes(arch: ModelArch, tp: int, tokens: int, dtype_bytes: int) -> float:
    """Bytes of the logits: 2 × [tokens, V/tp] in the model dtype, plus the two fp32 [rows, V/tp] log-prob workspaces."""
    v_local = padded_vocab(arch, tp) // tp
    rows = min(tokens, max(1, LOGPROB_CHUNK_ELEMENTS // v_local))
    return 2 * tokens * v_local * dtype_bytes + 2 * rows * v_local * 4


# ----------------------------------------------------------------------------- the plan
@dataclasses.dataclass
class StageMemory:
    """Bytes of each term (`TERMS`) on one GPU of a pipeline stage, and the phases of its step."""

    stage: int
    terms: dict[str, float]
    phases: list[Phase] = dataclasses.field(default_factory=list)
    sizes: DeviceSizes | None = None  # what its ledger charged
    start_phases: list[Phase] = dataclasses.field(default_factory=list)  # colocated: the job's start-up

    @property
    def total(self) -> float:
        """The update's peak: every term at once."""
        return sum(self.terms.values())

    @property
    def peak(self) -> Phase:
        """The phase with the most bytes."""
        return max(self.phases, key=lambda p: p.total)

    def largest(self) -> tuple[str, float]:
        """The largest term: (name, bytes)."""
        return max(self.terms.items(), key=lambda kv: kv[1])


@dataclasses.dataclass
class MemoryPlan:
    """Estimated device memory of every pipeline stage of a layout, and the GPU's size."""

    stages: list[StageMemory]
    gpu_bytes: float
    layout: str
    placement: str  # colocated | disaggregated (SGLang on other GPUs, or no engine on a GPU)
    engine_phases: list[Phase] = dataclasses.field(default_factory=list)  # an engine GPU (disaggregated)
    update_groups: int = 0  # weight_sync distributed: NCCL communicators every engine TP rank joins
    update_group_layout: str = "pipeline stages"  # who sends: "pipeline stages" or "pipeline stages x expert owners"

    def problem(self) -> str | None:
        """One line naming the stage and phase that exceed the GPU and the phase's largest holding."""
        cap = self.gpu_bytes / GIB
        columns = [(f"pipeline stage {st.stage}", "start phase", st.start_phases) for st in self.stages]
        columns += [(f"pipeline stage {st.stage}", "phase", st.phases) for st in self.stages]
        columns.append(("an engine GPU", "phase", self.engine_phases))
        for where, when, phases in columns:
            for phase in phases:
                if phase.total > self.gpu_bytes:
                    name, size = max(phase.holdings.items(), key=lambda kv: kv[1])
                    return (
                        f"{self.layout}: {where} needs {phase.total / GIB:.1f} GiB per GPU in {when} "
                        f"'{phase.label}' ({self.placement}) > launch.gpu_memory_gib {cap:g} "
                        f"(largest: {name} {size / GIB:.1f} GiB)"
                    )
        return None

    def table(self) -> str:
        """GiB per term and per phase (rows) and pipeline stage (columns), Markdown."""
        head = ["term (GiB per GPU)"] + [f"stage {st.stage}" for st in self.stages]
        rule = ["---"] + ["---:"] * len(self.stages)
        rows = [head, rule]
        for key, label in TERMS:
            rows.append([label] + [f"{st.terms[key] / GIB:.2f}" for st in self.stages])
        rows.append(["**total (update)**"] + [f"**{st.total / GIB:.2f}**" for st in self.stages])
        phases = [[f"phase ({self.placement} step)"] + [f"stage {st.stage}" for st in self.stages], rule]
        for i, phase in enumerate(self.stages[0].start_phases):
            phases.append([f"start: {phase.label}"] + [f"{st.start_phases[i].total / GIB:.2f}" for st in self.stages])
        for i, phase in enumerate(self.stages[0].phases):
            phases.append([phase.label] + [f"{st.phases[i].total / GIB:.2f}" for st in self.stages])
        peaks = [max(st.phases + st.start_phases, key=lambda p: p.total) for st in self.stages]
        phases.append(["**peak**"] + [f"**{p.total / GIB:.2f}**" for p in peaks])
        lines = ["| " + " | ".join(r) + " |" for r in rows]
        lines += [""] + ["| " + " | ".join(r) + " |" for r in phases]
        if self.engine_phases:
            lines += ["", "| phase (engine GPU) | GiB |", "| --- | ---: |"]
            lines += [f"| {p.label} | {p.total / GIB:.2f} |" for p in self.engine_phases]
        verdict = self.problem() or f"fits launch.gpu_memory_gib {self.gpu_bytes / GIB:g}"
        if self.update_groups:
            lines += [
                "",
                f"weight sync distributed: {self.update_groups} update group(s), one per sending trainer rank "
                f"({self.update_group_layout}): each engine TP rank holds that many NCCL "
                "communicators and joins that many rendezvous",
            ]
        return "\n".join([f"memory plan: {self.layout}", "", *lines, "", verdict])


def plan_memory(cfg: RunConfig, arch: ModelArch) -> MemoryPlan:
    """The memory of every pipeline stage of `cfg` (see the module docstring)."""
    par, launch, train, sg = cfg.parallelism, cfg.launch, cfg.train, cfg.rollout.sglang
    tp, pp, ep = par.tp, par.pp, par.ep
    on_gpu = launch.gpus_per_node > 0
    trainer_gpus = (launch.nodes * launch.gpus_per_node - launch.engine_gpus) if on_gpu else tp * pp
    dp = max(1, trainer_gpus // (tp * pp))
    expert_dp = max(1, trainer_gpus // (ep * tp * pp))
    e = _BYTES[cfg.model.dtype]
    optimizer_bytes = 8 + (4 if e < 4 else 0)
    spec = "local" if cfg.model.spec == "local" or not on_gpu else "te"
    seq = cfg.rollout.max_prompt_len + cfg.rollout.max_response_len
    if cfg.rollout.environment.spec is not None:  # a multi-turn row holds environment tokens too
        seq = cfg.rollout.environment.max_total_tokens or arch.max_position_embeddings
    rows_per_step = cfg.rollout.prompts_per_step * cfg.rollout.group_size / train.mini_batches_per_step
    budget = train.max_tokens_per_micro_batch
    rows_per_microbatch = max(1, budget // seq) if budget else train.micro_batch_size
    microbatches = math.ceil(rows_per_step / dp / rows_per_microbatch)
    act = ActivationSettings(
        seq_len=seq,
        micro_batch_size=train.micro_batch_size,
        tp=tp,
        sequence_parallel=par.sp and tp > 1,
        spec=spec,
        dtype_bytes=e,
        recompute=train.recompute,
        recompute_method=train.recompute_method,
        recompute_num_layers=train.recompute_num_layers,
        packed_tokens=budget,
    )
    sglang = cfg.rollout.engine == "sglang" and on_gpu
    colocated = sglang and sg.placement == "colocated"
    # a LoRA reference is the actor's base (adapters off): no weights of its own
    reference = (cfg.algorithm.alpha < 1.0 or cfg.anchor.enabled) and not cfg.reference.offload and not cfg.lora.enabled
    engines = _engine_sizes(cfg, arch, e) if sglang else {}
    kept = engines["reference"].weights if colocated and "reference" in engines else 0.0
    contexts = (2 if colocated else 1) * CUDA_CONTEXT_GIB * GIB if on_gpu else 0.0
    offloads = train.offload_during_rollout if train.offload_during_rollout is not None else colocated
    stages = []
    for stage in range(pp):
        dense, expert = params_per_gpu(arch, tp, pp, ep, stage)
        shard = (dp, expert_dp) if on_gpu else (1, 1)
        params = dense + expert
        trained = (dense / shard[0] + expert / shard[1], params)  # (optimizer-sharded, gradient) parameters
        adapters, lora_width = 0.0, 0
        if cfg.lora.enabled:  # the base frozen: only the adapters have gradients and optimizer state
            adapters, lora_width = lora_params_per_gpu(arch, cfg.lora.target_modules, cfg.lora.rank, tp, pp, stage)
            trained = (adapters / shard[0], adapters)
        opt = optimizer_bytes * trained[0]
        c_dense, c_expert = params_per_gpu(arch, tp, pp, ep, stage, lm_head=False)
        critic = 0.0
        if needs_critic(cfg.algorithm.estimator):
            critic = (e + 4) * (c_dense + c_expert) + optimizer_bytes * (c_dense / shard[0] + c_expert / shard[1])
        held = in_flight_microbatches(pp, par.vpp, stage, microbatches)
        activations = activation_bytes(arch, stage_layers(arch, pp, stage), act, held)
        activations += held * act.tokens * e * lora_width
        if stage == 0:
            activations += held * act.tokens * e * arch.hidden_size / tp
        logits = logits_bytes(arch, tp, act.tokens, e) if stage == pp - 1 else 0.0
        terms = dict(
            weights=e * (params + adapters),
            gradients=4.0 * trained[1],
            optimizer=opt,
            activations=activations,
            logits=logits,
            reference=e * params if reference else 0.0,
            critic=critic,
            engine=kept,
            contexts=contexts,
        )
        sizes = DeviceSizes(
            gpu=launch.gpu_memory_gib * GIB,
            trainer={dict(TERMS)[k]: terms[k] for k in TRAINER_TERMS},
            logprobs=logits,
            update=activations + logits,
            engines=engines if colocated else {},
            contexts=contexts,
            bucket=STAGED_BUCKETS * sg.bucket_mb * 2**20 if sglang else 0.0,
        )
        ref_logprobs = needs_reference_logprobs(cfg)
        start: list[Phase] = []
        if colocated:
            ledger = DeviceLedger(sizes, trainer_on_device=not offloads)
            replay_colocated_step(
                ledger,
                offload=offloads,
                ref_logprobs=ref_logprobs,
                policy_keeps_weights=cfg.lora.enabled and cfg.lora.sync == "adapter",
            )
            start = replay_colocated_start(
                DeviceLedger(sizes, trainer_on_device=False), offload=offloads, reference_engine="reference" in engines
            ).phases
        else:
            ledger = replay_disaggregated_step(DeviceLedger(sizes), ref_logprobs=ref_logprobs)
        stages.append(StageMemory(stage, terms, ledger.phases, sizes, start))
    engine_phases = []
    if sglang and not colocated:  # an engine GPU: static region, graphs and a received bucket
        engine_gpu = DeviceSizes(
            gpu=launch.gpu_memory_gib * GIB,
            trainer={},
            logprobs=0.0,
            update=0.0,
            engines={"policy": engines["policy"]},
            contexts=CUDA_CONTEXT_GIB * GIB,
            bucket=sg.bucket_mb * 2**20,
        )
        ledger = DeviceLedger(engine_gpu, trainer_on_device=False)
        ledger.start("rollout")
        ledger.weights_pushed("policy")
        engine_phases = ledger.phases
    layout = f"tp={tp} pp={pp}" + (f" vpp={par.vpp}" if par.vpp else "") + (f" ep={ep}" if ep > 1 else "")
    batching = (
        f"packed micro-batches of {budget} tokens" if budget else f"micro-batch {train.micro_batch_size} x {seq} tokens"
    )
    layout += f" dp={dp}, {batching}, recompute {train.recompute}"
    return MemoryPlan(
        stages=stages,
        gpu_bytes=launch.gpu_memory_gib * GIB,
        layout=layout,
        placement="colocated" if colocated else "disaggregated",
        engine_phases=engine_phases,
        update_groups=update_groups(cfg, arch) if sglang else 0,
        update_group_layout="pipeline stages x expert owners" if sg.update_groups == "owner" else "pipeline stages",
    )


def update_groups(cfg: RunConfig, arch: ModelArch) -> int:
    """NCCL update groups of ``weight_sync: distributed`` (0 for the other modes).

    ``rollout.sglang.update_groups: stage`` (default): one per pipeline stage, its sender (the
    stage's dense owner) broadcasting the other expert owners' buckets too. ``owner``: one per
    trainer rank that owns exported tensors (`armor_megatron.megatron.weight_export`): per pipeline
    stage the dense owner, which is also expert-parallel rank 0's expert owner, and one expert
    owner per further expert-parallel rank. SGLang keeps every group (a dict by name), so each
    engine TP rank holds one communicator per group.
    """
    sg = cfg.rollout.sglang
    if sg.weight_sync != "distributed":
        return 0
    par = cfg.parallelism
    return par.pp * (par.ep if arch.num_experts and sg.update_groups == "owner" else 1)


def _engine_sizes(cfg: RunConfig, arch: ModelArch, dtype_bytes: int) -> dict[str, EngineSizes]:
    """Per GPU of an engine rank.

    Its weights (e·P/tp_per_engine), KV cache (the rest of ``mem_fraction_static``) and CUDA graphs;
    the reference role only when its group is launched.
    """
    sg = cfg.rollout.sglang
    static = sg.mem_fraction_static * cfg.launch.gpu_memory_gib * GIB
    weights = dtype_bytes * total_params(arch) / sg.tp_per_engine
    sizes = EngineSizes(weights=weights, kv_cache=max(static - weights, 0.0), cuda_graph=ENGINE_CUDA_GRAPH_GIB * GIB)
    return {"policy": sizes, **({"reference": sizes} if launched_reference_engines(cfg) else {})}


def plan_problem(cfg: RunConfig) -> str | None:
    """Why `cfg`'s layout does not fit its GPUs (one line), or None.

    It fits, it runs on CPUs (``launch.gpus_per_node: 0``), or its architecture is unknown here (no
    model.arch, no config.json). What ``--check``, ``armor-slurm submit`` and the example scripts
    refuse.
    """
    from armor_megatron.config.validate import model_arch_of

    if cfg.launch.gpus_per_node == 0:
        return None
    arch = model_arch_of(cfg)
    return None if arch is None else plan_memory(cfg, arch).problem()
