# Two commands on a fresh machine: `make run` (the main job) and `make test` (the test suite).
# Both build the venvs they need on first use (tests/install/stack_venv.py, below).

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
VENV18 ?= .venv-tr18
STAMP18 := $(VENV18)/.installed
export PATH := $(abspath $(VENV))/bin:$(PATH)

.PHONY: install run quickstart bench lint test test-1.8 test-fast upstream-suite gpu-check stream-check clean

install: $(STAMP)

# Each venv holds one TorchRec release's own pairing (requirements/stack-*.txt, TorchRec with
# --no-deps), then torchrec_swp's built wheel installed the way a user installs it, checked to
# change none of torch, fbgemm and TorchRec, then the tools of requirements/dev.txt and the
# checkout in editable mode (tests/install/stack_venv.py says each step as it runs).
# .venv: TorchRec 1.9.2, torch 2.14.1 (PyPI's CUDA build, run on the CPU), fbgemm-gpu-cpu 1.9.0:
# what `make run` and the whole suite use.
VENV_INPUTS := setup.py pyproject.toml requirements/dev.txt tests/install/stack_venv.py
$(STAMP): $(VENV_INPUTS) requirements/stack-1.9.txt requirements/torchrec-1.9.txt
	$(PYTHON) tests/install/stack_venv.py $(VENV) --stack 1.9

# .venv-tr18: TorchRec 1.8.0, torch 2.13.0 (CPU build), fbgemm-gpu-cpu 1.8.0: `make test` runs the
# parity tests against upstream 1.8.0 on it, and the fast tests that reach TorchRec.
$(STAMP18): $(VENV_INPUTS) requirements/stack-1.8.txt requirements/torchrec-1.8.txt
	$(PYTHON) tests/install/stack_venv.py $(VENV18) --stack 1.8

# The main job: the DLRM example on 2 CPU ranks (gloo), launched through torchx, with
# torchrec_swp's TrainPipelineSparseDist. ARGS go to examples/dlrm/train.py (see --help); they are
# checked before anything starts, and a failed job ends with one line saying why.
ARGS ?=
run: $(STAMP)
	$(PY) examples/dlrm/launch.py --timeline out/run/timeline.png $(ARGS)

# A shorter first look: 20 steps that print the plan and every step's loss.
quickstart: $(STAMP)
	$(PY) -m torch.distributed.run --standalone --nproc_per_node 2 examples/quickstart.py

# Side-by-side benchmarks with upstream (out/bench/, out/timeline/, out/pp/); about an hour (the
# scripts' times in docs/benchmarks.md added up):
# pipelines vs upstream, ours' step split at its task functions, the engine's own cost, overlap with peers (a self-tuning pipeline
# among them), what tuning costs a job, timelines, pipeline parallelism vs Maglev, the simulator vs real runs, and
# profile -> search -> run on the DLRM example.
bench: $(STAMP)
	$(PY) benchmarks/compare.py && $(PY) benchmarks/task_split.py && $(PY) benchmarks/engine_cost.py && \
	$(PY) benchmarks/overlap.py && $(PY) benchmarks/tuning_cost.py && \
	$(PY) benchmarks/timeline.py && $(PY) benchmarks/pp.py && $(PY) benchmarks/sim_vs_real.py && \
	$(PY) benchmarks/two_loads_blocks.py && \
	$(PY) benchmarks/close_loop.py

# Lint, then the whole suite on TorchRec 1.9.2's pairing, slow multi-process tests included (the
# parity tests of CHECKED_PARITY under the CPU stream checker), then on TorchRec 1.8.0's pairing the
# parity tests against upstream 1.8.0 (CHECKED_PARITY under the checker there too) and the fast
# tests that reach TorchRec (tests/conftest.py marks those whose imports never reach it
# torchrec_free: another TorchRec cannot change their result).
test: lint $(STAMP18)
	$(PY) -m pytest $(ON_BOTH_CORES) -m "not serial" $(addprefix --deselect=,$(CHECKED_PARITY))
	$(PY) -m pytest -m serial
	SWP_STREAM_CHECK=1 $(PY) -m pytest $(ON_BOTH_CORES) -m parity $(CHECKED_PARITY)
	$(VENV18)/bin/python -m pytest $(ON_BOTH_CORES) -m "($(TEST18)) and not serial" $(addprefix --deselect=,$(CHECKED_PARITY))
	$(VENV18)/bin/python -m pytest -m "($(TEST18)) and serial"
	SWP_STREAM_CHECK=1 $(VENV18)/bin/python -m pytest $(ON_BOTH_CORES) -m parity $(CHECKED_PARITY)

# Two pytest workers (pytest-xdist), each running whole test files in order (module fixtures are
# computed once); tests/conftest.py collects the longest files first. A 2-rank test's ranks then
# share the 2 cores with the other worker's test: the suite's timeouts allow for it. Tests marked
# serial (their result depends on measured times) run afterwards, one at a time.
ON_BOTH_CORES := -n 2 --dist loadfile

# ruff's rules and import order, then mypy over the package (pyproject.toml); a finding fails `make test`.
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy --python-executable $(VENV)/bin/python

TEST18 := parity or every_release or (not multiprocess and not slow and not torchrec_free)

# Parity tests that `make test` runs under the CPU stream checker (SWP_STREAM_CHECK=1): bit-identical
# to upstream and no unsynchronised access or early free in our tasks. Not in it: PT2 and
# CompAutograd (dynamo traces the checker's modes: not bit-identical). See docs/gpu_check.md.
CHECKED_PARITY := tests/dist/test_input_dist_group.py tests/dist/test_parity_foundation.py \
	tests/dist/test_parity_fused_prefetch.py tests/dist/test_parity_semisync_eval_staged.py \
	tests/dist/test_parity_lite_compiled.py::test_lite_equals_upstream_bit_for_bit \
	tests/unit/test_async_inplace_copy.py tests/unit/test_user_filled_batches.py \
	tests/dist/test_maglev_parity.py tests/dist/test_parity_pec.py \
	tests/dist/test_parity_experimental.py \
	tests/dist/test_parity_stashing.py \
	tests/dist/test_parity_cpu_sparse.py::test_eval_cpu_sparse_equals_upstream_bit_for_bit \
	tests/dist/test_parity_gradient_accumulation.py

# What `make test` runs on TorchRec 1.8.0: the parity tests against upstream and the fast tests
# that reach TorchRec.
test-1.8: $(STAMP18)
	$(VENV18)/bin/python -m pytest $(ON_BOTH_CORES) -m "($(TEST18)) and not serial"
	$(VENV18)/bin/python -m pytest -m "($(TEST18)) and serial"

# Upstream's own pipeline test files, run with upstream's classes and with ours swapped in, on
# both TorchRec versions (needs a torchrec git checkout: TORCHREC_REPO; see docs/upstream_suite.md).
TORCHREC_REPO ?=
upstream-suite: $(STAMP) $(STAMP18)
	@test -n "$(TORCHREC_REPO)" || { echo "make upstream-suite: set TORCHREC_REPO to a torchrec git checkout"; exit 2; }
	$(PY) tools/upstream_suite.py --torchrec-repo $(TORCHREC_REPO) --rev HEAD --force-cpu
	$(VENV18)/bin/python tools/upstream_suite.py --torchrec-repo $(TORCHREC_REPO) --rev release/v1.8.0 --force-cpu

# Only the fast, single-process tests.
test-fast: $(STAMP)
	$(PY) -m pytest $(ON_BOTH_CORES) -m "not multiprocess and not slow and not serial"
	$(PY) -m pytest -m "not multiprocess and not slow and serial"

# The pipelines' real tasks under the CPU stream checker (SWP_STREAM_CHECK=1, torchrec_swp.streamcheck),
# then mutants: each compiled wait / event record removed and each record_stream call site ignored,
# one at a time (tools/stream_check.py; docs/gpu_check.md). Exit 1 if a pipeline is not clean.
stream-check: $(STAMP)
	$(PY) tools/stream_check.py

# What only a CUDA device can check (docs/gpu_check.md), into out/gpu_check/: CUDA stream tests,
# parity with upstream, step time and an overlap trace on one GPU. Runs in .venv-gpu, made over the
# Python whose torch finds the GPU (TorchRec's CUDA stack pip-installed there where a package index
# is reachable). Without a CUDA device: one line, exit 0. GPU_CHECK_ARGS: e.g. --parts ab.
gpu-check:
	@$(PYTHON) benchmarks/gpu_check.py $(GPU_CHECK_ARGS)

clean:
	rm -rf $(VENV) $(VENV18) build *.egg-info
