# Two commands do all the set-up on a fresh machine:
#   make demo   # speculative generation on the embedded SmolLM2-135M-Instruct (+ stats, speedup over plain)
#   make test   # the test suite (fast subset; `make test-all` adds the slow tests)
PROMPT ?= Explain in three sentences why the sky is blue.
ARGS ?=

.PHONY: setup demo test test-all bench clean

setup:
	@bash scripts/setup.sh

demo: setup
	@scripts/run python -m mlx_dflash2.generate --prompt "$(PROMPT)" --max-tokens 128 --verbose --compare $(ARGS)

test: setup
	@scripts/run python -m pytest -q $(ARGS)

test-all: setup
	@scripts/run python -m pytest -q -m "slow or not slow" $(ARGS)

clean:
	rm -rf .venv build *.egg-info .pytest_cache
