# Two commands: `make run` (mount a kvfs at /mnt/kv-cache and show it working) and `make test`.
# Both install what is missing first: Debian packages, then a .venv with the project.

VENV        := .venv
PY          := $(VENV)/bin/python
MOUNTPOINT  ?= /mnt/kv-cache
APT_PKGS    := fuse3 libfuse3-dev pkg-config attr gcc libxxhash-dev
VLLM        := vllm==0.33.0
TORCH       := torch==2.13.0

.PHONY: run test test-io-uring lint unit apt clean install

run: apt $(VENV)/.mount
	$(PY) -m tools.demo $(MOUNTPOINT)

# The mount tests run once more over kvfs's own /dev/fuse session (the default run uses pyfuse3).
MOUNT_TESTS := tests/test_posix.py tests/test_posix_special.py tests/test_publish.py \
	tests/test_integrity.py tests/test_capacity.py tests/test_hostile_input.py \
	tests/test_deadlines.py tests/test_vllm_pattern.py tests/test_vllm_tier.py \
	tests/test_failures.py tests/test_inspect.py tests/test_daemon_death.py \
	tests/test_crash_loop.py tests/test_observability.py tests/test_deployment.py \
	tests/test_batch_lookup.py tests/test_kvfs_tier.py tests/test_vllm_engine.py \
	tests/test_shared.py tests/test_shared_sshfs.py tests/test_fs_tier.py tests/test_vllm_interop.py \
	tests/test_vllm_spec.py tests/test_declared_checksum.py

# The tests also need a loopback sshd and sshfs clients (a real shared filesystem); `make run`
# installs no SSH server.
test: APT_PKGS += openssh-server sshfs
test: export KVFS_TEST_SSHFS = required
test: apt $(VENV)/.test lint
	$(PY) -m pytest -q
	KVFS_TEST_SESSION=kernel $(PY) -m pytest -q $(MOUNT_TESTS)
	$(MAKE) --no-print-directory test-io-uring

# The kernel session once more over FUSE-over-io_uring (Linux 6.14+): the module parameter is
# set for this run only, and put back as it was.
URING_PARAM := /sys/module/fuse/parameters/enable_uring
test-io-uring: $(VENV)/.test
	@if [ ! -w $(URING_PARAM) ]; then \
		echo "no FUSE-over-io_uring in this kernel: its test run is skipped"; exit 0; fi; \
	was=$$(cat $(URING_PARAM)); echo Y > $(URING_PARAM); \
	KVFS_TEST_SESSION=kernel KVFS_TEST_IO_URING=auto $(PY) -m pytest -q $(MOUNT_TESTS) \
		tests/test_kernel_session.py; \
	rc=$$?; echo $$was > $(URING_PARAM); exit $$rc

# mypy checks the package as it is installed, kvfs/ with mount/ and connector/ inside it
# (setuptools' package-dir, which mypy cannot follow), from a tree of symlinks.
MYPY_TREE := build/mypy/kvfs

lint: $(VENV)/.test
	$(VENV)/bin/ruff check kvfs mount connector tests tools
	$(VENV)/bin/ruff format --check kvfs mount connector tests tools
	rm -rf $(MYPY_TREE) && mkdir -p $(MYPY_TREE)
	ln -s $(CURDIR)/kvfs/*.py $(CURDIR)/kvfs/*.pyi $(MYPY_TREE)/
	ln -s $(CURDIR)/mount $(CURDIR)/connector $(MYPY_TREE)/
	cd $(dir $(MYPY_TREE)) && $(CURDIR)/$(VENV)/bin/mypy --config-file $(CURDIR)/pyproject.toml \
		--cache-dir $(CURDIR)/build/mypy-cache kvfs

# openssh-server and sshfs are for tests/test_shared_sshfs.py, which starts an sshd of its own on
# 127.0.0.1: a machine that had no sshd gets none started, now or at boot (Debian's
# /etc/ssh/sshd_not_to_be_run; remove that file to run the system's sshd).
apt:
	@missing=$$(for p in $(APT_PKGS); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	if [ -n "$$missing" ]; then \
		echo "installing $$missing"; \
		case " $$(echo $$missing) " in *" openssh-server "*) \
			mkdir -p /etc/ssh && touch /etc/ssh/sshd_not_to_be_run;; esac; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing; \
	fi

$(VENV)/bin/python:
	python3 -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip

# (kvfs/_chunk_calls.c, mount/_dev_read.c and mount/_ring.c are built by the install, beside
# them: again when they change)
$(VENV)/.mount: pyproject.toml kvfs/_chunk_calls.c mount/_dev_read.c mount/_ring.c | $(VENV)/bin/python
	$(VENV)/bin/pip install -q -e '.[mount]'
	touch $@

# vLLM's own fs-tier code for the interop tests: its import-time packages, then vLLM itself
# without its dependency list (which would pull a CUDA build of torch).
$(VENV)/.test: pyproject.toml requirements/vllm.txt $(VENV)/.mount
	$(VENV)/bin/pip install -q -e '.[mount,connector,p2p,dev]' $(TORCH) -r requirements/vllm.txt
	$(VENV)/bin/pip install -q --no-deps $(VLLM)
	touch $@

# For boot-time mounts (docs/deployment.md): `kvfs` on root's PATH, mount(8)'s helper for
# `mount -t fuse.kvfs` and fstab (it looks in /sbin), the systemd unit, the logrotate snippet.
install: apt $(VENV)/.mount
	ln -sfn $(abspath $(VENV))/bin/kvfs /usr/local/bin/kvfs
	ln -sfn $(abspath $(VENV))/bin/mount.fuse.kvfs /sbin/mount.fuse.kvfs
	if [ -d /etc/systemd/system ]; then install -m 0644 packaging/systemd/kvfs@.service /etc/systemd/system/; fi
	if [ -d /etc/logrotate.d ]; then install -m 0644 packaging/logrotate/kvfs /etc/logrotate.d/kvfs; fi

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .mypy_cache .ruff_cache build
