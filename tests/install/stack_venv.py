"""Build a venv holding one TorchRec release's pairing, then add torchrec_swp the way a user does.

    python tests/install/stack_venv.py .venv --stack 1.9     # TorchRec 1.9.2, torch 2.14.1, fbgemm-gpu-cpu 1.9.0
    python tests/install/stack_venv.py .venv-tr18 --stack 1.8
    python tests/install/stack_venv.py .venv --check-only    # the wheel against an existing venv (make test)

In order:

1. a fresh venv with the pairing only, as a TorchRec user on the CPU has it from PyPI:
   ``requirements/stack-X.txt`` (torch, fbgemm-gpu-cpu, TorchRec's own needs), then
   ``requirements/torchrec-X.txt`` with ``--no-deps`` (TorchRec's metadata names the CUDA fbgemm-gpu);
2. ``pip freeze`` of that environment;
3. the wheel built from this checkout, installed **with** its dependencies, as ``pip install``
   of a user would;
4. ``pip freeze`` again: torch, every fbgemm distribution and TorchRec must be unchanged and no
   fbgemm added; anything else the wheel brought is listed. Any change to the stack fails here,
   naming it, and the venv is left unmarked (``make`` builds it again next time);
5. the wheel's metadata: no ``fbgemm`` requirement, no exact (``==``) torch pin;
6. ``import torchrec_swp.integrations.torchrec.pipelines`` from outside the checkout, with the
   installed wheel, printing no version warning (the pairing is a tested one);
7. this repository's tools (``requirements/dev.txt``) and the checkout in editable mode over the
   wheel, for development; the stack is checked once more (a tool must not move it either).

``--check-only`` runs 3-5 as a dry run (``pip install --dry-run --report``) against a venv that
already exists (tests/unit/test_packaging.py); ``--add-wheel`` runs 2-6 on an existing
environment (``make gpu-check`` adds the wheel to the CUDA stack so).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
REQ = ROOT / "requirements"
#: The distributions that make up a user's stack: the install must not touch them.
STACK = re.compile(r"^(torch|torchrec|fbgemm[-_].*|fbgemm)$")


def log(msg: str) -> None:
    print(f"[stack_venv] {msg}", flush=True)


def run(*cmd: str | Path, capture: bool = False, cwd: Path | None = None) -> str:
    argv = [str(c) for c in cmd]
    proc = subprocess.run(argv, cwd=cwd, text=True, stdout=subprocess.PIPE if capture else None)
    if proc.returncode != 0:
        raise SystemExit(f"stack_venv: failed ({proc.returncode}): {' '.join(argv)}")
    return proc.stdout if capture else ""


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def freeze(python: Path) -> dict[str, str]:
    """name -> version of every distribution ``python`` sees (editable installs by their version too)."""
    out = run(python, "-m", "pip", "list", "--format=json", "--disable-pip-version-check", capture=True)
    return {canonical(d["name"]): d["version"] for d in json.loads(out)}


def stack_of(dists: dict[str, str]) -> dict[str, str]:
    return {n: v for n, v in dists.items() if STACK.match(n)}


def diff(before: dict[str, str], after: dict[str, str]) -> list[str]:
    lines = []
    for name in sorted(set(before) | set(after)):
        old, new = before.get(name), after.get(name)
        if old != new:
            lines.append(f"{name}: {old or '(absent)'} -> {new or '(removed)'}")
    return lines


def check_unchanged(before: dict[str, str], after: dict[str, str], what: str) -> None:
    changed = diff(stack_of(before), stack_of(after))
    if changed:
        raise SystemExit(f"stack_venv: {what} changed the user's stack: " + "; ".join(changed))
    kept = ", ".join(f"{n} {v}" for n, v in sorted(stack_of(after).items()))
    log(f"{what}: torch, fbgemm and TorchRec unchanged ({kept})")


def build_wheel(python: Path) -> Path:
    """The wheel of this checkout, built in a temporary folder."""
    out = Path(tempfile.mkdtemp(prefix="swp-wheel-"))
    started = time.monotonic()
    # With the environment's own setuptools where it has one (no index needed), else pip's
    # isolated build (which fetches pyproject.toml's build requirements).
    has_setuptools = subprocess.run([str(python), "-c", "import setuptools"], capture_output=True).returncode == 0
    isolation = ["--no-build-isolation"] if has_setuptools else []
    # setuptools copies the package through ROOT/build/lib and never empties it: a module removed
    # from the checkout since an earlier build would ship in the wheel (seen: engine/unrolled.py)
    shutil.rmtree(ROOT / "build", ignore_errors=True)
    run(python, "-m", "pip", "wheel", "--quiet", "--no-deps", *isolation, "--wheel-dir", out, ROOT)
    (wheel,) = out.glob("torchrec_swp-*.whl")
    log(f"built {wheel.name} in {time.monotonic() - started:.0f} s")
    return wheel


def check_metadata(wheel: Path) -> list[str]:
    """The wheel's requirements; SystemExit if one names fbgemm or pins torch exactly."""
    import zipfile

    with zipfile.ZipFile(wheel) as z:
        (meta,) = [n for n in z.namelist() if n.endswith(".dist-info/METADATA")]
        text = z.read(meta).decode()
    requires = [line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("Requires-Dist:")]
    bad = [r for r in requires if "fbgemm" in r.lower() or re.match(r"torch\s*(\(|)\s*==", r)]
    if bad:
        raise SystemExit(f"stack_venv: the wheel's metadata names {bad}: it must name no fbgemm and pin no torch")
    log("wheel requires: " + "; ".join(requires))
    return requires


def dry_run(python: Path, wheel: Path) -> None:
    """What ``pip install WHEEL`` would do in ``python``'s environment: nothing of the stack may move."""
    report = Path(tempfile.mkdtemp(prefix="swp-report-")) / "report.json"
    run(python, "-m", "pip", "install", "--dry-run", "--quiet", "--report", report, wheel)
    items = json.loads(report.read_text())["install"]
    would = {canonical(i["metadata"]["name"]): i["metadata"]["version"] for i in items}
    touched = sorted(n for n in would if STACK.match(n))
    if touched:
        raise SystemExit(f"stack_venv: pip install {wheel.name} would install {touched} beside {python}")
    listed = ", ".join(f"{n} {v}" for n, v in would.items()) or "nothing new"
    log(f"pip install {wheel.name} beside {python} would install: {listed}")


def check_import(python: Path) -> None:
    """The installed wheel imports from outside the checkout (from the environment's own
    site-packages), with no version warning."""
    code = (
        "import sys, torchrec_swp, torchrec_swp.integrations.torchrec.pipelines as p; "
        "print(sys.prefix); print(torchrec_swp.__file__)"
    )
    with tempfile.TemporaryDirectory() as cwd:
        proc = subprocess.run([str(python), "-c", code], cwd=cwd, text=True, capture_output=True)
    lines = proc.stdout.strip().splitlines()
    prefix, imported = (Path(x).resolve() for x in lines[-2:]) if len(lines) >= 2 else (Path("/x"), Path("/"))
    if proc.returncode != 0 or prefix not in imported.parents or "torchrec_swp" in proc.stderr:
        raise SystemExit(f"stack_venv: the installed wheel does not import cleanly:\n{proc.stdout}{proc.stderr}")
    log(f"import from the wheel: {imported}")


def add_wheel(python: Path) -> dict[str, str]:
    """Steps 2-6 on the environment of ``python``: the wheel installed as a user installs it
    (with its dependencies), checked; returns the distributions found before it."""
    before = freeze(python)
    wheel = build_wheel(python)
    check_metadata(wheel)
    run(python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", wheel)
    after = freeze(python)
    check_unchanged(before, after, f"pip install {wheel.name}")
    log("the install added: " + "; ".join(diff(before, after)))
    check_import(python)
    return before


def build(venv: Path, stack: str, fresh_python: str) -> None:
    started = time.monotonic()
    venv = venv.absolute()
    if venv.is_symlink() or venv.exists():
        shutil.rmtree(venv) if not venv.is_symlink() else venv.unlink()
    log(f"{venv}: a fresh venv with TorchRec {stack}'s pairing ({REQ / f'stack-{stack}.txt'})")
    run(fresh_python, "-m", "venv", venv)
    python = venv / "bin/python"
    pip = [python, "-m", "pip", "--disable-pip-version-check"]
    run(*pip, "install", "--quiet", "-r", REQ / f"stack-{stack}.txt")
    run(*pip, "install", "--quiet", "--no-deps", "-r", REQ / f"torchrec-{stack}.txt")
    log(f"the user's environment: {len(freeze(python))} distributions, {time.monotonic() - started:.0f} s")
    before = add_wheel(python)

    run(*pip, "install", "--quiet", "-r", REQ / "dev.txt")
    run(*pip, "install", "--quiet", "--no-deps", "--no-build-isolation", "-e", ROOT)
    check_unchanged(before, freeze(python), "the development tools (requirements/dev.txt)")
    (venv / ".installed").write_text(f"stack {stack}\n")
    log(f"{venv} ready in {time.monotonic() - started:.0f} s")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("venv", type=Path)
    parser.add_argument("--stack", choices=("1.8", "1.9"), help="the TorchRec release whose pairing to build")
    parser.add_argument("--check-only", action="store_true", help="dry-run the wheel against an existing venv")
    parser.add_argument(
        "--add-wheel", action="store_true",
        help="install the wheel into the existing environment VENV (steps 2-6), as make gpu-check does",
    )  # fmt: skip
    parser.add_argument("--python", default=sys.executable, help="the Python to make the venv with")
    args = parser.parse_args(argv)
    args.venv = args.venv.absolute()
    if args.check_only:
        if not (args.venv / "bin/python").exists():
            raise SystemExit(f"stack_venv: {args.venv} has no bin/python: build it first (make install)")
        wheel = build_wheel(args.venv / "bin/python")
        check_metadata(wheel)
        dry_run(args.venv / "bin/python", wheel)
        return
    if args.add_wheel:
        add_wheel(args.venv / "bin/python")
        return
    if args.stack is None:
        parser.error("--stack 1.8|1.9 is needed to build a venv")
    build(args.venv, args.stack, args.python)


if __name__ == "__main__":
    main()
