"""``check_files``: what a config names on this machine, one ConfigError line naming the key and file."""

import json
import os

import pytest

from armor_megatron.config import ConfigError, load_config
from armor_megatron.config.files import check_files
from armor_megatron.config.identity import write_run_record

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = os.path.join(ROOT, "configs", "tiny_cpu.yaml")
HF_CONFIG = {"model_type": "qwen2", "vocab_size": 64, "hidden_size": 64, "intermediate_size": 128}
HF_CONFIG.update(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)


@pytest.fixture
def paths(tmp_path):
    """The overrides of a tiny run whose model directory and datasets exist."""
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps(HF_CONFIG))
    (tmp_path / "hf" / "model.safetensors").write_text("")  # existence is what --check looks at
    (tmp_path / "hf" / "tokenizer.json").write_text("{}")
    rows = "".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n" for i in range(20))
    (tmp_path / "train.jsonl").write_text(rows)
    (tmp_path / "val.jsonl").write_text(rows)
    paths = [
        f"model.path={tmp_path / 'hf'}",
        f"data.train_path={tmp_path / 'train.jsonl'}",
        f"eval.datasets=[{{name: val, path: {tmp_path / 'val.jsonl'}, k: 1}}]",
        f"checkpoint.dir={tmp_path / 'ckpt'}",
    ]
    return paths


@pytest.fixture
def run(paths):
    """``run(*overrides)`` -> the RunConfig of the tiny run of `paths`."""
    return lambda *overrides: load_config(TINY, [*paths, *overrides])


def _refused(cfg, expected: str) -> str:
    with pytest.raises(ConfigError) as err:
        check_files(cfg)
    line = str(err.value)
    assert expected in line and "\n" not in line, line
    return line


def test_a_complete_run_passes(run):
    check_files(run())


def test_output_directories_must_be_creatable(run, tmp_path):
    (tmp_path / "a_file").write_text("")
    _refused(
        run(f"checkpoint.dir={tmp_path / 'a_file' / 'ckpt'}"),
        f"checkpoint.dir: {tmp_path / 'a_file' / 'ckpt'}: {tmp_path / 'a_file'} is a file",
    )
    _refused(run(f"logging.dir={tmp_path / 'a_file'}"), "logging.dir: ")
    if os.geteuid() != 0:  # root writes anywhere
        (tmp_path / "locked").mkdir(mode=0o500)
        _refused(run(f"checkpoint.dir={tmp_path / 'locked' / 'c'}"), "which is not writable by this user")


def test_missing_paths_name_their_key(run, tmp_path):
    _refused(run(f"model.path={tmp_path / 'nope'}"), f"model.path: {tmp_path / 'nope'}: no such directory")
    (tmp_path / "empty").mkdir()
    _refused(run(f"model.path={tmp_path / 'empty'}"), "no config.json")
    _refused(
        run(f"model.mcore_path={tmp_path / 'mcore'}"), f"model.mcore_path: {tmp_path / 'mcore'}: no such directory"
    )
    os.remove(tmp_path / "hf" / "model.safetensors")  # the run would load model.path's weights itself
    _refused(run(), f"model.path: {tmp_path / 'hf'}: no safetensors weights (model.safetensors or")
    (tmp_path / "mcore").mkdir()
    check_files(run(f"model.mcore_path={tmp_path / 'mcore'}"))  # ... unless it starts from a torch_dist checkpoint
    (tmp_path / "hf" / "model.safetensors").write_text("")
    _refused(run(f"data.train_path={tmp_path / 'x.jsonl'}"), f"data.train_path: {tmp_path / 'x.jsonl'}: no such file")
    _refused(
        run(f"eval.datasets=[{{name: v, path: {tmp_path / 'v.parquet'}}}]"),
        f"eval.datasets[0].path: {tmp_path / 'v.parquet'}: no such file",
    )
    _refused(run(f"checkpoint.resume={tmp_path / 'iter_1'}"), "checkpoint.resume: ")
    os.remove(tmp_path / "hf" / "tokenizer.json")  # transformers would build an empty tokenizer
    _refused(run(), f"model.path: {tmp_path / 'hf'}: no tokenizer files (tokenizer.json, tokenizer.model, ")
    (tmp_path / "hf" / "tokenizer.model").write_text("")  # a SentencePiece model is a tokenizer too
    check_files(run())
    _refused(run(f"reference.init_from={tmp_path / 'best'}"), f"reference.init_from: {tmp_path / 'best'}: no such")


def test_checkpoint_resume_must_name_a_checkpoint(run, tmp_path):
    (tmp_path / "hf_copy").mkdir()  # a directory, but no checkpoint: the key is named, not a traceback at start
    line = _refused(run(f"checkpoint.resume={tmp_path / 'hf_copy'}"), f"checkpoint.resume: {tmp_path / 'hf_copy'}: ")
    assert "not a checkpoint (no metadata.json) nor a checkpoint directory of a run (no `latest` file)" in line
    (tmp_path / "hf_copy" / "metadata.json").write_text("{}")
    check_files(run(f"checkpoint.resume={tmp_path / 'hf_copy'}"))
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "latest").write_text("iter_0000001")
    check_files(run(f"checkpoint.resume={tmp_path / 'runs'}"))


@pytest.mark.parametrize(
    "content, expected",
    [
        ('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2=", "answer": \n', "train.jsonl:2: invalid JSON"),
        ('{"question": "1+1=", "answer": "2"}\n', "row 0 has no 'prompt' column (data.prompt_key; columns: answer"),
        ('{"prompt": "1+1=", "solution": "2"}\n', "row 0 has no 'answer' column (data.answer_key"),
        ('{"prompt": "1+1=", "answer": "2", "type": "maths"}\n', "row 0 type: unknown verifier 'maths'"),
        ('{"prompt": "1+1=", "answer": "2", "type": "nopkg:fn"}\n', "row 0 type: verifier 'nopkg:fn' is not allowed"),
        ("[1, 2]\n", "row 0 is list, not an object with columns"),
        ('{"prompt": "1+1=", "answer": null}\n', "row 0: ground truth None cannot be scored by verifier 'math'"),
        ('{"prompt": "1+1=", "answer": "B"}\n{"prompt": "?", "answer": "Z", "type": "multiple_choice"}\n', "row 1: "),
        ("\n\n", "dataset is empty"),
        (b'{"prompt": "caf\xe9", "answer": "2"}\n', "train.jsonl:1: not UTF-8 text"),
    ],
)
def test_the_first_rows_of_a_dataset_are_read(run, tmp_path, content, expected):
    path = tmp_path / "train.jsonl"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    line = _refused(run(), "data.train_path: ")
    assert expected in line


def test_every_rows_type_must_name_an_allowed_verifier_not_any_importable_function(run, tmp_path):
    # `builtins:exec` scored a response by running it as code; row 12 lies beyond the peeked rows
    rows = [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(20)]
    rows[12].update(type="builtins:exec", answer={})
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    line = _refused(run(), "data.train_path: ")
    assert f"{tmp_path / 'train.jsonl'}: row 12 type: verifier 'builtins:exec' is not allowed" in line
    rows[12].update(type="tests.rewards.user_verifiers:exact_match", answer="13")  # importable, not listed
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    _refused(run(), "row 12 type: verifier 'tests.rewards.user_verifiers:exact_match' is not allowed")
    check_files(run("reward.verifiers=[tests.rewards.user_verifiers:exact_match]"))  # listed by the config
    with pytest.raises(ConfigError, match=r"reward.verifiers\[0\]: verifier spec .* has no attribute 'nothing'"):
        run("reward.verifiers=[tests.rewards.user_verifiers:nothing]")  # each listed verifier must load


def test_parquet_rows_are_peeked(run, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"prompt": ["1+1="], "ans": ["2"]}), tmp_path / "train.parquet")
    _refused(run(f"data.train_path={tmp_path / 'train.parquet'}"), "row 0 has no 'answer' column")
    check_files(run(f"data.train_path={tmp_path / 'train.parquet'}", "data.answer_key=ans", "eval.datasets=[]"))
    (tmp_path / "bad.parquet").write_text("not parquet")
    _refused(run(f"data.train_path={tmp_path / 'bad.parquet'}"), "not a readable Parquet file")


def test_optional_packages_turned_on_must_be_installed(run, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name in ("tensorboard", "wandb") else real(name, *a)
    )
    _refused(run("logging.tensorboard=true"), "logging.tensorboard: true, but the tensorboard package is not installed")
    _refused(run("logging.wandb.project=p"), "logging.wandb.project: set, but the wandb package is not installed")


def test_another_runs_checkpoint_directory_is_refused(run):
    first = run()
    write_run_record(first)
    os.makedirs(os.path.join(first.checkpoint.dir, "iter_0000005"))
    _refused(run("name=other"), "checkpoint.dir: ")
    check_files(run("name=other", "checkpoint.resume=force"))


def test_a_verl_parquet_passes_with_its_nested_answer_key(run, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    row = {"data_source": "math_dapo", "prompt": [{"role": "user", "content": "1+1="}]}
    row["reward_model"] = {"style": "rule", "ground_truth": "2"}
    pq.write_table(pa.Table.from_pylist([row]), tmp_path / "verl.parquet")
    verl = [f"data.train_path={tmp_path / 'verl.parquet'}", "eval.datasets=[]"]
    _refused(run(*verl), "row 0 has no 'answer' column (data.answer_key")
    check_files(run(*verl, "data.answer_key=reward_model.ground_truth"))


def test_check_calls_a_verl_compute_score_with_the_first_rows_real_fields(run, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [
        {"data_source": source, "prompt": "1+1=", "reward_model": {"ground_truth": "2"}, "extra_info": {"index": i}}
        for i, source in enumerate(["openai/gsm8k", "openai/gsm8k", "lighteval/MATH"])
    ]
    pq.write_table(pa.Table.from_pylist(rows[:2]), tmp_path / "gsm8k.parquet")
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "mixed.parquet")
    verl = ["reward.verifier=tests.rewards.row_verifiers:compute_score", "data.answer_key=reward_model.ground_truth"]
    check_files(run(*verl, f"data.train_path={tmp_path / 'gsm8k.parquet'}", "eval.datasets=[]"))
    line = _refused(run(*verl, f"data.train_path={tmp_path / 'mixed.parquet'}", "eval.datasets=[]"), "row 2: ")
    assert "raised NotImplementedError on a response stating the ground truth '2'" in line, line
    assert "data_source='lighteval/MATH'" in line, line


def test_check_calls_the_remote_judge_on_the_first_rows(run):
    import socket

    from armor_megatron.rewards.remote import configure_remote_judge

    with socket.socket() as closed:  # a port nothing listens on: the judge is down
        closed.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{closed.getsockname()[1]}/"
    try:
        cfg = run("reward.verifier=remote", f"reward.remote.url={url}", "reward.remote.retries=0")
        line = _refused(cfg, "reward.remote: ")  # the judge's section to fix, not the dataset
        assert line.startswith(f"reward.remote: remote judge {url} failed 1 attempt (reward.remote.retries=0): "), line
        assert "on a response stating the ground truth '1'" in line and "train.jsonl row 0)" in line, line
    finally:
        configure_remote_judge(None)


def _write_verifier_module(tmp_path, name: str, body: str) -> str:
    (tmp_path / f"{name}.py").write_text(f"def judge(response, ground_truth):\n    {body}\n")
    return f"reward.verifier={name}:judge"


@pytest.mark.parametrize(
    "body, expected",
    [
        ('return "yes"', "returned str 'yes'; expected RewardResult, a number, or a dict with a 'score' key"),
        ("return {'correct': 1.0}", "returned dict {'correct': 1.0}; expected RewardResult"),
        ("return {'score': float('inf')}", "returned {'score': inf}: RewardResult.score must be finite"),
        ("return None", "returned NoneType None"),
        ("return 1 / 0", "raised ZeroDivisionError on a response stating the ground truth '1': division by zero"),
    ],
    ids=["str", "no_score", "inf", "none", "raises"],
)
def test_a_user_verifier_is_called_on_the_first_ground_truths(run, tmp_path, body, expected):
    name = f"rm_{tmp_path.name}"  # one module name per case: imported modules stay in sys.modules
    line = _refused(
        run(_write_verifier_module(tmp_path, name, body), f"reward.python_path=[{tmp_path}]"), "data.train_path: "
    )
    assert f"row 0: verifier '{name}:judge' " in line and expected in line, line


def test_a_user_verifier_must_score_a_response_without_an_answer(run, tmp_path):
    """Early responses state no answer; a verifier returning None for them is found by --check, not at step 1."""
    name = f"rm_{tmp_path.name}"
    body = 'return 1.0 if "boxed" in response else None'
    line = _refused(
        run(_write_verifier_module(tmp_path, name, body), f"reward.python_path=[{tmp_path}]"), "data.train_path: "
    )
    assert f"row 0: verifier '{name}:judge' returned NoneType None" in line, line
    assert "on the response 'I cannot solve this.', which states no answer" in line, line
    assert "a verifier returns a reward, e.g. 0, for every response" in line, line


def test_user_modules_are_found_beside_the_config_or_in_reward_python_path(tmp_path):
    rows = "".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n" for i in range(3))
    (tmp_path / "train.jsonl").write_text(rows)
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps(HF_CONFIG))
    (tmp_path / "hf" / "model.safetensors").write_text("")
    (tmp_path / "hf" / "tokenizer.json").write_text("{}")
    config = tmp_path / "run.yaml"
    config.write_text(
        f"extends: {TINY}\nmodel: {{path: hf}}\ndata: {{train_path: {tmp_path / 'train.jsonl'}}}\n"
        f"eval: {{datasets: []}}\ncheckpoint: {{dir: {tmp_path / 'ckpt'}}}\n"
    )
    beside = _write_verifier_module(tmp_path, "beside_the_config_rm", "return float(response == ground_truth)")
    (tmp_path / "lib").mkdir()
    elsewhere = _write_verifier_module(tmp_path / "lib", "in_python_path_rm", "return 1.0")
    cfg = load_config(str(config), [beside, f"model.path={tmp_path / 'hf'}"])
    check_files(cfg)
    assert cfg.reward.python_path == [str(tmp_path)]
    with pytest.raises(
        ConfigError, match=r"reward.verifier: .*No module named 'in_python_path_rm'.*reward.python_path"
    ):
        load_config(str(config), [elsewhere, f"model.path={tmp_path / 'hf'}"])
    cfg = load_config(str(config), [elsewhere, "reward.python_path=[lib]", f"model.path={tmp_path / 'hf'}"])
    assert cfg.reward.python_path == [str(tmp_path / "lib")]
    check_files(cfg)


def test_an_eval_set_may_name_its_own_columns(run, tmp_path):
    (tmp_path / "math500.jsonl").write_text(json.dumps({"problem": "1+1=", "answer": "2"}) + "\n")
    verl = tmp_path / "verl.jsonl"
    verl.write_text(json.dumps({"prompt": "2+2=", "reward_model": {"ground_truth": "4"}}) + "\n")
    common = [f"data.train_path={verl}", "data.answer_key=reward_model.ground_truth"]
    line = _refused(
        run(*common, f"eval.datasets=[{{name: m, path: {tmp_path / 'math500.jsonl'}}}]"),
        "eval.datasets[0].path: ",
    )
    assert (
        "row 0 has no 'prompt' column (data.prompt_key or eval.datasets[0].prompt_key; columns: answer, problem)"
        in line
    )
    own = f"eval.datasets=[{{name: m, path: {tmp_path / 'math500.jsonl'}, prompt_key: problem, answer_key: answer}}]"
    check_files(run(*common, own))


def test_a_ground_truth_its_verifier_never_rewards_is_a_warning(paths, run, tmp_path, capsys):
    """gsm8k's own ``answer`` column holds the whole solution (``... #### 2``); verl's gsm8k scorer
    compares the number after ``####`` with the ground truth, so with that column every response
    scores 0: --check says so (and still passes); with verl's ``reward_model.ground_truth`` the
    probe stating it scores 1."""
    from armor_megatron.cli.train import main

    row = {"data_source": "openai/gsm8k", "prompt": "1+1=", "answer": "1+1 is 2.\n#### 2"}
    row["reward_model"] = {"ground_truth": "2"}
    (tmp_path / "gsm8k.jsonl").write_text((json.dumps(row) + "\n") * 3)
    verl = [
        "reward.verifier=tests.rewards.row_verifiers:compute_score",
        f"data.train_path={tmp_path / 'gsm8k.jsonl'}",
        "eval.datasets=[]",
    ]
    assert check_files(run(*verl, "data.answer_key=reward_model.ground_truth")) == []
    [warning] = check_files(run(*verl))
    assert warning.startswith(f"data.train_path: {tmp_path / 'gsm8k.jsonl'}: a response stating the ground truth ")
    assert "on 3 of the first 3 rows (row 0: 0 for ground truth '1+1 is 2.\\n#### 2'" in warning, warning
    assert "is 'answer' (data.answer_key) the answer column?" in warning, warning
    assert main(["--config", TINY, *paths, *verl, "--check"]) == 0
    err = capsys.readouterr().err.splitlines()
    assert err[0] == f"armor-train: warning: {warning}" and err[-1].startswith("armor-train: config OK"), err


ENVIRONMENTS = "tests.config.user_environments"


def test_the_environment_is_built_from_the_first_rows_and_stepped_once(run, tmp_path):
    assert check_files(run(f"rollout.environment.spec={ENVIRONMENTS}:Calculator")) == []
    where = f"{tmp_path / 'train.jsonl'} row 0"
    line = _refused(run(f"rollout.environment.spec={ENVIRONMENTS}:NeedsExpression"), "rollout.environment.spec: ")
    assert line == (
        f"rollout.environment.spec: {ENVIRONMENTS}:NeedsExpression: building it from {where} raised KeyError: "
        "'expression' (its keys: answer, index, prompt)"
    )
    line = _refused(run(f"rollout.environment.spec={ENVIRONMENTS}:StepRaises"), "rollout.environment.spec: ")
    assert line.startswith(
        f"rollout.environment.spec: {ENVIRONMENTS}:StepRaises: step() on {where} raised ValueError: could not "
        "convert string to float"
    ), line
