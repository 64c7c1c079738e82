import glob
import os

import pytest

from armor_megatron.config import ConfigError, load_config
from armor_megatron.config.load import deep_merge, parse_override

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SHIPPED = sorted(glob.glob(os.path.join(ROOT, "configs", "*.yaml")))


def test_all_shipped_configs_validate():
    assert len(SHIPPED) >= 5
    for path in SHIPPED:
        load_config(path)


def test_paper_settings_of_the_7b_recipe():
    cfg = load_config(os.path.join(ROOT, "configs", "qwen25_math_7b_dapo_armor.yaml"))
    assert cfg.rollout.group_size == 16 and cfg.algorithm.alpha == 0.9375
    assert cfg.reference.reset == "every" and cfg.reference.tau == 160
    assert cfg.anchor.max_tries == 4
    assert (cfg.algorithm.eps_low, cfg.algorithm.eps_high) == (0.2, 0.28)


def test_two_stage_recipe():
    cfg = load_config(os.path.join(ROOT, "configs", "qwen3_8b_base_two_stage.yaml"))
    assert (cfg.reference.reset, cfg.reference.tau, cfg.reference.stage_one_steps) == ("two_stage", 1, 180)


def test_overrides_are_typed_and_nested():
    cfg = load_config(
        os.path.join(ROOT, "configs", "tiny_cpu.yaml"),
        [
            "algorithm.alpha=0.875",
            "anchor.enabled=false",
            "eval.pass_k=[1]",
            "rollout.sglang.api_key=secret",
            "optimizer.lr=1e-4",
        ],
    )
    assert cfg.algorithm.alpha == 0.875 and cfg.anchor.enabled is False
    assert cfg.rollout.sglang.api_key == "secret"
    assert cfg.optimizer.lr == 1e-4  # YAML reads 1e-4 as a string; float fields accept it


def test_override_parsing():
    assert parse_override("a.b=1") == ("a.b", 1)
    assert parse_override("a=null") == ("a", None)
    assert parse_override("a=x=y") == ("a", "x=y")
    with pytest.raises(ConfigError, match="override must look like"):
        parse_override("alpha")


def test_extends_deep_merges(tmp_path):
    (tmp_path / "base.yaml").write_text(
        "algorithm: {alpha: 0.5, eps_low: 0.1}\nmodel: {path: m}\ndata: {train_path: d}\n"
    )
    (tmp_path / "run.yaml").write_text("extends: base.yaml\nalgorithm: {alpha: 0.75}\n")
    cfg = load_config(str(tmp_path / "run.yaml"))
    assert (cfg.algorithm.alpha, cfg.algorithm.eps_low) == (0.75, 0.1)
    assert deep_merge({"a": {"b": 1, "c": 2}}, {"a": {"b": 3}}) == {"a": {"b": 3, "c": 2}}


def test_model_dir_config_json_is_used_for_checks(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(
        '{"model_type": "llama", "vocab_size": 32, "hidden_size": 48, "intermediate_size": 64,'
        ' "num_hidden_layers": 3, "num_attention_heads": 6, "num_key_value_heads": 3}'
    )
    run = tmp_path / "run.yaml"
    run.write_text(
        f"model: {{path: {model}}}\ndata: {{train_path: d}}\nlaunch: {{gpus_per_node: 0}}\nrollout: {{engine: local}}\n"
    )
    load_config(str(run), ["parallelism.tp=3"])
    with pytest.raises(ConfigError, match=r"^parallelism\.tp: num_attention_heads=6 is not divisible by tp=4"):
        load_config(str(run), ["parallelism.tp=4"])
    with pytest.raises(ConfigError, match=r"^parallelism\.pp: num_layers=3 is not divisible by pp=2"):
        load_config(str(run), ["parallelism.pp=2"])


def test_ppo_config_builds_a_critic_section():
    cfg = load_config(os.path.join(ROOT, "configs", "tiny_cpu_ppo.yaml"))
    assert cfg.algorithm.estimator == "gae" and (cfg.algorithm.gamma, cfg.algorithm.lam) == (1.0, 0.95)
    assert cfg.critic.optimizer.lr == 1e-3 and cfg.critic.clip_eps == 0.5 and cfg.critic.whiten_advantages
    assert cfg.parallelism.tp == 2 and cfg.anchor.enabled  # the tiny run's layout and ARMOR settings
    unclipped = load_config(os.path.join(ROOT, "configs", "tiny_cpu_ppo.yaml"), ["critic.clip_eps=null"])
    assert unclipped.critic.clip_eps is None


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["algorithm.estimator=gae", "critic.warmup_steps=20"], "critic.warmup_steps: 20 leaves no actor update"),
        (
            ["algorithm.estimator=gae", "critic.optimizer.lr=1e-5", "critic.optimizer.min_lr=1e-4"],
            "critic.optimizer.min_lr: 0.0001 exceeds critic.optimizer.lr=1e-05",
        ),
        (["critic.clip_eps=-1"], "critic.clip_eps: -1.0 must be > 0"),
        (["critic.value_head_init_std=-0.1"], "critic.value_head_init_std: -0.1 is out of range"),
        (["critic.optimizer.lr=0"], "critic.optimizer.lr: 0.0 must be > 0"),
        (["critic.lr=1e-5"], "critic.lr: unknown key"),
    ],
)
def test_critic_settings_are_checked(overrides, message):
    with pytest.raises(ConfigError) as err:
        load_config(os.path.join(ROOT, "configs", "tiny_cpu.yaml"), overrides)
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_critic_checks_apply_only_with_gae():
    cfg = load_config(os.path.join(ROOT, "configs", "tiny_cpu.yaml"), ["critic.warmup_steps=20"])
    assert cfg.algorithm.estimator == "dapo"  # no critic is built, its warm-up cannot starve the actor


def test_model_dir_config_json_sizes_are_checked_before_a_model_is_built(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    run = tmp_path / "run.yaml"
    run.write_text(
        f"model: {{path: {model}}}\ndata: {{train_path: d}}\nlaunch: {{gpus_per_node: 0}}\nrollout: {{engine: local}}\n"
    )
    base = '"model_type": "llama", "vocab_size": 32, "hidden_size": 48, "intermediate_size": 64'
    (model / "config.json").write_text("{" + base + ', "num_hidden_layers": 3, "num_attention_heads": 0}')
    with pytest.raises(ConfigError, match=r"^model\.path: .*config\.json: num_attention_heads: 0 must be a positive"):
        load_config(str(run))
    (model / "config.json").write_text("{" + base + ', "num_hidden_layers": 3, "num_attention_heads": 6,')
    with pytest.raises(ConfigError, match=r"^model\.path: .*config\.json: unreadable"):
        load_config(str(run))


def test_to_dict_redacts_the_api_key_unless_asked_for_secrets():
    from armor_megatron.config import to_dict

    cfg = load_config(os.path.join(ROOT, "configs", "qwen25_math_7b_dapo_armor.yaml"), ["rollout.sglang.api_key=k1"])
    assert to_dict(cfg)["rollout"]["sglang"]["api_key"] == "<redacted>"
    assert to_dict(cfg, secrets=True)["rollout"]["sglang"]["api_key"] == "k1"
    assert to_dict(load_config(os.path.join(ROOT, "configs", "tiny_cpu.yaml")))["rollout"]["sglang"]["api_key"] is None


def test_a_sample_metrics_hook_that_does_not_import_is_refused_in_one_line():
    worked = os.path.join(ROOT, "configs", "tiny_overopt_worked.yaml")
    assert load_config(worked).logging.sample_metrics == "armor_megatron.tasks.worked_addition:mode_metrics"
    with pytest.raises(ConfigError, match=r"^logging\.sample_metrics: cannot load 'nope\.mod:fn'") as err:
        load_config(worked, ["logging.sample_metrics=nope.mod:fn"])
    assert "\n" not in str(err.value)


def test_the_engine_key_from_the_environment_is_the_key(monkeypatch):
    """How the SLURM plan and the torchrun relaunch hand ranks the key: never on their command lines."""
    seven_b = os.path.join(ROOT, "configs", "qwen25_math_7b_dapo_armor.yaml")
    monkeypatch.setenv("ARMOR_ENGINE_API_KEY", "from-env")
    assert load_config(seven_b, ["rollout.sglang.api_key=stale"]).rollout.sglang.api_key == "from-env"
    monkeypatch.delenv("ARMOR_ENGINE_API_KEY")
    assert load_config(seven_b).rollout.sglang.api_key is None


@pytest.mark.parametrize(
    "text, masked",
    [
        ("https://user:s3cret@host:8000/x", "https://user:***@host:8000/x"),
        ("see http://a:b@h and ftp://c:d@e", "see http://a:***@h and ftp://c:***@e"),
        ("http://host:30000/generate", "http://host:30000/generate"),  # a port is not a password
        ("https://token@host", "https://token@host"),
        ("/data/a:b@c.jsonl", "/data/a:b@c.jsonl"),
    ],
)
def test_passwords_in_urls_are_masked(text, masked):
    from armor_megatron.config.typed import mask_url_passwords

    assert mask_url_passwords(text) == masked


def test_reward_remote_registers_the_remote_verifier_and_checks_its_keys(monkeypatch):
    from armor_megatron.rewards.registry import registered_verifiers
    from armor_megatron.rewards.remote import configure_remote_judge

    tiny = os.path.join(ROOT, "configs", "tiny_cpu.yaml")
    with pytest.raises(ConfigError, match="reward.verifier: verifier 'remote' is the judge at reward.remote.url"):
        load_config(tiny, ["reward.verifier=remote"])
    for key, value, message in [
        ("url", "judge:8000", "is not an http:// or https:// URL"),
        ("api_key_env", "sk-abc123", "is not an environment variable's name"),
        ("concurrency", "0", "must be >= 1"),
    ]:
        with pytest.raises(ConfigError, match=f"reward.remote.{key}: .*{message}"):
            load_config(tiny, [f"reward.remote.{key}={value}"])
    monkeypatch.delenv("ARMOR_TEST_JUDGE_KEY", raising=False)
    remote = [
        "reward.verifier=remote",
        "reward.remote.url=http://judge:8000/",
        "reward.remote.api_key_env=ARMOR_TEST_JUDGE_KEY",
    ]
    try:
        with pytest.raises(ConfigError, match="reward.remote.api_key_env: environment variable ARMOR_TEST_JUDGE_KEY"):
            load_config(tiny, remote)
        monkeypatch.setenv("ARMOR_TEST_JUDGE_KEY", "k")
        cfg = load_config(tiny, remote)  # no request is made at load
        assert cfg.reward.remote.url == "http://judge:8000/" and "remote" in registered_verifiers()
    finally:
        configure_remote_judge(None)
