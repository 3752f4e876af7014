package conformance

import (
	"strings"
	"testing"
)

// TestCheckRecoversPanic checks that a check that panics (a plugin's
// answer breaking an assumption of the suite) is a failed check naming its
// rule, and that the run goes on.
func TestCheckRecoversPanic(t *testing.T) {
	s := &suite{}
	var none []int
	ok := s.check("boom", "the rule", func() (string, error) {
		return "", nil
	}) && s.check("index", "the rule", func() (string, error) {
		_ = none[len(none)] // index out of range, as a divide by zero on an empty list was
		return "unreachable", nil
	})
	if ok {
		t.Fatal("a panicking check passed")
	}
	if !s.check("after", "another rule", func() (string, error) { return "fine", nil }) {
		t.Fatal("the check after a panic failed")
	}
	if len(s.report.Checks) != 3 {
		t.Fatalf("%d checks recorded, want 3", len(s.report.Checks))
	}
	c := s.report.Checks[1]
	if c.OK || c.Name != "index" || c.Rule != "the rule" || !strings.Contains(c.Message, "index out of range") {
		t.Fatalf("check after a panic: %+v; want a failure with the rule and the panic", c)
	}
}
