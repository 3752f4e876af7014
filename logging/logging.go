// Package logging builds kvhost's log/slog logger: colour text through tint
// on a terminal, JSON lines for machines.
package logging

import (
	"fmt"
	"io"
	"log/slog"
	"os"
	"time"

	"github.com/lmittmann/tint"
	"golang.org/x/sys/unix"
)

// ParseLevel converts debug, info, warn or error to a slog.Level.
func ParseLevel(s string) (slog.Level, error) {
	var l slog.Level
	if err := l.UnmarshalText([]byte(s)); err != nil {
		return 0, fmt.Errorf("logging: level %q: want debug, info, warn or error", s)
	}
	return l, nil
}

// New returns a logger writing to w at level. format is "text" (tint,
// coloured), "json", or "auto": text when w is a terminal, JSON otherwise.
func New(w io.Writer, level, format string) (*slog.Logger, error) {
	l, err := ParseLevel(level)
	if err != nil {
		return nil, err
	}
	if format == "auto" {
		format = "json"
		if isTerminal(w) {
			format = "text"
		}
	}
	switch format {
	case "text":
		return slog.New(tint.NewTextHandler(w, &tint.Options{Level: l, TimeFormat: time.TimeOnly, NoColor: !isTerminal(w)})), nil
	case "json":
		return slog.New(slog.NewJSONHandler(w, &slog.HandlerOptions{Level: l})), nil
	}
	return nil, fmt.Errorf("logging: format %q: want auto, text or json", format)
}

func isTerminal(w io.Writer) bool {
	f, ok := w.(*os.File)
	if !ok {
		return false
	}
	_, err := unix.IoctlGetTermios(int(f.Fd()), unix.TCGETS)
	return err == nil
}
