// Package testlog is for tests: a logger that writes to a test's log, so
// that a failing test shows what the code under test warned about.
package testlog

import (
	"io"
	"log/slog"
	"strings"
	"testing"
)

// New returns a logger that writes warnings and errors to t's log.
func New(t testing.TB) *slog.Logger {
	return slog.New(slog.NewTextHandler(Writer(t), &slog.HandlerOptions{Level: slog.LevelWarn}))
}

// Writer returns a writer whose every write is one entry of t's log,
// without its trailing newline: for a handler of another level.
func Writer(t testing.TB) io.Writer { return writer{t} }

// writer writes each record to a test's log.
type writer struct{ t testing.TB }

func (w writer) Write(b []byte) (int, error) {
	w.t.Log(strings.TrimSpace(string(b)))
	return len(b), nil
}
