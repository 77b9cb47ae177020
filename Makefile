# Two entry points for a fresh machine (Python 3.11, no GPU):
#   make train   set up .venv and run the main job
#   make test    set up .venv and run the test suite
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed

.PHONY: setup train test bench clean setup-titan03 train-titan03 test-titan03

setup: $(STAMP)

# torch first, pinned to the CPU wheel on local disk (constraints/cpu.txt), so
# nothing afterwards can pull a multi-GB CUDA build. torchtitan 0.2.2 goes in
# --no-deps: its runtime deps are our [titan] extra.
$(STAMP): pyproject.toml constraints/cpu.txt
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q -c constraints/cpu.txt torch==2.13.0 numpy
	$(PIP) install -q -c constraints/cpu.txt --no-deps torchtitan==0.2.2
	$(PIP) install -q -c constraints/cpu.txt -e ".[titan,bench,test]"
	touch $(STAMP)

# The main job: torchtitan's llama3 debug model on 2 CPU processes with core
# attention disaggregation on (train_configs/debug_cpu.toml), about 1-2 minutes on 2 cores
# (1 min 11 s measured: docs/records/torchtitan_cpu.md).
# The console shows rank 0 (torchrun's filter, as torchtitan's run_train.sh does);
# every rank: make train LOG_RANK=0,1
LOG_RANK ?= 0
train: $(STAMP)
	OMP_NUM_THREADS=1 $(VENV)/bin/torchrun --standalone --nproc_per_node 2 --local-ranks-filter $(LOG_RANK) \
		-m torchtitan_ext.train --job.config_file train_configs/debug_cpu.toml

# The planner report (balance, bytes, plan time of every policy on the paper's distributions).
bench: $(STAMP)
	$(PY) scripts/bench_planner.py --doclens pretrain --ranks 512 --tokens-per-rank 131072
	$(PY) scripts/bench_planner.py --doclens prolong --ranks 512 --tokens-per-rank 131072

# One process: the suite is CPU-bound on 2 cores (two pytest-xdist workers ran it in 824 s
# against 883 s, each test ~1.8x slower: docs/records/test_suite.md).
test: $(STAMP)
	$(PY) -m pytest -q --durations=30 tests

# The torchtitan 0.3.0 lane (torchtitan_ext.titan03, docs/guides/torchtitan03.md) in its own venv:
# the two torchtitans cannot share one. Same order as `setup`: torch pinned first, torchtitan
# --no-deps, then its runtime deps as our [titan03] extra under the same constraint.
VENV03  := .venv-titan03
PY03    := $(VENV03)/bin/python
STAMP03 := $(VENV03)/.installed

setup-titan03: $(STAMP03)

$(STAMP03): pyproject.toml constraints/cpu.txt
	$(PYTHON) -m venv $(VENV03)
	$(PY03) -m pip install -q -c constraints/cpu.txt torch==2.13.0 numpy
	$(PY03) -m pip install -q -c constraints/cpu.txt --no-deps torchtitan==0.3.0
	$(PY03) -m pip install -q -c constraints/cpu.txt -e ".[titan03,test]"
	$(PY03) -c "import torch; assert torch.__version__.startswith('2.13.0'), torch.__version__"
	touch $(STAMP03)

# The 0.3 main job: `make train`'s, on torchtitan 0.3.0: the llama3 debug model on 2 CPU
# processes with CAD on, from the config registry (torchtitan_ext/titan03/config_registry.py).
train-titan03: $(STAMP03)
	OMP_NUM_THREADS=1 $(VENV03)/bin/torchrun --standalone --nproc_per_node 2 --local-ranks-filter $(LOG_RANK) \
		-m torchtitan_ext.titan03.train --module torchtitan_ext.titan03 --config llama3_debugmodel_ca

# The 0.3 lane's tests only (tests/test_titan03*.py; the 0.2.2 venv skips them).
test-titan03: $(STAMP03)
	OMP_NUM_THREADS=1 $(PY03) -m pytest -q --durations=10 tests/test_titan03_config.py tests/test_titan03_train.py \
		tests/test_titan03_3d.py tests/test_titan03_pp.py

clean:
	rm -rf $(VENV) $(VENV03) build *.egg-info
