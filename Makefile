# The two set-up commands of the README:
#   make main   install everything, then run the main job on embedded defaults
#   make test   install everything, then run the test suite
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
DATA   ?= data/synth
RESULTS ?= results

.PHONY: install main test bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip setuptools wheel
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

# Main job: synthetic KITTI data -> FP32 train -> evaluate (mAP). Re-running resumes: existing data is
# kept and training continues from its last checkpoint.
main: $(STAMP)
	test -d $(DATA)/train -a -d $(DATA)/val || $(BIN)/qatpipe data synth --out $(DATA) --train 2000 --val 300 --seed 0
	$(BIN)/qatpipe train -e default -r $(RESULTS)/train
	$(BIN)/qatpipe evaluate -e default -m $(RESULTS)/train/model.keras -o $(RESULTS)/evaluate

test: $(STAMP)
	$(BIN)/pytest

bench: $(STAMP)
	$(BIN)/python bench/train_eval.py

clean:
	rm -rf $(RESULTS) .pytest_cache
