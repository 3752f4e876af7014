package conformance

import (
	"strings"
	"testing"
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
