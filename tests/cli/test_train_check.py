"""``armor-train --check``: every malformed config gives exit 2 and one stderr line naming the key."""

import os
import subprocess
import sys

import pytest

from armor_megatron.cli.train import main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = os.path.join(ROOT, "configs", "tiny_cpu.yaml")
SEVEN_B = os.path.join(ROOT, "configs", "qwen25_math_7b_dapo_armor.yaml")
MOE = os.path.join(ROOT, "configs", "qwen3_30b_a3b_moe_armor.yaml")

# (config, overrides, text the single error line must contain — always the offending key)
MALFORMED = [
    (TINY, ["algorithm.alpha=1.5"], "algorithm.alpha: 1.5 is out of range, must be in (0, 1]"),
    (TINY, ["algorithm.alpha=0"], "algorithm.alpha: 0.0 is out of range"),
    (TINY, ["algorithm.alpha=-0.1"], "algorithm.alpha"),
    (TINY, ["algorithm.alpha=high"], "algorithm.alpha: expected a number"),
    (TINY, ["algorithm.eps_low=0"], "algorithm.eps_low"),
    (TINY, ["algorithm.eps_low=-0.2"], "algorithm.eps_low"),
    (TINY, ["algorithm.eps_high=0"], "algorithm.eps_high"),
    (TINY, ["algorithm.eps_high=0.1"], "algorithm.eps_high: 0.1 is below eps_low=0.2"),
    (TINY, ["algorithm.dual_clip_c=1.0"], "algorithm.dual_clip_c"),
    (TINY, ["algorithm.estimator=ppo2"], "algorithm.estimator: unknown advantage estimator 'ppo2'"),
    (TINY, ["algorithm.estimator=gae", "critic.warmup_steps=20"], "critic.warmup_steps: 20 leaves no actor update"),
    (TINY, ["critic.clip_eps=0"], "critic.clip_eps: 0.0 must be > 0"),
    (TINY, ["algorithm.loss_agg=token_mean"], "did you mean 'token-mean'?"),
    (TINY, ["algorithm.qae_quantile=1.2"], "algorithm.qae_quantile"),
    (TINY, ["algorithm.alpah=0.9"], "algorithm.alpah: unknown key (did you mean 'alpha'?)"),
    (TINY, ["algorithm.overlong.buffer_len=0"], "algorithm.overlong.buffer_len"),
    (
        TINY,
        ["algorithm.overlong.enabled=true", "algorithm.overlong.buffer_len=64"],
        "algorithm.overlong.buffer_len: 64 must be smaller",
    ),
    # the default buffer (4096) against a short limit: the message gives the override
    (
        TINY,
        ["algorithm.overlong.enabled=true", "algorithm.overlong.buffer_len=4096", "rollout.max_response_len=64"],
        "64: set algorithm.overlong.buffer_len=16 (DAPO shapes the last fifth to quarter of the limit) or "
        "algorithm.overlong.enabled=false",
    ),
    (TINY, ["rollout.group_size=1"], "rollout.group_size: 1 must be >= 2"),
    # prompt + response over the model's context (128 tokens for tiny, 4096 for Qwen2.5-Math-7B)
    (TINY, ["rollout.max_response_len=113"], "rollout.max_response_len: 113 + rollout.max_prompt_len=16 = 129"),
    (SEVEN_B, ["eval.max_response_len=8192"], "eval.max_response_len: 8192 + rollout.max_prompt_len=1024 = 9216"),
    (SEVEN_B, ["rollout.max_prompt_len=1025"], "rollout.max_response_len: 3072 + rollout.max_prompt_len=1025"),
    (TINY, ["rollout.group_size=4.5"], "rollout.group_size: expected an integer"),
    (TINY, ["rollout.group_size=true"], "rollout.group_size: expected an integer"),
    (TINY, ["rollout.temperature=0"], "rollout.temperature"),
    (TINY, ["rollout.top_p=1.5"], "rollout.top_p"),
    (TINY, ["rollout.top_k=0"], "rollout.top_k"),
    (TINY, ["rollout.engine=vllm"], "rollout.engine: unknown rollout engine 'vllm'; known: local, sglang"),
    (TINY, ["rollout.sglang.weight_sync=nccl"], "rollout.sglang.weight_sync"),
    (TINY, ["rollout.sglang.urls=[http://h:1]"], "rollout.sglang.urls: set, but rollout.engine is 'local'"),
    (TINY, ["rollout.sglang.urls=http://h:1"], "rollout.sglang.urls: expected a list"),
    (TINY, ["rollout.tempreature=0.7"], "did you mean 'temperature'?"),
    (TINY, ["anchor.max_tries=0"], "anchor.max_tries"),
    (TINY, ["anchor.tries_per_request=8"], "anchor.tries_per_request: 8 exceeds anchor.max_tries=4"),
    (TINY, ["anchor.enabled=yes please"], "anchor.enabled: expected true or false"),
    (TINY, ["anchor.source=shared"], "anchor.source"),
    (TINY, ["anchor.source=swap", "anchor.pregenerate=true"], "anchor.pregenerate: needs anchor.source 'separate'"),
    (
        TINY,
        ["rollout.engine=sglang", "rollout.sglang.placement=colocated", "anchor.pregenerate=true"],
        "anchor.pregenerate: colocated engines release their GPU memory",
    ),
    (TINY, ["reference.tau=0"], "reference.tau"),
    (TINY, ["reference.reset=sometimes"], "reference.reset"),
    (TINY, ["reference.reset=validation_hook"], "reference.validation_hook: required"),
    (
        TINY,
        ["reference.reset=validation_best", "eval.every_steps=0"],
        "reference.reset: 'validation_best' needs periodic evaluation",
    ),
    (TINY, ["parallelism.tp=0"], "parallelism.tp: 0 must be >= 1"),
    (TINY, ["parallelism.tp=3"], "parallelism.tp: num_attention_heads=4 is not divisible by tp=3"),
    (TINY, ["parallelism.tp=4"], "parallelism.tp: num_key_value_heads=2 is not divisible by tp=4"),
    (TINY, ["parallelism.pp=3"], "parallelism.pp: num_layers=2 is not divisible by pp=3"),
    (TINY, ["parallelism.ep=2"], "parallelism.ep: ep=2 needs a MoE model"),
    (TINY, ["parallelism.sp=true", "parallelism.tp=1"], "parallelism.sp: sequence parallelism needs tp > 1"),
    (TINY, ["parallelism.vpp=2"], "parallelism.vpp: virtual pipeline chunks need pp > 1"),
    (
        SEVEN_B,
        ["parallelism.tp=7", "launch.gpus_per_node=7"],
        "parallelism.tp: num_key_value_heads=4 is not divisible by tp=7",
    ),
    (
        SEVEN_B,
        ["parallelism.tp=8", "parallelism.pp=2", "launch.gpus_per_node=4"],
        "parallelism.tp: tp·pp=16 does not divide the 4 trainer GPUs",
    ),
    # context parallelism is not offered: the trainer does not split sequences over ranks
    (TINY, ["parallelism.cp=2"], "parallelism.cp: unknown key"),
    (MOE, ["parallelism.sp=false"], "parallelism.sp: MoE training with tp > 1 needs sequence parallelism"),
    (MOE, ["parallelism.ep=3"], "parallelism.ep"),
    (TINY, ["optimizer.lr=0"], "optimizer.lr: 0.0 must be > 0"),
    (TINY, ["optimizer.lr=fast"], "optimizer.lr: expected a number"),
    (TINY, ["optimizer.lr_schedule=step"], "optimizer.lr_schedule"),
    (TINY, ["optimizer.skip_grad_norm_ratio=1"], "optimizer.skip_grad_norm_ratio"),
    (TINY, ["train.steps=0"], "train.steps"),
    (TINY, ["train.mini_batches_per_step=5"], "train.mini_batches_per_step: 5 does not divide the 128 samples"),
    (TINY, ["train.micro_batch_size=0"], "train.micro_batch_size"),
    (TINY, ["eval.pass_k=[1,4]"], "eval.datasets[0].k: 1 samples cannot give pass@4"),
    (TINY, ["eval.datasets=[{name: x}]"], "eval.datasets[0].path: required key is missing"),
    (TINY, ["eval.datasets=oops"], "eval.datasets: expected a list"),
    (TINY, ["checkpoint.keep_last=0"], "checkpoint.keep_last"),
    (TINY, ["logging=3"], "logging: expected a mapping"),
    (TINY, ["model.path="], "model.path: must not be empty"),
    (TINY, ["model.dtype=fp8"], "model.dtype"),
    (TINY, ["model.arch.model_type=gpt2"], "model: unsupported architecture 'gpt2'"),
    (TINY, ["launch.engine_gpus=8", "launch.gpus_per_node=8"], "launch.engine_gpus: 8 leaves no GPU"),
    (TINY, ["reward.workers=0"], "reward.workers"),
    (TINY, ["launch.requeue_exit_code=2"], "launch.requeue_exit_code: 2 is out of range, must be in [3, 127]"),
    (TINY, ["launch.requeue_exit_code=143"], "launch.requeue_exit_code: 143 is out of range"),
    (TINY, ["anchor.temperature=0.7"], "anchor.temperature: 0.7 differs from rollout.temperature=1.0"),
    (TINY, ["algorithm.estimator=grpoo"], "algorithm.estimator: unknown advantage estimator 'grpoo'; known: grpo"),
    (TINY, ["algorithm.policy_loss=ppo"], "algorithm.policy_loss: unknown policy loss 'ppo'; known: armor"),
    (TINY, ["algorithm.tis.cap=0"], "algorithm.tis.cap"),
    (
        TINY,
        ["train.recompute=full", "train.recompute_num_layers=3"],
        "train.recompute_num_layers: 3 does not divide the 2 layers of a pipeline chunk",
    ),
    (
        TINY,
        ["stability.min_history=50", "stability.window=10"],
        "stability.min_history: 50 exceeds stability.window=10",
    ),
    (TINY, ["stability.max_rollbacks=1"], "stability.max_rollbacks: rolling back"),
    (TINY, ["algorithm.alpha.value=1"], "algorithm.alpha: is a value, not a section"),
    (TINY, ["no_equals_sign"], "no_equals_sign: override must look like section.key=value"),
    (TINY, ["rollout_cfg.x=1"], "rollout_cfg: unknown key (did you mean 'rollout'?)"),
    # numbers that are not numbers
    (TINY, ["algorithm.alpha=.nan"], "algorithm.alpha: nan is not a finite number"),
    (TINY, ["optimizer.lr=.inf"], "optimizer.lr: inf is not a finite number"),
    (TINY, ["optimizer.lr=-.inf"], "optimizer.lr: -inf is not a finite number"),
    (TINY, ["algorithm.eps_high=nan"], "algorithm.eps_high: 'nan' is not a finite number"),
    # model sizes the model would be built from (a ModelArch divides by them)
    (TINY, ["model.arch.num_attention_heads=0"], "model.arch.num_attention_heads: 0 must be a positive integer"),
    (TINY, ["model.arch.num_hidden_layers=0"], "model.arch.num_hidden_layers: 0 must be a positive integer"),
    (TINY, ["model.arch.hidden_size=-64"], "model.arch.hidden_size: -64 must be a positive integer"),
    (TINY, ["model.arch.vocab_size=6.4"], "model.arch.vocab_size: 6.4 must be a positive integer"),
    (
        TINY,
        ["model.arch.num_key_value_heads=3"],
        "model.arch.num_key_value_heads: 3 does not divide num_attention_heads=4",
    ),
    (
        TINY,
        ["model.arch.num_attention_heads=3"],
        "model.arch.num_key_value_heads: 2 does not divide num_attention_heads=3",
    ),
    (TINY, ["model.arch.rms_norm_eps=0"], "model.arch.rms_norm_eps: 0 must be a positive finite number"),
    # user code named by the config
    (TINY, ["reward.verifier=maths"], "reward.verifier: unknown verifier 'maths'; did you mean 'math'?"),
    (TINY, ["reward.verifier=no_such_pkg.rewards:judge"], "reward.verifier: verifier spec 'no_such_pkg.rewards:judge'"),
    (
        TINY,
        ["reward.verifier=os.path:no_such_fn"],
        "reward.verifier: verifier spec 'os.path:no_such_fn': module 'os.path'",
    ),
    (
        TINY,
        ["reference.reset=validation_hook", "reference.validation_hook=no_such_pkg:hook"],
        "reference.validation_hook: cannot load 'no_such_pkg:hook'",
    ),
    (
        TINY,
        ["reference.reset=validation_hook", "reference.validation_hook=no_colon"],
        "reference.validation_hook: expected 'module:function'",
    ),
    # conflicts the SLURM launcher used to refuse only when the job started
    (
        SEVEN_B,
        ["anchor.source=swap", "anchor.reference_urls=[http://h:1]"],
        "anchor.reference_urls: set, but anchor.source is 'swap'",
    ),
    (SEVEN_B, ["rollout.sglang.weight_sync=distributed"], "rollout.sglang.weight_sync: distributed puts the driver"),
    (
        SEVEN_B,
        ["rollout.sglang.num_engines=8", "rollout.sglang.tp_per_engine=2"],
        "rollout.sglang.num_engines: 9 engines (8 policy + 1 reference) x tp_per_engine 2 need 18 GPUs, the job has 8",
    ),
    (
        SEVEN_B,
        ["rollout.sglang.tp_per_engine=3"],
        "rollout.sglang.tp_per_engine: 3 does not divide launch.gpus_per_node=8",
    ),
    (
        SEVEN_B,
        ["rollout.sglang.placement=disaggregated", "launch.engine_gpus=2"],
        "launch.engine_gpus: 2, but disaggregated engines need 4 (3 policy + 1 reference) x tp_per_engine 2 = 8",
    ),
    (TINY, ["rollout.engine=sglang"], "rollout.engine: sglang launches engines on GPUs, but launch.gpus_per_node=0"),
    # engines reachable from the whole network need a key, or an explicit opt-out
    (SEVEN_B, ["rollout.sglang.host=0.0.0.0"], "rollout.sglang.host: 0.0.0.0 exposes the engines"),
    (
        SEVEN_B,
        ["rollout.sglang.router.enabled=true", "rollout.sglang.router.host=0.0.0.0"],
        "rollout.sglang.router.host: 0.0.0.0 exposes the routers",
    ),
    # a packed micro-batch holds whole rows
    (
        SEVEN_B,
        ["train.max_tokens_per_micro_batch=4000"],
        "train.max_tokens_per_micro_batch: 4000 tokens cannot hold a row of rollout.max_prompt_len + "
        "rollout.max_response_len = 4096 tokens",
    ),
    (
        SEVEN_B,
        ["train.max_tokens_per_micro_batch=null", "train.forward_max_tokens_per_micro_batch=9000"],
        "train.forward_max_tokens_per_micro_batch: needs train.max_tokens_per_micro_batch",
    ),
    (SEVEN_B, ["train.max_tokens_per_micro_batch=0"], "train.max_tokens_per_micro_batch: 0 must be >= 1 or null"),
    # the run's name becomes a directory under checkpoints/ and logging.dir: it may not leave them
    (TINY, ["name=../../.."], "name: must be a plain name (no '/', not '.' or '..')"),
    (TINY, ["name=a/b"], "name: must be a plain name"),
    (TINY, ["name=.."], "name: must be a plain name"),
]


@pytest.mark.parametrize("config, overrides, expected", MALFORMED, ids=[" ".join(m[1]) for m in MALFORMED])
def test_malformed_config_exits_2_with_one_line_naming_the_key(config, overrides, expected, capsys):
    assert main(["--config", config, "--check", *overrides]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert expected in lines[0]


def test_malformed_files(tmp_path, capsys):
    cases = {
        "missing.yaml": None,
        "bad_yaml.yaml": "model: {path: x\n",
        "list.yaml": "- 1\n- 2\n",
        "no_model.yaml": "data: {train_path: d}\n",
        "no_data.yaml": "model: {path: m}\n",
        "loop.yaml": "extends: loop.yaml\n",
        "latin1.yaml": "# a comment\nname: caf\xe9\n",
        "a_directory.yaml": "",
    }
    expected = {
        "missing.yaml": "config file not found",
        "bad_yaml.yaml": "invalid YAML",
        "list.yaml": "top level must be a mapping",
        "no_model.yaml": "model: required key is missing",
        "no_data.yaml": "data: required key is missing",
        "loop.yaml": "extends: circular extends",
        "latin1.yaml": "latin1.yaml line 2: not UTF-8 text (byte 0xe9)",
        "a_directory.yaml": "a_directory.yaml is a directory, not a YAML config file",
    }
    for name, text in cases.items():
        path = tmp_path / name
        if name == "a_directory.yaml":
            path.mkdir()
        elif text is not None:
            path.write_bytes(text.encode("latin-1"))
        assert main(["--config", str(path), "--check"]) == 2, name
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and expected[name] in err[0], (name, err)


def test_check_prints_its_ok_line_and_print_config_the_resolved_config(capsys):
    assert main(["--config", TINY, "--check", "--no-files", "algorithm.alpha=0.875"]) == 0
    out, err = capsys.readouterr()
    assert out == "" and err.endswith(
        f"armor-train: config OK ({TINY}); every key: docs/config.md, armor-train --explain KEY\n"
    )
    assert main(["--config", TINY, "--print-config", "--no-files", "algorithm.alpha=0.875"]) == 0
    out, err = capsys.readouterr()
    assert "alpha: 0.875" in out and "group_size: 8" in out and "config OK" in err


def test_console_process_has_no_traceback(tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.run(
        [sys.executable, "-m", "armor_megatron.cli.train", "--config", TINY, "--check", "algorithm.alpha=2"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        "armor-train: error: config: algorithm.alpha: 2.0 is out of range, must be in (0, 1] "
        "(armor-train --explain algorithm.alpha)"
    )
    proc = subprocess.run(
        [sys.executable, "-m", "armor_megatron.cli.train"], capture_output=True, text=True, env=env, timeout=120
    )
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1 and "--config" in proc.stderr


def test_check_redacts_the_engine_api_key(capsys):
    assert (
        main(
            [
                "--config",
                SEVEN_B,
                "--print-config",
                "--no-files",
                "rollout.sglang.api_key=s3cret",
                "rollout.sglang.host=0.0.0.0",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "s3cret" not in out and "api_key: <redacted>" in out


def test_check_accepts_all_interfaces_when_explicitly_allowed(capsys):
    assert (
        main(
            [
                "--config",
                SEVEN_B,
                "--check",
                "--no-files",
                "rollout.sglang.host=0.0.0.0",
                "rollout.sglang.allow_unauthenticated=true",
            ]
        )
        == 0
    )


def test_check_looks_at_the_files_unless_told_not_to(tmp_path, capsys):
    missing = str(tmp_path / "nowhere")
    assert main(["--config", TINY, "--check", f"model.path={missing}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "model.path" in err[0] and "nowhere" in err[0]
    assert main(["--config", TINY, "--check", "--no-files", f"model.path={missing}"]) == 0


def test_explain_prints_one_keys_entry_without_a_config(capsys):
    assert main(["--explain", "algorithm.alpha"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "algorithm.alpha" and "  default:  0.9375" in out and "  accepted: (0, 1]" in out
    assert main(["--explain", "eval.datasets[0].k"]) == 0 and "samples per prompt" in capsys.readouterr().out
    assert main(["--explain", "algorithm.tis"]) == 0 and "algorithm.tis.cap: float" in capsys.readouterr().out
    assert main(["--explain", "algorithm.alpah"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["armor-train: error: explain: algorithm.alpah: not a config key (did you mean 'algorithm.alpha'?)"]


def test_check_masks_passwords_in_urls(capsys):
    urls = '["https://alice:pa55@engines.example:30000/v1","http://127.0.0.1:30001"]'
    assert main(["--config", SEVEN_B, "--check", "--print-config", "--no-files", f"rollout.sglang.urls={urls}"]) == 0
    out = capsys.readouterr().out
    assert "pa55" not in out and "https://alice:***@engines.example:30000/v1" in out and "http://127.0.0.1:30001" in out


def test_the_relaunch_under_torchrun_hands_ranks_the_key_by_environment(monkeypatch):
    """Ranks started by ``armor-train``'s own relaunch show their command lines in ``ps`` too."""
    import armor_megatron.cli.train as train_cli

    for var in train_cli.LAUNCHER_VARS + ("ARMOR_ENGINE_API_KEY",):
        monkeypatch.delenv(var, raising=False)
    started = {}

    def relaunch(argv, nprocs, requeue_code):
        started.update(argv=argv, nprocs=nprocs, key=os.environ.get("ARMOR_ENGINE_API_KEY"))
        return 0

    monkeypatch.setattr(train_cli, "relaunch_under_torchrun", relaunch)
    assert main(["--config", TINY, "--no-files", "rollout.sglang.api_key=s3cret", "train.steps=1"]) == 0
    assert started["nprocs"] == 2 and started["key"] == "s3cret"
    assert started["argv"] == ["--config", TINY, "--no-files", "train.steps=1"]
    assert "ARMOR_ENGINE_API_KEY" not in os.environ  # set for the ranks only: later configs in this process load no key
