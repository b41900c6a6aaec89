# The two set-up commands of the README: `make demo` and `make test`.
PYTHON ?= python3
# torch to install when none is importable (the GPU machines bring their own).
TORCH ?= torch==2.13.0

.PHONY: install demo test

install:
	$(PYTHON) -c "import torch" 2>/dev/null || $(PYTHON) -m pip install "$(TORCH)"
	$(PYTHON) -m pip install ninja pytest
	[ -n "$$UCX_HOME" ] || $(PYTHON) -m pip install libucx-cu13
	$(PYTHON) -m pip install --no-build-isolation -e .

# One rank per GPU where there are 2 or more, else 2 ranks on CPU (the demo says why).
demo: install
	nproc=$$($(PYTHON) -c "import torch; print(max(2, torch.cuda.device_count()))"); \
	$(PYTHON) -m torch.distributed.run --nproc-per-node=$$nproc examples/p2p_demo.py

test: install
	$(PYTHON) -m pytest -q tests
