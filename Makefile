# Quiver: the two commands of the README, and the steps they are made of.
CACHE ?= $(CURDIR)/.cache
export QUIVER_CACHE := $(CACHE)
CARGO ?= cargo
QUIVER := target/release/quiver

.PHONY: test-amx demo test test-data test-server check-cuda opencl-runtimes test-opencl-pocl check-opencl-codegen build model venv clean-refs

demo: model build
	python3 scripts/demo.py

# The workspace's OpenCL tests (opencl_kernels, opencl_lora, opencl_parity) run on Intel's CPU
# OpenCL runtime: portable kernels, and the DPAS GEMM at 16 and 8 lanes with the matrix builtin
# emulated. OCL_ICD_VENDORS shows them that runtime alone.
OPENCL_INTEL := OCL_ICD_VENDORS=$(CACHE)/opencl/intel-cpu QUIVER_TEST_OPENCL_PLATFORM="Intel(R) OpenCL"

# The Rust build (test binaries and the server binary) runs while the Python references are made:
# on a fresh 2-core machine each takes ~15 minutes, and the references use one thread.
test: opencl-runtimes
	@mkdir -p $(CACHE)
	@echo "building the tests in the background (log: $(CACHE)/test-build.log) while the reference data is made"
	@( $(CARGO) build --release -p quiver && $(OPENCL_INTEL) $(CARGO) test --release --workspace --no-run ) > $(CACHE)/test-build.log 2>&1 & build=$$!; \
	 $(MAKE) test-data; data=$$?; \
	 wait $$build; built=$$?; \
	 if [ $$built -ne 0 ]; then tail -n 80 $(CACHE)/test-build.log; echo "the build failed ($(CACHE)/test-build.log)"; exit $$built; fi; \
	 exit $$data
	$(OPENCL_INTEL) $(CARGO) test --release --workspace
	$(MAKE) test-amx
	$(MAKE) test-server
	$(MAKE) check-cuda
	$(MAKE) test-opencl-pocl
	$(MAKE) check-opencl-codegen

# The opt-in AMX GEMM mode against the same references (HF, PEFT, batched = alone), on CPUs that
# have AMX-BF16; elsewhere there is nothing different to run.
test-amx: test-data
	@if grep -qw amx_bf16 /proc/cpuinfo 2>/dev/null; then \
		QUIVER_CPU_AMX=1 $(CARGO) test --release -p quiver-engine --test parity_hf --test parity_peft --test batched_forward; \
	else echo "test-amx: no AMX-BF16 on this CPU, skipped"; fi

# The CUDA device builds everywhere (CUDA is loaded at run time); its tests need a GPU and run
# through scripts/gpu-check.sh on one, so CI compiles them only, and NVRTC (from NVIDIA's PyPI
# wheel) compiles the kernels' CUDA C as the device does at start-up.
check-cuda:
	$(CARGO) check --workspace --tests --features quiver/cuda,quiver-engine/cuda,quiver-lora/cuda
	@CACHE=$(CACHE) bash scripts/nvrtc-gate.sh

# Intel's CPU OpenCL runtime (PyPI, into the cache), PoCL and Intel's offline compiler (Debian).
opencl-runtimes:
	@bash scripts/setup-opencl.sh

# The portable OpenCL kernels on PoCL (OpenCL C 1.2, no subgroups). One test thread: PoCL 3.1
# crashes when several threads drive devices at once.
test-opencl-pocl: opencl-runtimes
	OCL_ICD_VENDORS=$(CACHE)/opencl/pocl QUIVER_TEST_OPENCL_PLATFORM="Portable Computing Language" QUIVER_TEST_OPENCL_SETS=portable \
		$(CARGO) test --release -p quiver-kernels --test opencl_kernels -- --test-threads 1
	OCL_ICD_VENDORS=$(CACHE)/opencl/pocl QUIVER_TEST_OPENCL_PLATFORM="Portable Computing Language" QUIVER_TEST_OPENCL_SETS=portable \
		$(CARGO) test --release -p quiver-lora --test opencl_lora -- --test-threads 1

# Every DPAS kernel compiled for PVC and DG2 by Intel's offline compiler must contain dpas
# instructions and no unresolved calls.
check-opencl-codegen: opencl-runtimes
	@bash scripts/ocloc-gate.sh

build:
	$(CARGO) build --release -p quiver

model:
	@bash scripts/fetch-model.sh >/dev/null

venv:
	@bash scripts/setup-venv.sh

# Reference data from HF transformers + PEFT (float32, CPU); cached under $(CACHE)/ref.
test-data: model venv
	@bash scripts/make-refs.sh

clean-refs:
	rm -rf $(CACHE)/ref

# HTTP server end to end: real `openai` client, Prometheus parser, shutdown; then the hostile-input
# regressions and the 2,000-request soak (about 2 minutes); tool calling on a tiny random Qwen2
# (its tokenizer, like lm-eval's reference, comes from test-data); embeddings against the
# transformers references. Each starts and kills its own servers on ephemeral ports.
test-server: model venv build test-data
	$(CACHE)/venv/bin/python tests/server/test_openai_api.py --quiver $(QUIVER)
	$(CACHE)/venv/bin/python tests/server/test_tools.py --quiver $(QUIVER)
	$(CACHE)/venv/bin/python tests/server/test_hardening.py --quiver $(QUIVER)
	$(CACHE)/venv/bin/python tests/server/test_embeddings.py --quiver $(QUIVER)
