"""The commands of the README and of the docs pages run as written.

Every fenced ```bash block of README.md, then of each docs/*.md page (in name order), runs, in
order, each block as one bash script (``set -e``, so ``source .venv/bin/activate`` carries to the
next line of its block) from the root of a temporary copy of the checkout (its files as git sees
them, the venvs linked in), so that what the commands write (``out/``, checkpoints) never lands
in, or overwrites, the user's checkout. ``make test`` lines are left out: CI runs exactly that
command (``.ci/run``), and here it would run this test again. A block right after a
``<!-- not run by tests: REASON -->`` line is skipped, with its reason. Sample output lives in
```text blocks, which are not run.

The blocks include the README's ``make run``, the DLRM example's other launches and the profile
-> plan -> run loop of the auto-scheduler (docs/dlrm_example.md), training with evaluation
(docs/train_and_eval.md), checkpoints, resume and a fault drill (docs/long_jobs.md) and 4 ranks
(docs/cluster.md).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SKIP = re.compile(r"<!-- not run by tests: (?P<reason>[^>]+) -->")


def pages() -> list[Path]:
    """README.md, then every docs page, in the order their blocks run."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def bash_blocks(text: str) -> list[tuple[str, str | None]]:
    """``(script, skip reason or None)`` for every ```bash block of a page, in order."""
    blocks = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        if lines[i].strip() == "```bash":
            j = i + 1
            while lines[j].strip() != "```":
                j += 1
            previous = next((ln for ln in reversed(lines[:i]) if ln.strip()), "")
            skip = SKIP.search(previous)
            body = [ln for ln in lines[i + 1 : j] if not re.match(r"\s*make test\b", ln)]
            blocks.append(("\n".join(body), skip["reason"].strip() if skip else None))
            i = j
        i += 1
    return blocks


def test_the_readme_has_the_two_set_up_commands_and_runs_the_rest() -> None:
    readme = (ROOT / "README.md").read_text()
    blocks = bash_blocks(readme)
    scripts = "\n".join(script for script, skip in blocks if skip is None)
    assert any(line.split("#")[0].strip() == "make run" for line in scripts.splitlines())
    assert "\nmake test" in readme
    for page in pages():
        assert all(reason for _, reason in bash_blocks(page.read_text()) if reason is not None), page.name


def make_run_args(script: str) -> list[list[str]]:
    """The arguments of each ``make run ARGS="..."`` line of a block."""
    return [shlex.split(m[1]) for m in re.finditer(r'^\s*make run ARGS="([^"]*)"', script, re.M)]


def test_the_make_runs_of_the_blocks_not_run_take_their_arguments() -> None:
    """A block left out of the run below (a dedicated test runs its command, or it needs a cluster) still names options
    that exist, in a combination the example accepts: each of its ``make run ARGS="..."`` lines
    through launch.py's parser and train.py's own checks (``parse_args``: what ``make run`` checks
    before torchx starts, but the checkpoint directory, which the block's earlier lines make)."""
    from examples.dlrm.launch import launch_parser
    from examples.dlrm.train import parse_args

    checked = []
    for page in pages():
        for script, skip in bash_blocks(page.read_text()):
            for argv in make_run_args(script) if skip is not None else ():
                launch, train_args = launch_parser().parse_known_args(argv)
                parse_args([*train_args, "--world-size", str(launch.nnodes * launch.nproc_per_node)])
                checked.append((page.name, argv))
    assert len(checked) >= 5, checked
    with pytest.raises(SystemExit):  # the check can fail: an option the example does not have
        parse_args([*make_run_args('make run ARGS="--steps 3 --no-such-option"')[0]])


def copy_of_checkout(dest: Path) -> Path:
    """The checkout's files (tracked, and untracked ones git does not ignore) copied into
    ``dest`` with their times (so make sees its venvs up to date), the venvs linked, not copied."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=ROOT, capture_output=True, check=True,
    ).stdout.decode().split("\0")
    venvs = (".venv", ".venv-tr18")
    for rel in filter(None, listed):
        if rel in venvs:  # a venv that is a link (git lists it as a file): linked below, like a folder
            continue
        src = ROOT / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
    for venv in venvs:
        if (ROOT / venv).exists():
            (dest / venv).symlink_to(ROOT / venv)
    return dest


@pytest.mark.slow
@pytest.mark.multiprocess
# every page's blocks, several make runs: 397 s alone on 2 cores, 642 s beside make test's other worker
@pytest.mark.timeout(1500)
def test_the_bash_blocks_of_the_readme_and_the_docs_run_as_written(tmp_path: Path) -> None:
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    checkout = copy_of_checkout(tmp_path / "checkout")
    out_before = sorted(p.name for p in (ROOT / "out").iterdir()) if (ROOT / "out").exists() else None
    ran = {}
    for page in pages():
        name = page.relative_to(ROOT).as_posix()
        for script, skip in bash_blocks(page.read_text()):
            if skip is not None:
                continue
            done = subprocess.run(
                ["bash", "-e", "-c", script],
                cwd=checkout, env=env, capture_output=True, text=True, timeout=600, check=False,
            )
            output = (done.stdout + done.stderr)[-4000:]
            why = f"{name}: block failed ({done.returncode}):\n{script}\n--- output ---\n{output}"
            assert done.returncode == 0, why
            ran[name] = ran.get(name, 0) + 1
    # the README's make run, and the pages the README's manual parts moved to
    for name in ("README.md", "docs/dlrm_example.md", "docs/train_and_eval.md", "docs/long_jobs.md", "docs/cluster.md"):
        assert ran.get(name), f"no block of {name} ran"
    assert (checkout / "out").exists()  # the commands wrote there, and not into the checkout:
    assert (sorted(p.name for p in (ROOT / "out").iterdir()) if (ROOT / "out").exists() else None) == out_before
