# vLLM elastic/distributed KV patch series. `make help` lists the targets.
PYTHON ?= python3
VLLM_VERSION ?= $(shell $(PYTHON) -c 'import tomllib;print(tomllib.load(open("ci/matrix.toml","rb"))["default"])')
export VLLM_VERSION
VENV ?= build/venv-$(VLLM_VERSION)
S := $(PYTHON) scripts

.PHONY: help setup apply install smoke refresh export rebase check-series lint overlay-install \
        overlay-uninstall test test-harness test-release test-gpu test-installed upstream-test \
        upstream-baseline hf-cache bench bench-doc clean-tree clean

help:  ## this list
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed 's/:.*## /\t/' | expand -t22

setup: apply install smoke  ## fresh machine: apply + install the default release, run a smoke

apply:  ## build/vllm-X = pristine sdist (tag vX) + overlay + patches/vX/series
	$(S)/apply.py

install:  ## editable install of build/vllm-X into $(VENV) with prebuilt kernels (VLLM_KERNELS=cpu|cuda|none)
	$(S)/install.py --venv $(VENV)

smoke:  ## short end-to-end generation through the patched engine
	$(VENV)/bin/python scripts/smoke.py

refresh:  ## write the build tree's commits back to patches/vX/
	$(S)/refresh.py

export:  ## the series as upstream-ready patches, one per topic, authored + signed off by you, in build/export/
	$(S)/export.py

rebase:  ## carry the series FROM=<release> TO=<release>; writes patches/vTO/ + a range-diff in docs/
	$(S)/rebase.py --from "$(FROM)" --to "$(TO)"

check-series:  ## apply every release's series to its pristine tree; print a table
	$(S)/check_series.py

.PHONY: check-bisect
check-bisect:  ## each exported patch of VLLM_VERSION on the ones before it compiles, passes ruff and its own tests (CHEAP=1: no tests)
	$(S)/check_bisect.py $(if $(CHEAP),--cheap) $(if $(JOBS),--jobs $(JOBS))

lint:  ## vLLM's own pre-commit on what the series changes; fails on findings it adds vs pristine vX
	$(S)/lint.py

overlay-install:  ## lay the series over an installed vLLM: SITE=<site-packages>
	$(S)/overlay_install.py --site "$(SITE)"

overlay-uninstall:  ## restore the installed vLLM from the backup: SITE=<site-packages>
	$(S)/overlay_install.py --site "$(SITE)" --uninstall

# The test targets install their own tools: pytest for the harness tier in build/venv-harness
# (ci/requirements-harness.txt, made on first use), each release's in build/venv-X.
test:  ## every release in ci/matrix.toml at its CI tiers (what CI runs)
	$(S)/run_tests.py

test-harness:  ## the harness's own tests only (pytest from build/venv-harness, made on first use)
	$(S)/run_tests.py --tiers harness

test-release:  ## one release (VLLM_VERSION) at its CI tiers
	$(S)/run_tests.py --version $(VLLM_VERSION)

test-gpu:  ## on a GPU host: each release's gpu tiers
	$(S)/run_tests.py --gpu

test-installed:  ## tests/gpu and the overlay's tests against the vLLM $(PYTHON) imports (after overlay-install)
	$(S)/run_tests.py --installed

upstream-test:  ## vLLM's own curated tests, offline: patched tree vs the stock baseline
	$(S)/upstream_oracle.py

upstream-baseline:  ## run the curated upstream tests on stock vX, write ci/upstream/vX.txt
	$(S)/upstream_oracle.py --write-baseline

BENCH_OUT ?= build/bench
bench:  ## benchmark suite, VMM KV vs stock side by side, into $(BENCH_OUT) (BENCH_ARGS="--quick ...")
	$(PYTHON) scripts/bench/bench.py --out "$(BENCH_OUT)" $(BENCH_ARGS)

bench-doc:  ## write $(BENCH_OUT)/results.json into docs/BENCHMARKS.md (and docs/bench/e2e/)
	$(PYTHON) scripts/bench/bench_report.py "$(BENCH_OUT)/results.json" --doc docs/BENCHMARKS.md

hf-cache:  ## build/hf-cache: offline hub cache of the public model configs in ci/hf-models
	$(S)/hf_cache.py

clean-tree:  ## delete build/vllm-X; refuses if it holds work not in the series (FORCE=1 overrides)
	$(S)/clean.py

clean:  ## delete build/ (trees, virtualenvs, exports) with the same check; the sdist cache stays
	$(S)/clean.py --all
