# make demo  - train the demo DLRM on 2 CPU ranks with intermittent checkpoints
# make test  - lint, type-check and run the test suite
# make bench - every recorded result (benchmarks/results/) again, each with its recorded
#              command, into out/bench/, then docs/benchmarks.md, docs/experiments.md and
#              the README's figures from them (long: hours)
PY := .venv/bin/python
NPROC ?= 2
BENCH := out/bench

.PHONY: setup demo test lint bench clean

setup:
	@bash scripts/setup_env.sh

# The serving process starts first and follows the job's root (runs/demo, removed so that it
# never serves an earlier run's checkpoints); its closing lines follow the job's table.
demo: setup
	@rm -rf runs/demo runs/demo-serve.json && mkdir -p runs
	@OMP_NUM_THREADS=1 nice -n 10 $(PY) scripts/serve.py --config configs/demo.yaml \
		>runs/demo-serve.out 2>runs/demo-serve.log & serve=$$!; \
	OMP_NUM_THREADS=1 .venv/bin/torchrun --standalone --nproc_per_node=$(NPROC) --max-restarts=1 \
		scripts/train.py --config configs/demo.yaml; \
	trained=$$?; \
	[ $$trained -eq 0 ] || kill $$serve 2>/dev/null; \
	wait $$serve; served=$$?; \
	cat runs/demo-serve.out; \
	if [ $$served -ne 0 ]; then \
		echo "serving process failed (exit $$served); the end of runs/demo-serve.log:"; \
		tail -n 20 runs/demo-serve.log; \
	fi; \
	[ $$trained -eq 0 ] && [ $$served -eq 0 ]

# mypy's paths on the command line replace pyproject's [tool.mypy] files, plus benchmarks/.
lint: setup
	$(PY) -m ruff check torchrec_cnr cnr_train tests scripts benchmarks
	$(PY) -m ruff format --check torchrec_cnr cnr_train tests scripts benchmarks
	$(PY) -m mypy torchrec_cnr cnr_train tests scripts benchmarks

# One pytest worker more than the cores: the tests' ranks, servers and subprocesses wait on
# one another and on the disk, and the extra worker fills those waits (on 2 cores, 3
# workers ran the suite in 11:39, 2 in 12:12 to 12:44).
TEST_WORKERS ?= $(shell echo $$(( $$(nproc) + 1 )))

test: lint
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=10 -W ignore::DeprecationWarning

# Every recorded result's run (benchmarks/runs.py lists them; --list prints the commands),
# then the docs rendered from what it ran.
bench: setup
	$(PY) -m benchmarks.runs --nproc $(NPROC) --out $(BENCH)

clean:
	rm -rf .venv runs out
