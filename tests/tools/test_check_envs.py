"""tools/check_envs.py without the network: the committed locks satisfy setup.py (so a pin changed
without re-locking fails here), the trainer's TE requirement becomes its prebuilt core, and a pip
report becomes a lock file that reads back."""

import importlib.util
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOL = os.path.join(ROOT, "tools", "check_envs.py")
_spec = importlib.util.spec_from_file_location("check_envs", TOOL)
check_envs = importlib.util.module_from_spec(_spec)
sys.modules["check_envs"] = check_envs  # dataclasses resolve annotations through sys.modules
_spec.loader.exec_module(check_envs)


def test_committed_locks_satisfy_setup_py():
    done = subprocess.run([sys.executable, TOOL, "--verify"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("trainer: torch==2.14.1 megatron-core==0.16.1 transformer-engine==2.11.0 sglang=- ")
    assert lines[1].startswith("sglang: torch==2.14.1 megatron-core=- transformer-engine=- sglang==0.5.23 ")


def _repo_copy(tmp_path, edit):
    """What setup.py reads (itself, README.md, the package version) with setup.py edited."""
    for name in ("setup.py", "README.md"):
        shutil.copy(os.path.join(ROOT, name), tmp_path / name)
    (tmp_path / "armor_megatron").mkdir()
    shutil.copy(os.path.join(ROOT, "armor_megatron", "__init__.py"), tmp_path / "armor_megatron" / "__init__.py")
    setup = tmp_path / "setup.py"
    old, new = edit
    assert old in setup.read_text()
    setup.write_text(setup.read_text().replace(old, new))
    return tmp_path


@pytest.mark.parametrize(
    "edit, message",
    [
        (
            ('"megatron-core>=0.16.1,<0.17"', '"megatron-core>=0.17"'),
            "trainer lock pins megatron-core==0.16.1, but setup.py requires megatron-core>=0.17",
        ),
        (
            ('"transformer-engine[pytorch]>=2.9,<2.12"', '"transformer-engine[pytorch]>=2.12"'),
            "trainer lock pins transformer-engine==2.11.0, but setup.py requires transformer-engine>=2.12",
        ),
        (('"tensorboard",', '"tensorboard", "wandb",'), "trainer lock has no wandb"),
        (
            ('"sglang==0.5.23"', '"sglang==0.5.24"'),
            "sglang lock pins sglang==0.5.23, but setup.py requires sglang==0.5.24",
        ),
    ],
)
def test_a_pin_changed_without_relocking_is_named(tmp_path, edit, message):
    root = _repo_copy(tmp_path, edit)
    with pytest.raises(check_envs.EnvError, match="^" + message.replace("[", r"\[").replace(".", r"\.")):
        check_envs.verify(root, lock_dir=check_envs.LOCK_DIR)


def test_locks_that_disagree_on_torch_or_the_nccl_wheel_fail(tmp_path):
    """weight_sync distributed puts both environments' NCCL in one communicator (NCCL refuses
    mixed versions), tensor hands torch's CUDA IPC handles across: the locks must agree."""
    for name in ("trainer", "sglang"):
        shutil.copy(check_envs.LOCK_DIR / f"{name}-py312.lock", tmp_path)
    trainer = tmp_path / "trainer-py312.lock"
    pins = check_envs.read_lock(trainer)
    assert pins["torch"] == check_envs.read_lock(tmp_path / "sglang-py312.lock")["torch"]
    nccl = next(n for n in pins if n.startswith("nvidia-nccl-cu"))
    trainer.write_text(trainer.read_text().replace(f"{nccl}=={pins[nccl]}", f"{nccl}==2.28.9"))
    with pytest.raises(
        check_envs.EnvError,
        match=rf"the trainer lock pins {nccl}==2\.28\.9, the sglang lock {nccl}==.*one NCCL communicator",
    ):
        check_envs.verify(lock_dir=tmp_path)
    same = {"torch": "2.14.1", nccl: "2.30.7"}
    assert check_envs.shared_wheels_problem(same, dict(same)) is None
    assert "torch==2.11.0, the sglang lock torch==2.14.1: CUDA IPC" in check_envs.shared_wheels_problem(
        {**same, "torch": "2.11.0"}, same
    )
    assert f"{nccl}==-, the sglang lock" in check_envs.shared_wheels_problem({"torch": "2.14.1"}, same)


def test_a_missing_lock_is_named(tmp_path):
    with pytest.raises(check_envs.EnvError, match="trainer-py312.lock: no such lock"):
        check_envs.verify(lock_dir=tmp_path)


def test_trainer_resolves_tes_prebuilt_core_and_the_extensions_requirements():
    spec = check_envs.trainer_spec(13, "torch==2.14.1")  # sglang's torch (`sglang_torch`)
    te = [r for r in spec.requirements if r.startswith("transformer-engine")]
    assert te == ["transformer-engine[core-cu13]<2.12,>=2.9"]  # the source-only pytorch extra is built later
    assert spec.requirements.count("torch==2.14.1") == 1 and "torch>=2.6" in spec.requirements
    assert set(check_envs.TE_TORCH_REQUIRES) <= set(spec.requirements)
    assert "sglang-router==0.3.2" in spec.requirements
    assert check_envs.sglang_spec().requirements == ("sglang==0.5.23", "sglang-router==0.3.2", "pyyaml")


def test_torch_cuda_major_comes_from_its_cudnn_requirement():
    entry = {
        "metadata": {
            "version": "2.11.0",
            "requires_dist": ["filelock", 'nvidia-cudnn-cu13==9.19.0.56; platform_system == "Linux"'],
        }
    }
    assert check_envs.torch_cuda_major(entry) == 13
    with pytest.raises(check_envs.EnvError, match="torch 2.11.0 declares no nvidia-cudnn-cu<N>: not a CUDA build"):
        check_envs.torch_cuda_major({"metadata": {"version": "2.11.0", "requires_dist": ["filelock"]}})


def test_pip_runs_for_the_target_without_local_configuration():
    tags = check_envs.platform_tags()
    assert tags[0] == "manylinux_2_34_x86_64" and "manylinux_2_17_x86_64" in tags and tags[-1] == "manylinux1_x86_64"
    env = check_envs.pip_environ(
        {"PIP_CONSTRAINT": "/etc/c.txt", "PIP_FIND_LINKS": "/w", "PIP_CERT": "/ca", "HOME": "/h"}
    )
    assert env == {"PIP_CERT": "/ca", "HOME": "/h", "PIP_CONFIG_FILE": os.devnull, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    cmd = check_envs.pip_command(["torch==2.11.0"], "r.json", "t", "https://pypi.org/simple")
    assert cmd[1:5] == ["-m", "pip", "install", "--dry-run"] and "--only-binary=:all:" in cmd
    assert cmd[cmd.index("--python-version") + 1] == "3.12" and cmd[-1] == "torch==2.11.0"


def test_a_report_becomes_a_lock_that_reads_back(tmp_path):
    report = [  # the fields of pip's installation report (format 1) the tool reads
        {
            "metadata": {"name": "Megatron_Core", "version": "0.16.1"},
            "download_info": {
                "url": "https://files/megatron_core-0.16.1-cp312-cp312-manylinux_2_28_x86_64.whl",
                "archive_info": {"hashes": {"sha256": "ab" * 32}},
            },
        },
        {
            "metadata": {"name": "absl-py", "version": "2.5.1"},
            "download_info": {"url": "https://files/absl_py-2.5.1-py3-none-any.whl", "archive_info": {}},
        },
    ]
    pins = check_envs.pins_of(report)
    assert [(p.name, p.version) for p in pins] == [("absl-py", "2.5.1"), ("megatron-core", "0.16.1")]
    spec = check_envs.EnvSpec("trainer", ("megatron-core>=0.16.1,<0.17",), ("pip install x",))
    text = check_envs.lock_text(spec, pins, "https://pypi.org/simple", "24.0", "2026-01-01")
    path = tmp_path / "envs" / "trainer-py312.lock"
    check_envs.write_atomic(path, text)
    assert os.listdir(path.parent) == ["trainer-py312.lock"]  # no temporary file left
    assert f"megatron-core==0.16.1 \\\n    --hash=sha256:{'ab' * 32}\n" in path.read_text()
    assert "# then:   pip install x\n" in path.read_text()
    assert check_envs.read_lock(path) == {"absl-py": "2.5.1", "megatron-core": "0.16.1"}
    assert check_envs.summary("trainer", pins) == (
        "trainer: torch=- megatron-core==0.16.1 transformer-engine=- sglang=- transformers=-"
    )
