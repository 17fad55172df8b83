# Set-up and everyday commands. Every target installs what it needs, idempotently: the virtual
# environment is rebuilt only when pyproject.toml changes, node_modules only when package-lock.json does.
SHELL := /bin/bash
.SHELLFLAGS := -euo pipefail -c
PYTHON ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
ENV ?= default
PCLUSTER_VERSION := 3.16.1
# jsii prints a Node 20 end-of-life banner on every run; Node 20 works, and the banner buries messages.
export JSII_SILENCE_WARNING_END_OF_LIFE_NODE_VERSION := 20
# Offline: never reach for instance metadata when looking for credentials.
export AWS_EC2_METADATA_DISABLED := true

.PHONY: image-config deps tools synth synth-all demo slurm-up slurm-down slurm-status bytecode test test-main test-slurm test-fast test-neuron lint snapshots schemas lock cost clean

deps: $(VENV)/.installed node_modules/.installed

## System tools the tests use (Debian packages, installed as root when missing): shellcheck lints the node
## bootstrap script; gpg (gnupg) makes the test keys whose fingerprints the bootstrap checks.
TOOLS := shellcheck:shellcheck gpg:gnupg
tools:
	@missing=""; for tool in $(TOOLS); do \
	  command -v "$${tool%%:*}" >/dev/null || missing="$$missing $${tool#*:}"; done; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null; \
	  else echo "missing:$$missing: install it (e.g. sudo apt-get install$$missing)" >&2; exit 1; fi; fi

## Python writes the bytecode of each module the first time a process imports it: the tests start hundreds of
## Python processes (pipeline stages, torchrun ranks, CLI runs), which would otherwise compile torch and
## transformers every time where the environment sets PYTHONDONTWRITEBYTECODE (these machines do). So make's
## commands run without it, and installs compile nothing up front (compiling every installed module costs a
## fresh `.venv` about 80 s of CPU, most of it for modules no command imports).
unexport PYTHONDONTWRITEBYTECODE

## uv installs the pinned set in about 15 s where pip takes almost three minutes (the same versions: every direct
## dependency is pinned). uv reads no pip configuration: a machine's local wheels (PIP_FIND_LINKS, where the CPU
## build of torch lies) are handed to it as UV_FIND_LINKS.
UV_VERSION := 0.13.8
PIP_VERSION := 26.3
UV_PIP := UV_FIND_LINKS="$${UV_FIND_LINKS:-$${PIP_FIND_LINKS:-}}" $(VPY) -m uv pip install --quiet --python $(VPY)
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VPY) -m pip install --quiet --quiet uv==$(UV_VERSION)
	# pip itself: stacks/cluster_requirements.py resolves the nodes' lock with it.
	$(UV_PIP) pip==$(PIP_VERSION) -e '.[infra,training,dev]'
	# Schema and validators only: its CDK v1 / jsii 1.85 pins conflict with aws-cdk-lib v2 (see pyproject.toml).
	$(UV_PIP) --no-deps aws-parallelcluster==$(PCLUSTER_VERSION)
	touch $@

node_modules/.installed: package.json package-lock.json
	npm ci --no-audit --no-fund --loglevel=error
	touch $@

## Synthesize one environment (ENV=default) with the pinned CDK CLI; cdk-nag runs as part of synth.
synth: deps
	npx cdk synth -c env=$(ENV) --quiet
	@echo "Templates for environment '$(ENV)' are in cdk.out/"

## Synthesize every file in environments/ into cdk.out.<name>/.
synth-all: deps
	for file in environments/*.yaml; do name=$$(basename $$file .yaml); \
	  npx cdk synth -c env=$$name --quiet --output cdk.out.$$name; done

## The main job, locally: both recipes' tiny variants through the whole Slurm pipeline on a local Slurm
## (started and stopped here; Debian's slurm packages are installed when missing, as root).
demo: deps
	$(VPY) -m training.local.demo

## The local Slurm on its own (state in .local-slurm/): `eval "$$(make -s slurm-up | grep ^export)"` to use it.
slurm-up: deps
	$(VPY) -m training.local.slurm up
slurm-down: deps
	$(VPY) -m training.local.slurm down
slurm-status: deps
	$(VPY) -m training.local.slurm status

## Lint, type-check the pure parts and run every test, in two rounds of two jobs each (each job's output
## printed whole when it ends): lint (mypy: one core) beside the main suite; then the local Slurm's tests beside
## the neuron tier (whose own tests run in one process, mostly on one core). The local Slurm's tests run in one
## plain pytest process (a second local cluster started inside an xdist worker never ran its job:
## tests/pipeline/test_local_slurm.py). docs/how-it-is-checked.md has the measured split.
test: deps tools bytecode
	$(MAKE) --no-print-directory -j 2 --output-sync=target lint test-main
	$(MAKE) --no-print-directory -j 2 --output-sync=target test-slurm test-neuron

## The project's bytecode, compiled up front on both cores before the tests' processes start importing it.
bytecode: deps
	$(VPY) -m compileall -q -j 2 training stacks tests benchmarks app.py

## The main suite on two xdist workers: every test but the local Slurm's.
test-main: deps
	$(VPY) -m pytest -n 2 --dist worksteal -m "not slurm"

## The local Slurm's tests (started and stopped by their fixtures; Debian's slurm packages installed when missing).
test-slurm: deps
	$(VPY) -m pytest -m slurm

## The edit loop's subset: every test not marked `slow` or `slurm` (pyproject.toml), under 2 minutes.
test-fast: deps
	$(VPY) -m pytest -m "not slow and not slurm"

## The neuron tier: neuronx-distributed on torch-xla's CPU device, in its own environment with the cluster's
## locked requirement set (built once under ~/.cache/trainium-training; NXD_SOURCE: the NxD source archive).
test-neuron: deps
	$(VPY) -m tests.neuron.tier

## mypy's cache outlives the checkout, as the neuron tier's environment does: a fresh clone's check reuses what an
## earlier one analysed (mostly torch's and pydantic's own types; about 100 s of CPU on these machines, 20 s
## from a warm cache in another clone). mypy checks every file whose content changed again.
lint: export MYPY_CACHE_DIR ?= $(HOME)/.cache/trainium-training/mypy
lint: deps
	$(VPY) -m ruff check .
	$(VPY) -m ruff format --check .
	$(VPY) -m mypy

## A `pcluster build-image` configuration for a baked Trainium image of ENV (docs/operations.md: "Node bootstrap: its time budget, and baked images"):
## make image-config ENV=default BUCKET=<ResultsBucketName> POLICY=<ComputeNodePolicyArn> PARENT=<official AMI>
image-config: deps
	$(VPY) -m stacks.node_image --env $(ENV) --bucket "$(BUCKET)" --node-policy-arn "$(POLICY)" --parent-image "$(PARENT)"

## What environment ENV costs per hour: idle, while a CPU stage runs, while training (the README's table).
cost: deps
	$(VPY) -m stacks.cost --env $(ENV)

## Rewrite the template snapshots in tests/infra/snapshots/ after an intended infrastructure change.
snapshots: deps
	UPDATE_SNAPSHOTS=1 $(VPY) -m pytest tests/infra/test_snapshots.py tests/pipeline/test_templates.py

## Re-resolve each node software set's locked requirements (assets/node/*-requirements.in) for the nodes' Python.
lock: deps
	$(VPY) -m stacks.cluster_requirements

## Rewrite the JSON Schemas of the environment file and the recipe after a change of their models.
schemas: deps
	$(VPY) -m stacks.schemas

clean:
	rm -rf cdk.out cdk.out.* .pytest_cache .ruff_cache .mypy_cache work
