# Kiln's two set-up commands (see README.md), each idempotent on a fresh Debian 12 machine:
#   make run    install build deps, build, and run the main job (`kiln info`, `kiln selftest`,
#               and `kiln generate` on the embedded default model)
#   make test   install build deps, build three times (release, ASan+UBSan, libFuzzer), run
#               every test and fuzz each target for a while
# Anything else is plain CMake: cmake -B build && cmake --build build.

BUILD      ?= build
ASAN_BUILD ?= build-asan
FUZZ_BUILD ?= build-fuzz
FUZZ_SECS  ?= 20
JOBS       ?= $(shell nproc)
DEB_PKGS   := build-essential cmake pkg-config libinih-dev libcmocka-dev libopenblas-dev \
              libpcre2-dev libutf8proc-dev libxxhash-dev libcurl4-openssl-dev libmicrohttpd-dev \
              libpng-dev libjpeg62-turbo-dev libwebp-dev python3-pil python3-numpy python3-venv \
              valgrind hipcc libze-dev clang libclang-rt-14-dev chromium
SUDO       := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: all deps build run python test test-release test-asan test-memcheck test-fuzz clean

all: build

# Installs only what is missing, so a second run does nothing. npm (for the tests' real
# tokenizer files) is taken from Debian only when no npm is on the PATH already.
deps:
	@missing=$$(for p in $(DEB_PKGS); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done; \
	  command -v npm >/dev/null 2>&1 || echo npm); \
	if [ -n "$$missing" ]; then \
	  echo "installing: $$missing"; \
	  $(SUDO) apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq --no-install-recommends $$missing; \
	fi

$(BUILD)/CMakeCache.txt:
	cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=Release

build: deps $(BUILD)/CMakeCache.txt
	cmake --build $(BUILD) -j $(JOBS)

run: build
	./$(BUILD)/bin/kiln info
	./$(BUILD)/bin/kiln selftest
	./$(BUILD)/bin/kiln generate --prompt "Once upon a time" --max-tokens 48 --temperature 0.8 --seed 1

# The Python package (python/, `import kiln`) into a virtual environment: the active one
# ($$VIRTUAL_ENV), else $(BUILD)/venv (made with Debian's python3-venv). pip installs it offline
# and records $(BUILD)/lib/libkiln.so for it to load. Then: $(BUILD)/venv/bin/python.
PYTHON ?= python3
VENV   ?= $(or $(VIRTUAL_ENV),$(BUILD)/venv)
python: build
	@[ -x "$(VENV)/bin/pip" ] || $(PYTHON) -m venv "$(VENV)"
	KILN_BUILD_DIR="$(abspath $(BUILD))" "$(VENV)/bin/pip" install --no-index --no-cache-dir \
	  --force-reinstall --quiet ./python
	@echo "kiln: installed into $(VENV); try: $(VENV)/bin/python -c 'import kiln; print(kiln.LLM().generate(\"Once upon a time\")[0].outputs[0].text)'"

test-release: build
	cd $(BUILD) && ctest --output-on-failure -j $(JOBS)

# The sanitizer build skips the GPU plugins: their host code is exercised in the release build
# and the device code cannot run here.
test-asan: deps
	cmake -S . -B $(ASAN_BUILD) -DCMAKE_BUILD_TYPE=Debug -DKILN_SANITIZE=ON \
	  -DKILN_BACKEND_CUDA=OFF -DKILN_BACKEND_ROCM=OFF
	cmake --build $(ASAN_BUILD) -j $(JOBS)
	cd $(ASAN_BUILD) && ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 \
	  UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 ctest --output-on-failure -j $(JOBS)

# valgrind over the cmocka suites of the release build (the scripted CLI/SDK/server tests, the
# Pillow cross-check (bash + python; its C half is test_image, which does run here), the seed
# corpus check (bash + python) and the selftest are left to the sanitizer build), for leaks and
# uninitialised reads. The engine simulation runs 2,000 requests there instead of 100,000.
test-memcheck: build
	cd $(BUILD) && KILN_PCRE2_JIT=0 KILN_SIM_REQUESTS=2000 ctest -T memcheck -E 'test_layers|test_fuzz_corpus|make_gguf_vocabs|test_cli|test_sdk|test_gpus_info|test_trace|test_plugin_folders|test_generate_batch|test_server|test_bench_serve|test_hub_download|test_hub_npm|test_python|test_chat|test_bench_offline|test_default_model|kiln_selftest|fetch_|test_ops_cpu_|test_image_pil|test_collectives_exec' --output-on-failure -j $(JOBS)

# The libFuzzer targets (tests/fuzz, Debian's clang 14 with its compiler-rt), built alone, then
# FUZZ_SECS seconds of fuzzing each from the committed seeds after replaying every kept crash
# input (tests/fuzz/README.md). About 3 minutes on 2 cores; FUZZ_SECS=0 only replays.
test-fuzz: deps
	cmake -S . -B $(FUZZ_BUILD) -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_C_COMPILER=clang \
	  -DKILN_FUZZ=ON -DKILN_BACKEND_CUDA=OFF -DKILN_BACKEND_ROCM=OFF
	cmake --build $(FUZZ_BUILD) -j $(JOBS) --target fuzzers
	KILN_FUZZ_JOBS=$(JOBS) tests/fuzz/run_fuzzers.sh $(FUZZ_BUILD) $(FUZZ_SECS)

test: test-release test-asan test-memcheck test-fuzz

clean:
	rm -rf $(BUILD) $(ASAN_BUILD) $(FUZZ_BUILD)
