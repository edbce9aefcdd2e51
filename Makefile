# The two commands of the quickstart: `make serve` and `make test`. Both install first (fast when done):
# serving installs what serving imports; the tests add pyproject.toml's `test` extra.
VENV ?= .venv
PORT ?=

.PHONY: install install-test serve test bench clean

install:
	@bash installer/install.sh

install-test:
	@bash installer/install.sh --with test

serve: install
	$(VENV)/bin/appliance serve $(if $(PORT),--port $(PORT))

test: install-test
	$(VENV)/bin/python -m pytest -q -p no:cacheprovider

bench: install-test
	$(VENV)/bin/python -m bench.throughput

clean:
	rm -rf $(VENV)
