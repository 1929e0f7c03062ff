# make demo  - train the demo DLRM on 2 CPU ranks with intermittent checkpoints
# make test  - lint, type-check and run the test suite
# make bench - every benchmark and experiment at full size (long: the experiments train
#              for thousands of steps) into out/bench/, then docs/benchmarks.md and
#              docs/experiments.md from them
PY := .venv/bin/python
NPROC ?= 2
BENCH := out/bench
TORCHRUN := OMP_NUM_THREADS=1 .venv/bin/torchrun --standalone --nproc_per_node=$(NPROC)

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

test: lint
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -W ignore::DeprecationWarning

bench: setup
	$(TORCHRUN) -m benchmarks.policies --out $(BENCH)/policies.json
	$(TORCHRUN) -m benchmarks.tracking --rounds 30 --out $(BENCH)/tracking.json
	$(PY) -m benchmarks.quantization --out $(BENCH)/quantization.json
	$(PY) -m benchmarks.quantization --vs-greedy --out $(BENCH)/quantization_vs_greedy.json
	$(TORCHRUN) -m benchmarks.checkpoint --out $(BENCH)/checkpoint.json
	$(TORCHRUN) -m benchmarks.stall --out $(BENCH)/stall.json
	$(TORCHRUN) -m benchmarks.scaling --out $(BENCH)/scaling.json
	$(TORCHRUN) -m benchmarks.storage --out $(BENCH)/storage.json
	$(TORCHRUN) -m benchmarks.offline --out $(BENCH)/offline.json
	OMP_NUM_THREADS=1 $(PY) -m benchmarks.serving --out $(BENCH)/serving.json
	OMP_NUM_THREADS=1 .venv/bin/torchrun --standalone --nproc_per_node=1 -m benchmarks.overhead \
		--out $(BENCH)/overhead_1rank.json && $(TORCHRUN) -m benchmarks.overhead \
		--merge $(BENCH)/overhead_1rank.json --out $(BENCH)/overhead.json
	OMP_NUM_THREADS=1 .venv/bin/torchrun --standalone --nproc_per_node=1 -m benchmarks.overhead \
		--intervals 30 --rounds 3 --out $(BENCH)/overhead_1rank_30.json
	OMP_NUM_THREADS=1 .venv/bin/torchrun --standalone --nproc_per_node=1 -m benchmarks.overhead \
		--save-cost --saves 16 --out $(BENCH)/save_cost.json
	$(TORCHRUN) -m benchmarks.experiments.quantized_restores \
		--out $(BENCH)/experiments/quantized_restores.json
	$(TORCHRUN) -m benchmarks.policies --figure --out $(BENCH)/experiments/policy_bytes.json
	$(TORCHRUN) -m benchmarks.experiments.cpr --out $(BENCH)/experiments/cpr.json
	$(PY) -m benchmarks.report benchmarks/results $(BENCH)

clean:
	rm -rf .venv runs out
