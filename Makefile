# The two commands of the quickstart: `make serve` and `make test`. Both install first (fast when done).
VENV ?= .venv
PORT ?=

.PHONY: install serve test bench clean

install:
	@bash installer/install.sh

serve: install
	$(VENV)/bin/appliance serve $(if $(PORT),--port $(PORT))

test: install
	$(VENV)/bin/python -m pytest -q -p no:cacheprovider

bench: install
	$(VENV)/bin/python -m bench.throughput

clean:
	rm -rf $(VENV)
