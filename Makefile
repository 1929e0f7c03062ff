# make demo  - train the demo DLRM on 2 CPU ranks with intermittent checkpoints
# make test  - lint, type-check and run the test suite
# make bench - every recorded result (benchmarks/results/) again, each with its recorded
#              command, into out/bench/, then docs/benchmarks.md, docs/experiments.md and
#              the README's figures from them (long: hours)
PY := .venv/bin/python
NPROC ?= 2
BENCH := out/bench
TORCHRUN := OMP_NUM_THREADS=1 .venv/bin/torchrun --standalone --nproc_per_node=$(NPROC)
TORCHRUN1 := OMP_NUM_THREADS=1 .venv/bin/torchrun --standalone --nproc_per_node=1
PY1 := OMP_NUM_THREADS=1 $(PY)

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
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -n auto --dist loadfile --durations=10 -W ignore::DeprecationWarning

# One line per result in benchmarks/results/ (tests/unit/test_bench_targets.py checks it).
bench: setup
	$(TORCHRUN) -m benchmarks.policies --out $(BENCH)/policies.json
	$(TORCHRUN) -m benchmarks.tracking --rounds 30 --out $(BENCH)/tracking.json
	$(PY1) -m benchmarks.quantization --out $(BENCH)/quantization.json
	$(PY1) -m benchmarks.quantization --vs-greedy --out $(BENCH)/quantization_vs_greedy.json
	$(TORCHRUN) -m benchmarks.checkpoint --policies full intermittent --repeats 1 --restore-repeats 1 --rounds 5 --out $(BENCH)/checkpoint.json
	$(TORCHRUN1) -m benchmarks.checkpoint --policies full --repeats 1 --restore-repeats 1 --rounds 3 --out $(BENCH)/checkpoint_1rank.json
	$(TORCHRUN) -m benchmarks.stall --out $(BENCH)/stall.json
	$(TORCHRUN) -m benchmarks.stall --rows 500000 --repeats 5 --out $(BENCH)/stall_1gb.json
	$(TORCHRUN) -m benchmarks.stall --rows 2000000 --repeats 5 --out $(BENCH)/stall_4gb.json
	$(TORCHRUN) -m benchmarks.stall --rows 4000000 --repeats 5 --out $(BENCH)/stall_8gb.json
	$(TORCHRUN) -m benchmarks.scaling --out $(BENCH)/scaling.json
	$(TORCHRUN) -m benchmarks.storage --out $(BENCH)/storage.json
	$(TORCHRUN) -m benchmarks.history --policies intermittent --out $(BENCH)/history.json
	$(TORCHRUN) -m benchmarks.history --policies consecutive --out $(BENCH)/history_consecutive.json
	$(PY1) -m benchmarks.shards --out $(BENCH)/shards.json
	$(TORCHRUN) -m benchmarks.offline --out $(BENCH)/offline.json
	$(TORCHRUN) -m benchmarks.dcp_interop --out $(BENCH)/dcp_interop.json
	$(TORCHRUN) -m benchmarks.dcp_stager --out $(BENCH)/dcp_stager.json
	$(PY1) -m benchmarks.serving --out $(BENCH)/serving.json
	$(PY1) -m benchmarks.serving --interval-steps 30 --steps 300 --modes copy --out $(BENCH)/serving_5s.json
	$(PY1) -m benchmarks.serving --tables 8 --interval-steps 6 --steps 120 --policies intermittent consecutive --served fp32 int4 --modes swap --out $(BENCH)/serving_fresh.json
	$(PY1) -m benchmarks.serving --tables 8 --interval-steps 6 --steps 120 --policies consecutive --served fp32 int4 --modes swap --background process --out $(BENCH)/serving_fresh_process.json
	$(PY1) -m benchmarks.serving --policies consecutive --served fp32 int4 --modes copy swap --nproc 1 --interval-steps 30 --steps 600 --join-after 5 --out $(BENCH)/serving_join.json
	$(PY1) -m benchmarks.serving --storage s3 --policies consecutive --served fp32 int4 --modes copy --nproc 1 --interval-steps 30 --steps 600 --join-after 5 --out $(BENCH)/serving_join_s3.json
	$(PY1) -m benchmarks.serving --storage s3 --served int4 --modes copy --steps 60 --out $(BENCH)/serving_s3.json
	$(PY1) -m benchmarks.serving --modes budget --budget-mb 16 --out $(BENCH)/serving_budget.json
	$(PY1) -m benchmarks.serving --policies consecutive --served fp32 --modes copy --followers 1 4 --nproc 1 --interval-steps 48 --steps 1200 --requests-per-s 1 --storage fs --out $(BENCH)/serving_fanout_fs.json
	$(PY1) -m benchmarks.serving --policies consecutive --served fp32 --modes copy --followers 1 4 --nproc 1 --interval-steps 48 --steps 1200 --requests-per-s 1 --storage s3 --out $(BENCH)/serving_fanout_s3.json
	$(TORCHRUN1) -m benchmarks.overhead --out $(BENCH)/overhead_1rank.json
	$(TORCHRUN) -m benchmarks.overhead --intervals 5 30 --merge $(BENCH)/overhead_1rank.json --out $(BENCH)/overhead.json
	$(TORCHRUN1) -m benchmarks.overhead --intervals 30 --rounds 3 --out $(BENCH)/overhead_1rank_30.json
	$(TORCHRUN1) -m benchmarks.overhead --paired --intervals 5 10 30 --out $(BENCH)/overhead_paired_1rank.json
	$(TORCHRUN) -m benchmarks.overhead --paired --intervals 5 10 30 --out $(BENCH)/overhead_paired_2rank.json
	$(TORCHRUN1) -m benchmarks.overhead --save-cost --saves 16 --out $(BENCH)/save_cost.json
	$(TORCHRUN1) -m benchmarks.overhead --gil --gil-s 60 --out $(BENCH)/overhead_gil.json
	$(TORCHRUN1) -m benchmarks.overhead --floor --tables 8 --rows 1000000 --intervals 2 5 10 --pair-s 60 --per-stretch 3 --compact-every 10 --policy consecutive --out $(BENCH)/overhead_floor_1rank.json
	$(TORCHRUN) -m benchmarks.overhead --floor --tables 8 --rows 1000000 --intervals 2 --pair-s 60 --per-stretch 3 --compact-every 10 --policy consecutive --out $(BENCH)/overhead_floor_2rank.json
	$(TORCHRUN1) -m benchmarks.overhead --floor --tables 8 --rows 1000000 --intervals 2 5 10 --pair-s 60 --per-stretch 3 --compact-every 10 --policy consecutive --background process --out $(BENCH)/overhead_floor_process_1rank.json
	$(TORCHRUN) -m benchmarks.overhead --floor --tables 8 --rows 1000000 --intervals 2 --pair-s 60 --per-stretch 3 --compact-every 10 --policy consecutive --background process --out $(BENCH)/overhead_floor_process_2rank.json
	$(TORCHRUN) -m benchmarks.experiments.quantized_restores --out $(BENCH)/experiments/quantized_restores.json
	$(TORCHRUN) -m benchmarks.policies --figure --out $(BENCH)/experiments/policy_bytes.json
	$(TORCHRUN) -m benchmarks.experiments.cpr --out $(BENCH)/experiments/cpr.json
	$(PY) -m benchmarks.report benchmarks/results $(BENCH)

clean:
	rm -rf .venv runs out
