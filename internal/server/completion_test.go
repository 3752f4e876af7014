package server

import (
	"context"
	"errors"
	"fmt"
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

// TestLoadWhoseDestinationChangedFailsWithItsOwnCode: a load key whose
// destination blocks the client changed under the load (the engine's
// ErrDestinationChanged: the file verifies) fails with code destination
// changed, named as such, not internal error, and the completion
// decodes. A code past the last this decoder names (as 23 is to a client
// older than it) still decodes as a failed key, named by its number.
func TestLoadWhoseDestinationChangedFailsWithItsOwnCode(t *testing.T) {
	changed := fmt.Errorf("%w: /m/a.kv: key 0", engine.ErrDestinationChanged)
	for _, tc := range []struct {
		name string
		err  error
	}{
		{"the engine's error", changed},
		{"wrapped again", fmt.Errorf("load: %w", changed)},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := errorOf(tc.err).Code; got != protocol.CodeDestinationChanged {
				t.Fatalf("errorOf(%v) = %v, want %v", tc.err, got, protocol.CodeDestinationChanged)
			}
			keys := []engine.KeyResult{{Outcome: engine.OutcomeFailed, Err: tc.err}, {Outcome: engine.OutcomeLoaded}}
			m := completionOf(1, protocol.JobLoad, len(keys), engine.Result{Keys: keys}, nil)
			back, err := protocol.Decode(m.Type(), m.AppendBody(nil))
			if err != nil {
				t.Fatalf("the completion %+v does not decode: %v", m, err)
			}
			k := back.(*protocol.Completion).Keys[0]
			if k.Outcome != protocol.OutcomeFailed || k.Code != protocol.CodeDestinationChanged {
				t.Fatalf("key 0 decodes as %v %v, want failed, %v", k.Outcome, k.Code, protocol.CodeDestinationChanged)
			}
			if name := k.Code.String(); name != "destination changed" {
				t.Errorf("the code is named %q, want %q", name, "destination changed")
			}
		})
	}
	newer := &protocol.Completion{Job: 1, Kind: protocol.JobLoad, Keys: []protocol.KeyOutcome{{Outcome: protocol.OutcomeFailed, Code: protocol.CodeDestinationChanged + 1}}}
	back, err := protocol.Decode(newer.Type(), newer.AppendBody(nil))
	if err != nil {
		t.Fatalf("a newer daemon's code does not decode: %v", err)
	}
	if k := back.(*protocol.Completion).Keys[0]; k.Outcome != protocol.OutcomeFailed || k.Code.String() != "code(24)" {
		t.Fatalf("a newer daemon's code decodes as %v %q, want failed, code(24)", k.Outcome, k.Code)
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
		{"the wire's cancelled, no engine outcome", []engine.KeyResult{{Outcome: engine.Outcome(protocol.OutcomeCancelled)}}, nil},
		{"failed without an error", []engine.KeyResult{{Outcome: engine.OutcomeFailed}}, nil},
		{"failed with a protocol error without a code", []engine.KeyResult{{Outcome: engine.OutcomeFailed, Err: &protocol.Error{}}}, nil},
		{"an outcome past the protocol's", []engine.KeyResult{{Outcome: engine.Outcome(protocol.OutcomeCancelled + 1)}}, nil},
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

// TestEveryEngineOutcomeIsSentAsItself: a completion carrying each
// engine outcome decodes to the same outcome (one vocabulary, package
// outcome), but pending, which no finished job reports, which is sent
// cancelled; a value past the engine's outcomes is sent failed, with
// CodeInternal.
func TestEveryEngineOutcomeIsSentAsItself(t *testing.T) {
	for _, tc := range []struct {
		engine engine.Outcome
		sent   protocol.Outcome
		code   protocol.Code
	}{
		{engine.OutcomePending, protocol.OutcomeCancelled, protocol.CodeCancelled},
		{engine.OutcomeStored, protocol.OutcomeStored, protocol.CodeOK},
		{engine.OutcomePresent, protocol.OutcomePresent, protocol.CodeOK},
		{engine.OutcomeNotAdmitted, protocol.OutcomeNotAdmitted, protocol.CodeOK},
		{engine.OutcomeLoaded, protocol.OutcomeLoaded, protocol.CodeOK},
		{engine.OutcomeMissing, protocol.OutcomeMissing, protocol.CodeOK},
		{engine.OutcomeFailed, protocol.OutcomeFailed, protocol.CodeInternal},
		{engine.OutcomeFailed + 1, protocol.OutcomeFailed, protocol.CodeInternal},
	} {
		t.Run(tc.engine.String(), func(t *testing.T) {
			m := completionOf(1, protocol.JobStore, 1, engine.Result{Keys: []engine.KeyResult{{Outcome: tc.engine}}}, nil)
			back, err := protocol.Decode(m.Type(), m.AppendBody(nil))
			if err != nil {
				t.Fatalf("the completion %+v does not decode: %v", m, err)
			}
			if k := back.(*protocol.Completion).Keys[0]; k.Outcome != tc.sent || k.Code != tc.code {
				t.Errorf("engine outcome %v sent as %v (%v), want %v (%v)", tc.engine, k.Outcome, k.Code, tc.sent, tc.code)
			}
		})
	}
}
