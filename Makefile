# xpod: `make run` and `make test` work on a fresh machine (they create .venv and install into it).
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
XPOD   := $(VENV)/bin/xpod
STAMP  := $(VENV)/.installed

.PHONY: install run test test-scale test-multihost lint format bench bench-full mpi clean-shm

$(STAMP): setup.cfg pyproject.toml
	python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -e '.[test,plot,serve,mpi,multihost]'
	$(PY) -c "from comm import kernels; from runtime.model import kernels as m; kernels.warm(); m.warm()"  # compile numba kernels into the cache
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(XPOD) run --dies 4
	$(XPOD) run --hosts 2,2 --size 256K
	$(XPOD) bench p2p --dies 2 --quick --variants mte,zero-copy --cores 1
	$(XPOD) decode --dies 4 --batch 8 --prompt-len 32 --steps 16 --model small --check
	$(XPOD) decode --attention-dies 2 --expert-dies 2 --domains 2 --microbatches 2 --batch 8 \
		--prompt-len 32 --steps 16 --model small --check
	$(XPOD) generate --dies 4 --max-tokens 24 --prompt "The pod is" --prompt "Experts run" \
		--prompt "A decode step" --prompt "Each die owns" --prompt "Tokens travel"
	$(XPOD) generate --prefill-dies 2 --decode-dies 2 --max-tokens 24 --prompt "The KV moves" \
		--prompt "Prefill dies compute" --prompt "Decode dies stream"
	$(XPOD) generate --dies 4 --max-tokens 24 --num-speculative-tokens 1 --prompt "The pod is" \
		--prompt "Experts run" --prompt "MTP drafts"
	$(XPOD) bench serve --launch --dies 4 --max-concurrency 8 --ignore-eos --num-prompts 32 --quick

test: $(STAMP)
	$(PY) -m pytest -q -m "not multihost and not scale"

# Captures of large pods (EP32-64 at the paper's sizes, the synthesizer checked against them).
test-scale: $(STAMP)
	$(PY) -m pytest -q -m scale

# The whole multi-host suite (MPI and mirror conformance, every crash case): ~2 min more.
test-multihost: $(STAMP)
	$(PY) -m pytest -q -m multihost tests/integration/test_multihost_*.py

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: $(STAMP)
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

bench: $(STAMP)
	$(XPOD) bench p2p --dies 2 --quick --peers
	$(XPOD) bench ring --dies 8,16 --quick
	$(XPOD) bench alltoall --dies 8 --quick --protocol fused --quant int8 --peers
	$(XPOD) decode --dies 4 --batch 8 --prompt-len 64 --steps 32 --check
	$(XPOD) bench engine --dies 4 --batch 8 --quick
	$(XPOD) bench serve --launch --dies 4 --max-concurrency 8 --ignore-eos --num-prompts 64

bench-full: $(STAMP)
	$(XPOD) bench p2p --dies 2 --peers --json p2p.jsonl --plot p2p.png
	$(XPOD) bench ring --dies 8,16,32 --json ring.jsonl

# Optional MPI peer for `xpod bench p2p --peers`: OpenMPI from Debian, mpi4py into the venv.
mpi: $(STAMP)
	$(PIP) install -q -e '.[mpi]'

clean-shm: $(STAMP)
	$(XPOD) clean
