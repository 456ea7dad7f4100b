# `make train` and `make test` each set up .venv on first use, then run.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: train test test-extended test-quick lint explain bench bench-compile zoo-layouts clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	$(PY) -m pip install torch==2.13.0
	$(PY) -m pip install -e ".[dev]"
	touch $(STAMP)

# one intra-op thread: on a shared 2-core machine two OpenMP threads crawl (README)
train: $(STAMP)
	$(PY) -m boost_compile.train trainer.threads=1

# the suite (tests/unit, tests/distributed, tests/integrations) less the tests marked extended,
# with its 25 slowest tests listed (within 20 minutes of a fresh clone on 2 cores, venv included);
# PYTEST_ARGS adds to it, e.g. make test PYTEST_ARGS=tests/unit
test: $(STAMP)
	$(PY) -m pytest -q -m "not extended" --durations=25 $(PYTEST_ARGS)

# the tests marked extended: further layouts, model styles and compilers of claims make test
# checks once (the style matrix under TP, FSDP2's and PP's products, resumes, SLURM sweeps);
# CI runs them after make test
test-extended: $(STAMP)
	$(PY) -m pytest -q -m extended --durations=25 $(PYTEST_ARGS)

# the loop between edits: the passes, the analysis, verify and parity on aot_eager, no
# Inductor compile, no training run and no second process (under 4 minutes cold on 2 cores)
QUICK := $(addprefix tests/unit/test_,analysis.py backend_registration.py dead_code.py verify.py explain.py \
	factorize.py group_linears.py norm_sites.py parity.py parity_rule.py pass_manager.py rmsnorm_forms.py \
	rmsnorm_pass.py activation_checkpoint.py compile_modes.py layering.py layout.py torch_compat.py \
	tp_random.py lax_model.py models.py repeated_blocks.py fsdp_units.py style_models.py compile_blocks.py loss_logits.py \
	meta_init.py)
test-quick: $(STAMP)
	$(PY) -m pytest -q -m "not slow" --durations=10 $(QUICK) $(PYTEST_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .

explain: $(STAMP)
	$(VENV)/bin/boost-explain --preset tiny --out explain_out

# every boost-bench benchmark (about 8 minutes on 2 cores), then benchmarks/RESULTS.md
bench: $(STAMP)
	$(VENV)/bin/boost-bench all

bench-compile: $(STAMP)
	$(PY) benchmarks/compile_overhead.py

# every causal-LM architecture of transformers, tiny, one forward+backward through boost (aot_eager)
# against eager and float64 (zoo.md), the same with verify off: the passes alone (zoo-noverify.md),
# then a sample under Inductor, one of each structure: dense Llama-like, latent attention (MLA),
# experts as 3-D weights, a Mamba hybrid (zoo-inductor.md); tables in benchmarks/zoo/
ZOO_INDUCTOR ?= llama,deepseek_v3,qwen3_moe,jamba
zoo: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m boost_compile.bench.zoo --out benchmarks/zoo
	OMP_NUM_THREADS=1 $(PY) -m boost_compile.bench.zoo --options '{"verify": false}' --out benchmarks/zoo --stem zoo-noverify
	OMP_NUM_THREADS=1 $(PY) -m boost_compile.bench.zoo --inner inductor --only $(ZOO_INDUCTOR) --out benchmarks/zoo --stem zoo-inductor

# the zoo under distributed layouts on gloo ranks of this machine: tp2-megatron, tp2-btp (factorized), fsdp2
# (data parallel), tp2xfsdp2 (a sample) and ep2 (mixtures of experts), 3 SGD steps each against eager and
# float64 (zoo-layouts.md)
zoo-layouts: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m boost_compile.bench.zoo_layouts --out benchmarks/zoo

clean:
	rm -rf $(VENV) explain_out .pytest_cache
