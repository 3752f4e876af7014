package daemon

import (
	"io"
	"log/slog"
	"runtime"
	"testing"

	"github.com/kvhost/kvhost/internal/engine"
)

func TestDaemonProcessorsLeaveOneForTheControlPath(t *testing.T) {
	cases := []struct {
		name           string
		workers, procs int
		fromEnv        bool
		want           int
	}{
		{"workers on every processor get one more", 2, 2, false, 3},
		{"sixteen workers on sixteen processors", 16, 16, false, 17},
		{"more workers than processors", 8, 2, false, 9},
		{"processors to spare already", 4, 64, false, 64},
		{"one spare already", 3, 4, false, 4},
		{"GOMAXPROCS set by the operator is kept", 2, 2, true, 2},
		{"GOMAXPROCS set by the operator, even below the workers", 8, 2, true, 2},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			if got := daemonProcessors(c.workers, c.procs, c.fromEnv); got != c.want {
				t.Fatalf("daemonProcessors(%d, %d, %v) = %d, want %d", c.workers, c.procs, c.fromEnv, got, c.want)
			}
		})
	}
}

func TestReserveControlProcessorsSettlesTheDefaultWorkersFirst(t *testing.T) {
	t.Setenv("GOMAXPROCS", "")
	before := runtime.GOMAXPROCS(0)
	t.Cleanup(func() { runtime.GOMAXPROCS(before) })
	want := engine.DefaultIOWorkers()
	workers, restore := reserveControlProcessors(0, slog.New(slog.NewTextHandler(io.Discard, nil)))
	if workers != want {
		t.Fatalf("workers = %d, want the default before the raise, %d", workers, want)
	}
	if got := runtime.GOMAXPROCS(0); got != workers+1 {
		t.Fatalf("GOMAXPROCS = %d with %d workers, want %d", got, workers, workers+1)
	}
	restore()
	if got := runtime.GOMAXPROCS(0); got >= workers+1 {
		t.Fatalf("GOMAXPROCS = %d after restore, want the runtime's default (at most %d)", got, before)
	}
}

func TestGOMAXPROCSFromEnvIsAPositiveCount(t *testing.T) {
	for _, c := range []struct {
		env  string
		want bool
	}{{"", false}, {"0", false}, {"-1", false}, {"abc", false}, {"1", true}, {"17", true}} {
		t.Setenv("GOMAXPROCS", c.env)
		if got := gomaxprocsFromEnv(); got != c.want {
			t.Errorf("GOMAXPROCS=%q: gomaxprocsFromEnv() = %v, want %v", c.env, got, c.want)
		}
	}
}
