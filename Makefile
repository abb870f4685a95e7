# The two set-up commands of the README:
#   make main   install everything, then run the main job on embedded defaults
#   make test   install everything, then run the test suite
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
RESULTS ?= results/pipeline

MODELOPT_VENV := $(VENV)-modelopt
MODELOPT_STAMP := $(MODELOPT_VENV)/.installed-stamp

.PHONY: install modelopt main test bench compile clean lock images

$(STAMP): pyproject.toml images/horovod/build-wheel.sh
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip setuptools wheel
	$(BIN)/pip install --quiet -e '.[dev]'
	# Horovod, built against the installed TensorFlow with the TF 2.21 fix; the wheel is kept in .cache/wheels
	$(BIN)/pip install --quiet --no-deps "$$(PYTHON=$(BIN)/python images/horovod/build-wheel.sh .cache/wheels)"
	touch $(STAMP)

install: $(STAMP)

# NVIDIA Model Optimizer for `ptq.tool: modelopt`, in its own environment beside $(VENV) (it pins onnxruntime-gpu
# and torch; qatpipe/quantization/modelopt_ptq.py finds it there). About 2 min and some GB (torch's CUDA wheels).
$(MODELOPT_STAMP): images/modelopt/requirements.in
	$(PYTHON) -m venv $(MODELOPT_VENV)
	$(MODELOPT_VENV)/bin/pip install --quiet --upgrade pip
	$(MODELOPT_VENV)/bin/pip install --quiet -r images/modelopt/requirements.in
	touch $(MODELOPT_STAMP)

modelopt: $(MODELOPT_STAMP)

# Main job: the whole Kubeflow pipeline on this machine (kfp.local) on the default spec: synthetic KITTI data
# -> train -> evaluate -> compare, tracked in MLflow (SQLite store in $(RESULTS)). Prints the variant table
# and writes $(RESULTS)/summary.json. Re-running reuses every finished stage.
main: $(STAMP)
	$(BIN)/qatpipe run --local --spec default --output $(RESULTS)

# the tests run Model Optimizer's PTQ for real too, so its environment is installed first
test: $(STAMP) $(MODELOPT_STAMP)
	$(BIN)/pytest

bench: $(STAMP)
	$(BIN)/python bench/pipeline_local.py

# the compiled pipeline in the repo, after a change to a component or the stage table (a test checks it is in sync)
compile: $(STAMP)
	$(BIN)/qatpipe compile -o pipelines/qat_pipeline.yaml

# The images' lock files, images/<kind>/requirements.lock: pyproject.toml's dependencies and
# images/<kind>/requirements.in resolved by pip for each image's Python and platform, every package pinned and
# hashed (images/README.md). Needs only a Python >= 3.11 with pip, and PyPI; the Dockerfiles install what it writes.
lock:
	$(if $(wildcard $(BIN)/python),$(BIN)/python,$(PYTHON)) images/lock.py

# The three images, CPU variant, with podman (or Docker), no registry and no network in the builds: Ubuntu 24.04 /
# Debian 12 bases from images/local-base.sh (debootstrap, root), packages from the lock files' wheelhouse in
# .cache/wheelhouse (images/wheelhouse.py). Tagged as qatpipe_kfp.settings names them, which the compiled pipeline
# and `qatpipe run --local --runner docker` use. GPU images: images/build.sh without --cpu (images/README.md).
images: $(STAMP)
	PYTHON=$(BIN)/python images/build.sh --cpu

clean:
	rm -rf results .pytest_cache
