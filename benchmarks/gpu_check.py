"""``make gpu-check``: what only a CUDA device can check, in four parts (docs/gpu_check.md).

    python3 benchmarks/gpu_check.py [--parts abcd] [--out out/gpu_check] [--budget-s 540] [--no-install]

(a) the CUDA tests of tests/gpu (stream pool, engine on real streams, record_stream);
(b) parity of all our pipelines with upstream on one GPU; (c) ours vs upstream step time on the
DLRM example; (d) a profiler trace of SparseDist and the overlap of its H2D and input-dist device
work with compute. Results: ``OUT/results.json`` and ``OUT/summary.md`` (+ traces, logs).

Without a CUDA device it prints one line saying so and what it skipped, and exits 0. With one:
it prepares ``.venv-gpu`` over the Python whose torch found the device, makes sure TorchRec's
CUDA stack is there (pip, if a package index is reachable), and runs the parts there; (b)-(d)
are skipped, saying why, where that stack cannot be had. Exit status 1 if a part failed.

Environment: ``GPU_CHECK_PYTHON`` (the interpreter to use), ``GPU_CHECK_OUT``,
``GPU_CHECK_BUDGET_S``, ``GPU_CHECK_INSTALL=0`` (defaults of the options below).
Standard library only: this runs before anything imports torch.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.gpu import env


def parse_args(argv: list[str] | None, environ: dict[str, str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--parts", type=env.parse_parts, default="".join(env.PARTS), help="letters among abcd (default: all)"
    )
    parser.add_argument(
        "--out", type=Path, default=Path(environ.get("GPU_CHECK_OUT") or "out/gpu_check"), help="(default: %(default)s)"
    )
    parser.add_argument(
        "--budget-s",
        type=float,
        default=float(environ.get("GPU_CHECK_BUDGET_S") or 540),
        help="every part must end within this many seconds from the start (default: %(default)s)",
    )
    parser.add_argument(
        "--no-install",
        action="store_true",
        default=environ.get("GPU_CHECK_INSTALL") == "0",
        help="never run pip: use the stack as found",
    )
    args = parser.parse_args(argv)
    if args.budget_s <= 0:
        parser.error("--budget-s must be > 0")
    return args


def main(argv: list[str] | None = None) -> int:
    environ = dict(os.environ)
    args = parse_args(argv, environ)
    deadline = time.time() + args.budget_s
    base, why = env.cuda_python(environ)
    if base is None:
        print(env.skip_line(why, args.parts))
        return 0
    print(f"gpu-check: CUDA found by {why}", flush=True)
    out = args.out if args.out.is_absolute() else env.ROOT / args.out
    out.mkdir(parents=True, exist_ok=True)
    python = env.prepare_venv(base)
    stack = env.stack_status(python)
    if not stack.ok and not args.no_install and any(p in env.NEEDS_TORCHREC for p in args.parts):
        print(
            f"gpu-check: TorchRec's CUDA stack not usable ({stack.error}); installing it into {env.VENV.name}",
            flush=True,
        )
        asked, error = env.install_stack(python, base.torch, out / "pip.log")
        stack = env.stack_status(python)
        stack.installed, stack.install_error = asked, error
    print(f"gpu-check: stack {'ok' if stack.ok else 'not usable'}: {json.dumps(stack.versions)}", flush=True)
    stack_file = env.VENV / "stack.json"  # results.json repeats it: OUT keeps few files
    stack_file.write_text(json.dumps(stack.to_json(), indent=2) + "\n")
    command = [
        str(python), "-m", "benchmarks.gpu.run", "--parts", args.parts, "--out", str(out),
        "--stack", str(stack_file), "--deadline", str(deadline),
    ]  # fmt: skip
    child_env = {**environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(env.ROOT), environ.get("PYTHONPATH")]))}
    return subprocess.run(command, cwd=env.ROOT, env=child_env, check=False).returncode


if __name__ == "__main__":
    sys.exit(main())
