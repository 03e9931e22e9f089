# kvrouter-ha: build, test, demo, bench.
GO      ?= go
BIN     := bin/kvrouter-ha
PKGS    := ./...
# Each fuzz target runs this many inputs in `make test` (CI); `make fuzz FUZZTIME=5m` digs deeper.
# A count, not a duration: with a duration, Go 1.26's fuzz coordinator can report a spurious
# "context deadline exceeded" when its workers are slow to stop at the deadline on a loaded
# machine (go.dev/issue/75804, fixed in Go 1.27); a count has no deadline to race.
FUZZTIME ?= 20000x
# package:target pairs that `make fuzz` runs.
FUZZ_TARGETS := \
	./transport/openai:FuzzParse \
	./transport/h1:FuzzReadHead \
	./transport/openai:FuzzDecodeModelList \
	./transport/openai:FuzzReadCommonHead \
	./transport/openai:FuzzScanUsage \
	./transport/openai:FuzzResponseWatch \
	./sim:FuzzDecodeRequest \
	./sim/trace:FuzzRead \
	./internal/testreport:FuzzReport \
	./indexer:FuzzChain \
	./transport/kvevents:FuzzDecode \
	./transport/kvevents:FuzzGuardFraming \
	./fsm:FuzzDecode \
	./internal/proc:FuzzReadHAProxyPolicy \
	./fsm:FuzzRestore \
	./workers:FuzzParseSpecs \
	./discovery:FuzzDecodePool \
	./discovery:FuzzParseKubernetes \
	./transport/openai:FuzzParseMatchesEncodingJSON \
	./indexer:FuzzSnapshotDecode \
	./cluster/hints:FuzzHealthDecode \
	./cluster/hints:FuzzSnapshotContainer \
	./cluster/hints:FuzzLoadDecode \
	./transport/enginemetrics:FuzzParse \
	./cluster/hints:FuzzDecisionDecode \
	./cluster/gossip:FuzzParseFrame \
	./cluster/gossip:FuzzDecodeMeta \
	./transport/openai:FuzzTransferParams \
	./transport/openai:FuzzClientKey \
	./sim:FuzzParseKVTransferParams \
	./sim:FuzzDecodePullRequest \
	./transport/extproc:FuzzProcessStream \
	./transport/openai:FuzzParseAPIs \
	./sim:FuzzDecodeAPIs \
	./transport/openai:FuzzMigrationRelay \
	./internal/proc:FuzzParseHAProxyLogLine

.PHONY: all build test unit fuzz demo demo-scale bench bench-report lint clean jepsen jepsen-ci

all: build

# The version kvrouter-ha --version prints (empty: the source tree's release and VCS revision).
VERSION ?= $(shell git describe --tags --always --dirty 2>/dev/null)
build:
	$(GO) build -trimpath -ldflags "-X github.com/kvrouter-ha/kvrouter-ha/internal/version.stamp=$(VERSION)" -o $(BIN) ./cmd/kvrouter-ha

## test: lint, every test with the race detector, then a short run of each fuzz target.
test: lint unit fuzz

# With SKIPS_ALLOWED set to an allow-list (CI: .ci/skips-allowed), unit and fuzz run go test
# under internal/testreport: it prints every skipped test with its reason and fails on one
# the list does not name (a skip is a test that did not run).
SKIPS_ALLOWED ?=
REPORT   := $(if $(SKIPS_ALLOWED),bin/testreport -allow $(SKIPS_ALLOWED) --)
REPORT_V := $(if $(SKIPS_ALLOWED),bin/testreport -allow $(SKIPS_ALLOWED) -v --)
TESTREPORT := $(if $(SKIPS_ALLOWED),bin/testreport)

bin/testreport: internal/testreport/*.go
	$(GO) build -o $@ ./internal/testreport

unit: $(TESTREPORT)
	$(REPORT) $(GO) test -race -count=1 -timeout 35m $(PKGS)

# Every Fuzz function in the tree must be listed, and every listed one must exist: a target
# that moved to another package would otherwise "pass" by fuzzing nothing.
fuzz: $(TESTREPORT)
	@set -e; listed=" $(FUZZ_TARGETS) "; \
	for f in $$(grep -rl --include='*_test.go' '^func Fuzz' .); do \
		pkg=./$$(dirname $${f#./}); \
		for name in $$(sed -n 's/^func \(Fuzz[A-Za-z0-9_]*\)(.*/\1/p' $$f); do \
			case "$$listed" in *" $$pkg:$$name "*) ;; *) echo "$$pkg:$$name is not in FUZZ_TARGETS"; exit 1;; esac; \
		done; \
	done; \
	for t in $(FUZZ_TARGETS); do \
		pkg=$${t%%:*}; name=$${t##*:}; \
		$(GO) test -list "^$$name\$$" $$pkg | grep -qx "$$name" || { echo "no fuzz target $$name in $$pkg"; exit 1; }; \
		echo "fuzz $$pkg $$name ($(FUZZTIME))"; \
		$(REPORT_V) $(GO) test -run '^$$' -fuzz "^$$name\$$" -fuzztime $(FUZZTIME) $$pkg; \
	done

## demo: the main job on its embedded defaults: three replicas behind HAProxy (when installed), simulated workers, a trace replayed, the leader killed half-way.
demo: build
	./$(BIN) demo

## demo-scale: three replicas find their workers in a fleet file that grows at one third of the replay and shrinks at two thirds; what moved, beside a fixed fleet of the same average size.
demo-scale: build
	./$(BIN) demo --scenario scale

## bench: the microbenchmarks behind the performance targets (figures, not assertions).
bench:
	$(GO) test -run '^$$' -bench . -benchtime 2s ./indexer ./routing ./transport/openai

## bench-report: the benchmarks and replays behind the performance and quality claims (about 25 minutes on two cores, 15 of them the capacity sweep), written to docs/bench-report/ as report.md, PNG plots and results.json.
BENCH_REPORT_OUT ?= docs/bench-report
BENCH_REPORT_FLAGS ?=
bench-report: build
	$(GO) build -trimpath -o bin/bench-report ./cmd/bench-report
	./bin/bench-report --binary $(BIN) --out $(BENCH_REPORT_OUT) --command "make bench-report" $(BENCH_REPORT_FLAGS)

## jepsen: the fault harness on a long seeded schedule (partitions need root, ip and iptables).
JEPSEN_DURATION ?= 10m
JEPSEN_SEED ?= 1
JEPSEN_FAULTS ?= all
JEPSEN_OUT ?= jepsen-out
jepsen: build
	./$(BIN) jepsen --duration $(JEPSEN_DURATION) --seed $(JEPSEN_SEED) --faults $(JEPSEN_FAULTS) --out $(JEPSEN_OUT) $$(command -v haproxy >/dev/null && echo --haproxy)

## jepsen-ci: the short schedule CI runs.
jepsen-ci:
	$(MAKE) jepsen JEPSEN_DURATION=2m JEPSEN_FAULTS=kill,stop,restart,partition,worker,stale,discovery JEPSEN_OUT=jepsen-ci-out

lint:
	@out=$$(gofmt -l $$(git ls-files '*.go' 2>/dev/null || find . -name '*.go')); \
	if [ -n "$$out" ]; then echo "gofmt needed:"; echo "$$out"; exit 1; fi
	$(GO) vet $(PKGS)

clean:
	rm -rf bin
