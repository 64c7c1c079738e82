#!/usr/bin/env python3
"""Resolve the two GPU environments against the package index, without installing, and lock them.

    python tools/check_envs.py                    # resolve both, print the key versions, write the locks
    python tools/check_envs.py --env trainer      # one of them
    python tools/check_envs.py --no-write         # resolve and print only
    python tools/check_envs.py --shared           # also: do trainer and SGLang resolve as ONE environment?
    python tools/check_envs.py --verify           # offline: the committed locks satisfy setup.py (CI runs this)

A GPU job runs two environments (docs/gpu.md, "GPU environments"):

* ``trainer`` - the Megatron trainer: setup.py's ``install_requires`` and its ``gpu`` extra, with
  torch pinned to the release the ``sglang`` extra's sglang pins (`sglang_torch`). Transformer Engine's torch extension (``transformer-engine-torch``)
  is published as source only and compiles against the installed torch, so the lock holds TE's
  prebuilt core (``transformer-engine-cu<N>``, N = the CUDA major of that torch) and the extension's
  own requirements and build requirements (`TE_TORCH_REQUIRES`); it is built afterwards with the
  command the lock's header states.
* ``sglang`` - the SGLang servers (``rollout.sglang.python`` names its interpreter): setup.py's
  ``sglang`` extra, plus what the API-key wrapper needs to import ``armor_megatron`` there (pyyaml).
  SGLang pins its own torch and transformers, which is why it gets an environment of its own.

For each, pip (the interpreter's own) answers ``pip install --dry-run --report`` for CPython
`PYTHON_VERSION` on Linux x86-64 (manylinux tags down from glibc `GLIBC`), wheels only, against
``--index-url`` alone: pip configuration files and ``PIP_*`` settings other than certificates,
proxy and timeout are ignored, so a lock depends on the index and the requirements only. The lock
(``tools/envs/<env>-py312.lock``) pins every package with the sha256 of the wheel pip chose; it is
written atomically. The summary line per environment names torch, megatron-core,
transformer-engine, sglang and transformers (``-`` when absent).

``--shared`` also resolves the trainer's and the servers' requirements together, torch pinned
by sglang, and prints whether that resolves; it writes no lock (nothing was tested that way).

``--verify`` needs no network: every requirement the environment takes from setup.py (for this
target: markers evaluated for Python 3.12 on Linux x86-64) must be satisfied by the lock's pins,
and every lock must exist. It exits 1 naming the first requirement a lock breaks.

One torch, one NCCL: ``weight_sync: distributed`` puts trainer ranks and engine ranks in one NCCL
communicator, and NCCL refuses ranks of different versions ("Mismatched NCCL version detected");
``weight_sync: tensor`` hands CUDA IPC handles pickled by the trainer's torch to the servers'
torch. So the trainer takes SGLang's torch, and with it the exact ``nvidia-nccl-cu<N>`` wheel
torch pins; resolving and ``--verify`` both fail, naming the two versions, when the locks
disagree on torch or on the NCCL wheel (`shared_wheels_problem`).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import re
import runpy
import subprocess
import sys
import tempfile
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
LOCK_DIR = ROOT / "tools" / "envs"
PYTHON_VERSION = "3.12"
GLIBC = (2, 34)  # sglang 0.5.23 publishes manylinux_2_34 wheels: Ubuntu 22.04, RHEL 9 and newer
INDEX_URL = "https://pypi.org/simple"
# The trainer's torch is the one sglang pins (one torch and one NCCL wheel on both sides of a
# weight sync: module docstring); megatron-core 0.16 needs torch >= 2.6 and Transformer Engine
# 2.9-2.11 >= 2.1, neither caps it. Must agree in the locks (`shared_wheels_problem`):
SHARED_WHEELS = ("torch", "nvidia-nccl-cu")  # exact names, or a prefix ending in "-cu" (the CUDA major varies)
# transformer_engine_torch 2.11.0's Requires-Dist (its sdist's PKG-INFO) besides torch and the
# transformer_engine_cu<N> core, which its setup.py picks from the CUDA major of the installed torch.
# Building it with --no-build-isolation imports setuptools (torch requires it), wheel and packaging;
# ninja parallelises the compile.
TE_TORCH_REQUIRES = ("einops", "onnxscript", "onnx", "packaging", "pydantic", "wheel", "ninja")
LOCKED = ("trainer", "sglang")
SUMMARY = ("torch", "megatron-core", "transformer-engine", "sglang", "transformers")
# PIP_* variables kept: how to reach the index, not what to resolve.
PIP_ENV_KEPT = ("PIP_CERT", "PIP_CLIENT_CERT", "PIP_PROXY", "PIP_TRUSTED_HOST", "PIP_DEFAULT_TIMEOUT", "PIP_RETRIES")


class EnvError(RuntimeError):
    """An environment does not resolve, or a lock does not satisfy its requirements (one line)."""


def setup_requirements(root: Path = ROOT) -> tuple[list[str], dict[str, list[str]]]:
    """``install_requires`` and ``extras_require`` of setup.py, read by running it with setup() captured."""
    import setuptools

    captured: dict = {}
    real_setup, cwd = setuptools.setup, os.getcwd()
    setuptools.setup = lambda **kw: captured.update(kw)
    try:
        os.chdir(root)
        runpy.run_path(str(root / "setup.py"), run_name="__main__")
    finally:
        setuptools.setup = real_setup
        os.chdir(cwd)
    return list(captured["install_requires"]), {k: list(v) for k, v in captured["extras_require"].items()}


@dataclasses.dataclass(frozen=True)
class EnvSpec:
    """One environment: its name, the requirements resolved, and the command that completes it."""

    name: str
    requirements: tuple[str, ...]
    post_install: tuple[str, ...] = ()

    @property
    def lock_path(self) -> Path:
        return LOCK_DIR / f"{self.name}-py{PYTHON_VERSION.replace('.', '')}.lock"


def trainer_requirements(root: Path = ROOT) -> list[str]:
    """setup.py's requirements of the trainer environment as setup.py states them (``--verify``)."""
    install, extras = setup_requirements(root)
    return install + extras["gpu"]


def sglang_requirements(root: Path = ROOT) -> list[str]:
    _, extras = setup_requirements(root)
    return extras["sglang"] + ["pyyaml"]  # the key wrapper imports armor_megatron (config: yaml)


def te_requirement(requirements: list[str]) -> Requirement:
    found = [Requirement(r) for r in requirements if canonicalize_name(Requirement(r).name) == "transformer-engine"]
    if len(found) != 1:
        raise EnvError("setup.py's gpu extra must name transformer-engine exactly once")
    return found[0]


def trainer_spec(cuda_major: int, torch: str, root: Path = ROOT) -> EnvSpec:
    """The trainer's resolvable requirements: TE's ``pytorch`` extra (a source package) replaced by
    its prebuilt core for `cuda_major` plus the extension's own requirements, torch pinned to `torch`."""
    reqs = trainer_requirements(root)
    te = te_requirement(reqs)
    core = Requirement(str(te))
    # extras as TE's markers spell them (``extra == "core-cu13"``): older pips compare them verbatim
    core.extras = {canonicalize_name(e) for e in te.extras if e != "pytorch"} | {f"core-cu{cuda_major}"}
    out = [str(core) if canonicalize_name(Requirement(r).name) == "transformer-engine" else r for r in reqs]
    return EnvSpec("trainer", (*out, torch, *TE_TORCH_REQUIRES))


def sglang_spec(root: Path = ROOT) -> EnvSpec:
    return EnvSpec("sglang", tuple(sglang_requirements(root)))


# ----------------------------------------------------------------------------- resolving
def platform_tags(glibc: tuple[int, int] = GLIBC) -> list[str]:
    """manylinux tags a Linux x86-64 machine with this glibc accepts, newest first (pip does not
    expand ``--platform manylinux_2_X`` to the older ones itself)."""
    major, minor = glibc
    tags = [f"manylinux_{major}_{m}_x86_64" for m in range(minor, 16, -1)]
    return tags + ["manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64"]


def pip_environ(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The environment pip runs in: no configuration files, no PIP_* setting but how to reach the index."""
    env = {k: v for k, v in (os.environ if environ is None else environ).items() if not k.startswith("PIP_")}
    env.update({k: v for k, v in (os.environ if environ is None else environ).items() if k in PIP_ENV_KEPT})
    env["PIP_CONFIG_FILE"] = os.devnull
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


def pip_command(requirements, report: str, target: str, index_url: str, *, no_deps: bool = False) -> list[str]:
    cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--report", report, "--target", target]
    cmd += ["--python-version", PYTHON_VERSION, "--implementation", "cp", "--only-binary=:all:"]
    cmd += [f"--platform={t}" for t in platform_tags()]
    cmd += ["--index-url", index_url] + (["--no-deps"] if no_deps else [])
    return cmd + list(requirements)


def resolve(requirements, index_url: str = INDEX_URL, *, no_deps: bool = False, timeout: float = 1800) -> list[dict]:
    """pip's report ``install`` entries for `requirements` on the target (no package is installed)."""
    with tempfile.TemporaryDirectory(prefix="armor-envs-") as tmp:
        report = os.path.join(tmp, "report.json")
        cmd = pip_command(requirements, report, os.path.join(tmp, "target"), index_url, no_deps=no_deps)
        proc = subprocess.run(cmd, env=pip_environ(), capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0:
            errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("ERROR")] or proc.stderr.splitlines()
            raise EnvError(" / ".join(errors[-3:]).strip() or f"pip exited {proc.returncode}")
        with open(report) as f:
            return json.load(f)["install"]


def torch_cuda_major(entry: dict) -> int:
    """The CUDA major version a torch wheel was built with, from its requirements (nvidia-cudnn-cu<N>)."""
    for dep in entry["metadata"].get("requires_dist", []):
        m = re.match(r"nvidia-cudnn-cu(\d+)\b", dep)
        if m:
            return int(m.group(1))
    raise EnvError(f"torch {entry['metadata']['version']} declares no nvidia-cudnn-cu<N>: not a CUDA build")


@dataclasses.dataclass(frozen=True)
class Pin:
    name: str
    version: str
    sha256: str | None
    filename: str


def pins_of(report_install: list[dict]) -> list[Pin]:
    pins = []
    for entry in report_install:
        info = entry["download_info"]
        hashes = info.get("archive_info", {}).get("hashes", {})
        pins.append(
            Pin(
                canonicalize_name(entry["metadata"]["name"]),
                entry["metadata"]["version"],
                hashes.get("sha256"),
                info["url"].rsplit("/", 1)[-1],
            )
        )
    return sorted(pins, key=lambda p: p.name)


def summary(name: str, pins) -> str:
    versions = {p.name: p.version for p in pins}
    return f"{name}: " + " ".join(f"{pkg}=={versions[pkg]}" if pkg in versions else f"{pkg}=-" for pkg in SUMMARY)


def lock_text(spec: EnvSpec, pins: list[Pin], index_url: str, pip_version: str, today: str) -> str:
    lines = [
        f"# {spec.name} environment: CPython {PYTHON_VERSION}, Linux x86-64 (glibc >= {GLIBC[0]}.{GLIBC[1]})",
        f"# Written by tools/check_envs.py on {today} (pip {pip_version}, {index_url}); do not edit.",
        "# Resolved from: " + ", ".join(spec.requirements),
        f"#   pip install --require-hashes --no-deps -r tools/envs/{spec.lock_path.name}",
    ]
    lines += [f"# then:   {cmd}" for cmd in spec.post_install]
    lines.append("")
    for p in pins:
        lines.append(f"{p.name}=={p.version}" + (f" \\\n    --hash=sha256:{p.sha256}" if p.sha256 else ""))
    return "\n".join(lines) + "\n"


def write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def sglang_torch(index_url: str = INDEX_URL, root: Path = ROOT) -> str:
    """The torch requirement of the sglang extra's sglang release (its metadata pins one)."""
    sglang = next(r for r in sglang_spec(root).requirements if canonicalize_name(Requirement(r).name) == "sglang")
    entry = resolve([sglang], index_url, no_deps=True)[0]
    torch = [Requirement(d) for d in entry["metadata"].get("requires_dist", []) if Requirement(d).name == "torch"]
    if not torch or torch[0].marker is not None:
        raise EnvError(f"{sglang} declares no plain torch requirement")
    return str(torch[0])


def resolve_env(name: str, index_url: str = INDEX_URL) -> tuple[EnvSpec, list[Pin]]:
    """Resolve environment `name`; the trainer's TE core follows the CUDA major of its torch.
    ``shared`` (the trainer and the SGLang servers in one environment) takes sglang's torch."""
    if name == "sglang":
        spec = sglang_spec()
    else:
        torch = sglang_torch(index_url)  # the trainer and shared environments alike: one torch, one NCCL
        cuda = torch_cuda_major(resolve([torch], index_url, no_deps=True)[0])
        spec = trainer_spec(cuda, torch=torch)
        if name == "shared":
            spec = EnvSpec("shared", spec.requirements + sglang_spec().requirements)
    pins = pins_of(resolve(spec.requirements, index_url))
    if name != "sglang":
        versions = {p.name: p.version for p in pins}
        te = next((p for p in pins if p.name == "transformer-engine"), None)
        if te is None or versions.get(f"transformer-engine-cu{cuda}") != te.version:
            raise EnvError(f"{name}: transformer-engine and transformer-engine-cu{cuda} at one version did not resolve")
        build = f"pip install --no-build-isolation --no-deps transformer-engine-torch=={te.version}"
        spec = dataclasses.replace(spec, post_install=(f"{build}   # compiles against the torch above (needs nvcc)",))
    return spec, pins


# ----------------------------------------------------------------------------- verifying
def read_lock(path: Path) -> dict[str, str]:
    """``{canonical name: version}`` of a lock file."""
    pins = {}
    for line in path.read_text().splitlines():
        m = re.match(r"^([A-Za-z0-9._-]+)==([^\s\\]+)", line)
        if m:
            pins[canonicalize_name(m.group(1))] = m.group(2)
    return pins


def target_environment() -> dict[str, str]:
    env = default_environment()
    env.update(
        python_version=PYTHON_VERSION,
        python_full_version=f"{PYTHON_VERSION}.0",
        sys_platform="linux",
        platform_system="Linux",
        platform_machine="x86_64",
        os_name="posix",
        implementation_name="cpython",
        platform_python_implementation="CPython",
    )
    return env


def verify_lock(requirements, pins: dict[str, str], name: str) -> None:
    """Raise EnvError when a requirement (markers evaluated for the target) is missing from or
    excluded by the lock's pins."""
    env = target_environment()
    for text in requirements:
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate({**env, "extra": ""}):
            continue
        version = pins.get(canonicalize_name(req.name))
        if version is None:
            raise EnvError(f"{name} lock has no {req.name} (setup.py requires {text})")
        if not req.specifier.contains(Version(version), prereleases=True):
            raise EnvError(f"{name} lock pins {req.name}=={version}, but setup.py requires {text}")


def shared_wheels_problem(trainer: dict[str, str], sglang: dict[str, str]) -> str | None:
    """One line naming the first of `SHARED_WHEELS` the two environments' pins disagree on, or None.

    ``{canonical name: version}`` of each environment. A package both must hold and one lacks is a
    disagreement too.
    """
    for wanted in SHARED_WHEELS:
        names = sorted(
            {n for n in (*trainer, *sglang) if n == wanted or (wanted.endswith("-cu") and n.startswith(wanted))}
        )
        for name in names or [wanted]:
            a, b = trainer.get(name, "-"), sglang.get(name, "-")
            if a != b:
                why = (
                    "one NCCL communicator (weight_sync distributed)"
                    if "nccl" in name
                    else "CUDA IPC (weight_sync tensor)"
                )
                return (
                    f"the trainer lock pins {name}=={a}, the sglang lock {name}=={b}: {why} spans both "
                    "environments and needs one version (re-resolve: tools/check_envs.py)"
                )
    return None


def verify(root: Path = ROOT, lock_dir: Path | None = None) -> list[str]:
    """Check every lock against setup.py, and the two against each other; returns the summary lines."""
    lock_dir = lock_dir or root / "tools" / "envs"
    lines, locked = [], {}
    for name, reqs in (("trainer", trainer_requirements(root)), ("sglang", sglang_requirements(root))):
        path = lock_dir / f"{name}-py{PYTHON_VERSION.replace('.', '')}.lock"
        if not path.is_file():
            raise EnvError(f"{path}: no such lock (run tools/check_envs.py)")
        pins = locked[name] = read_lock(path)
        te = [Requirement(r) for r in reqs if canonicalize_name(Requirement(r).name) == "transformer-engine"]
        # the extension is built after the lock is installed; the lock holds its core at the same version
        reqs = [r for r in reqs if canonicalize_name(Requirement(r).name) != "transformer-engine"]
        reqs += [f"transformer-engine{te[0].specifier}"] if te else []
        verify_lock(reqs, pins, name)
        cores = [n for n in pins if re.fullmatch(r"transformer-engine-cu\d+", n)]
        if te and [pins[n] for n in cores] != [pins["transformer-engine"]]:
            raise EnvError(f"{name} lock holds no transformer-engine-cu<N> at transformer-engine's version")
        lines.append(summary(name, [Pin(n, v, None, "") for n, v in pins.items()]))
    problem = shared_wheels_problem(locked["trainer"], locked["sglang"])
    if problem:
        raise EnvError(problem)
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="check_envs.py", description=__doc__.split("\n")[0])
    parser.add_argument("--env", choices=(*LOCKED, "all"), default="all")
    parser.add_argument(
        "--shared", action="store_true", help="also ask whether the trainer and SGLang resolve as one environment"
    )
    parser.add_argument("--index-url", default=INDEX_URL)
    parser.add_argument("--no-write", action="store_true", help="resolve and print; leave the lock files alone")
    parser.add_argument("--verify", action="store_true", help="offline: the committed locks satisfy setup.py")
    args = parser.parse_args(argv)
    try:
        if args.verify:
            print("\n".join(verify()))
            return 0
        pip_version = subprocess.run(
            [sys.executable, "-m", "pip", "--version"], capture_output=True, text=True, check=True
        ).stdout.split()[1]
        today = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
        resolved = {}
        for name in ("trainer", "sglang") if args.env == "all" else (args.env,):
            resolved[name] = resolve_env(name, args.index_url)
            print(summary(name, resolved[name][1]) + f" ({len(resolved[name][1])} packages)", flush=True)
            for cmd in resolved[name][0].post_install:
                print(f"  then: {cmd}")
        for name, path in ((n, LOCK_DIR / f"{n}-py{PYTHON_VERSION.replace('.', '')}.lock") for n in LOCKED):
            if name not in resolved and path.is_file():  # the other lock as written: the pair must agree
                resolved[name] = (None, [Pin(n, v, None, "") for n, v in read_lock(path).items()])
        if len(resolved) == len(LOCKED):
            versions = {n: {p.name: p.version for p in pins} for n, (_, pins) in resolved.items()}
            problem = shared_wheels_problem(versions["trainer"], versions["sglang"])
            if problem:
                raise EnvError(problem + "; no lock written")
        for spec, pins in resolved.values():
            if spec is not None and not args.no_write:
                write_atomic(spec.lock_path, lock_text(spec, pins, args.index_url, pip_version, today))
                print(f"  wrote {spec.lock_path.relative_to(ROOT)}")
        if args.shared:
            try:
                _, pins = resolve_env("shared", args.index_url)
                print(summary("shared", pins) + f" ({len(pins)} packages): resolves (no lock: not a tested setup)")
            except (EnvError, subprocess.TimeoutExpired) as err:
                print(f"shared: does not resolve: {err}")
    except (EnvError, subprocess.TimeoutExpired) as err:
        print(f"check_envs: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
