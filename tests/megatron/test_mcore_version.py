"""The megatron-core guard: another minor release is refused in one line when `armor_megatron.megatron`
is imported (GPU runs too, where `cpu_compat` stays off); another patch release warns."""

import os
import subprocess
import sys

import pytest

from armor_megatron.megatron import mcore_version

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_supported_minor_only():
    mcore_version.check("0.16.1")
    with pytest.warns(UserWarning, match="megatron-core 0.16.2 is not the release armor_megatron was checked against"):
        mcore_version.check("0.16.2")
    for other in ("0.15.3", "0.17.1", "0.18.0"):
        with pytest.raises(
            ImportError, match=rf"^armor_megatron.megatron supports megatron-core 0.16.1, not {other}: "
        ):
            mcore_version.check(other)


def test_the_installed_release_is_read_from_its_metadata():
    import megatron.core

    assert mcore_version.installed_version() == megatron.core.__version__


def _import_with_metadata(tmp_path, version: str) -> subprocess.CompletedProcess:
    """Import the subpackage in a process that finds megatron-core `version`'s metadata first."""
    dist = tmp_path / f"megatron_core-{version}.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: megatron-core\nVersion: {version}\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), ROOT])}
    code = "import armor_megatron.megatron.model"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)


def test_importing_the_subpackage_refuses_another_minor(tmp_path):
    done = _import_with_metadata(tmp_path, "0.17.1")
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: armor_megatron.megatron supports megatron-core 0.16.1, not 0.17.1: "), last
    assert "pip install 'megatron-core>=0.16.1,<0.17'" in last


@pytest.mark.slow  # a fresh interpreter importing megatron-core
def test_importing_the_subpackage_accepts_the_supported_release(tmp_path):
    done = _import_with_metadata(tmp_path, "0.16.1")
    assert done.returncode == 0, done.stderr
