package main

import (
	"os"
	"strconv"
	"strings"
	"testing"
	"time"
)

// TestServeTellsSystemdsWatchdogItLives: under a systemd watchdog
// ($WATCHDOG_USEC) the daemon sends WATCHDOG=1 again and again while it
// serves.
func TestServeTellsSystemdsWatchdogItLives(t *testing.T) {
	dir := t.TempDir()
	file, _, _ := testConfig(t, dir, "")
	notify := newNotifySocket(t)
	startProc(t, []string{"NOTIFY_SOCKET=" + notify.path, "WATCHDOG_USEC=200000"}, "serve", "--config", file)
	notify.expect(t, "READY=1")
	for range 3 {
		notify.expect(t, "WATCHDOG=1")
	}
}

// TestSystemdWatchdogReadsHalfOfWatchdogUsecForThisProcess checks the
// environment systemd sets for a service with WatchdogSec=.
func TestSystemdWatchdogReadsHalfOfWatchdogUsecForThisProcess(t *testing.T) {
	self := strconv.Itoa(os.Getpid())
	for _, tc := range []struct {
		usec, pid string
		want      time.Duration
		err       string
	}{
		{"", "", 0, ""},
		{"30000000", "", 15 * time.Second, ""},
		{"30000000", self, 15 * time.Second, ""},
		{"30000000", "1", 0, ""}, // another process's
		{"0", "", 0, "WATCHDOG_USEC"},
		{"thirty", "", 0, "WATCHDOG_USEC"},
		{"99999999999999999", "", 0, "WATCHDOG_USEC"},
	} {
		t.Setenv("WATCHDOG_USEC", tc.usec)
		t.Setenv("WATCHDOG_PID", tc.pid)
		got, err := systemdWatchdog()
		if got != tc.want || (err == nil) != (tc.err == "") || (err != nil && !strings.Contains(err.Error(), tc.err)) {
			t.Errorf("WATCHDOG_USEC=%q WATCHDOG_PID=%q: %s, %v; want %s, error naming %q", tc.usec, tc.pid, got, err, tc.want, tc.err)
		}
	}
}
