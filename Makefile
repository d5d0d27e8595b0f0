# Two commands on a fresh machine: `make run` (the main job) and `make test` (the test suite).
# Both create .venv and install the pinned CPU stack on first use.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
export PATH := $(abspath $(VENV))/bin:$(PATH)

.PHONY: install run quickstart bench test test-fast clean

install: $(STAMP)

$(STAMP): setup.py requirements/runtime.txt requirements/torchrec.txt requirements/dev.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet -r requirements/runtime.txt -r requirements/dev.txt
	$(PY) -m pip install --quiet --no-deps -r requirements/torchrec.txt
	$(PY) -m pip install --quiet --no-deps --no-build-isolation -e .
	$(PY) -c "import torchrec_swp.integrations.torchrec.pipelines"
	touch $(STAMP)

# The main job: the DLRM example on 2 CPU ranks (gloo), launched through torchx, with
# torchrec_swp's TrainPipelineSparseDist. ARGS go to examples/dlrm/train.py (see --help).
ARGS ?= --steps 200
run: $(STAMP)
	$(VENV)/bin/torchx run -s local_cwd dist.ddp -j 1x2 --script examples/dlrm/train.py -- $(ARGS)

# A shorter first look: 20 steps that print the plan and every step's loss.
quickstart: $(STAMP)
	$(PY) -m torch.distributed.run --standalone --nproc_per_node 2 examples/quickstart.py

# Side-by-side benchmarks with upstream (out/bench/, out/timeline/); about 15 minutes.
bench: $(STAMP)
	$(PY) benchmarks/compare.py && $(PY) benchmarks/overlap.py && $(PY) benchmarks/timeline.py

# The whole suite, slow multi-process tests included (as CI runs it).
test: $(STAMP)
	$(PY) -m pytest

# Only the fast, single-process tests.
test-fast: $(STAMP)
	$(PY) -m pytest -m "not multiprocess and not slow"

clean:
	rm -rf $(VENV) build *.egg-info
