package testlog

import (
	"strings"
	"testing"
)

// recorder is a testing.TB that keeps what is logged to it.
type recorder struct {
	testing.TB
	lines []string
}

func (r *recorder) Log(args ...any) {
	for _, a := range args {
		r.lines = append(r.lines, a.(string))
	}
}

func TestWarningsReachTheTestsLogAndInfoDoesNot(t *testing.T) {
	r := &recorder{TB: t}
	log := New(r)
	log.Info("not shown")
	log.Warn("upload failed", "err", "quota")
	if len(r.lines) != 1 || !strings.Contains(r.lines[0], "upload failed") || !strings.Contains(r.lines[0], "err=quota") || strings.HasSuffix(r.lines[0], "\n") {
		t.Fatalf("logged %q, want one line of the warning and its error, without its newline", r.lines)
	}
}
