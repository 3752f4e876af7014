package server

import (
	"errors"
	"testing"

	"github.com/kvhost/kvhost/host/engine"
	"github.com/kvhost/kvhost/protocol"
)

// TestCompletionMessage: a completion's message is the first failed key's
// error; with no failed key, it says why the first missing key is
// missing; with neither, it is empty.
func TestCompletionMessage(t *testing.T) {
	missing := engine.KeyResult{Outcome: engine.OutcomeMissing, Err: errors.New("file vanished")}
	failed := engine.KeyResult{Outcome: engine.OutcomeFailed, Err: errors.New("disk on fire")}
	loaded := engine.KeyResult{Outcome: engine.OutcomeLoaded}
	for _, tc := range []struct {
		name string
		keys []engine.KeyResult
		want string
	}{
		{"failed-first", []engine.KeyResult{missing, failed}, "key 1: disk on fire"},
		{"missing", []engine.KeyResult{loaded, missing}, "key 1: missing: file vanished"},
		{"none", []engine.KeyResult{loaded, loaded}, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			m := completionOf(1, protocol.JobLoad, len(tc.keys), engine.Result{Keys: tc.keys}, nil)
			if m.Message != tc.want {
				t.Fatalf("message %q, want %q", m.Message, tc.want)
			}
		})
	}
}
