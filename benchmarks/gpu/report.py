"""gpu-check's results: one JSON document, rendered as markdown and as one-line verdicts. Pure.

The document::

    {"meta": {...}, "stack": {...}, "parts": {"a": PART, "b": PART, ...}}

Every PART has ``status`` (``passed``, ``failed``, ``skipped`` or ``error``), ``seconds`` and,
unless skipped, its own figures: ``tests`` (a), ``cases`` (b), ``results`` (c), ``configs`` (d).
A skipped or errored part has a ``reason``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from benchmarks.gpu.env import PARTS

STATUSES = ("passed", "failed", "skipped", "error")
JSON_NAME = "results.json"
MARKDOWN_NAME = "summary.md"


def skipped(reason: str) -> dict[str, Any]:
    return {"status": "skipped", "seconds": 0.0, "reason": reason}


def exit_code(report: Mapping[str, Any]) -> int:
    """0 unless a part failed or raised."""
    return int(any(p["status"] in ("failed", "error") for p in report["parts"].values()))


def write(report: Mapping[str, Any], out: Path) -> tuple[Path, Path]:
    """``results.json`` and ``summary.md`` in ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    (out / JSON_NAME).write_text(json.dumps(report, indent=2, default=str) + "\n")
    (out / MARKDOWN_NAME).write_text(markdown(report))
    return out / JSON_NAME, out / MARKDOWN_NAME


# --------------------------------------------------------------------------- one-liners
def part_line(letter: str, part: Mapping[str, Any]) -> str:
    """``gpu-check (b) parity with upstream on one GPU: passed, 21/21 equal, 95 s``."""
    head = f"gpu-check ({letter}) {PARTS[letter]}: {part['status']}"
    if part["status"] in ("skipped", "error"):
        return f"{head} ({part.get('reason', '')})"
    return f"{head}, {_brief(letter, part)}, {part['seconds']:.0f} s"


def _brief(letter: str, part: Mapping[str, Any]) -> str:
    match letter:
        case "a":
            tests = part["tests"]
            passed = sum(t["outcome"] == "passed" for t in tests)
            return f"{passed}/{len(tests)} tests passed"
        case "b":
            cases = part["cases"]
            equal = sum(c["status"] == "equal" for c in cases)
            return f"{equal}/{len(cases)} runs bit-identical to upstream"
        case "c":
            return "ours/upstream " + ", ".join(f"{_short(r['pipeline'])} {r['ratio']:.3f}" for r in part["results"])
        case "d":
            return "; ".join(
                f"{c['label']}: H2D overlap {_us(c['overlap']['overlap_us_per_step']['h2d'])}/step, "
                f"input dist {_us(c['overlap']['overlap_us_per_step']['input_dist'])}/step"
                for c in part["configs"]
            )
        case _:
            raise ValueError(f"unknown part {letter!r}")


def verdict(report: Mapping[str, Any]) -> str:
    """The last line printed: overall result and the status of each part."""
    parts = report["parts"]
    overall = "FAILED" if exit_code(report) else "passed"
    return f"gpu-check {overall}: " + ", ".join(f"({p}) {parts[p]['status']}" for p in parts)


# ------------------------------------------------------------------------------ markdown
def markdown(report: Mapping[str, Any]) -> str:
    meta, stack, parts = report["meta"], report["stack"], report["parts"]
    versions = stack.get("versions") or {}
    lines = [
        "# gpu-check",
        "",
        (
            f"{meta.get('date', '?')}, {meta.get('device', '?')}; torch {meta.get('torch', '?')} "
            f"(CUDA {meta.get('cuda', '?')}), fbgemm-gpu {versions.get('fbgemm_gpu') or 'absent'}, "
            f"torchrec {versions.get('torchrec') or 'absent'}; Python {meta.get('python', '?')}."
        ),
    ]
    if not stack.get("ok"):
        lines += ["", f"TorchRec's CUDA stack is not usable here: {stack.get('error') or 'unknown'}."]
        if stack.get("install_error"):
            lines.append(f"Installing it failed: {stack['install_error']}")
    lines += ["", "| part | status | time | summary |", "|---|---|---|---|"]
    for letter, part in parts.items():
        summary = part.get("reason", "") if part["status"] in ("skipped", "error") else _brief(letter, part)
        lines.append(f"| ({letter}) {PARTS[letter]} | {part['status']} | {part['seconds']:.0f} s | {summary} |")
    for letter, part in parts.items():
        if part["status"] in ("skipped", "error") and not _has_figures(letter, part):
            continue
        lines += ["", f"## ({letter}) {PARTS[letter]}", ""]
        lines += _SECTIONS[letter](part)
    return "\n".join(lines) + "\n"


def _has_figures(letter: str, part: Mapping[str, Any]) -> bool:
    return bool(part.get({"a": "tests", "b": "cases", "c": "results", "d": "configs"}[letter]))


def _streams_section(part: Mapping[str, Any]) -> list[str]:
    lines = ["| test | outcome | time |", "|---|---|---|"]
    for t in part.get("tests", []):
        message = f" ({t['message']})" if t.get("message") else ""
        lines.append(f"| `{t['name']}` | {t['outcome']}{message} | {t['seconds']:.2f} s |")
    return lines


def _parity_section(part: Mapping[str, Any]) -> list[str]:
    lines = [
        (
            f"{part.get('steps', '?')} steps per run on one GPU (nccl, world size 1), the test model of "
            "harness/ranks.py and harness/parity.py; outputs, losses, final weights, batch count and StopIteration "
            "call compared bit for bit with upstream's run of the same options."
        ),
        "",
        "| pipeline | ours | batches | result | ours s | upstream s |",
        "|---|---|---|---|---|---|",
    ]
    for c in part.get("cases", []):
        result = c["status"]
        if c.get("difference"):
            result += f": {c['difference']}"
        if c.get("upstream_repeatable") is False:
            result += " (upstream itself differs between two runs)"
        lines.append(
            f"| {c['pipeline']}{_options(c)} | {c['variant']} | {c.get('batches', '-')} | {result} "
            f"| {_seconds(c.get('seconds'))} | {_seconds(c.get('upstream_seconds'))} |"
        )
    return lines


def _bench_section(part: Mapping[str, Any]) -> list[str]:
    lines = [
        (
            f"DLRM {part.get('size', '?')}; {part.get('warmup', '?')} warm-up + {part.get('steps', '?')} measured "
            f"steps each, in blocks of {part.get('block_steps', '?')} steps timed to a device sync, upstream and "
            "ours alternating block by block."
        ),
        "",
        (
            "| pipeline | upstream median / P90 ms | ours median / P90 ms | upstream QPS | ours QPS "
            "| ours / upstream (95% interval) | same losses |"
        ),
        "|---|---|---|---|---|---|---|",
    ]
    for r in part.get("results", []):
        up, us = r["upstream"], r["ours"]
        lo, hi = r["ratio_95"]
        same = "yes" if r["same_losses"] else f"no, max diff {r.get('max_loss_diff', float('nan')):.3g}"
        lines.append(
            f"| {r['pipeline']} | {up['median_ms']:.2f} / {up['p90_ms']:.2f} | {us['median_ms']:.2f} / "
            f"{us['p90_ms']:.2f} | {up['qps']:,.0f} | {us['qps']:,.0f} | **{r['ratio']:.3f}** ({lo:.3f}-{hi:.3f}) "
            f"| {same} |"
        )
    for name, why in (part.get("errors") or {}).items():
        lines.append(f"| {name} | error: {why} | | | | | |")
    return lines


def _trace_section(part: Mapping[str, Any]) -> list[str]:
    lines = [
        (
            f"TrainPipelineSparseDist, DLRM {part.get('size', '?')}; {part.get('steps', '?')} profiled steps after "
            "a warm-up. Device time per step from the trace: busy = union of the category's kernels and copies; "
            "overlap = time it ran while the compute stream ran."
        ),
        "",
        (
            "| plan | step ms | compute busy | H2D busy | H2D overlap (share) | input dist busy "
            "| input dist overlap (share) | trace |"
        ),
        "|---|---|---|---|---|---|---|---|",
    ]
    for c in part.get("configs", []):
        o = c["overlap"]
        busy, over, share = o["busy_us_per_step"], o["overlap_us_per_step"], o["overlap_share"]
        lines.append(
            f"| {c['label']} | {c['step_ms']:.2f} | {_us(busy['compute'])} | {_us(busy['h2d'])} "
            f"| {_us(over['h2d'])} ({_pct(share['h2d'])}) | {_us(busy['input_dist'])} "
            f"| {_us(over['input_dist'])} ({_pct(share['input_dist'])}) | `{c['trace']}` |"
        )
    lines += [
        "",
        "Streams (CUPTI ids): "
        + "; ".join(f"{c['label']}: {c['overlap']['streams']}" for c in part.get("configs", [])),
    ]
    return lines


_SECTIONS = {"a": _streams_section, "b": _parity_section, "c": _bench_section, "d": _trace_section}


def _short(pipeline: str) -> str:
    return pipeline.replace("TrainPipeline", "").replace("Pipeline", "") or pipeline


def _options(case: Mapping[str, Any]) -> str:
    return f" ({case['options']})" if case.get("options") else ""


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _us(value: float) -> str:
    return f"{value / 1000:.3f} ms" if value >= 1000 else f"{value:.0f} us"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.0f}%"
