package daemon

import (
	"os"
	"strconv"
	"strings"
	"testing"
	"time"
)

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
