# The two set-up commands of the README:
#   make main   install everything, then run the main job on embedded defaults
#   make test   install everything, then run the test suite
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
RESULTS ?= results/pipeline

.PHONY: install main test bench clean lock

$(STAMP): pyproject.toml images/horovod/build-wheel.sh
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip setuptools wheel
	$(BIN)/pip install --quiet -e '.[dev]'
	# Horovod, built against the installed TensorFlow with the TF 2.21 fix; the wheel is kept in .cache/wheels
	$(BIN)/pip install --quiet --no-deps "$$(PYTHON=$(BIN)/python images/horovod/build-wheel.sh .cache/wheels)"
	touch $(STAMP)

install: $(STAMP)

# Main job: the whole Kubeflow pipeline on this machine (kfp.local) on the default spec: synthetic KITTI data
# -> train -> evaluate -> compare, tracked in MLflow (SQLite store in $(RESULTS)). Prints the variant table
# and writes $(RESULTS)/summary.json. Re-running reuses every finished stage.
main: $(STAMP)
	$(BIN)/qatpipe run --local --spec default --output $(RESULTS)

test: $(STAMP)
	$(BIN)/pytest

bench: $(STAMP)
	$(BIN)/python bench/pipeline_local.py

# The images' lock files, images/<kind>/requirements.lock: pyproject.toml's dependencies and
# images/<kind>/requirements.in resolved by pip for each image's Python and platform, every package pinned and
# hashed (images/README.md). Needs only a Python >= 3.11 with pip, and PyPI; the Dockerfiles install what it writes.
lock:
	$(if $(wildcard $(BIN)/python),$(BIN)/python,$(PYTHON)) images/lock.py

clean:
	rm -rf results .pytest_cache
