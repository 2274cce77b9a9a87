# Two entry points for a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.zephon-installed

.PHONY: demo test build lint bench docs clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# The editable installs leave the kernels out (ZEPHON_NO_EXTENSIONS): pip would compile them in
# a throw-away directory at every install, and `build` compiles them in place anyway.
PIP_EDITABLE := ZEPHON_NO_EXTENSIONS=1 $(BIN)/python -m pip install -q --no-build-isolation -e

# Reinstall only when the packaging metadata changes; `build` recompiles changed .pyx files.
$(STAMP): $(BIN)/python pyproject.toml setup.py
	$(BIN)/python -m pip install -q --upgrade pip setuptools wheel "Cython>=3.0" "numpy>=2.0"
	$(PIP_EDITABLE) ".[test]"
	touch $(STAMP)

build: $(STAMP)
	$(BIN)/python setup.py -q build_ext --inplace --parallel 2
	@# An editable install leaves zephon's modules uncompiled, and where PYTHONDONTWRITEBYTECODE
	@# is set nothing caches them: every new process (a fork server, a worker, a test's
	@# subprocess) would compile them again, a tenth of a second each.
	$(BIN)/python -m compileall -q zephon

# Each compiled module against its stub: mypy reads the stubs, stubtest checks they say what the
# built modules hold.
KERNEL_MODULES := $(patsubst zephon/_core/%.pyi,zephon._core.%,$(wildcard zephon/_core/*.pyi))

lint: build
	$(BIN)/ruff check zephon tests asv_bench docs/examples
	$(BIN)/ruff format --check zephon tests asv_bench
	$(BIN)/mypy
	$(BIN)/lint-imports --no-cache
	$(BIN)/python -m mypy.stubtest --mypy-config-file pyproject.toml --allowlist tests/stubtest_allowlist.txt $(KERNEL_MODULES)

# The test-only extras: torch pinned to the CPU build this machine kind keeps on disk (an
# unpinned torch would pull a multi-GB CUDA build), then torchdata and the docs tools.
TEST_STAMP := $(VENV)/.zephon-test-extras
$(TEST_STAMP): $(STAMP)
	$(BIN)/python -m pip install -q "torch==2.13.0"
	$(PIP_EDITABLE) ".[test,torch,docs]"
	@# Mosaic's MDS writer for the MDS tests, without its requirements (they pull torchvision):
	@# only what its writer module imports. Zephon's own MDS reader needs none of it.
	$(BIN)/python -m pip install -q --no-deps "streaming-community==0.14.2" "zstd==1.5.7.2" \
		"brotli==1.2.1" "python-snappy==0.7.3" "cramjam==2.14.0" "pillow>=10"
	@# LitData's writer for the LitData tests, likewise without its requirements (torch>=2.4 from
	@# PyPI is a CUDA build); Zephon reads LitData chunks itself.
	$(BIN)/python -m pip install -q --no-deps "litdata==0.2.76" "lightning-utilities==0.15.3"
	touch $(TEST_STAMP) $(DOCS_STAMP)  # the docs extra came with it: no third install

test: $(TEST_STAMP) lint docs
	$(BIN)/python -m pytest -p no:cacheprovider

# The docs extra (sphinx, myst-parser) goes into the same venv; autodoc imports the built package.
DOCS_STAMP := $(VENV)/.zephon-docs-installed
$(DOCS_STAMP): $(STAMP)
	$(PIP_EDITABLE) ".[docs]"
	touch $(DOCS_STAMP)

docs: $(DOCS_STAMP) build
	$(BIN)/sphinx-build -W --keep-going -b html docs docs/_build/html

demo: build
	$(BIN)/zephon demo

bench: build
	$(BIN)/zephon bench

clean:
	rm -rf build dist zephon/_core/*.c zephon/_core/*.so zephon_loader.egg-info
