# Bistouri: `make demo` sets everything up and shows the profiler at work;
# `make test` runs the whole test suite. Both install what they need (apt
# packages, a virtualenv) and are idempotent. Run them as root.

SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
CLANG ?= clang
# One object per architecture, each from its own vmlinux.h (bpf/vmlinux/ARCH): x86-64's keeps its
# old name, arm64's is bistouri.arm64.bpf.o (bistouri/bpf/loader.py picks by the machine).
BPF_OBJ := bistouri/bpf/_bpfobj/bistouri.bpf.o
BPF_OBJ_ARM64 := bistouri/bpf/_bpfobj/bistouri.arm64.bpf.o
BPF_SRC := bpf/bistouri.bpf.c
# Every header under bpf/ (bistouri.h, unwind_step.h, *.bpf.h): the object rebuilds when any changes.
BPF_HDR := $(wildcard bpf/*.h)
BPF_CFLAGS := -target bpf -O2 -g -Wall -Werror -Werror=undef -Ibpf

# Debian packages, by purpose. `make deps` installs the missing ones.
APT_BUILD := clang llvm libbpf-dev libbpf1 bpftool gcc g++ make binutils elfutils
APT_SYMBOLIZER := llvm-19 postgresql libc6-dbg
APT_UI := chromium
# qemu-system-arm and qemu-user-static: the arm64 scenario's VM and its image build (make molecule-arm64).
APT_DEPLOY := qemu-system-x86 qemu-system-arm qemu-user-static qemu-utils debootstrap systemd-container openssh-client \
	dpkg-dev lintian rpm rpmlint fakeroot
# promtool checks the shipped alert rules (tests/unit/test_monitoring.py).
APT_MONITORING := prometheus
# The load balancer in front of two symbolizer instances (tests/integration/test_fleet_load.py).
APT_FLEET := haproxy
# Go programs built by the tests, named from their pclntab (tests/unit/symbolizer/test_gopclntab.py,
# tests/integration/test_record.py): Debian's Go toolchain.
APT_GO := golang-go
APT_ALL := $(APT_BUILD) $(APT_SYMBOLIZER) $(APT_UI) $(APT_DEPLOY) $(APT_MONITORING) $(APT_FLEET) $(APT_GO)
APT_DEMO := $(APT_BUILD) llvm-19
# What the benchmarks compare with: bpftrace and perf (sampling cost, JIT names, `record`),
# BCC's CO-RE runqlat and offcputime (libbpf-tools: the episode hooks' cost, bench_episode).
APT_BENCH := bpftrace linux-perf nodejs openjdk-17-jdk-headless libbpf-tools

export PATH := $(CURDIR)/$(VENV)/bin:/usr/sbin:/usr/bin:/sbin:/bin:$(PATH)
export PYTHONDONTWRITEBYTECODE := 1

.PHONY: all deps deps-demo venv venv-runtime bpf fixtures lint typecheck test test-fast test-bpf \
	test-service test-ui test-vm test-py39 demo bench clean help

all: bpf venv

help:
	@echo "make demo     set up, start the symbolizer and the agent, cause pressure, show the UI"
	@echo "make test     lint, typecheck and run every test (needs root for BPF and PSI)"
	@echo "make test-fast     only the tests that need nothing (no root, services, browser or VM)"
	@echo "make test-bpf      the tests that need root: BPF programs, cgroups, PSI, mounts"
	@echo "make test-service  the tests of real processes: agent, symbolizer, PostgreSQL, HAProxy"
	@echo "make test-ui       the UI tests in headless Chromium"
	@echo "make test-vm       the packages in the VM image's tree and molecule in qemu"
	@echo "make test-py39     the unit tests on Python 3.9 (the floor) with Debian 11's dependencies"
	@echo "make bench    run the benchmarks under bench/"
	@echo "make package  build the .deb and .rpm packages into dist/"
	@echo "make molecule run the molecule scenarios in qemu VMs"

# --- system packages ---------------------------------------------------------
# Installs the listed packages that are missing; the stamp name changes with the list.
define apt_install
	@mkdir -p .cache
	@missing=$$(for p in $(1); do dpkg-query -W -f='$${Status}\n' $$p 2>/dev/null \
		| grep -q '^install ok installed' || echo $$p; done); \
	if [ -n "$$missing" ]; then \
		echo "Installing Debian packages:" $$missing; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
			--no-install-recommends $$missing >/dev/null; \
	fi
	@touch $@
endef

APT_STAMP := .cache/apt-$(shell echo $(APT_ALL) | md5sum | cut -c1-8).stamp
APT_DEMO_STAMP := .cache/apt-demo-$(shell echo $(APT_DEMO) | md5sum | cut -c1-8).stamp
APT_BENCH_STAMP := .cache/apt-bench-$(shell echo $(APT_BENCH) | md5sum | cut -c1-8).stamp

$(APT_STAMP):
	$(call apt_install,$(APT_ALL))

$(APT_DEMO_STAMP):
	$(call apt_install,$(APT_DEMO))

$(APT_BENCH_STAMP):
	$(call apt_install,$(APT_BENCH))

deps: $(APT_STAMP)
deps-demo: $(APT_DEMO_STAMP)

# --- virtualenv ----------------------------------------------------------------
# The demo needs only the runtime dependencies; the tests add the dev tools.
define make_venv
	@test -x $(VPY) || $(PYTHON) -m venv $(VENV) || \
		(apt-get install -y -qq python3-venv >/dev/null && $(PYTHON) -m venv $(VENV))
	$(VPY) -m pip install -q --disable-pip-version-check -r $(1)
	$(VPY) -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e .
	@touch $@
endef

$(VENV)/.stamp: requirements/dev.txt pyproject.toml | deps
	$(call make_venv,requirements/dev.txt)

$(VENV)/.stamp-runtime: requirements/runtime.txt pyproject.toml | deps-demo
	$(call make_venv,requirements/runtime.txt)

venv: $(VENV)/.stamp
venv-runtime: $(VENV)/.stamp-runtime

# --- BPF object (precompiled, shipped inside the package) ----------------------
$(BPF_OBJ): $(BPF_SRC) $(BPF_HDR) bpf/vmlinux/x86/vmlinux.h | deps-demo
	@mkdir -p $(dir $@)
	$(CLANG) $(BPF_CFLAGS) -D__TARGET_ARCH_x86 -Ibpf/vmlinux/x86 -c $< -o $@

$(BPF_OBJ_ARM64): $(BPF_SRC) $(BPF_HDR) bpf/vmlinux/arm64/vmlinux.h | deps-demo
	@mkdir -p $(dir $@)
	$(CLANG) $(BPF_CFLAGS) -D__TARGET_ARCH_arm64 -Ibpf/vmlinux/arm64 -c $< -o $@

bpf: $(BPF_OBJ) $(BPF_OBJ_ARM64)

# --- tests ---------------------------------------------------------------------
fixtures: | deps-demo
	$(MAKE) -s -C tests/fixtures

# The layers contract (which package may import which) is a test: lint runs it alone, in about a second.
lint: venv
	$(VENV)/bin/ruff check bistouri tests bench testkit
	$(VENV)/bin/ruff format --check bistouri tests bench testkit
	$(VENV)/bin/pytest -q -p no:cacheprovider tests/unit/test_layers.py

typecheck: venv
	$(VENV)/bin/mypy

test: bpf venv fixtures lint typecheck
	$(VENV)/bin/pytest -q $(PYTEST_ARGS) tests

# Parts of the suite by what the tests need (markers given in tests/conftest.py; docs/testing.md).
# A test with several needs is in each of their targets; `make test` runs every test once.
# Pure tests: unprivileged and self-contained, so any user may run them (checked as nobody:
# docs/testing.md).
test-fast: bpf venv fixtures
	$(VENV)/bin/pytest -q -m pure $(PYTEST_ARGS) tests

# Root: BPF programs in the kernel, cgroups, PSI, mounts, other users (the VM tests apart).
test-bpf: bpf venv fixtures
	$(VENV)/bin/pytest -q -m "(bpf or root) and not vm" $(PYTEST_ARGS) tests

# Real processes: the agent, the symbolizer, `record`, PostgreSQL, HAProxy.
test-service: bpf venv fixtures
	$(VENV)/bin/pytest -q -m service $(PYTEST_ARGS) tests

# The UI in headless Chromium.
test-ui: venv fixtures
	$(VENV)/bin/pytest -q -m browser $(PYTEST_ARGS) tests

# The packages, installed in the VM image's tree (systemd-nspawn) and by molecule in qemu.
test-vm: bpf venv fixtures
	$(VENV)/bin/pytest -q -m vm $(PYTEST_ARGS) tests

# Python 3.9, the floor (Debian 11's python3): the unit tests under pyenv's 3.9, in
# .venv39 with Debian 11's versions of the dependencies (requirements/py39.txt). Without a 3.9 it says
# so and passes. Not part of `make test` (docs/testing.md says what it costs).
PYTHON39 ?= $(firstword $(wildcard $(HOME)/.pyenv/versions/3.9.*/bin/python3.9))
VENV39 := .venv39

$(VENV39)/.stamp: requirements/py39.txt pyproject.toml
	@test -x $(VENV39)/bin/python || $(PYTHON39) -m venv $(VENV39)
	$(VENV39)/bin/python -m pip install -q --disable-pip-version-check -r requirements/py39.txt
	$(VENV39)/bin/python -m pip install -q --disable-pip-version-check --no-deps -e .
	@touch $@

test-py39: bpf fixtures
ifeq ($(PYTHON39),)
	@echo "test-py39: no Python 3.9 (pyenv's 3.9.x, or PYTHON39=...): skipped"
else
	$(MAKE) -s $(VENV39)/.stamp
	$(VENV39)/bin/pytest -q -p no:cacheprovider $(PYTEST_ARGS) tests/unit
endif

bench: $(APT_BENCH_STAMP) bpf venv fixtures
	$(VPY) -m bench $(BENCH_ARGS)

demo: bpf venv-runtime fixtures
	$(VPY) -m tests.demo $(DEMO_ARGS)

clean:
	rm -rf $(BPF_OBJ) $(BPF_OBJ_ARM64) build dist *.egg-info .pytest_cache .mypy_cache .ruff_cache
	$(MAKE) -s -C tests/fixtures clean

-include packaging/packaging.mk
-include ansible/ansible.mk
