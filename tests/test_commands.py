"""Every ``armor-…`` command a document or a message of the package names is installed by setup.py."""

import ast
import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# a command's name: not part of a longer word, a file name (armor-x.stamp) or a prefix (armor-sglang-)
NAME = re.compile(r"(?<![\w/.-])armor-[a-z]+(?:-[a-z]+)*(?![\w.-])")
NOT_COMMANDS = {"armor-signal-forwarder": "the relaunching process's signal thread (cli/relaunch.py)"}
TEXT = (".md", ".py", ".yaml", ".yml", ".sh", ".sbatch", ".toml", ".txt")


def entry_points() -> set[str]:
    """The console scripts setup.py installs."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Dict):
            for key, value in zip(node.keys, node.values):
                if isinstance(key, ast.Constant) and key.value == "console_scripts":
                    return {ast.literal_eval(item).split("=")[0].strip() for item in value.elts}
    raise AssertionError("setup.py installs no console_scripts")


def named_commands() -> dict[str, str]:
    """``armor-…`` names in the README, docs/, examples/, configs/, tools/ and the package, with a file naming each."""
    files = [ROOT / "README.md", ROOT / "setup.py"]
    for folder in ("docs", "examples", "configs", "tools", "armor_megatron", "bench"):
        for dirpath, _, names in os.walk(ROOT / folder):
            files += [Path(dirpath) / n for n in names if n.endswith(TEXT) or n.endswith(".sbatch")]
    found: dict[str, str] = {}
    for path in files:
        for name in NAME.findall(path.read_text(errors="replace")):
            found.setdefault(name, str(path.relative_to(ROOT)))
    return found


def test_every_command_named_is_installed():
    installed = entry_points()
    named = named_commands()
    missing = {name: where for name, where in named.items() if name not in installed and name not in NOT_COMMANDS}
    assert not missing, f"commands named but not installed by setup.py's console_scripts: {missing}"
    # the check sees the commands it must: the documented tools, and a name that is not one
    assert {"armor-train", "armor-slurm", "armor-sweep"} <= named.keys()
    assert NAME.findall("run armor-nope --help; armor-sglang-cpu.stamp, armor-alpha0.875") == ["armor-nope"]


def test_each_installed_command_is_a_main_that_returns_an_exit_code():
    import importlib
    import inspect

    tree = ast.parse((ROOT / "setup.py").read_text())
    scripts = [
        ast.literal_eval(item)
        for node in ast.walk(tree)
        if isinstance(node, ast.List)
        for item in node.elts
        if isinstance(item, ast.Constant) and isinstance(item.value, str) and "=armor_megatron." in item.value
    ]
    assert len(scripts) == len(entry_points())
    for script in scripts:
        name, target = (part.strip() for part in script.split("="))
        module, func = target.split(":")
        main = getattr(importlib.import_module(module), func)
        assert "argv" in inspect.signature(main).parameters, script
        prog = getattr(importlib.import_module(module), "PROG", None)
        assert prog == name, f"{script}: its messages and --help say {prog!r}"
