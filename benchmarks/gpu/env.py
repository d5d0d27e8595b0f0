"""Finding a CUDA torch and preparing ``.venv-gpu`` for ``make gpu-check``. Standard library only:
this runs under whatever ``python3`` the Makefile finds, before anything imports torch.

Steps (``benchmarks/gpu_check.py`` drives them):

1. ``cuda_python``: the first interpreter whose torch sees a CUDA device, among
   ``$GPU_CHECK_PYTHON`` (then the only one asked), ``.venv-gpu/bin/python``, the running
   ``python3``, the other ``python3`` on PATH and ``.venv/bin/python``. Without an NVIDIA driver
   nobody is asked (no torch is imported): there is no CUDA device to find.
2. ``prepare_venv``: ``.venv-gpu``, a virtual environment whose site-packages sees that
   interpreter's packages after its own (a ``.pth`` file calls ``site.addsitedir`` on them), so
   its CUDA torch is reused instead of downloaded again.
3. ``stack_status`` / ``install_stack``: TorchRec 1.9's CUDA stack in ``.venv-gpu``: the pins of
   ``requirements/stack-1.9.txt`` with ``fbgemm-gpu-cpu`` swapped for the CUDA ``fbgemm-gpu`` of
   the same version, torch only when the found one is another release, and
   ``requirements/torchrec-1.9.txt`` with ``--no-deps``; then torchrec_swp's wheel, installed
   the way a user installs it and checked to change none of torch, fbgemm and TorchRec
   (``tests/install/stack_venv.py --add-wheel``, as for the CPU venvs). pip is asked once, with
   short network timeouts; where it cannot reach a package index (the lent GPU machines reach
   none) the stack stays missing and only the parts that need no TorchRec run.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
VENV = ROOT / ".venv-gpu"

PARTS: dict[str, str] = {
    "a": "CUDA stream tests",
    "b": "parity with upstream on one GPU",
    "c": "step time vs upstream on one GPU",
    "d": "overlap trace on one GPU",
}
"""The parts of gpu-check, by letter."""

NEEDS_TORCHREC = ("b", "c", "d")
"""Parts that need TorchRec's CUDA stack (part a needs torch alone)."""

# Not needed on the GPU: the CPU fbgemm build is replaced, numpy stays the one torch came with,
# OR-Tools serves only the auto-scheduler's exact mode.
_SKIPPED_PINS = ("numpy", "ortools")

_PROBE = r"""
import json, sys
out = {"python": sys.executable, "version": "%d.%d" % sys.version_info[:2]}
try:
    import torch
    out["torch"] = torch.__version__
    out["cuda_build"] = torch.version.cuda
    out["cuda"] = bool(torch.cuda.is_available())
    if out["cuda"]:
        out["device"] = torch.cuda.get_device_name(0)
        out["devices"] = torch.cuda.device_count()
except Exception as e:
    out["error"] = "%s: %s" % (type(e).__name__, e)
print(json.dumps(out))
"""

_STACK_PROBE = r"""
import json, traceback
from importlib import metadata
out = {"ok": False}
def version(*names):
    for n in names:
        try:
            return metadata.version(n)
        except metadata.PackageNotFoundError:
            pass
    return None
try:
    import torch
    out["torch"] = torch.__version__
    import fbgemm_gpu  # noqa: F401
    out["fbgemm_gpu"] = version("fbgemm-gpu", "fbgemm_gpu", "fbgemm-gpu-cpu", "fbgemm_gpu_cpu")
    lengths = torch.tensor([1, 2, 3], device="cuda")
    torch.ops.fbgemm.asynchronous_complete_cumsum(lengths)  # a CUDA kernel of fbgemm-gpu
    import torchrec  # noqa: F401
    out["torchrec"] = version("torchrec")
    import torchrec_swp.integrations.torchrec.pipelines  # noqa: F401
    out["ok"] = True
except Exception as e:
    out["error"] = "%s: %s" % (type(e).__name__, str(e).splitlines()[0] if str(e) else "")
print(json.dumps(out))
"""


@dataclass(frozen=True)
class Probe:
    """What one interpreter's torch says about CUDA."""

    python: str
    torch: str | None = None
    cuda: bool = False
    device: str | None = None
    error: str | None = None
    version: str | None = None

    def describe(self) -> str:
        if self.torch is None:
            return f"{self.python}: no torch ({self.error or 'not importable'})"
        if not self.cuda:
            return f"{self.python}: torch {self.torch} sees no CUDA device"
        return f"{self.python}: torch {self.torch} on {self.device}"


@dataclass
class Stack:
    """TorchRec's CUDA stack in ``.venv-gpu``: usable or not, and why."""

    ok: bool
    versions: dict[str, str | None] = field(default_factory=dict)
    error: str | None = None
    installed: list[str] = field(default_factory=list)
    install_error: str | None = None

    def to_json(self) -> dict[str, object]:
        return {
            "ok": self.ok,
            "versions": self.versions,
            "error": self.error,
            "installed": self.installed,
            "install_error": self.install_error,
        }


def parse_parts(text: str) -> str:
    """``"b,a"`` -> ``"ab"``: letters of PARTS, each once, in PARTS order (argparse type)."""
    import argparse

    letters = "".join(dict.fromkeys(text.replace(",", "").strip()))
    if not letters or any(p not in PARTS for p in letters):
        raise argparse.ArgumentTypeError(f"parts must be letters among {''.join(PARTS)}, got {text!r}")
    return "".join(p for p in PARTS if p in letters)


def nvidia_driver() -> bool:
    """An NVIDIA driver is loaded (or its tool is on PATH): without one no torch can see CUDA."""
    return Path("/proc/driver/nvidia/version").exists() or shutil.which("nvidia-smi") is not None


def skip_line(reason: str, parts: str = "".join(PARTS)) -> str:
    """The single line ``make gpu-check`` prints where there is no CUDA device."""
    skipped = ", ".join(f"({p}) {PARTS[p]}" for p in parts)
    return f"gpu-check: no CUDA device found ({reason}); skipped {skipped}"


def candidates(env: dict[str, str] | None = None) -> list[str]:
    """Interpreters to ask, in order (``GPU_CHECK_PYTHON`` alone when set): ``.venv-gpu``'s, the
    running one, every ``python3`` on PATH outside this repository, ``.venv``'s."""
    env = dict(os.environ) if env is None else env
    if env.get("GPU_CHECK_PYTHON"):
        return [env["GPU_CHECK_PYTHON"]]
    # the Makefile puts .venv/bin first on PATH: look past the repository's own venvs too
    elsewhere = [
        str(Path(d) / "python3")
        for d in env.get("PATH", "").split(os.pathsep)
        if d and not Path(d).is_relative_to(ROOT)
    ]
    found = [str(VENV / "bin" / "python"), sys.executable, *elsewhere, str(ROOT / ".venv" / "bin" / "python")]
    unique: dict[str, str] = {}  # real path -> as found
    for python in found:
        if Path(python).exists():
            unique.setdefault(os.path.realpath(python), python)
    return list(unique.values())


def probe(python: str, timeout_s: float = 120.0) -> Probe:
    """Ask ``python`` whether its torch sees a CUDA device (a subprocess: nothing is imported here)."""
    try:
        done = subprocess.run(
            [python, "-c", _PROBE], capture_output=True, text=True, timeout=timeout_s, cwd=ROOT, check=False
        )
        fields = json.loads(done.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.TimeoutExpired, json.JSONDecodeError, IndexError) as e:
        return Probe(python, error=f"{type(e).__name__}: {e}")
    return Probe(
        python=python,
        torch=fields.get("torch"),
        cuda=bool(fields.get("cuda")),
        device=fields.get("device"),
        error=fields.get("error"),
        version=fields.get("version"),
    )


def cuda_python(env: dict[str, str] | None = None) -> tuple[Probe | None, str]:
    """The first interpreter with a CUDA torch, or None and why none was found."""
    if not nvidia_driver():
        return None, "no NVIDIA driver"
    asked = [probe(python) for python in candidates(env)]
    for p in asked:
        if p.cuda:
            return p, p.describe()
    if not asked:
        return None, "no Python interpreter to ask"
    return None, "; ".join(p.describe() for p in asked)


# ------------------------------------------------------------------------------- the stack
def _pins(path: Path) -> dict[str, str]:
    """``{name: version}`` of the ``name==version`` lines of a requirements file."""
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        match = re.fullmatch(r"([A-Za-z0-9_.\-]+)==([^\s;]+)", line)
        if match:
            pins[match.group(1).lower()] = match.group(2)
    return pins


def _release(version: str | None) -> str:
    """``"2.13.0+cu130"`` -> ``"2.13.0"``."""
    return (version or "").split("+", 1)[0]


def stack_requirements(base_torch: str | None, root: Path = ROOT) -> tuple[list[str], list[str]]:
    """``(with_deps, without_deps)``: what pip installs into ``.venv-gpu``.

    TorchRec 1.9's pairing (``requirements/stack-1.9.txt``) with ``fbgemm-gpu-cpu`` replaced by
    ``fbgemm-gpu`` of the same version, without numpy, and torch only where ``base_torch`` is
    another release; TorchRec (``requirements/torchrec-1.9.txt``) goes without its dependencies,
    as on the CPU.
    """
    runtime = _pins(root / "requirements" / "stack-1.9.txt")
    with_deps = []
    for name, version in runtime.items():
        if name in _SKIPPED_PINS:
            continue
        if name == "torch" and _release(base_torch) == _release(version):
            continue
        if name == "fbgemm-gpu-cpu":
            name = "fbgemm-gpu"
        with_deps.append(f"{name}=={version}")
    without_deps = [f"{n}=={v}" for n, v in _pins(root / "requirements" / "torchrec-1.9.txt").items()]
    return with_deps, without_deps


def _site_dirs(python: str) -> list[str]:
    """Where ``python`` finds installed packages (its site-packages folders), in order."""
    code = (
        "import json, site, sys; "
        "print(json.dumps([p for p in sys.path if p.endswith(('site-packages', 'dist-packages'))]))"
    )
    done = subprocess.run([python, "-c", code], capture_output=True, text=True, check=True, cwd="/")
    return json.loads(done.stdout.strip().splitlines()[-1])


def venv_python(venv: Path = VENV) -> Path:
    return venv / "bin" / "python"


def prepare_venv(base: Probe, venv: Path = VENV) -> Path:
    """``.venv-gpu`` over ``base``'s packages (created, or re-created when ``base`` changed); its python."""
    python = venv_python(venv)
    if base.python == str(python):
        return python  # asked first, and already has a CUDA torch
    sites = _site_dirs(base.python)
    stamp = venv / ".base.json"
    wanted = {"python": base.python, "sites": sites}
    if python.exists() and stamp.exists() and json.loads(stamp.read_text()) == wanted:
        return python
    if venv.exists():
        shutil.rmtree(venv)
    subprocess.run([base.python, "-m", "venv", "--without-pip", str(venv)], check=True)
    own = json.loads(
        subprocess.run(
            [str(python), "-c", "import json, site; print(json.dumps(site.getsitepackages()))"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    )[0]
    # After the venv's own site-packages: the base's, with their .pth files processed.
    lines = [f"import site; site.addsitedir({site!r})" for site in sites]
    Path(own, "_gpu_check_base.pth").write_text("\n".join(lines) + "\n")
    stamp.write_text(json.dumps(wanted))
    return python


def stack_status(python: Path | str) -> Stack:
    """Whether TorchRec's CUDA stack imports and runs a CUDA kernel of fbgemm-gpu in ``python``."""
    try:
        done = subprocess.run(
            [str(python), "-c", _STACK_PROBE],
            capture_output=True,
            text=True,
            timeout=300,
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            check=False,
        )
        fields = json.loads(done.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.TimeoutExpired, json.JSONDecodeError, IndexError) as e:
        return Stack(False, error=f"the stack probe failed: {type(e).__name__}: {e}")
    versions = {k: fields.get(k) for k in ("torch", "fbgemm_gpu", "torchrec")}
    return Stack(bool(fields.get("ok")), versions, fields.get("error"))


def install_stack(python: Path | str, base_torch: str | None, log: Path) -> tuple[list[str], str | None]:
    """pip-install the stack into ``python``'s environment; ``(what was asked, error or None)``.

    Short network timeouts and no retries: on a machine that reaches no package index this fails
    within seconds. pip's own settings (``PIP_INDEX_URL``, ``PIP_FIND_LINKS``, ``PIP_NO_INDEX``)
    apply, e.g. to install from a folder of wheels.
    """
    with_deps, without_deps = stack_requirements(base_torch)
    pip = [str(python), "-m", "pip", "install", "--disable-pip-version-check", "--retries", "0", "--timeout", "20"]
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as out:
        for extra, reqs in (([], with_deps), (["--no-deps"], without_deps)):
            done = subprocess.run([*pip, *extra, *reqs], stdout=out, stderr=subprocess.STDOUT, check=False)
            if done.returncode != 0:
                return with_deps + without_deps, f"pip install {' '.join(reqs)} failed: {_last_error(log)}"
        # torchrec_swp itself, as a user adds it to that stack (fails if it would move the stack)
        wheel = [sys.executable, str(ROOT / "tests" / "install" / "stack_venv.py"), str(Path(python).parent.parent)]
        done = subprocess.run([*wheel, "--add-wheel"], stdout=out, stderr=subprocess.STDOUT, check=False)
        if done.returncode != 0:
            return with_deps + without_deps, f"installing torchrec_swp's wheel failed: {_last_error(log)}"
    return with_deps + without_deps, None


def _last_error(log: Path) -> str:
    """The last line of a pip log that says what went wrong."""
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("ERROR")]
    return (errors or lines or ["no output"])[-1][:300]
