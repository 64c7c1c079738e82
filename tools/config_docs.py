#!/usr/bin/env python
"""Write ``docs/config.md``, the reference of every config key, from the schema.

python tools/config_docs.py            # (re)write docs/config.md
python tools/config_docs.py --check    # exit 1 when docs/config.md differs from the schema
"""

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from armor_megatron.config.reference import DOC_PATH, REGENERATE, missing_docs, render_markdown  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only report whether the file is current")
    args = parser.parse_args(argv)
    problems = missing_docs()
    if problems:
        print(f"config_docs: {len(problems)} keys lack a description, first: {problems[0]}", file=sys.stderr)
        return 1
    path = os.path.join(ROOT, DOC_PATH)
    text = render_markdown()
    current = open(path, encoding="utf-8").read() if os.path.isfile(path) else None
    if args.check:
        if current != text:
            print(f"config_docs: {DOC_PATH} is stale; run `{REGENERATE}`", file=sys.stderr)
            return 1
        return 0
    if current != text:
        tmp = f"{path}.tmp.{os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    print(f"config_docs: {DOC_PATH} is current")
    return 0


if __name__ == "__main__":
    sys.exit(main())
