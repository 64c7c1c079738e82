"""``lora.*``: each bad value or layout the adapters cannot be built on gives exit 2 and one line naming
the key (``armor-train --check``); the supported ones pass."""

import pytest

from armor_megatron.cli.train import main
from tests.config.test_throughput_moe_keys import DEEPSEEK, MOE, SEVEN_B, TINY

ON = "lora.enabled=true"
TP1 = ("parallelism.tp=1", "parallelism.sp=false", "--no-plan")  # the MoE recipe at tp 1 (no sequence parallelism)
BAD = [
    (TINY, [ON, "lora.rank=0"], "lora.rank: 0 must be >= 1"),
    (TINY, [ON, "lora.alpha=0"], "lora.alpha: 0.0 must be > 0"),
    (TINY, [ON, "lora.dropout=1.0"], "lora.dropout: 1.0 is out of range"),
    (TINY, [ON, "lora.target_modules=[q_proj]"], "lora.target_modules: 'q_proj' is not one of linear_qkv"),
    (TINY, [ON, "lora.target_modules=[]"], "lora.target_modules: must be a non-empty list"),
    (TINY, [ON, "lora.target_modules=[linear_qkv,linear_qkv]"], "lora.target_modules: lists a module twice"),
    (SEVEN_B, [ON, "model.spec=te"], "model.spec: lora needs the local layer spec"),
    (TINY, [ON, "parallelism.tp=2", "lora.dropout=0.1"], "lora.dropout: dropout > 0 needs tp = 1"),
    (MOE, [ON, "lora.target_modules=[linear_qkv]"], "parallelism.sp: lora does not support sequence parallelism"),
    (TINY, [ON, "reference.init_from=/somewhere"], "reference.init_from: with lora the reference is"),
    (TINY, [ON, "reference.offload=true"], "reference.offload: with lora the reference is the actor's own base"),
    (MOE, [ON, *TP1], "lora.target_modules: linear_fc1 of an MoE model is its experts"),
    (DEEPSEEK, [ON, "lora.target_modules=[linear_proj]", "--no-plan"], "lora.enabled: lora does not support MLA"),
    (TINY, [ON, "lora.sync=delta"], "lora.sync: 'delta' is not one of"),
    (TINY, ["lora.sync=adapter"], "lora.sync: adapter sends the adapters of lora.enabled: true, which is off"),
    (
        TINY,
        [ON, "lora.sync=adapter"],
        "lora.sync: adapter loads A and B into SGLang servers; rollout.engine is 'local'",
    ),
    (
        SEVEN_B,
        [
            ON,
            "model.spec=local",
            "parallelism.sp=false",
            "lora.sync=adapter",
            "rollout.partial.enabled=true",
            "anchor.enabled=false",
        ],
        "lora.sync: adapter does not work with rollout.partial",
    ),
]


@pytest.mark.parametrize("config, overrides, expected", BAD, ids=[" ".join(b[1]) for b in BAD])
def test_bad_lora_settings_exit_2_with_one_line_naming_the_key(config, overrides, expected, capsys):
    code = main(["--config", config, "--check", "--no-files", *overrides])
    out, err = capsys.readouterr()
    assert code == 2 and out == "", err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert expected in lines[0], lines[0]


GOOD = [
    (TINY, [ON]),
    (TINY, [ON, "lora.rank=8", "lora.alpha=16", "lora.target_modules=[linear_qkv,linear_proj]"]),
    (MOE, [ON, "lora.target_modules=[linear_qkv,linear_proj]", *TP1]),
    (SEVEN_B, [ON, "model.spec=local", "parallelism.sp=false", "lora.sync=adapter"]),
]


@pytest.mark.parametrize("config, overrides", GOOD, ids=[" ".join(g[1]) for g in GOOD])
def test_supported_lora_settings_pass(config, overrides, capsys):
    assert main(["--config", config, "--check", "--no-files", *overrides]) == 0, capsys.readouterr().err
