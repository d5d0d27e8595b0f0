"""The pure parts of tools/upstream_suite.py: CPU rewriting, module renames, junit parsing, the report.

The tool itself needs a torchrec repository (none in CI); these need nothing but the file.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "tools" / "upstream_suite.py"
_spec = importlib.util.spec_from_file_location("upstream_suite_tool", _PATH)
assert _spec is not None and _spec.loader is not None
us = importlib.util.module_from_spec(_spec)
sys.modules["upstream_suite_tool"] = us
_spec.loader.exec_module(us)

SOURCE = """class T(unittest.TestCase):
    @unittest.skipIf(
        not torch.cuda.is_available(),
        "Not enough GPUs, this test requires at least one GPU",
    )
    def test_a(self) -> None:
        self.device = torch.device("cuda:0")

    @unittest.skipIf(torch.cuda.device_count() <= 1, "two GPUs")
    def test_b(self) -> None:
        pass

    @unittest.skipIf(not torch.cuda.is_available() or SLOW, "mixed condition, kept")
    def test_c(self) -> None:
        s = torch.cuda.Stream()


def runner(rank: int, backend: str = "nccl") -> None:
    device = torch.device("cuda")
"""


def test_force_cpu_rewrites_only_device_only_conditions_and_logs_each_change() -> None:
    text, subs = us.force_cpu(SOURCE, "test_x.py")
    assert "@unittest.skipIf(\n        False,\n" in text
    assert '@unittest.skipIf(False, "two GPUs")' in text
    assert "not torch.cuda.is_available() or SLOW" in text  # a condition with more than CUDA is kept
    assert "torch.cuda.Stream()" in text  # other CUDA calls are left to fail visibly
    assert 'torch.device("cuda' not in text and text.count('torch.device("cpu")') == 2
    assert 'backend: str = "gloo"' in text
    assert [(s.line, s.rule) for s in subs] == [
        (3, "skip-cuda"),
        (7, "device-cpu"),
        (9, "skip-cuda"),
        (18, "backend-gloo"),
        (19, "device-cpu"),
    ]
    assert subs[2].before == "torch.cuda.device_count() <= 1" and subs[2].after == "False"


def test_force_cpu_is_identity_without_cuda() -> None:
    source = "@unittest.skipIf(IS_WINDOWS, 'x')\ndef test(): pass\n"
    assert us.force_cpu(source, "f.py") == (source, [])


def test_rename_modules_replaces_whole_dotted_names_only() -> None:
    source = (
        "from torchrec.distributed.train_pipeline.tests.test_train_pipelines_base import A\n"
        "from torchrec.distributed.train_pipeline.tests.test_train_pipelines_base_extra import B\n"
        'patch("torchrec.distributed.train_pipeline.tests.test_train_pipelines_base.C")\n'
    )
    out = us.rename_modules(
        source, {"torchrec.distributed.train_pipeline.tests.test_train_pipelines_base": "upstream_tests.base"}
    )
    assert out.splitlines() == [
        "from upstream_tests.base import A",
        "from torchrec.distributed.train_pipeline.tests.test_train_pipelines_base_extra import B",
        'patch("upstream_tests.base.C")',
    ]


def test_torchrec_imports() -> None:
    source = (
        "import torch\nfrom torchrec.distributed.tests.util import x\n    import torchrec.a.b\nfrom torchrec import y\n"
    )
    assert us.torchrec_imports(source) == {"torchrec.distributed.tests.util", "torchrec.a.b"}


JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest">
<testcase classname="upstream_tests.test_x.A" name="test_pass" time="0.1"/>
<testcase classname="upstream_tests.test_x.A" name="test_skip"><skipped type="pytest.skip"
  message="no GPU">x</skipped></testcase>
<testcase classname="upstream_tests.test_x.A" name="test_fail"><failure
  message="RuntimeError: boom&#10;more">tb</failure></testcase>
<testcase classname="upstream_tests.test_x.A" name="test_fail"><error
  message="failed on teardown with &quot;AssertionError: 1 != 3&quot;">tb</error></testcase>
<testcase classname="upstream_tests.test_x.B" name="test_group"><failure
  message="ExceptionGroup: Hypothesis found 2 distinct failures. (2 sub-exceptions)">  +-+---
    | ValueError: keys must be unique
    | RuntimeError: unknown parameter type
    | RuntimeError: unknown parameter type
</failure></testcase>
<testcase classname="upstream_tests.test_x.B" name="test_ranks"><failure
  message="AssertionError: 2 != 0 : Detected at least one unsuccessful run, example errors are: "
  >E   RuntimeError: Worker raised AssertionError: Tensor-likes are not close!
E   AssertionError: Tensor-likes are not close!</failure></testcase>
</testsuite></testsuites>"""


def test_parse_junit_merges_teardown_errors_and_digs_out_the_real_errors() -> None:
    results = us.parse_junit(JUNIT)
    assert results["A::test_pass"] == {"outcome": "passed", "reason": ""}
    assert results["A::test_skip"] == {"outcome": "skipped", "reason": "no GPU"}
    assert results["A::test_fail"]["outcome"] == "failed"
    assert results["A::test_fail"]["reason"] == 'RuntimeError: boom; failed on teardown with "AssertionError: 1 != 3"'
    assert results["B::test_group"]["reason"].endswith(
        "[ValueError: keys must be unique; RuntimeError: unknown parameter type]"
    )
    assert results["B::test_ranks"]["reason"].endswith("[AssertionError: Tensor-likes are not close!]")


@pytest.mark.parametrize(
    ("reason", "category"),
    [
        ("RuntimeError: FSDP needs a non-CPU accelerator device", "FSDP needs an accelerator"),
        ("RuntimeError: torch.cuda.Stream requires CUDA support", "test-side CUDA-only code"),
        (
            "ValueError: Unrecognized or unsupported compute kernel: fused_uvm_caching",
            "planner / kernels (CPU lacks the kernel the test asks for)",
        ),
        ("Failed: Timeout >600.0s", "timeout"),
        ("AssertionError: 1 != 3", "other"),
    ],
)
def test_categorize(reason: str, category: str) -> None:
    assert us.categorize(reason) == category


def _report() -> dict:
    up = {
        "A::t1": {"outcome": "passed", "reason": ""},
        "A::t2": {"outcome": "failed", "reason": "E1"},
        "A::t3": {"outcome": "failed", "reason": "RuntimeError: torch.cuda.Stream requires CUDA support"},
    }
    ours = {
        "A::t1": {"outcome": "failed", "reason": "StopIteration"},
        "A::t2": {"outcome": "passed", "reason": ""},
        "A::t3": {"outcome": "failed", "reason": "RuntimeError: torch.cuda.Stream requires CUDA support"},
    }
    return {
        "torchrec_repo": "/r",
        "rev": "HEAD",
        "commit": "0123456789abcdef",
        "commit_date": "2026-08-21",
        "environment": {"torchrec": "1.9.2", "torch": "2.13.0", "python": "3.11"},
        "ours": {"source": "/w/torchrec_swp", "rev": "HEAD", "commit": "abc", "dirty": False},
        "force_cpu": True,
        "timeout_s": 600,
        "started": "now",
        "substitutions": [
            {
                "file": "f.py",
                "line": 3,
                "rule": "skip-cuda",
                "before": "not torch.cuda.is_available()",
                "after": "False",
            }
        ],
        "support_modules": ["torchrec.distributed.tests.m"],
        "files": [{"file": "test_x.py", "wall_s": {"upstream": 10.0, "ours": 12.0}, "rows": us.compare(up, ours)}],
        "constructed": {"ours": {"torchrec_swp.x.TrainPipelineSparseDist": 2}},
        "missed_swaps": [],
    }


def test_compare_counts_and_regressions() -> None:
    report = _report()
    rows = report["files"][0]["rows"]
    assert [r["test"] for r in rows] == ["A::t1", "A::t2", "A::t3"]
    assert us.counts(rows, "upstream")["passed"] == 1 and us.counts(rows, "ours")["failed"] == 2
    assert [(f, r["test"]) for f, r in us.regressions(report)] == [("test_x.py", "A::t1")]


def test_render_markdown_has_counts_differences_categories_and_substitutions() -> None:
    text = us.render_markdown(_report())
    assert "| upstream | 1 | 2 | 0 | 0 | 3 | 10 s |" in text
    assert "| ours | 1 | 2 | 0 | 0 | 3 | 12 s |" in text
    assert (
        "## Ours fails, upstream passes (1)" in text
        and "| test_x.py | A::t1 | passed | failed | StopIteration |" in text
    )
    assert "## Upstream fails, ours passes (1)" in text
    assert "### test-side CUDA-only code (1)" in text
    assert "| f.py | 3 | skip-cuda | `not torch.cuda.is_available()` | `False` |" in text
    assert "Missed swaps: 0" in text


def test_add_hooks_swaps_before_the_first_class_body_and_again_at_the_end() -> None:
    source = (
        '"""doc"""\n'
        "import unittest\n"
        "from torchrec.distributed.train_pipeline.train_pipelines import (\n"
        "    TrainPipelineSparseDist,\n"
        ")\n"
        "\n"
        "class T(unittest.TestCase):\n"
        "    @given(cls=st.sampled_from([TrainPipelineSparseDist]))\n"
        "    def test(self, cls): pass\n"
        "import late\n"
    )
    lines = us.add_hooks(source).splitlines()
    hooks = [i for i, line in enumerate(lines) if "module_loaded(globals())" in line]
    assert hooks == [5, len(lines) - 1]  # after the multi-line import, before `class T`; and last
    assert lines[6] == "" and lines[7].startswith("class T")
