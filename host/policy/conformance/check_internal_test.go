package conformance

import (
	"errors"
	"strings"
	"testing"
	"time"
)

// panicsOnNil dereferences a nil pointer: the panic the test recovers.
func panicsOnNil(p *int) (string, error) { return strings.Repeat("x", *p), nil }

// TestACheckThatPanicsFailsSayingWhere: a panic inside a check fails that
// check (never the process), and its message names the function where
// the panic was raised, so that a report of it can be followed up.
func TestACheckThatPanicsFailsSayingWhere(t *testing.T) {
	s := &suite{}
	if s.check("boom", "a rule", func() (string, error) { return panicsOnNil(nil) }) {
		t.Fatal("a check that panicked passed")
	}
	c := s.report.Checks[0]
	if c.OK || !strings.Contains(c.Message, "internal error") || !strings.Contains(c.Message, "panicsOnNil") {
		t.Fatalf("check %+v: want a failure naming panicsOnNil", c)
	}
}

// TestCallTimingJudgesFuelNotTime: the call-timing check fails a plugin
// whose call ran out of fuel, the deterministic form of the deadline,
// and only reports how long the calls took: calls that returned late
// within their fuel were held up by the machine (load, -race, GC), as the
// host counts them (slow, not failed), so a loaded machine cannot fail a
// plugin that an idle one passes.
func TestCallTimingJudgesFuelNotTime(t *testing.T) {
	ms := time.Millisecond
	tests := []struct {
		name  string
		times []time.Duration // of kvhost_name's calls
		fuel  error           // the first call out of fuel
		ok    bool
		want  string
	}{
		{"every call within the deadline", []time.Duration{ms, 2 * ms, 3 * ms}, nil, true, "name p50 2ms p99 3ms max 3ms"},
		{"most calls late, within their fuel", []time.Duration{150 * ms, 200 * ms, ms}, nil, true,
			"2 calls returned after the deadline within their fuel"},
		{"a call out of fuel", []time.Duration{ms}, errors.New("kvhost_name (shard 0): ran out of fuel: exceeded the call deadline of 100ms"), false,
			"ran out of fuel"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s := &suite{opts: Options{CallTimeout: 100 * ms}, deadlineErr: tt.fuel,
				times: map[string][]time.Duration{"kvhost_name": tt.times}, records: map[string]int{"kvhost_name": len(tt.times)}}
			msg, err := s.callTiming()
			if got := err == nil; got != tt.ok {
				t.Fatalf("callTiming = %q, %v; want ok %v", msg, err, tt.ok)
			}
			if err != nil {
				msg = err.Error()
			}
			if !strings.Contains(msg, tt.want) {
				t.Fatalf("callTiming says %q, want %q in it", msg, tt.want)
			}
		})
	}
}
