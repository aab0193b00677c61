# The README's commands. Each one creates or refreshes .venv first.
PY := .venv/bin/python
STAMP := .venv/.installed

.PHONY: serve test proto install clean

$(STAMP): pyproject.toml scripts/install
	scripts/install

install: $(STAMP)

serve: $(STAMP)
	.venv/bin/specfleet serve $(ARGS)

test: $(STAMP)
	scripts/ensure-redis
	scripts/ensure-prometheus
	$(PY) -m pytest $(PYTEST_ARGS)

proto: $(STAMP)
	$(PY) -m tools.protogen

clean:
	rm -rf .venv .pytest_cache .cache/random-models
