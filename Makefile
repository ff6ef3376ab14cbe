# Usual targets. `make install OVERLAY=simulated` installs on the current kubectl context.
PYTHON  ?= python3
VENV    ?= .venv
IMAGE   ?= gpu-slice
TAG     ?= $(shell sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
OVERLAY ?= nvidia
KUBECTL ?= kubectl
OUT     ?= build/manifests

.PHONY: help venv dev test lint image manifests install uninstall clean

help:
	@echo "make venv       create $(VENV) with the test extra (the README's test command's environment)"
	@echo "make test       run the test suite (pytest)"
	@echo "make lint       ruff, mypy, the import contracts, generated protobuf code is current"
	@echo "make image      build the image $(IMAGE):$(TAG) (both services)"
	@echo "make manifests  render every overlay to $(OUT)/<overlay>.yaml with kubectl kustomize"
	@echo "make install    kubectl apply -k manifests/overlays/$(OVERLAY) (OVERLAY=nvidia|simulated)"
	@echo "make uninstall  kubectl delete -k manifests/overlays/$(OVERLAY)"

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)

venv: $(VENV)/bin/python
	$(VENV)/bin/pip install -e '.[test]'

dev: $(VENV)/bin/python
	$(VENV)/bin/pip install -e '.[dev]'

test: venv
	$(VENV)/bin/pytest

lint: dev
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports
	$(VENV)/bin/python scripts/gen_protos.py --check

image:
	docker build -t $(IMAGE):$(TAG) .

manifests:
	mkdir -p $(OUT)
	for o in manifests/overlays/*/; do \
	  n=$$(basename $$o); $(KUBECTL) kustomize $$o > $(OUT)/$$n.yaml || exit 1; echo "$(OUT)/$$n.yaml"; \
	done

install:
	$(KUBECTL) apply --server-side -k manifests/overlays/$(OVERLAY)

uninstall:
	$(KUBECTL) delete --ignore-not-found -k manifests/overlays/$(OVERLAY)

clean:
	rm -rf build
