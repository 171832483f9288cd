# paged_kv: two commands do all the set-up.
#   make lab    create .venv when missing, install everything, open JupyterLab on the course
#   make test   create the same .venv when missing, then lint and run every test
.DEFAULT_GOAL := help

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PYTEST_ARGS ?= -n 2
LAB_ARGS ?=
# The learner's working copy of the course, which JupyterLab opens (git-ignored; see tools/lab_setup.py).
WORK ?= my_course

NBVAL := --nbval-current-env -p no:cacheprovider -n 2 --dist loadfile
LESSON_NBVAL := --nbval --nbval-sanitize-with tests/nbval_sanitize.cfg $(NBVAL)
SOLUTION_NBVAL := --nbval-lax $(NBVAL)

.PHONY: help venv lab serve site test lint format test-lesson notebooks course check-env screenshots constraints clean

help: ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-12s %s\n", $$1, $$2}'

# The environment: rebuilt when pyproject.toml or constraints.txt change.
$(STAMP): pyproject.toml constraints.txt
	@$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), "paged_kv needs Python 3.11 or newer, found " + sys.version.split()[0]'
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet --constraint constraints.txt --editable '.[dev]'
	touch $(STAMP)

venv: $(STAMP) ## create .venv and install the pinned environment

# JupyterLab refuses to start as root (uid 0, as in most containers) without --allow-root: make lab
# passes it then, and only then. Expanded when a recipe uses it, so other targets never run `id`.
AS_ROOT = $(filter 0,$(shell id -u 2>/dev/null))
AS_ROOT_NOTE := make lab: running as root (uid 0), so JupyterLab is started with --allow-root

lab: $(STAMP) ## open your copy of the course, my_course/, in JupyterLab (flags: LAB_ARGS="--port 8899")
	$(BIN)/python tools/lab_setup.py --work "$(WORK)"
	$(if $(AS_ROOT),@echo "$(AS_ROOT_NOTE)")
	$(BIN)/jupyter lab --ServerApp.root_dir="$(abspath $(WORK))" --LabApp.default_url=/lab/tree/lessons \
		--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate $(if $(AS_ROOT),--allow-root) $(LAB_ARGS)

# The OpenAI-compatible server of lesson 15 on 127.0.0.1:8000, in the foreground (Ctrl-C stops it).
SERVE_ARGS ?=

serve: $(STAMP) ## start `paged-kv serve` on 127.0.0.1:8000 (flags: SERVE_ARGS="--tiny --port 8001")
	$(BIN)/python -m paged_kv serve $(SERVE_ARGS)

site: $(STAMP) ## build the lessons into a static site to read offline: open site/index.html (needs npm)
	$(BIN)/python tools/build_site.py --out site

test: $(STAMP) lint ## lint, then run every test: the package, the course tools, every notebook
	$(BIN)/python -m pytest $(PYTEST_ARGS)
	$(MAKE) --no-print-directory notebooks

notebooks: $(STAMP) ## run the lessons under nbval (outputs compared) and the solutions (must not fail)
	$(BIN)/python -m pytest $(LESSON_NBVAL) lessons
	$(BIN)/python -m pytest $(SOLUTION_NBVAL) solutions

lint: $(STAMP) ## ruff: lint and formatting
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: $(STAMP) ## let ruff fix what it can and format the code
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

test-lesson: $(STAMP) ## the tests and notebooks of one lesson: make test-lesson LESSON=02
	@$(BIN)/python -c 'import sys; from paged_kv.course_map import BY_NUMBER; lesson = sys.argv[1]; \
	lesson in BY_NUMBER or sys.exit("usage: make test-lesson LESSON=NN, NN one of the lessons " \
	+ " ".join(BY_NUMBER) + " (two digits); got LESSON=" + repr(lesson))' "$(LESSON)"
	$(BIN)/python -m pytest -m lesson$(LESSON) $(PYTEST_ARGS)
	$(BIN)/python -m pytest $(LESSON_NBVAL) lessons/$(LESSON)_*.ipynb
	$(BIN)/python -m pytest $(SOLUTION_NBVAL) solutions/$(LESSON)_*.ipynb

course: $(STAMP) ## regenerate the notebooks from course/ (ONLY=03 for one lesson), executing the lessons
	$(BIN)/python tools/build_course.py $(if $(ONLY),--only $(ONLY))

check-env: $(STAMP) ## print versions and OK/FAIL per requirement, for bug reports
	$(BIN)/python -m paged_kv check-env

screenshots: $(STAMP) ## redraw docs/images/player.png, playground.png and kv_page.png (needs chromium and npm)
	$(BIN)/python tools/screenshots.py
	PAGED_KV_DOCS_IMAGES=1 $(BIN)/python -m pytest -q -p no:cacheprovider tests/browser/test_kv_page.py

constraints: $(STAMP) ## re-pin constraints.txt from the current .venv (after a deliberate upgrade)
	{ grep '^#' constraints.txt; $(BIN)/python -m pip freeze --exclude-editable | sed 's/^torch==.*/torch==2.13.0/' | sort -f; } > constraints.new
	mv constraints.new constraints.txt

clean: ## remove .venv, the caches and the built site
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis site
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
