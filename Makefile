# Rackplane: `make run` starts the service on its embedded default; `make test` runs the tests.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PYTEST_ARGS ?=

.PHONY: run test install services openapi lint clean portal chromium ha-engines ha ha-down \
	container-engines vm-engines train-engines

$(BIN)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e ".[dev]"
	touch $@

install: $(BIN)/.installed

# The portal page: rebuilt when its sources or lock file change.
PORTAL_SRC := $(shell find portal/src -type f 2>/dev/null) portal/index.html portal/vite.config.ts \
	portal/tsconfig.json portal/package.json portal/package-lock.json
PORTAL := app/portal/dist/index.html

$(PORTAL): $(PORTAL_SRC)
	bash scripts/build-portal.sh

portal: $(PORTAL)

run: install
	@$(MAKE) --no-print-directory $(PORTAL) || bash scripts/build-portal.sh --optional
	$(BIN)/rackplane up

services:
	bash scripts/ensure-services.sh

chromium:
	bash scripts/ensure-chromium.sh

ha-engines:
	bash scripts/ensure-ha.sh

# podman, runc, catatonit, netavark, busybox-static ... for the `container` tier's tests
# (tests/agent/test_container_wall.py), and /etc/subuid's range for --userns=auto.
container-engines:
	bash scripts/ensure-podman.sh

# QEMU and a Debian kernel (unpacked, not installed) for the `vm` runtime's tests
# (tests/agent/test_vm.py builds its guest from them).
vm-engines:
	bash scripts/ensure-qemu.sh

# PyTorch (CPU, offline from this machine's disk) in `.venv-train`, which runs' own uids may
# execute, and iproute2 for hosts made of network namespaces: the distributed-training tests
# (tests/agents/test_ddp.py) and `rackplane bench ddp`.
train-engines:
	bash scripts/ensure-train.sh

# The high-availability topology on this machine (docs/ha.md): Patroni, Sentinel, two API
# processes, two workers and a beat, left running; `make ha-down` stops it.
# `make ha HA_BASE_PORT=16400` where 15400 and the ports after it are taken.
HA_BASE_PORT ?= 15400
ha: install ha-engines
	@$(MAKE) --no-print-directory $(PORTAL) || bash scripts/build-portal.sh --optional
	$(BIN)/python -m rackplane_bench.ha up --dir .ha --base-port $(HA_BASE_PORT)

ha-down:
	$(BIN)/python -m rackplane_bench.ha down --dir .ha

test: install services portal chromium ha-engines container-engines vm-engines train-engines lint
	$(BIN)/python -m pytest $(PYTEST_ARGS)

openapi: install
	$(BIN)/rackplane openapi

lint: install
	$(BIN)/ruff check app workers tests benchmarks rackplane_bench rackplane_agent rackplane_wire examples scripts
	$(BIN)/mypy app/placement --ignore-missing-imports
	$(BIN)/lint-imports --no-cache
	$(BIN)/python scripts/private_imports.py

clean:
	rm -rf .rackplane .pytest_cache .ha
