import pytest

from armor_megatron.cli.slurm import main
from armor_megatron.launch.nodelist import NodeListError, expand_nodelist


@pytest.mark.parametrize(
    "compressed, hosts",
    [
        ("node01", ["node01"]),
        ("node[01-02]", ["node01", "node02"]),
        # ranges and single numbers mix inside one bracket; a plain host follows after a top-level comma
        ("node[01-03,07],gpu5", ["node01", "node02", "node03", "node07", "gpu5"]),
        # the padding width is the lower bound's: 08 09 10, and 9-11 stays unpadded
        ("n[08-10],m[9-11]", ["n08", "n09", "n10", "m9", "m10", "m11"]),
        # two bracket groups expand as a product, the first varying slowest
        ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
        ("a-1,b[3]-ib", ["a-1", "b3-ib"]),
    ],
)
def test_expand_nodelist(compressed, hosts):
    assert expand_nodelist(compressed) == hosts


@pytest.mark.parametrize("bad", ["", "node[01-02", "node01-02]", "node[a-b]", "node[05-03]", "n1,,n2", "node[[1]]"])
def test_bad_nodelists_raise_one_line(bad):
    with pytest.raises(NodeListError) as err:
        expand_nodelist(bad)
    assert "\n" not in str(err.value)


def test_command_line_prints_one_host_a_line(capsys):
    assert main(["hostnames", "node[01-02],x"]) == 0
    assert capsys.readouterr().out == "node01\nnode02\nx\n"
    assert main(["hostnames", "node[2-1]"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "runs backwards" in err[0]


@pytest.mark.slow  # bash and a fresh interpreter importing the package
def test_the_batch_scripts_fallback_runs_without_warnings():
    """armor.sbatch expands the node list itself where scontrol is absent: stderr stays empty."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run(
        [sys.executable, "-m", "armor_megatron.cli.slurm", "hostnames", "n[1-2]"],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, PYTHONPATH=root),
    )
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "n1\nn2\n", "")
