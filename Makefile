# The two set-up commands of the README: `make demo` and `make test`.
PYTHON ?= python3
# torch to install when none is importable (the GPU machines bring their own).
TORCH ?= torch==2.13.0
# The build runs against the installed torch (no build isolation), so what it needs is
# installed beside it.
BUILD_DEPS := "setuptools>=64" wheel ninja

# Stamps per Python environment and UCX: switching either installs again.
STAMPS := build/make/$(shell $(PYTHON) -c "import hashlib, sys; print(hashlib.sha1((sys.prefix + ':$(UCX_HOME)').encode()).hexdigest()[:12])")
NATIVE := setup.py pyproject.toml $(shell find csrc -name '*.cpp' -o -name '*.h')

.PHONY: install demo test

install: $(STAMPS)/installed

$(STAMPS)/deps: Makefile
	$(PYTHON) -c "import torch" 2>/dev/null || $(PYTHON) -m pip install "$(TORCH)"
	$(PYTHON) -m pip install $(BUILD_DEPS) pytest
	[ -n "$$UCX_HOME" ] || $(PYTHON) -m pip install libucx-cu13
	mkdir -p $(@D) && touch $@

# Runs only when a native source changed, and then ninja compiles only the changed files
# (setup.py keeps the objects under build/).
$(STAMPS)/installed: $(STAMPS)/deps $(NATIVE)
	$(PYTHON) -m pip install --no-build-isolation -e .
	touch $@

# One rank per GPU where there are 2 or more; with one GPU, 2 ranks share it (smfree beside the
# copy floors: NCCL refuses two ranks on one GPU); with none, 2 ranks on CPU.
demo: install
	nproc=$$($(PYTHON) -c "import torch; print(max(2, torch.cuda.device_count()))"); \
	$(PYTHON) -m torch.distributed.run --nproc-per-node=$$nproc examples/p2p_demo.py

# TESTS: the test files or folders to run (default: all).
TESTS ?= tests
test: install
	$(PYTHON) -m pytest -q $(TESTS)
