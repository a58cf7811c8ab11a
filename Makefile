# Two set-up commands: `make demo` and `make test`. Both create .venv if missing and install kiln.
# torch is pinned to the CPU build this machine class carries (2.13.0); the GPU machine has 2.11.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kiln-installed
TORCH ?= torch==2.13.0
TRITON ?= triton==3.6.0

.PHONY: demo test test-all test-gpu bench lines install

install: $(STAMP)

# rich and matplotlib are kiln's bench extra (pip install 'kiln[bench]'): kiln demo and the bench tests use them
$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)" "$(TRITON)" numpy scipy rich matplotlib pytest pytest-timeout pytest-xdist hypothesis expecttest
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/kiln demo

# two pytest-xdist workers, one per core of the 2-core machines, each test process on one thread; a test file
# runs whole in one worker (its module fixtures and shared compiles stay together)
test: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -p no:cacheprovider --timeout=600 -n 2 --dist loadfile

test-all: $(STAMP)
	$(PY) -m pytest -q -m "not gpu"

# On the GPU machine (no package index there): PYTHONPATH=. python3 -m pytest -m gpu
test-gpu:
	PYTHONPATH=. python3 -m pytest -q -m gpu

# records into benchmarks/RESULTS.md (kiln bench alone only prints)
bench: $(STAMP)
	@if $(PY) -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then \
	  $(VENV)/bin/kiln bench --suite micro --device cuda --record && \
	  $(VENV)/bin/kiln bench --suite models --device cuda --budget 1.0,0.5,0.1 --record; \
	else \
	  $(VENV)/bin/kiln bench --suite micro --device cpu --record && \
	  $(VENV)/bin/kiln bench --suite models --cases gpt --device cpu --budget 1.0,0.5,0.1 --record && \
	  $(VENV)/bin/kiln bench --suite user --device cpu --threads 2 --record; \
	fi

# the compiler (kiln/) by folder, then the tools beside it (kiln_bench/)
lines:
	@for d in kiln/*/ ; do printf "%-20s %6s\n" $$d $$(cat $$d*.py $$d*/*.py 2>/dev/null | wc -l); done
	@printf "%-20s %6s\n" "kiln (compiler)" $$(find kiln -name '*.py' | xargs cat | wc -l)
	@printf "%-20s %6s\n" "kiln_bench (tools)" $$(find kiln_bench -name '*.py' | xargs cat | wc -l)
