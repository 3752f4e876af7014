package daemon

import (
	"fmt"
	"math"
	"net"
	"os"
	"strconv"
	"time"
)

// sdNotify sends state to systemd's notification socket ($NOTIFY_SOCKET,
// set for a Type=notify service; sd_notify(3)). Without it, it does
// nothing.
func sdNotify(state string) error {
	path := os.Getenv("NOTIFY_SOCKET")
	if path == "" {
		return nil
	}
	if path[0] == '@' {
		path = "\x00" + path[1:] // an abstract socket
	}
	conn, err := net.DialUnix("unixgram", nil, &net.UnixAddr{Name: path, Net: "unixgram"})
	if err != nil {
		return fmt.Errorf("sd_notify: %w", err)
	}
	defer conn.Close()
	// A notification socket that does not take it in a second would hold
	// the watchdog's check (and a reload) behind systemd.
	if err := conn.SetWriteDeadline(time.Now().Add(time.Second)); err != nil {
		return fmt.Errorf("sd_notify: %w", err)
	}
	if _, err := conn.Write([]byte(state)); err != nil {
		return fmt.Errorf("sd_notify: %w", err)
	}
	return nil
}

// systemdWatchdog is half of the watchdog timeout systemd keeps on this
// process ($WATCHDOG_USEC, for the process $WATCHDOG_PID names if it is
// set; sd_watchdog_enabled(3)): how often to tell it WATCHDOG=1. 0 where
// systemd keeps none on it.
func systemdWatchdog() (time.Duration, error) {
	usec := os.Getenv("WATCHDOG_USEC")
	if usec == "" {
		return 0, nil
	}
	if pid := os.Getenv("WATCHDOG_PID"); pid != "" && pid != strconv.Itoa(os.Getpid()) {
		return 0, nil // meant for another process
	}
	n, err := strconv.ParseUint(usec, 10, 63)
	if err != nil || n == 0 || n > math.MaxInt64/uint64(time.Microsecond) {
		return 0, fmt.Errorf("WATCHDOG_USEC=%q: want a positive number of microseconds", usec)
	}
	return time.Duration(n) * time.Microsecond / 2, nil
}
