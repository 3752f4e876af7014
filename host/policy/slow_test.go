package policy

import (
	"context"
	"log/slog"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/abi/guest"
	"github.com/kvhost/kvhost/plugins/lru"
)

// TestSlowCallsOutliveTheBackend: the slow calls of a wasm backend are
// still counted once it is closed, at a reload or a switch to the
// fallback (issue 37: kvhost_policy_slow_calls_total went down at every
// reload, because the daemon read the old host's counts after Close).
func TestSlowCallsOutliveTheBackend(t *testing.T) {
	tests := []struct {
		name string
		end  func(h *Host) error
	}{
		{"closed", func(h *Host) error { return h.Close(context.Background()) }},
		{"switched to the fallback", func(h *Host) error {
			return h.switchToFallback(context.Background(), &Error{Plugin: "wellbehaved", Hook: "kvhost_name", Err: context.Canceled})
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			module := wasmFixture(t, "wellbehaved")
			h, err := Open(context.Background(), module, "wellbehaved", emptyIndex{}, Config{
				Shards: 1, CallTimeout: time.Second, Fallback: func() guest.Policy { return lru.New() }, Logger: slog.New(slog.DiscardHandler)})
			if err != nil {
				t.Fatal(err)
			}
			defer h.Close(context.Background())
			// Open's own calls count too if the machine held one past its
			// deadline: the count is taken from what Open left.
			before := h.Stats().SlowCalls
			h.mu.RLock()
			h.mu.backend.(*wasmBackend).slow.Add(3) // three calls past their deadline
			h.mu.RUnlock()
			if err := tt.end(h); err != nil {
				t.Fatal(err)
			}
			if got := h.Stats().SlowCalls; got != before+3 {
				t.Fatalf("SlowCalls = %d after the backend ended, want %d (Open's) + 3", got, before)
			}
		})
	}
}

// wasmFixture reads testdata/NAME.wasm, built from NAME.wat by `make wasm`.
func wasmFixture(t *testing.T, name string) []byte {
	t.Helper()
	b, err := os.ReadFile(filepath.Join("testdata", name+".wasm"))
	if err != nil {
		t.Fatalf("%v (build the fixtures with `make wasm`)", err)
	}
	return b
}

// emptyIndex is an Index with nothing stored (package policytest imports
// this package).
type emptyIndex struct{}

func (emptyIndex) Lookup(uint64) (Entry, bool)       { return Entry{}, false }
func (emptyIndex) Range(func(Entry) bool)            {}
func (emptyIndex) Namespaces() []abi.NamespaceRecord { return nil }
