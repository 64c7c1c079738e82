"""``tools/quoted_outputs.py``: the README's quoted main-job line is found and rewritten from a run's log."""

import importlib.util
import os
import re
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _tool():
    spec = importlib.util.spec_from_file_location("quoted_outputs", os.path.join(ROOT, "tools", "quoted_outputs.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


LINE = (
    "val_acc_start=0.5000 dapo_val_peak=0.5100 dapo_val_peak_step=20 dapo_val_end=0.4000 armor_val_end=0.4500 "
    "dapo_d_share_end=0.7000 armor_d_share_end=0.6000 minutes=3.10"
)


def test_the_readme_quotes_one_main_job_line_that_the_tool_rewrites():
    tool = _tool()
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    text, count = tool.rewrite(readme, LINE)
    assert count == 1 and f"\n    {LINE}\n" in text
    assert text.replace(f"    {LINE}", "") == re.sub(r"(?m)^    val_acc_start=.*$", "", readme)


def test_the_line_is_the_last_result_line_of_the_log():
    tool = _tool()
    log = f"[tiny] warm-up\nval_acc_start=0.1 dapo_val_peak=0.1 x minutes=1.00\ncurves: x.png\n{LINE}\n"
    assert tool.last_line(log) == LINE


def test_ci_runs_the_readme_test_command_from_its_first_code_block():
    """``.ci/run`` runs the pytest line of the README's first code block; that block holds the two commands."""
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        block = f.read().split("```")[1]
    lines = block.strip().splitlines()[1:]  # after the fence's language
    assert len(lines) == 2 and lines[0].endswith("python examples/tiny_cpu.py") and " -m pytest -q" in lines[1]
    with open(os.path.join(ROOT, ".ci", "run"), encoding="utf-8") as f:
        awk = re.search(r"^cmd=\$\((awk .*)\)$", f.read(), re.MULTILINE).group(1)  # CI's own extraction
    assert subprocess.run(awk, shell=True, cwd=ROOT, capture_output=True, text=True).stdout.strip() == lines[1]
