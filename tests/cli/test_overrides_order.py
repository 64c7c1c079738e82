"""Flags and ``section.key=value`` overrides in any order, for every command that takes overrides."""

import os

import pytest

from armor_megatron.cli import slurm, sweep, train

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = os.path.join(ROOT, "configs", "tiny_cpu.yaml")


def test_train_takes_overrides_after_check_and_the_last_one_of_a_key_wins(capsys):
    argv = ["--config", TINY, "algorithm.alpha=0.5", "--print-config", "algorithm.alpha=0.875", "--no-files"]
    assert train.main([*argv, "rollout.group_size=4"]) == 0
    out = capsys.readouterr().out
    assert "alpha: 0.875" in out and "group_size: 4" in out


def test_an_override_after_check_is_checked_like_one_before_it(capsys):
    assert train.main(["--config", TINY, "--check", "--no-files", "algorithm.alpha=2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "algorithm.alpha: 2.0 is out of range" in err[0], err


@pytest.mark.parametrize(
    ("parser", "argv", "expected"),
    [
        (slurm.build_parser(), ["plan", "--config", "c.yaml", "a.b=1", "--shell", "c.d=2"], ["a.b=1", "c.d=2"]),
        (sweep.build_parser(), ["--config", "c.yaml", "a.b=1", "--out", "o", "c.d=2"], ["a.b=1", "c.d=2"]),
        (train.build_parser(), ["--check", "a.b=1", "--config", "c.yaml", "c.d=2"], ["a.b=1", "c.d=2"]),
    ],
)
def test_every_command_with_overrides_keeps_them_in_order(parser, argv, expected):
    assert parser.parse_with_overrides(argv).overrides == expected


def test_an_unknown_flag_is_still_refused_in_one_line(capsys):
    with pytest.raises(SystemExit) as code:
        train.main(["--config", TINY, "a.b=1", "--chek", "c.d=2"])
    err = capsys.readouterr().err
    assert code.value.code == 2 and err.count("\n") == 1 and "unrecognized arguments: --chek (see" in err, err


def test_a_subcommand_without_overrides_refuses_a_stray_word(capsys):
    with pytest.raises(SystemExit) as code:
        slurm.build_parser().parse_with_overrides(["hostnames", "node[01-02]", "extra"])
    err = capsys.readouterr().err
    assert code.value.code == 2 and "unrecognized arguments: extra" in err, err
