package conformance

import (
	"context"
	"fmt"
	"log/slog"
	"sync"
)

// hostFailureMessage is the message a policy host logs for each plugin
// failure (a trap, a failure status, an output it rejected) before it
// replaces the instance; package policy's Host.failed writes it.
const hostFailureMessage = "policy plugin failed; replacing the instance"

// failureLog holds the plugin failures the hosts of a run logged, in
// order, so that a check fails by its own name for the failures it
// caused, even where the host's retry on a rebuilt instance answered
// right.
type failureLog struct {
	mu   sync.Mutex
	msgs []string
}

func (f *failureLog) add(msg string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.msgs = append(f.msgs, msg)
}

// len returns the number of failures so far; 0 on a nil log.
func (f *failureLog) len() int {
	if f == nil {
		return 0
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	return len(f.msgs)
}

// since returns the failures after the first n.
func (f *failureLog) since(n int) []string {
	if f == nil {
		return nil
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if n >= len(f.msgs) {
		return nil
	}
	return append([]string(nil), f.msgs[n:]...)
}

// failureHandler is a slog.Handler that records the hosts' failure
// messages in log and passes every record on to next (the caller's
// logger) where next takes it.
type failureHandler struct {
	next slog.Handler
	log  *failureLog
}

// Enabled implements slog.Handler: failures are logged at warn level,
// which the handler takes whatever next takes.
func (h *failureHandler) Enabled(ctx context.Context, l slog.Level) bool {
	return l >= slog.LevelWarn || h.next.Enabled(ctx, l)
}

// Handle implements slog.Handler.
func (h *failureHandler) Handle(ctx context.Context, r slog.Record) error {
	if r.Message == hostFailureMessage {
		var hook, cause string
		shard := "?"
		r.Attrs(func(a slog.Attr) bool {
			switch a.Key {
			case "hook":
				hook = a.Value.String()
			case "shard":
				shard = a.Value.String()
			case "err":
				cause = a.Value.String()
			}
			return true
		})
		h.log.add(fmt.Sprintf("%s (shard %s): %s", hook, shard, cause))
	}
	if !h.next.Enabled(ctx, r.Level) {
		return nil
	}
	return h.next.Handle(ctx, r)
}

// WithAttrs implements slog.Handler.
func (h *failureHandler) WithAttrs(as []slog.Attr) slog.Handler {
	return &failureHandler{next: h.next.WithAttrs(as), log: h.log}
}

// WithGroup implements slog.Handler.
func (h *failureHandler) WithGroup(name string) slog.Handler {
	return &failureHandler{next: h.next.WithGroup(name), log: h.log}
}

// truncate forgets the failures after the first n: failures a check
// provoked on purpose and judged itself.
func (f *failureLog) truncate(n int) {
	if f == nil {
		return
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if n < len(f.msgs) {
		f.msgs = f.msgs[:n]
	}
}
