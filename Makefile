# The README's commands. Each one creates or refreshes .venv first.
PY := .venv/bin/python
STAMP := .venv/.installed

.PHONY: serve test proto bench clean

$(STAMP): pyproject.toml
	@test -x $(PY) || python3 -m venv .venv
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	@touch $(STAMP)

serve: $(STAMP)
	.venv/bin/specfleet serve

test: $(STAMP)
	scripts/ensure-redis
	$(PY) -m pytest -q $(PYTEST_ARGS)

proto: $(STAMP)
	$(PY) -m specfleet.protogen

clean:
	rm -rf .venv .pytest_cache
