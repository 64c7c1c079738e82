"""Prepare a virtual environment holding SGLang 0.5.23's pure-Python request code on a CPU machine.

    python tools/sglang_cpu_env.py [DEST]    # prints the interpreter's path last

DEST defaults to :func:`default_dest`: ``$ARMOR_SGLANG_CPU_ENV``, else a folder of the user's cache
(``$XDG_CACHE_HOME``, else ``~/.cache``) named by the requirements' digest, so every clone on a
machine (a CI run's fresh one included) shares one build of it and a change of requirements builds
a new one beside it.

SGLang's wheel declares CUDA kernels, flashinfer and torch 2.14.1 (a CUDA build of several GB).
None of that is needed to import what a client's requests meet first: ``SamplingParams``
(``sglang/srt/sampling/sampling_params.py``), the request dataclasses and their
``normalize_batch_and_arguments`` (``sglang/srt/managers/io_struct.py``), the ``/generate``
contract gate (``sglang/srt/entrypoints/api_contract.py``), ``SafeUnpickler`` and
``MultiprocessingSerializer`` (``sglang/srt/utils/common.py``) and ``FlattenedTensorBucket``
(``sglang/srt/weight_sync/tensor_bucket.py``). So every package below is installed with
``--no-deps``, at the exact version SGLang's own lock (``envs/sglang-py312.lock``) names, beside
the CPU build of torch 2.13.0. The list is what those imports need, found by importing them.

One part of the import chain does not load on CPU: ``io_struct`` reaches torchvision
(through ``sglang/srt/configs``), whose index wheels are CUDA builds whose ``_C`` extension
needs ``libc10_cuda.so``. torchvision then fails at import because it registers fake kernels
for ``torchvision::nms``/``qnms`` whether or not its extension loaded. The tests' runner
declares those two operator schemas first (:data:`TORCHVISION_OPS`); nothing calls them.

Idempotent: a finished environment carries a stamp naming its requirements; with the same
requirements the script does nothing, otherwise it rebuilds the folder. The stamp is written
last, so an interrupted build is redone. Exit status 75 when the package index cannot be
reached (the caller may skip), 1 for any other failure.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request

TORCH = "torch==2.13.0"  # the CPU build, as everywhere in this project's CPU instructions
SGLANG = "sglang==0.5.23"
# Everything SGLang's request code imports, pinned as in tools/envs/sglang-py312.lock (torchvision:
# the release that matches torch 2.13; apache-tvm-ffi: the version sglang 0.5.23 pins).
PACKAGES = """
aiohappyeyeballs==2.7.1 aiohttp==3.14.5 aiosignal==1.4.0 annotated-types==0.8.0 anyio==4.16.0
apache-tvm-ffi==0.1.11 attrs==26.1.0 certifi==2026.10.19.post1 click==8.5.1 compressed-tensors==0.18.0
dill==0.4.1 distro==1.9.0 filelock==4.3.1 frozenlist==1.8.0 fsspec==2026.9.0 gguf==0.19.0 h11==0.16.0
hf-xet==1.8.0 httpcore==1.0.9 httpx==0.28.1 huggingface-hub==1.33.0 idna==3.20 ipython==9.18.1
jinja2==3.1.6 loguru==0.7.3 markdown-it-py==4.3.0 markupsafe==3.0.4 mdurl==0.1.2 mpmath==1.3.0
msgspec==0.23.0 multidict==7.2.1 networkx==3.6.1 numpy==2.3.5 openai==2.8.0 orjson==3.13.0
packaging==26.4 partial-json-parser==0.2.1.1.post7 pillow==13.0.0 propcache==0.5.4 psutil==7.2.2
pybase64==1.5.1 pydantic==2.14.4 pydantic-core==2.50.5 pygments==2.21.0 pyyaml==6.0.4 pyzmq==27.3.0
regex==2026.11.19 requests==2.34.2 rich==15.0.0 safetensors==0.8.0 sentencepiece==0.2.1
shellingham==1.5.4 sniffio==1.3.1 starlette==1.10.0 sympy==1.14.0 tokenizers==0.23.2
torchvision==0.28.0 tqdm==4.70.1 traitlets==5.16.1 transformers==5.19.0 triton==3.8.0 typer==0.29.2
typing-extensions==4.16.0 typing-inspection==0.4.5 urllib3==2.8.0 yarl==1.25.1
""".split()
REQUIREMENTS = [TORCH, SGLANG, *PACKAGES]
# torchvision's operators whose fake kernels it registers unconditionally at import.
TORCHVISION_OPS = (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
)
STAMP = "armor-sglang-cpu.stamp"
UNREACHABLE = 75
DEFAULT_INDEX = "https://pypi.org/simple"


def stamp_text() -> str:
    """What a finished environment's stamp holds: a digest of the requirements and the Python."""
    digest = hashlib.sha256("\n".join([sys.version, *REQUIREMENTS]).encode()).hexdigest()
    return f"{digest}\n"


def default_dest() -> str:
    """Where the environment lives unless told: ``$ARMOR_SGLANG_CPU_ENV``, else the user's cache."""
    explicit = os.environ.get("ARMOR_SGLANG_CPU_ENV", "").strip()
    if explicit:
        return explicit
    cache = os.environ.get("XDG_CACHE_HOME", "").strip() or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "armor_megatron", f"sglang-cpu-env-{stamp_text()[:12]}")


def interpreter(dest: str) -> str:
    return os.path.join(os.path.abspath(dest), "bin", "python")


def is_ready(dest: str) -> bool:
    try:
        with open(os.path.join(dest, STAMP)) as f:
            return f.read() == stamp_text() and os.path.exists(interpreter(dest))
    except OSError:
        return False


class IndexUnreachable(RuntimeError):
    pass


def index_url() -> str:
    """The index pip uses: ``PIP_INDEX_URL``, else pip's configuration, else PyPI."""
    if os.environ.get("PIP_INDEX_URL"):
        return os.environ["PIP_INDEX_URL"]
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "config", "get", "global.index-url"], capture_output=True, text=True
    )
    return proc.stdout.strip() if proc.returncode == 0 and proc.stdout.strip() else DEFAULT_INDEX


def index_error(timeout: float = 15.0) -> str | None:
    """Why the index does not answer for sglang (None when it does)."""
    url = f"{index_url().rstrip('/')}/sglang/"
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            resp.read(1)
    except (urllib.error.URLError, OSError) as e:
        return f"{url}: {getattr(e, 'reason', e)}"
    return None


def _run(cmd: list[str]) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        unreachable = index_error()
        if unreachable:
            raise IndexUnreachable(f"the package index cannot be reached ({unreachable})")
        out = proc.stdout + proc.stderr
        raise RuntimeError(f"{' '.join(cmd[:4])} ... failed (exit {proc.returncode}):\n{out[-3000:]}")


def build(dest: str) -> None:
    """Create ``dest`` anew and install :data:`REQUIREMENTS` into it without their dependencies."""
    shutil.rmtree(dest, ignore_errors=True)
    _run([sys.executable, "-m", "venv", dest])
    pip = [interpreter(dest), "-m", "pip", "install", "--quiet", "--no-deps", "--disable-pip-version-check"]
    _run([*pip, *REQUIREMENTS])
    tmp = os.path.join(dest, STAMP + ".tmp")
    with open(tmp, "w") as f:
        f.write(stamp_text())
    os.replace(tmp, os.path.join(dest, STAMP))


def ensure(dest: str) -> str:
    """The interpreter of a ready environment at ``dest``, building it first if needed (one builder at a time)."""
    dest = os.path.abspath(dest)
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    with open(dest.rstrip("/") + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not is_ready(dest):
            build(dest)
    if not is_ready(dest):
        raise RuntimeError(f"{dest}: environment not ready after building")
    return interpreter(dest)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "dest",
        nargs="?",
        default=None,
        help="folder of the virtual environment, created or reused (default: the cache)",
    )
    args = parser.parse_args(argv)
    args.dest = args.dest or default_dest()
    start = time.monotonic()
    ready = is_ready(args.dest)
    try:
        python = ensure(args.dest)
    except IndexUnreachable as e:
        print(f"sglang_cpu_env: {e}", file=sys.stderr)
        return UNREACHABLE
    except RuntimeError as e:
        print(f"sglang_cpu_env: {e}", file=sys.stderr)
        return 1
    how = "reused" if ready else f"built in {time.monotonic() - start:.0f}s"
    print(f"sglang_cpu_env: {args.dest} {how}", file=sys.stderr)
    print(python)
    return 0


if __name__ == "__main__":
    sys.exit(main())
