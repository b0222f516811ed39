# The two commands a fresh clone needs: `make run` and `make test`.
JOBS ?= $(shell nproc)
MODEL ?= models/stories260K.gguf
PORT ?= 8080

.PHONY: run test deps configure build build-pagoda build-asan asan bench clean

# The OpenAI-compatible server on the bundled model; it prints its URL and a
# curl example (docs/serving.md). Ctrl-C stops it. Builds the pagoda binary
# alone (what `serve` runs), not the tests and benchmarks `make test` needs.
run: build-pagoda
	./build/release/pagoda serve -m $(MODEL) --host 127.0.0.1 --port $(PORT)

test: build
	ctest --test-dir build/release -j $(JOBS) --output-on-failure

deps:
	./scripts/install-deps.sh

configure: deps
	cmake --preset release >/dev/null

# Everything: the binary, the library, tests, benchmarks and examples.
build: configure
	cmake --build build/release -j $(JOBS)

build-pagoda: configure
	cmake --build build/release -j $(JOBS) --target pagoda

# The test suite under AddressSanitizer + UndefinedBehaviorSanitizer.
asan: deps
	cmake --preset asan >/dev/null
	cmake --build build/asan -j $(JOBS)
	ctest --test-dir build/asan -j $(JOBS) --output-on-failure

bench: build
	./scripts/bench.sh

clean:
	rm -rf build
