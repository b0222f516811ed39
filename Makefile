# The two commands a fresh clone needs: `make run` and `make test`.
JOBS ?= $(shell nproc)
MODEL ?= models/stories260K.gguf

.PHONY: run test deps build build-asan asan bench clean

run: build
	./build/release/pagoda run -m $(MODEL) -p "Once upon a time" -n 200 --temp 0.8 --seed 42

test: build
	ctest --test-dir build/release -j $(JOBS) --output-on-failure

deps:
	./scripts/install-deps.sh

build: deps
	cmake --preset release >/dev/null
	cmake --build build/release -j $(JOBS)

# The test suite under AddressSanitizer + UndefinedBehaviorSanitizer.
asan: deps
	cmake --preset asan >/dev/null
	cmake --build build/asan -j $(JOBS)
	ctest --test-dir build/asan -j $(JOBS) --output-on-failure

bench: build
	./scripts/bench.sh

clean:
	rm -rf build
