"""torchrec_swp is a guest in the user's environment: its wheel names no fbgemm and pins no torch,
installing it moves none of torch, fbgemm and TorchRec, and import says in one line where the
stack around it is not a tested pairing.

The full check (a fresh venv holding a TorchRec release's pairing, the wheel installed into it
with its dependencies, ``pip freeze`` before and after) runs whenever ``make`` builds a venv:
tests/install/stack_venv.py. Here: its checks can fail, and the wheel of this checkout passes
them against the venv running the tests.
"""

from __future__ import annotations

import re
import subprocess
import sys
import warnings
import zipfile
from pathlib import Path

import pytest

from tests.install import stack_venv
from torchrec_swp.integrations.torchrec import compat

ROOT = Path(__file__).resolve().parents[2]


def _wheel(tmp_path: Path, requires: list[str]) -> Path:
    wheel = tmp_path / "torchrec_swp-0.0.0-py3-none-any.whl"
    meta = "Metadata-Version: 2.1\nName: torchrec_swp\nVersion: 0.0.0\n" + "".join(
        f"Requires-Dist: {r}\n" for r in requires
    )
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("torchrec_swp-0.0.0.dist-info/METADATA", meta)
    return wheel


@pytest.mark.parametrize("bad", ["fbgemm-gpu-cpu==1.9.0", "fbgemm_gpu", "torch==2.14.1", "torch (==2.13.0)"])
def test_metadata_check_refuses_fbgemm_and_exact_torch(tmp_path: Path, bad: str) -> None:
    with pytest.raises(SystemExit, match="must name no fbgemm and pin no torch"):
        stack_venv.check_metadata(_wheel(tmp_path, ["torch>=2.13", bad]))


def test_metadata_check_accepts_ranges(tmp_path: Path) -> None:
    requires = ["torch>=2.13", 'torchrec<1.10,>=1.8; extra == "torchrec"']
    assert stack_venv.check_metadata(_wheel(tmp_path, requires)) == requires


def test_a_moved_stack_fails_naming_what_moved() -> None:
    before = {"torch": "2.14.1", "fbgemm-gpu-cpu": "1.9.0", "torchrec": "1.9.2", "numpy": "2.4.6"}
    stack_venv.check_unchanged(before, {**before, "numpy": "2.5.0", "torchrec-swp": "0.2.0"}, "install")
    for after, named in [
        ({**before, "torch": "2.13.0+cpu"}, "torch: 2.14.1 -> 2.13.0+cpu"),
        ({**before, "fbgemm-gpu": "1.9.0"}, "fbgemm-gpu: (absent) -> 1.9.0"),
        ({k: v for k, v in before.items() if k != "torchrec"}, "torchrec: 1.9.2 -> (removed)"),
    ]:
        with pytest.raises(SystemExit, match=named.replace("(", r"\(").replace(")", r"\)").replace("+", r"\+")):
            stack_venv.check_unchanged(before, after, "install")


@pytest.mark.slow
def test_the_wheel_of_this_checkout_would_move_nothing_of_this_stack() -> None:
    """Builds the wheel and asks pip (``--dry-run --report``) what installing it here would do."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "tests/install/stack_venv.py"), sys.prefix, "--check-only"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "wheel requires: torch>=2.13; typing_extensions>=4.5" in done.stdout
    assert "would install" in done.stdout


def test_setup_declares_no_pins() -> None:
    """Exact pins live in requirements/ only; setup.py's requirements are ranges."""
    text = (ROOT / "setup.py").read_text()
    assert "==" not in text and "fbgemm-gpu-cpu" not in text.split('"""', 2)[2]


def test_one_python_floor_everywhere() -> None:
    """The package needs Python 3.11 (a failure's report is an exception note, ``add_note``): the
    wheel's ``python_requires``, ruff's target, the install guide and the README say the same, and
    this interpreter has it."""
    assert 'python_requires=">=3.11"' in (ROOT / "setup.py").read_text()
    assert 'target-version = "py311"' in (ROOT / "pyproject.toml").read_text()
    assert "Python 3.11 or newer" in (ROOT / "docs" / "install.md").read_text()
    assert "Python 3.11" in (ROOT / "README.md").read_text()
    assert sys.version_info >= (3, 11)
    assert hasattr(BaseException, "add_note")


def test_dev_tools_do_not_pin_the_stack() -> None:
    pins = [line.split("==")[0] for line in (ROOT / "requirements/dev.txt").read_text().splitlines() if "==" in line]
    assert pins and not [p for p in pins if stack_venv.STACK.match(stack_venv.canonical(p))]


def test_the_dev_extra_names_every_tool_the_project_pins() -> None:
    """``pip install torchrec_swp[dev]`` gives a contributor the tools ``make`` installs from
    requirements/dev.txt (mypy and pytest-xdist were once missing from it): the same names, ranges
    in setup.py, pins in the requirements."""
    text = (ROOT / "setup.py").read_text()
    names = {
        stack_venv.canonical(m) for m in re.findall(r'"([A-Za-z0-9_.-]+)[<>=]', text.split("extras_require", 1)[0])
    }  # EXAMPLES and AUTOSCHED, which the extra unpacks
    dev = re.search(r'"dev": \[(.*?)\]', text, re.S)
    assert dev and "*EXAMPLES" in dev[1] and "*AUTOSCHED" in dev[1]
    names |= {stack_venv.canonical(m) for m in re.findall(r'"([A-Za-z0-9_.-]+)[<>=]', dev[1])}
    pinned = {
        stack_venv.canonical(line.split("==")[0])
        for line in (ROOT / "requirements/dev.txt").read_text().splitlines()
        if "==" in line and not line.startswith("#")
    }
    assert pinned and pinned - names == set()


# ------------------------------------------------------------------------ versions at import
@pytest.mark.parametrize(
    ("torchrec", "torch", "fbgemm"),
    [("1.9.2", "2.14.1", "fbgemm-gpu-cpu 1.9.0"), ("1.9.2", "2.14.0+cu128", "fbgemm-gpu 1.9.0+cu128"),
     ("1.8.0", "2.13.0+cpu", "fbgemm-gpu-cpu 1.8.0")],
)  # fmt: skip
def test_tested_pairings_say_nothing(torchrec: str, torch: str, fbgemm: str) -> None:
    assert compat.untested_stack(torchrec, torch, fbgemm) is None


@pytest.mark.parametrize(
    ("torchrec", "torch", "fbgemm"),
    [("1.9.2", "2.13.0+cpu", "fbgemm-gpu-cpu 1.8.0"), ("1.9.1", "2.14.1", "fbgemm-gpu 1.9.0"),
     ("1.8.0", "2.14.1", "fbgemm-gpu-cpu 1.8.0"), ("1.9.2", "2.14.1", None)],
)  # fmt: skip
def test_an_untested_stack_is_one_line_naming_found_and_tested(torchrec: str, torch: str, fbgemm: str | None) -> None:
    line = compat.untested_stack(torchrec, torch, fbgemm)
    assert line is not None and "\n" not in line
    assert f"found torchrec {torchrec}, torch {torch}, {fbgemm or 'no fbgemm'}" in line
    assert "torchrec 1.9.2 + torch 2.14.x + fbgemm 1.9.0" in line and "torchrec 1.8.0 + torch 2.13.x" in line


def test_import_warns_once_as_one_printed_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compat, "_warned", False)
    monkeypatch.setattr(
        compat, "found_stack", lambda: {"torchrec": "1.9.2", "torch": "2.13.0+cpu", "fbgemm": "fbgemm-gpu-cpu 1.8.0"}
    )
    monkeypatch.setattr(compat, "check_torchrec_version", lambda found=None: "1.9.2")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        compat.installed()
        compat.installed()
    assert [w.category for w in seen] == [compat.UntestedStackWarning]
    printed = warnings.formatwarning(seen[0].message, seen[0].category, seen[0].filename, seen[0].lineno)
    assert printed.count("\n") == 1 and "UntestedStackWarning: untested stack: found torchrec 1.9.2" in printed


def test_this_stack_is_a_tested_pairing() -> None:
    """The venvs make builds hold tested pairings: the suite runs with no version warning."""
    found = compat.found_stack()
    assert compat.untested_stack(found["torchrec"] or "", found["torch"], found["fbgemm"]) is None, found


def test_lint_reads_every_tracked_python_file() -> None:
    """``make lint``'s ``ruff check .`` reads every Python file git tracks: ruff's default exclude
    once held "dist", a directory name anywhere, and hid all of tests/dist."""
    tracked = set(
        subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    )
    shown = subprocess.run(
        [str(Path(sys.executable).parent / "ruff"), "check", ".", "--show-files"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout
    read = {str(Path(line.strip()).resolve().relative_to(ROOT)) for line in shown.splitlines() if line.strip()}
    assert tracked and tracked - read == set()
