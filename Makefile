# The README's commands. Each one creates or refreshes .venv first.
PY := .venv/bin/python
STAMP := .venv/.installed

.PHONY: serve test proto install clean

$(STAMP): pyproject.toml scripts/install
	scripts/install

install: $(STAMP)

serve: $(STAMP)
	.venv/bin/specfleet serve $(ARGS)

# Tests run on TEST_WORKERS processes (pytest-xdist): most of a test's time is real services starting and
# serving, which leaves a core idle much of the time, so two workers on two cores finish the suite in about
# three quarters of one worker's time. TEST_WORKERS=0 runs every test in pytest's own process.
TEST_WORKERS ?= 2

test: $(STAMP)
	scripts/ensure-redis
	scripts/ensure-prometheus
	$(PY) -m pytest -n $(TEST_WORKERS) $(PYTEST_ARGS)

proto: $(STAMP)
	$(PY) -m tools.protogen

clean:
	rm -rf .venv .pytest_cache .cache/random-models
