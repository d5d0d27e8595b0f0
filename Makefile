# Two commands on a fresh machine: `make run` (the main job) and `make test` (the test suite).
# Both create .venv and install the pinned CPU stack on first use.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
export PATH := $(abspath $(VENV))/bin:$(PATH)

.PHONY: install run test test-fast clean

install: $(STAMP)

$(STAMP): setup.py requirements/runtime.txt requirements/torchrec.txt requirements/dev.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet -r requirements/runtime.txt -r requirements/dev.txt
	$(PY) -m pip install --quiet --no-deps -r requirements/torchrec.txt
	$(PY) -m pip install --quiet --no-deps --no-build-isolation -e .
	$(PY) -c "import torchrec_swp.integrations.torchrec.pipelines"
	touch $(STAMP)

# The main job: 2 CPU ranks (gloo) training with torchrec_swp's TrainPipelineSparseDist.
run: $(STAMP)
	$(PY) -m torch.distributed.run --standalone --nproc_per_node 2 examples/quickstart.py $(ARGS)

# The whole suite, slow multi-process tests included (as CI runs it).
test: $(STAMP)
	$(PY) -m pytest

# Only the fast, single-process tests.
test-fast: $(STAMP)
	$(PY) -m pytest -m "not multiprocess and not slow"

clean:
	rm -rf $(VENV) build *.egg-info
