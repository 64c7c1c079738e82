"""``throughput.*`` and ``moe.*``: each bad value gives exit 2 and one line naming the key
(``armor-train --check``), and every recipe loads with its documented values."""

import os

import pytest

from armor_megatron.cli.train import main
from armor_megatron.config.load import load_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = os.path.join(ROOT, "configs", "tiny_cpu.yaml")  # dense, CPU run (gpus_per_node 0), local spec
SEVEN_B = os.path.join(ROOT, "configs", "qwen25_math_7b_dapo_armor.yaml")  # dense, 8 GPUs, spec auto
MOE = os.path.join(ROOT, "configs", "qwen3_30b_a3b_moe_armor.yaml")  # MoE, tp 2, ep 8
DEEPSEEK = os.path.join(ROOT, "configs", "deepseek_v2_lite_armor.yaml")  # MoE + MLA, ep 8
RECIPES = sorted(
    os.path.join(ROOT, "configs", f) for f in os.listdir(os.path.join(ROOT, "configs")) if f.endswith(".yaml")
)

BAD = [
    (TINY, ["throughput.gradient_accumulation_fusion=true"], "throughput.gradient_accumulation_fusion: needs CUDA"),
    (TINY, ["throughput.apply_rope_fusion=true"], "throughput.apply_rope_fusion: needs the Transformer Engine spec"),
    (
        TINY,
        ["throughput.bias_activation_fusion=true"],
        "throughput.bias_activation_fusion: needs the Transformer Engine",
    ),
    (TINY, ["throughput.bias_dropout_fusion=true"], "throughput.bias_dropout_fusion: needs the Transformer Engine"),
    (TINY, ["throughput.bias_dropout_fusion=null"], "throughput.bias_dropout_fusion: expected true or false"),
    (SEVEN_B, ["model.spec=local", "throughput.bias_dropout_fusion=true"], "but model.spec is local"),
    (TINY, ["throughput.overlap_grad_reduce=maybe"], "throughput.overlap_grad_reduce: expected true or false"),
    (
        TINY,
        ["throughput.overlap_param_gather=true"],
        "throughput.overlap_param_gather: needs the distributed optimizer",
    ),
    (
        SEVEN_B,
        ["throughput.overlap_param_gather=true", "throughput.overlap_grad_reduce=false"],
        "throughput.overlap_param_gather: needs throughput.overlap_grad_reduce: true",
    ),
    (SEVEN_B, ["throughput.overlap_param_gather=true"], "throughput.overlap_param_gather: not supported yet"),
    (DEEPSEEK, ["throughput.apply_rope_fusion=true"], "throughput.apply_rope_fusion: megatron's fused MLA RoPE"),
    (MOE, ["moe.aux_loss_coeff=-0.1"], "moe.aux_loss_coeff: -0.1 is out of range"),
    (MOE, ["moe.load_balancing_type=switch"], "moe.load_balancing_type: 'switch' is not one of"),
    (MOE, ["moe.load_balancing_type=sinkhorn"], "moe.load_balancing_type: sinkhorn routes differently"),
    (MOE, ["moe.token_dispatcher_type=broadcast"], "moe.token_dispatcher_type: 'broadcast' is not one of"),
    (MOE, ["moe.token_dispatcher_type=allgather"], "moe.token_dispatcher_type: allgather needs one token count"),
    (TINY, ["launch.gpus_per_node=0", "moe.token_dispatcher_type=flex"], None),  # dense: MoE keys ignored
    (MOE, ["moe.router_dtype=bf16"], "moe.router_dtype: 'bf16' is not one of"),
    (MOE, ["moe.expert_capacity_factor=0"], "moe.expert_capacity_factor: 0.0 must be > 0"),
    (MOE, ["moe.expert_capacity_factor=-1"], "moe.expert_capacity_factor: -1.0 must be > 0"),
    (MOE, ["moe.token_drop_policy=random"], "moe.token_drop_policy: 'random' is not one of"),
    (MOE, ["moe.pad_expert_input_to_capacity=true"], "moe.pad_expert_input_to_capacity: needs moe.expert_capacity"),
    (
        MOE,
        ["moe.token_dispatcher_type=flex", "moe.expert_capacity_factor=1.5", "moe.pad_expert_input_to_capacity=true"],
        "moe.pad_expert_input_to_capacity: is not supported by the flex",
    ),
    (
        MOE,
        [
            *("launch.gpus_per_node=0", "rollout.engine=local", "throughput.gradient_accumulation_fusion=false"),
            "moe.token_dispatcher_type=flex",
        ],
        "moe.token_dispatcher_type: flex needs DeepEP on GPUs, but launch.gpus_per_node=0",
    ),
]


@pytest.mark.parametrize("config, overrides, expected", BAD, ids=[" ".join(b[1]) for b in BAD])
def test_bad_values_exit_2_with_one_line_naming_the_key(config, overrides, expected, capsys):
    code = main(["--config", config, "--check", "--no-files", *overrides])
    out, err = capsys.readouterr()
    if expected is None:
        assert code == 0, err
        return
    assert code == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert expected in lines[0], lines[0]


GOOD = [
    (MOE, ["moe.expert_capacity_factor=1.25", "moe.token_drop_policy=position"]),
    (MOE, ["moe.expert_capacity_factor=1.0", "moe.pad_expert_input_to_capacity=true"]),
    (MOE, ["moe.router_dtype=fp64"]),
    (MOE, ["moe.router_dtype=null"]),
    (MOE, ["moe.load_balancing_type=global_aux_loss"]),  # coefficient 0: no loss added
    (MOE, ["moe.token_dispatcher_type=flex"]),  # DeepEP is looked for when the job starts, not here
    # a 30B MoE on one GPU per replica does not fit (the memory plan refuses it): only the keys are judged here
    (
        MOE,
        [
            *("parallelism.ep=1", "parallelism.tp=1", "parallelism.sp=false", "moe.token_dispatcher_type=allgather"),
            "--no-plan",
        ],
    ),
    (SEVEN_B, ["throughput.apply_rope_fusion=true", "throughput.bias_activation_fusion=false"]),
]


@pytest.mark.parametrize("config, overrides", GOOD, ids=[" ".join(g[1]) for g in GOOD])
def test_valid_settings_pass(config, overrides, capsys):
    assert main(["--config", config, "--check", "--no-files", *overrides]) == 0, capsys.readouterr().err


@pytest.mark.parametrize("path", RECIPES, ids=os.path.basename)
def test_every_recipe_checks_and_keeps_cpu_runs_off_gpu_kernels(path, capsys):
    assert main(["--config", path, "--check", "--no-files"]) == 0, capsys.readouterr().err
    cfg = load_config(path)
    th = cfg.throughput
    if cfg.launch.gpus_per_node == 0 or cfg.name == "gpu-check":  # gpu_check: a bare GPU image, no APEX / TE
        assert not th.overlap_grad_reduce
    else:
        assert th.overlap_grad_reduce and not th.overlap_param_gather
    # what an image installed from the lock files lacks: APEX, a C compiler, DeepEP
    assert not (th.gradient_accumulation_fusion or th.torch_compile or th.bias_dropout_fusion)
    assert th.apply_rope_fusion is th.bias_activation_fusion is None
    assert cfg.moe.token_dispatcher_type == "alltoall" and cfg.moe.router_dtype == "fp32"
    assert cfg.moe.aux_loss_coeff == 0.0 and cfg.moe.expert_capacity_factor is None
