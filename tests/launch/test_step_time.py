"""The step-time model of ``--plan`` (launch/step_time.py) against hand-computed values."""

import math

import pytest

from armor_megatron.config import ConfigError
from armor_megatron.launch.memory import total_params
from armor_megatron.launch.step_time import (
    REFERENCE_DECODE_TOKENS_PER_S,
    REFERENCE_WEIGHTS_PER_TOKEN,
    Balance,
    Rates,
    Split,
    Workload,
    default_decode_rate,
    disaggregated_splits,
    generation_gpu_seconds,
    generation_seconds,
    main,
    overlap_ratio,
    plan_step_time,
    rates_of,
    step_time,
    train_seconds,
    weights_per_token,
    workload_of,
)
from armor_megatron.models.arch import ModelArch

LLAMA3 = dict(model_type="llama", vocab_size=128256, num_attention_heads=64, num_key_value_heads=8, rope_theta=5e5)


def test_off_and_one_step_by_hand():
    # generation 3 s, training 2 s, push 0.5 s: off runs them in a row, one_step overlaps the first two
    t = step_time(
        Workload(300.0, 0.0, False, 1e12, 2.0, 4e9, 1), Rates(50.0, 1e12, 8e9), Split(2, 0, 1, "disaggregated", "disk")
    )
    assert (t.generation, t.train, t.sync) == (3.0, 2.0, 0.5)
    assert t.off == 5.5 and t.one_step == 3.5 and t.ratio == pytest.approx(3.5 / 5.5)
    assert overlap_ratio(1.0, 1.0) == 0.5  # balanced, nothing to push: the best overlap can do
    assert overlap_ratio(1.0, 2.0) == pytest.approx(2 / 3)
    assert overlap_ratio(1.0, 3.0, 1.0) == pytest.approx(4 / 5)
    with pytest.raises(ValueError, match="must be >= 0"):
        overlap_ratio(-1.0, 1.0)


def test_generation_runs_anchors_then_policy_samples_on_their_groups():
    work = Workload(1500.0, 400.0, False, 0.0, 0.0, 0.0, 1)
    rates = Rates(100.0, 1.0, 1.0)
    assert generation_seconds(work, rates, policy_gpus=3, reference_gpus=2) == 1500 / 300 + 400 / 200
    swapped = Workload(1500.0, 400.0, True, 0.0, 0.0, 0.0, 3)  # anchors from π_ref pushed into the policy engines
    assert generation_seconds(swapped, rates, policy_gpus=3, reference_gpus=0) == 1900 / 300


def test_training_and_push_by_hand():
    work = Workload(0.0, 0.0, False, forward_flops=1e15, forward_passes=5.0, weight_bytes=2e9, syncs=3)
    rates = Rates(1.0, trainer_flops_per_s_per_gpu=1e14, sync_bytes_per_s=1e9)
    assert train_seconds(work, rates, trainer_gpus=4) == 5 * 1e15 / (4 * 1e14)
    assert step_time(work, rates, Split(1, 0, 4, "disaggregated", "distributed")).sync == 6.0


def test_balance_point_by_hand():
    # (√400 + √900)² / 10 = 250 GPU-seconds: the least E·t_gen over the groups' shares (E_r:E_p = 2:3)
    work = Workload(900.0, 400.0, False, 0.0, 0.0, 0.0, 1)
    rates = Rates(10.0, 1.0, 1.0)
    assert generation_gpu_seconds(work, rates) == 250.0
    assert generation_seconds(work, rates, 3, 2) * 5 == 250.0
    assert min(generation_seconds(work, rates, 5 - r, r) * 5 for r in (1, 3, 4)) > 250.0
    b = Balance(gpus=8, generation_gpu_s=30.0, train_gpu_s=10.0, sync=1.0)
    assert b.engine_gpus == 6.0  # 8·30/40: 30/6 = 10/2 = 5 s each
    assert b.one_step == 6.0
    assert b.off_engine_gpus == pytest.approx(8 * math.sqrt(30) / (math.sqrt(30) + math.sqrt(10)))
    assert b.off == pytest.approx((math.sqrt(30) + math.sqrt(10)) ** 2 / 8 + 1)


def test_default_decode_rate_is_sglangs_llama3_8b_figure_scaled_by_weights():
    llama70b = ModelArch.from_hf_config(dict(LLAMA3, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80))
    llama8b = ModelArch.from_hf_config(
        dict(LLAMA3, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32)
    )
    # per layer: q,k,v h·(nq + 2·nkv)·d, o nq·d·h, SwiGLU 3·h·f; plus the LM head h·V
    w8 = 32 * (4096 * 48 * 128 + 32 * 128 * 4096 + 3 * 4096 * 14336) + 4096 * 128256
    w70 = 80 * (8192 * 80 * 128 + 64 * 128 * 8192 + 3 * 8192 * 28672) + 8192 * 128256
    assert weights_per_token(llama8b) == w8 == REFERENCE_WEIGHTS_PER_TOKEN
    assert default_decode_rate(llama8b) == REFERENCE_DECODE_TOKENS_PER_S == 4000.0
    assert default_decode_rate(llama70b) == pytest.approx(4000.0 * w8 / w70)  # ≈ 432 tokens/s per GPU


TINY_GPU = (
    "rollout.engine=sglang",
    "launch.gpus_per_node=8",
    "model.dtype=bfloat16",
    "rollout.prompts_per_step=2",
    "rollout.group_size=4",
    "rollout.max_prompt_len=28",
    "rollout.max_response_len=100",
    "launch.step_time.response_len_fraction=0.5",
    "anchor.max_tries=3",
    "anchor.tries_per_request=1",
)


def test_workload_of_a_config_by_hand(load):
    cfg = load("tiny_cpu", *TINY_GPU)
    arch = ModelArch.from_hf_config(cfg.model.arch)
    work = workload_of(cfg, arch)
    # P=2, G=4, L = 0.5·100 = 50: (G − 1)·P·L on-policy, a·P·L = 3·2·50 from the reference group
    assert (work.policy_tokens, work.anchor_tokens, work.anchors_on_policy) == (300.0, 300.0, False)
    # s = 28 + 50 = 78. tiny arch: h 64, V 64, f 128, 2 layers, 4 q heads, 2 kv heads, d 16:
    # W = 2·(64·8·16 + 4·16·64 + 3·64·128) + 64·64 = 77824; scores 2 layers · 39 keys · 4 heads · 32
    f78 = 6 * 77824 + 6 * 2 * 39 * 4 * 32
    assert work.forward_flops == 2 * 4 * 78 * f78 / 3
    assert work.forward_passes == 5.0  # π_old + π_ref (alpha < 1) + 3 for one epoch's update
    assert work.weight_bytes == 2 * total_params(arch) and work.syncs == 1
    ppo = workload_of(load("tiny_cpu_ppo", *TINY_GPU), arch)
    assert ppo.forward_passes == 9.0  # + the critic's values forward and its update
    assert workload_of(load("tiny_cpu", *TINY_GPU, "anchor.source=swap"), arch).syncs == 3
    no_anchor = workload_of(load("tiny_cpu", *TINY_GPU, "anchor.enabled=false"), arch)
    assert (no_anchor.policy_tokens, no_anchor.anchor_tokens) == (400.0, 0.0)


def test_the_suggested_split_is_the_least_one_step_time_by_hand(load):
    # rates chosen so that, by hand: r = 10 tokens/s, B = 5·forward_flops / R = 120 GPU-seconds, push 1 s
    forward_flops = 2 * 4 * 78 * (6 * 77824 + 6 * 2 * 39 * 4 * 32) / 3
    peak_tflops = 5 * forward_flops / 120 / 1e12
    cfg = load(
        "tiny_cpu",
        *TINY_GPU,
        "launch.step_time.decode_tokens_per_s_per_gpu=10",
        "launch.step_time.mfu=1",
        f"launch.gpu_peak_tflops={peak_tflops!r}",
        "launch.step_time.sync_gb_per_s=0.0001568",  # 2·78400 bytes of weights in 1 s
    )
    arch = ModelArch.from_hf_config(cfg.model.arch)
    plan = plan_step_time(cfg, arch)
    # as configured: colocated, 1 policy + 1 reference engine of one GPU, 8 trainer GPUs:
    # t_gen = 300/10 + 300/10 = 60, t_train = 120/8 = 15, off = 76
    conf = plan.configured
    assert (conf.split.engine_gpus, conf.split.trainer_gpus, conf.split.placement) == (2, 8, "colocated")
    assert (conf.time.generation, conf.time.train, conf.time.sync) == pytest.approx((60.0, 15.0, 1.0))
    # splits (n_p, n_r | T): (1,1|6) gen 60 train 20 -> one_step 61; (2,2|4) 30 / 30 -> 31;
    # (1,3|4) and (3,1|4) 40 / 30 -> 41; E = 6 leaves T = 2: train 60 -> 61 or more
    best = plan.for_one_step
    assert (best.split.policy_gpus, best.split.reference_gpus, best.split.trainer_gpus) == (2, 2, 4)
    assert best.time.one_step == pytest.approx(31.0) and best.time.off == pytest.approx(61.0)
    assert plan.for_off.split == best.split
    # A = (√300 + √300)²/10 = 120 = B: E* = 4 of 8, one_step (120 + 120)/8 + 1
    assert plan.balance.engine_gpus == pytest.approx(4.0) and plan.balance.one_step == pytest.approx(31.0)
    table = plan.table()
    assert "| split for one_step, split for off (disaggregated, sync tensor) | 4 (2 + 2) | 4 | 30.0 | 30.0 |" in table
    assert "| as configured (colocated, sync tensor) | 2 (1 + 1) | 8 | 60.0 | 15.0 | 1.0 | 76.0 | - | - |" in table
    assert "4 trainer GPUs: one_step 31.0 s per step, 0.51 of off at that split\nto run it, add: " in table
    # the split as overrides: 2 policy and 2 reference engines of one GPU each, on their own GPUs
    assert table.endswith(
        "to run it, add: rollout.overlap=one_step algorithm.tis.enabled=true rollout.sglang.placement=disaggregated "
        "rollout.sglang.num_engines=2 launch.engine_gpus=4 anchor.reference_engines=2"
    )


def test_splits_are_the_layouts_the_launcher_accepts_and_that_fit(load):
    cfg = load("llama3_70b_armor")
    arch = ModelArch.from_hf_config(cfg.model.arch)
    splits = disaggregated_splits(cfg, arch)
    # tp·pp = 32 must divide the trainer GPUs of 64: only 32 are left to engines, in whole TP8 engines
    assert {(s.policy_gpus, s.reference_gpus, s.trainer_gpus) for s in splits} == {
        (24, 8, 32),
        (16, 16, 32),
        (8, 24, 32),
    }
    assert {s.weight_sync for s in splits} == {"distributed"}
    # engines on other nodes cannot take CUDA IPC handles: tensor is planned as distributed there
    two_nodes = load("qwen3_8b_base_two_stage", "rollout.sglang.weight_sync=tensor", "rollout.sglang.num_engines=3")
    assert {s.weight_sync for s in disaggregated_splits(two_nodes, arch_of(two_nodes))} == {"distributed"}


def arch_of(cfg):
    return ModelArch.from_hf_config(cfg.model.arch)


def test_rates_defaults_and_overrides(load):
    cfg = load("qwen3_8b_base_two_stage")
    arch = arch_of(cfg)
    default = rates_of(cfg, arch, "disk")
    assert default.sync_bytes_per_s == 2e9 and default.trainer_flops_per_s_per_gpu == pytest.approx(989e12 * 0.35)
    assert rates_of(cfg, arch, "distributed").sync_bytes_per_s == 25e9
    cfg = load(
        "qwen3_8b_base_two_stage", "launch.gpu_peak_tflops=400", "launch.step_time.decode_tokens_per_s_per_gpu=900"
    )
    assert rates_of(cfg, arch, "disk").trainer_flops_per_s_per_gpu == pytest.approx(400e12 * 0.35)
    assert rates_of(cfg, arch, "disk").decode_tokens_per_s_per_gpu == 900.0


def test_a_registered_sync_mode_without_a_default_bandwidth_asks_for_one(load):
    cfg = load("qwen3_8b_base_two_stage")
    with pytest.raises(ConfigError, match=r"^launch.step_time.sync_gb_per_s: no default bandwidth for .*'shm'"):
        rates_of(cfg, arch_of(cfg), "shm")
    cfg = load("qwen3_8b_base_two_stage", "launch.step_time.sync_gb_per_s=40")
    assert rates_of(cfg, arch_of(cfg), "shm").sync_bytes_per_s == 40e9


def test_no_model_without_launched_gpu_engines(load):
    cfg = load("tiny_cpu")
    assert plan_step_time(cfg, arch_of(cfg)) is None


def test_a_mean_response_under_one_token_is_refused_in_one_line(load):
    with pytest.raises(
        ConfigError, match=r"^launch.step_time.response_len_fraction: 0\.1 x rollout.max_response_len 8 is"
    ):
        load("tiny_cpu", "launch.step_time.response_len_fraction=0.1")  # 0.8 tokens
    assert load("tiny_cpu", "launch.step_time.response_len_fraction=0.125").launch.step_time.response_len_fraction


def test_cli_predicts_the_ratio_of_measured_phases(capsys):
    assert main(["--generation-s", "1.0", "--train-s", "2.0"]) == 0
    assert capsys.readouterr().out == "predicted off_s=3.0000 one_step_s=2.0000 step_time_ratio_overlap_vs_off=0.6667\n"
    with pytest.raises(SystemExit) as exit_:
        main(["--generation-s", "-1", "--train-s", "2"])
    assert exit_.value.code == 2 and "must be >= 0" in capsys.readouterr().err
