"""``armor-convert``: exit codes, one-line errors for each bad input, no partial output."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from armor_megatron.cli.convert import main, parse_size
from armor_megatron.convert.progress import Progress
from tests.convert.conftest import save_tiny_model
from tests.processes import stopped_after

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run(capsys, *argv):
    capsys.readouterr()  # drop what fixtures printed (transformers' progress bars)
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def assert_bad_input(capsys, tmp_path, message, *argv):
    out_dir = tmp_path / "out"
    code, _, err = run(capsys, *argv, out_dir) if argv[0] != "verify" else run(capsys, *argv)
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("armor-convert: error: ") and message in err, err
    assert not out_dir.exists() and not [p for p in os.listdir(tmp_path) if ".tmp-" in p]  # nothing half-written


@pytest.fixture
def sharded_llama(tmp_path):
    """The tiny llama saved in several shards (so one can go missing)."""
    import transformers

    src = tmp_path / "src"
    save_tiny_model("llama", str(src))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(src))
    hf = tmp_path / "hf"
    model.save_pretrained(str(hf), max_shard_size="100KB")
    shutil.copy(src / "tokenizer.json", hf / "tokenizer.json")
    shards = sorted(f for f in os.listdir(hf) if f.endswith(".safetensors"))
    assert len(shards) > 2
    return hf, shards


def test_missing_shard(capsys, tmp_path, sharded_llama):
    hf, shards = sharded_llama
    os.remove(hf / shards[1])
    assert_bad_input(capsys, tmp_path, f"shard {shards[1]} is missing", "hf-to-mcore", hf)


def test_truncated_shard(capsys, tmp_path, sharded_llama):
    hf, shards = sharded_llama
    os.truncate(hf / shards[0], os.path.getsize(hf / shards[0]) // 2)
    assert_bad_input(capsys, tmp_path, f"{shards[0]}: unreadable or truncated", "hf-to-mcore", hf)


def rewrite(hf, change):
    tensors = load_file(str(hf / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(hf / "model.safetensors"), metadata={"format": "pt"})


def test_missing_tensor(capsys, tmp_path, tiny_models):
    hf = shutil.copytree(tiny_models["llama"], tmp_path / "hf")
    rewrite(hf, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    assert_bad_input(capsys, tmp_path, "tensor model.layers.1.mlp.up_proj.weight is missing", "hf-to-mcore", hf)


def test_wrong_shape(capsys, tmp_path, tiny_models):
    hf = shutil.copytree(tiny_models["qwen3"], tmp_path / "hf")
    rewrite(hf, lambda t: t.__setitem__("model.layers.0.self_attn.k_proj.weight", torch.zeros(16, 64)))
    assert_bad_input(
        capsys,
        tmp_path,
        "tensor model.layers.0.self_attn.k_proj.weight has shape [16, 64], expected [32, 64]",
        "hf-to-mcore",
        hf,
    )


def test_unexpected_tensor_is_not_dropped_silently(capsys, tmp_path, tiny_models):
    hf = shutil.copytree(tiny_models["llama"], tmp_path / "hf")
    rewrite(hf, lambda t: t.__setitem__("model.layers.0.mlp.extra.weight", torch.zeros(2)))
    assert_bad_input(
        capsys, tmp_path, "tensor model.layers.0.mlp.extra.weight is not part of a llama model", "hf-to-mcore", hf
    )


def test_unsupported_architecture(capsys, tmp_path, tiny_models):
    hf = shutil.copytree(tiny_models["llama"], tmp_path / "hf")
    config = json.loads((hf / "config.json").read_text())
    config.update(model_type="gpt2", architectures=["GPT2LMHeadModel"])
    (hf / "config.json").write_text(json.dumps(config))
    assert_bad_input(capsys, tmp_path, "unsupported architecture 'gpt2'", "hf-to-mcore", hf)


def test_heads_not_divisible_by_tp(capsys, tmp_path, tiny_models):
    assert_bad_input(
        capsys,
        tmp_path,
        "num_attention_heads=4 is not divisible by tp=3",
        "hf-to-mcore",
        tiny_models["llama"],
        "--tp",
        3,
    )


def test_missing_input_directory(capsys, tmp_path):
    assert_bad_input(capsys, tmp_path, "nowhere: not a directory", "mcore-to-hf", tmp_path / "nowhere")


def test_checkpoint_of_another_model(capsys, tmp_path, tiny_models):
    mcore = tmp_path / "mcore"
    assert run(capsys, "hf-to-mcore", tiny_models["llama"], mcore)[0] == 0
    assert_bad_input(
        capsys,
        tmp_path,
        "tensor decoder.layers.self_attention.q_layernorm.weight is missing",
        "mcore-to-hf",
        mcore,
        "--hf-config",
        tiny_models["qwen3"],
    )


def test_hf_config_beside_a_training_checkpoint_is_found(capsys, tmp_path, tiny_models):
    """A training run records its HF config as <checkpoint dir>/hf_config beside its iter_*
    checkpoints: mcore-to-hf of one needs no --hf-config; with neither, one line says so."""
    step = tmp_path / "ckpt" / "iter_0000001"
    step.parent.mkdir()
    assert run(capsys, "hf-to-mcore", tiny_models["qwen3"], step, "--quiet")[0] == 0
    shutil.rmtree(step / "hf_config")
    assert_bad_input(
        capsys, tmp_path, "no hf_config/config.json in it or beside it; pass --hf-config", "mcore-to-hf", step
    )
    shutil.copytree(tiny_models["qwen3"], tmp_path / "ckpt" / "hf_config")
    code, _, err = run(capsys, "mcore-to-hf", step, tmp_path / "out", "--quiet")
    assert code == 0, err
    exported, original = (
        load_file(tmp_path / "out" / "model.safetensors"),
        load_file(f"{tiny_models['qwen3']}/model.safetensors"),
    )
    assert exported.keys() == original.keys() and all(torch.equal(exported[n], t) for n, t in original.items())


def test_existing_output_is_refused_unless_overwrite(capsys, tmp_path, tiny_models):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep").write_text("x")
    code, _, err = run(capsys, "hf-to-mcore", tiny_models["qwen2"], out)
    assert code == 2 and "already exists (pass --overwrite" in err and err.count("\n") == 1
    assert os.listdir(out) == ["keep"]
    code, stdout, _ = run(capsys, "hf-to-mcore", tiny_models["qwen2"], out, "--overwrite", "--quiet")
    assert code == 0 and "hf-to-mcore: " in stdout and " tensors, " in stdout and "peak RSS" in stdout
    assert "keep" not in os.listdir(out) and "metadata.json" in os.listdir(out)
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".out.")]


def test_verify_exit_codes(capsys, tmp_path, tiny_models):
    mcore = tmp_path / "mcore"
    assert run(capsys, "hf-to-mcore", tiny_models["mixtral"], mcore)[0] == 0
    code, out, _ = run(capsys, "verify", tiny_models["mixtral"], mcore, "--no-logits")
    assert code == 0 and "verify: OK" in out
    other = save_tiny_model("mixtral", str(tmp_path / "other"), seed=1)
    code, out, _ = run(capsys, "verify", other, mcore, "--no-logits")
    assert code == 1 and "verify: FAILED" in out and "first mismatch" in out


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_verify_with_logits_as_a_user_runs_it(tmp_path, tiny_models):
    mcore = tmp_path / "mcore"
    cmd = [sys.executable, os.path.join(ROOT, "tools", "convert_checkpoint.py")]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run(cmd + ["hf-to-mcore", tiny_models["qwen3"], str(mcore), "--quiet"], check=True, env=env, timeout=200)
    proc = subprocess.run(
        cmd + ["verify", tiny_models["qwen3"], str(mcore)], capture_output=True, text=True, env=env, timeout=200
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert "logits: max |megatron - transformers|" in proc.stdout and "verify: OK" in proc.stdout


@pytest.mark.parametrize("text, size", [("5GB", 5 * 10**9), ("512MiB", 512 * 2**20), ("1000", 1000), ("1.5kb", 1500)])
def test_parse_size(text, size):
    assert parse_size(text) == size


def test_progress_lines(capsys):
    progress = Progress("hf-to-mcore", total_tensors=4, total_bytes=2**30, stream=sys.stderr, every_s=0)
    progress.advance(2**29, tensors=2)
    assert "[hf-to-mcore] 2/4 tensors, 0.50/1.00 GiB" in capsys.readouterr().err


def test_vocab_not_divisible_by_tp(capsys, tmp_path):
    hf = save_tiny_model("llama", str(tmp_path / "hf"), vocab_size=255)
    assert_bad_input(capsys, tmp_path, "vocab_size=255 is not divisible by tp=2", "hf-to-mcore", hf, "--tp", 2)


def test_a_padded_vocabulary_is_exported_at_the_hf_vocabulary_size(capsys, tmp_path):
    """A training checkpoint stores embedding and output layer with the vocabulary padded (here
    200 -> 256 rows); mcore-to-hf with the model's HF config strips the padding rows."""
    small = save_tiny_model("llama", str(tmp_path / "hf200"), vocab_size=200)
    padded = tmp_path / "hf256"
    shutil.copytree(small, padded)
    weights = load_file(padded / "model.safetensors")
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        weights[name] = torch.cat([weights[name], torch.randn(56, weights[name].shape[1])])
    save_file(weights, padded / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((padded / "config.json").read_text())
    (padded / "config.json").write_text(json.dumps({**config, "vocab_size": 256}))
    assert run(capsys, "hf-to-mcore", padded, tmp_path / "mcore", "--quiet")[0] == 0

    code, _, err = run(capsys, "mcore-to-hf", tmp_path / "mcore", tmp_path / "out", "--hf-config", small, "--quiet")
    assert code == 0, err
    exported, original = load_file(tmp_path / "out" / "model.safetensors"), load_file(f"{small}/model.safetensors")
    assert exported.keys() == original.keys()
    for name, tensor in original.items():
        assert torch.equal(exported[name], tensor), name


@pytest.mark.parametrize("umask, mode", [(0o022, 0o755), (0o027, 0o750)])
def test_outputs_honour_the_umask(capsys, tmp_path, tiny_models, umask, mode):
    previous = os.umask(umask)
    try:
        assert run(capsys, "hf-to-mcore", tiny_models["qwen2"], tmp_path / "mcore", "--quiet")[0] == 0
        assert run(capsys, "mcore-to-hf", tmp_path / "mcore", tmp_path / "hf", "--quiet")[0] == 0
    finally:
        os.umask(previous)
    for out in ("mcore", "hf"):
        assert (tmp_path / out).stat().st_mode & 0o777 == mode, out
        for name in os.listdir(tmp_path / out):  # the files it writes (side files keep their source's mode)
            if name.endswith((".safetensors", ".distcp", "index.json", "armor_convert.json")):
                assert (tmp_path / out / name).stat().st_mode & 0o777 == mode & 0o666, name


# ----------------------------------------------------------------------------- converter edges
@pytest.mark.parametrize("where", ["same", "inside", "parent"])
def test_an_output_that_would_replace_the_source_is_refused(capsys, tmp_path, tiny_models, where):
    hf = tmp_path / "model" / "hf"
    shutil.copytree(tiny_models["qwen2"], hf)
    before = sorted(os.listdir(hf))
    out = {"same": hf, "inside": hf / "mcore", "parent": tmp_path / "model"}[where]
    code, _, err = run(capsys, "hf-to-mcore", hf, out, "--overwrite")
    assert code == 2 and err.count("\n") == 1 and "is, contains or lies inside the input" in err, err
    assert sorted(os.listdir(hf)) == before  # the source weights are still there


def test_a_read_only_output_location_is_one_line(capsys, tmp_path, tiny_models):
    code, _, err = run(capsys, "hf-to-mcore", tiny_models["qwen2"], "/proc/armor_out")
    assert (
        code == 2
        and err.startswith("armor-convert: error: /proc: cannot write the output there")
        and err.count("\n") == 1
    ), err


def test_a_truncated_torch_dist_is_one_line(capsys, tmp_path, tiny_models):
    mcore = tmp_path / "mcore"
    assert run(capsys, "hf-to-mcore", tiny_models["llama"], mcore, "--quiet")[0] == 0
    data = next(f for f in os.listdir(mcore) if f.endswith(".distcp"))
    os.truncate(mcore / data, 1000)
    assert_bad_input(capsys, tmp_path, "mcore: a data file is truncated or corrupt", "mcore-to-hf", mcore)


def test_verify_across_families_is_one_line(capsys, tmp_path, tiny_models):
    mcore = tmp_path / "mcore"
    assert run(capsys, "hf-to-mcore", tiny_models["qwen2"], mcore, "--quiet")[0] == 0
    code, out, err = run(capsys, "verify", tiny_models["llama"], mcore, "--no-logits")
    assert code == 2 and out == "" and err.count("\n") == 1, err
    assert "holds another model than" in err and "family is 'qwen2' there, 'llama' here" in err


@pytest.mark.parametrize("size, message", [("5XB", "not a size: '5XB'"), ("0", "'0' is not a positive size")])
def test_a_bad_shard_size_is_one_line(capsys, tmp_path, size, message):
    with pytest.raises(SystemExit) as exit_:
        main(["mcore-to-hf", str(tmp_path), str(tmp_path / "out"), "--max-shard-size", size])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1 and message in err, err


def test_an_interrupted_conversion_removes_its_output_and_old_leftovers(capsys, tmp_path, tiny_models, monkeypatch):
    import armor_megatron.convert.torch_dist as torch_dist

    (tmp_path / ".out.tmp-killed").mkdir()  # a conversion killed with -9 earlier
    (tmp_path / ".out.tmp-killed" / "big").write_bytes(b"x" * 1000)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(torch_dist, "write_checkpoint", interrupted)
    code, _, err = run(capsys, "hf-to-mcore", tiny_models["qwen2"], tmp_path / "out")
    assert code == 130 and err == "armor-convert: interrupted; the partial output was removed\n"
    assert sorted(os.listdir(tmp_path)) == []


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_sigterm_during_a_conversion_cleans_up(tmp_path, tiny_models):
    """A real process: SIGTERM while it converts (a slowed-down writer) leaves nothing behind."""
    script = (
        "import sys, time, armor_megatron.convert.torch_dist as td\n"
        "real = td.write_checkpoint\n"
        "def slow(*a, **k):\n"
        "    print('writing', flush=True); time.sleep(60); return real(*a, **k)\n"
        "td.write_checkpoint = slow\n"
        "from armor_megatron.cli.convert import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", script, "hf-to-mcore", tiny_models["qwen2"], str(tmp_path / "out")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ, PYTHONPATH=ROOT),
    )
    with stopped_after(proc):
        assert proc.stdout.readline() == "writing\n"
        assert [p for p in os.listdir(tmp_path) if ".tmp-" in p]  # the staged output exists now
        proc.terminate()
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and err.strip().endswith("interrupted; the partial output was removed"), err
    assert os.listdir(tmp_path) == []
