# Both targets create or refresh .venv from pyproject.toml, then run.
PYTHON ?= python3
VENV   := .venv
STAMP  := $(VENV)/.installed

.PHONY: up test venv tools clean

$(STAMP): pyproject.toml
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade pip
	$(VENV)/bin/python -m pip install -q -e '.[test]'
	touch $(STAMP)

venv: $(STAMP)

up: $(STAMP)
	$(VENV)/bin/warmboot up --demo $(UP_ARGS)

# promtool (Debian's prometheus package) checks deploy/prometheus/alerts.yml (tests/test_alerts.py): installed
# where this runs as root with apt-get (a CI machine, a fresh container: about 10 s); elsewhere that test is
# skipped, saying why, and so is said here.
tools:
	@command -v promtool >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing promtool (Debian's prometheus package) for tests/test_alerts.py"; \
	    export DEBIAN_FRONTEND=noninteractive; \
	    apt-get install -y -qq --no-install-recommends prometheus >/dev/null 2>&1 \
	      || { apt-get update -qq >/dev/null 2>&1 && \
	           apt-get install -y -qq --no-install-recommends prometheus >/dev/null 2>&1; } \
	      || echo "note: promtool could not be installed; tests/test_alerts.py's promtool check is skipped"; \
	  else \
	    echo "note: promtool is not installed (Debian: apt-get install prometheus); tests/test_alerts.py's" \
	         "promtool check is skipped"; \
	  fi; }

test: $(STAMP) tools
	$(VENV)/bin/python -m pytest -q -n 3 --dist loadfile

clean:
	rm -rf $(VENV) .warmboot .pytest_cache
