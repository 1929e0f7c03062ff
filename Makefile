# make demo  - train the demo DLRM on 2 CPU ranks with intermittent checkpoints
# make test  - lint, type-check and run the test suite
PY := .venv/bin/python
NPROC ?= 2

.PHONY: setup demo test lint bench clean

setup:
	@bash scripts/setup_env.sh

demo: setup
	OMP_NUM_THREADS=1 .venv/bin/torchrun --standalone --nproc_per_node=$(NPROC) --max-restarts=1 scripts/train.py --config configs/demo.yaml

lint: setup
	$(PY) -m ruff check torchrec_cnr cnr_train tests scripts
	$(PY) -m ruff format --check torchrec_cnr cnr_train tests scripts
	$(PY) -m mypy

test: lint
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -W ignore::DeprecationWarning

clean:
	rm -rf .venv runs out
