# Both targets create or refresh .venv from pyproject.toml, then run.
PYTHON ?= python3
VENV   := .venv
STAMP  := $(VENV)/.installed

.PHONY: up test venv clean

$(STAMP): pyproject.toml
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade pip
	$(VENV)/bin/python -m pip install -q -e '.[test]'
	touch $(STAMP)

venv: $(STAMP)

up: $(STAMP)
	$(VENV)/bin/warmboot up --demo $(UP_ARGS)

test: $(STAMP)
	$(VENV)/bin/python -m pytest -q -n 3 --dist loadfile

clean:
	rm -rf $(VENV) .warmboot .pytest_cache
