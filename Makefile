# Bistouri: `make demo` sets everything up and shows the profiler at work;
# `make test` runs the whole test suite. Both install what they need (apt
# packages, a virtualenv) and are idempotent. Run them as root.

SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
ARCH := x86
CLANG ?= clang
BPF_OBJ := bistouri/_bpfobj/bistouri.bpf.o
BPF_SRC := bpf/bistouri.bpf.c
BPF_HDR := bpf/bistouri.h bpf/core_fixes.bpf.h
BPF_CFLAGS := -target bpf -O2 -g -Wall -Werror -Werror=undef -D__TARGET_ARCH_$(ARCH) \
	-Ibpf -Ibpf/vmlinux/$(ARCH)

# Debian packages, by purpose. `make deps` installs the missing ones.
APT_BUILD := clang llvm libbpf-dev libbpf1 bpftool gcc g++ make binutils elfutils
APT_SYMBOLIZER := llvm-19 postgresql
APT_UI := chromium
APT_DEPLOY := qemu-system-x86 qemu-utils debootstrap systemd-container openssh-client \
	dpkg-dev lintian rpm rpmlint fakeroot
APT_ALL := $(APT_BUILD) $(APT_SYMBOLIZER) $(APT_UI) $(APT_DEPLOY)

export PATH := $(CURDIR)/$(VENV)/bin:/usr/sbin:/usr/bin:/sbin:/bin:$(PATH)
export PYTHONDONTWRITEBYTECODE := 1

.PHONY: all deps venv bpf fixtures lint typecheck test test-fast demo bench clean help

all: bpf venv

help:
	@echo "make demo     set up, start the symbolizer and the agent, cause pressure, show the UI"
	@echo "make test     lint, typecheck and run every test (needs root for BPF and PSI)"
	@echo "make bench    run the benchmarks under bench/"
	@echo "make package  build the .deb and .rpm packages into dist/"
	@echo "make molecule run the molecule scenarios in qemu VMs"

# --- system packages ---------------------------------------------------------
.cache/apt-$(shell echo $(APT_ALL) | md5sum | cut -c1-8).stamp:
	@mkdir -p .cache
	@missing=$$(for p in $(APT_ALL); do dpkg-query -W -f='$${Status}\n' $$p 2>/dev/null \
		| grep -q '^install ok installed' || echo $$p; done); \
	if [ -n "$$missing" ]; then \
		echo "Installing Debian packages:" $$missing; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
			--no-install-recommends $$missing >/dev/null; \
	fi
	@touch $@

deps: .cache/apt-$(shell echo $(APT_ALL) | md5sum | cut -c1-8).stamp

# --- virtualenv ----------------------------------------------------------------
$(VENV)/.stamp: requirements/dev.txt pyproject.toml | deps
	@test -x $(VPY) || $(PYTHON) -m venv $(VENV) || \
		(apt-get install -y -qq python3-venv >/dev/null && $(PYTHON) -m venv $(VENV))
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q -r requirements/dev.txt
	$(VPY) -m pip install -q --no-deps --no-build-isolation -e .
	@touch $@

venv: $(VENV)/.stamp

# --- BPF object (precompiled, shipped inside the package) ----------------------
$(BPF_OBJ): $(BPF_SRC) $(BPF_HDR) | deps
	@mkdir -p $(dir $@)
	$(CLANG) $(BPF_CFLAGS) -c $< -o $@

bpf: $(BPF_OBJ)

# --- tests ---------------------------------------------------------------------
fixtures: | deps
	$(MAKE) -s -C tests/fixtures

lint: venv
	$(VENV)/bin/ruff check bistouri tests bench
	$(VENV)/bin/ruff format --check bistouri tests bench

typecheck: venv
	$(VENV)/bin/mypy

test: bpf venv fixtures lint typecheck
	$(VENV)/bin/pytest -q $(PYTEST_ARGS) tests

# Unprivileged unit tests only.
test-fast: venv
	$(VENV)/bin/pytest -q tests/unit

bench: bpf venv fixtures
	$(VPY) -m bench $(BENCH_ARGS)

demo: bpf venv fixtures
	$(VPY) -m bistouri.demo

clean:
	rm -rf $(BPF_OBJ) build dist *.egg-info .pytest_cache .mypy_cache .ruff_cache
	$(MAKE) -s -C tests/fixtures clean

-include packaging/packaging.mk
-include ansible/ansible.mk
