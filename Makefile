# DualPath build, test and demo entry points. See README.md.
#   make install   system packages (apt), .venv, editable install with test extras
#   make test      install, host test suite, then the RDMA suite on a real device or in
#                  the SoftRoCE guest (DUALPATH_SKIP_RDMA=1 opts out, loudly; never in CI)
#   make vm CMD=…  run a command inside the SoftRoCE guest, repo at the same path
#   make demo      the main job on embedded defaults
SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.dualpath-installed
# Everything that changes the installed package; a newer one re-runs the install.
INSTALL_INPUTS := pyproject.toml setup.py dualpath/_native/build.py tools/gen_proto.py \
	tools/install-system-packages.sh $(wildcard csrc/*.c csrc/*.h proto/dualpath/v1/*.proto)

.PHONY: install test test-host test-rdma vm demo lint bench clean

install: $(STAMP)

$(STAMP): $(INSTALL_INPUTS)
	PY=$(PY) tools/install-system-packages.sh
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --disable-pip-version-check --upgrade pip setuptools wheel
	$(VPY) -m pip install -q --disable-pip-version-check -e '.[test]'
	touch $@

test: install
	$(MAKE) --no-print-directory lint
	$(MAKE) --no-print-directory test-host
	$(MAKE) --no-print-directory test-rdma

test-host: install
	$(VPY) -m pytest tests/unit tests/integration tests/faults tests/vm -q -p no:cacheprovider

test-rdma: install
	tools/rdma-suite.sh

vm: install
	tools/vm/run.sh "$(CMD)"

demo: install
	$(VENV)/bin/dualpath demo

lint: install
	$(VPY) -m ruff check dualpath tests bench tools && echo "lint: ruff clean"

clean:
	rm -rf build dualpath/_native/_dp*.so dualpath/_native/_dp.c dualpath/v1 *.egg-info
