package daemon

import (
	"context"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"slices"
	"testing"
	"time"

	"github.com/kvhost/kvhost/internal/daemon/daemontest"
	"github.com/kvhost/kvhost/internal/metrics"
)

// TestNothingSetsTheDaemonReadyOnceItStops: once the daemon is stopping
// (SIGTERM), a later setReady(true) (the end of its start-up, or of a
// reload, racing the signal) neither tells systemd READY=1 after
// STOPPING=1 nor turns /readyz back to 200 while it drains; nor does one
// that comes after the signal but before the daemon has said it stops.
func TestNothingSetsTheDaemonReadyOnceItStops(t *testing.T) {
	stopped, stop := context.WithCancel(context.Background())
	stop()
	tests := []struct {
		name string
		set  func(d *daemon)
	}{
		{"after STOPPING=1", func(d *daemon) {
			d.setReady(stopped, false)
			d.setReady(context.Background(), true)
		}},
		{"after the signal, before STOPPING=1", func(d *daemon) {
			d.setReady(stopped, true)
			d.setReady(stopped, false)
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			notify := daemontest.NewNotifySocket(t, time.Minute)
			t.Setenv("NOTIFY_SOCKET", notify.Path)
			d := &daemon{log: slog.New(slog.DiscardHandler), metrics: metrics.New("test")}
			tt.set(d)
			if got := notify.Drain(t); !slices.Equal(got, []string{"STOPPING=1"}) {
				t.Errorf("notifications %q, want only STOPPING=1", got)
			}
			rec := httptest.NewRecorder()
			d.metrics.Handler(false).ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/readyz", nil))
			if rec.Code != http.StatusServiceUnavailable {
				t.Errorf("/readyz answers %d while stopping, want 503", rec.Code)
			}
		})
	}
}
