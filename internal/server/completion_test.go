package server

import (
	"context"
	"errors"
	"testing"

	"github.com/kvhost/kvhost/internal/engine"
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

// TestEveryCompletionDecodes: whatever the engine reports for a key, the
// completion the daemon sends is one the protocol's decoder accepts (and
// so clients do): no key pending, and every failed or cancelled key with a
// code.
func TestEveryCompletionDecodes(t *testing.T) {
	for _, tc := range []struct {
		name string
		keys []engine.KeyResult
		err  error
	}{
		{"done", []engine.KeyResult{{Outcome: engine.OutcomeStored}, {Outcome: engine.OutcomeMissing, Err: errors.New("gone")}}, nil},
		{"pending", []engine.KeyResult{{Outcome: engine.OutcomePending}}, nil},
		{"cancelled", []engine.KeyResult{{Outcome: engine.OutcomeFailed, Err: context.Canceled}}, nil},
		{"cancelled without an error", []engine.KeyResult{{Outcome: protocol.OutcomeCancelled}}, nil},
		{"failed without an error", []engine.KeyResult{{Outcome: engine.OutcomeFailed}}, nil},
		{"failed with a protocol error without a code", []engine.KeyResult{{Outcome: engine.OutcomeFailed, Err: &protocol.Error{}}}, nil},
		{"an outcome past the protocol's", []engine.KeyResult{{Outcome: protocol.OutcomeCancelled + 1}}, nil},
		{"fewer results than keys", nil, nil},
		{"no results and an error", nil, errors.New("engine closed")},
	} {
		t.Run(tc.name, func(t *testing.T) {
			const nkeys = 2
			m := completionOf(1, protocol.JobStore, nkeys, engine.Result{Keys: tc.keys}, tc.err)
			got, err := protocol.Decode(m.Type(), m.AppendBody(nil))
			if err != nil {
				t.Fatalf("the completion %+v does not decode: %v", m, err)
			}
			if n := len(got.(*protocol.Completion).Keys); n != nkeys {
				t.Fatalf("%d keys, want %d", n, nkeys)
			}
		})
	}
}
