// Package logging builds kvhost's log/slog logger: colour text through tint
// on a terminal, JSON lines for machines.
//
// Every field has one type in JSON: durations are always strings in Go's
// notation ("1.5s", "250ms"), as the text format writes them, whichever
// package logged them (slog's JSON handler would write nanoseconds).
package logging

import (
	"fmt"
	"io"
	"log/slog"
	"os"

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
	var lv slog.LevelVar
	lv.Set(l)
	return NewLeveled(w, &lv, format)
}

// NewLeveled is New with a level that can change while the logger runs
// (a configuration reload sets it).
func NewLeveled(w io.Writer, l *slog.LevelVar, format string) (*slog.Logger, error) {
	if format == "auto" {
		format = "json"
		if isTerminal(w) {
			format = "text"
		}
	}
	switch format {
	case "text":
		return slog.New(tint.NewTextHandler(w, &tint.Options{Level: l, TimeFormat: textTime, NoColor: !isTerminal(w)})), nil
	case "json":
		return slog.New(slog.NewJSONHandler(w, &slog.HandlerOptions{Level: l, ReplaceAttr: durationStrings})), nil
	}
	return nil, fmt.Errorf("logging: format %q: want auto, text or json", format)
}

// textTime is the text format's time: the date too, since a daemon's log
// spans days; to the millisecond, in local time.
const textTime = "2006-01-02 15:04:05.000"

// durationStrings writes durations as strings ("1.5s"), never as
// nanoseconds.
func durationStrings(_ []string, a slog.Attr) slog.Attr {
	if a.Value.Kind() == slog.KindDuration {
		a.Value = slog.StringValue(a.Value.Duration().String())
	}
	return a
}

func isTerminal(w io.Writer) bool {
	f, ok := w.(*os.File)
	if !ok {
		return false
	}
	_, err := unix.IoctlGetTermios(int(f.Fd()), unix.TCGETS)
	return err == nil
}
