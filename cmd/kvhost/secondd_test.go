package main

import (
	"errors"
	"fmt"
	"net"
	"os/exec"
	"strconv"
	"strings"
	"testing"
)

// TestSecondDaemonOfAConfigWithMetricsSaysAnotherRuns: a second daemon
// started with the configuration of one that runs, metrics listener
// included (as the shipped systemd configuration has), stops saying that
// another kvhost runs on this node and naming its pid, not that the
// metrics port is taken.
func TestSecondDaemonOfAConfigWithMetricsSaysAnotherRuns(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close()
	file, _, _ := testConfig(t, t.TempDir(), fmt.Sprintf("[metrics]\nlisten = %q", addr))
	first := startProc(t, nil, "--config", file)
	out, err := exec.Command(kvhostBinary(t), "--config", file).CombinedOutput()
	var exit *exec.ExitError
	if !errors.As(err, &exit) || exit.ExitCode() != 1 {
		t.Fatalf("second daemon: %v, want exit status 1\n%s", err, out)
	}
	pid := strconv.Itoa(first.cmd.Process.Pid)
	if !strings.Contains(string(out), "another kvhost runs on this node") || !strings.Contains(string(out), "process "+pid) {
		t.Errorf("second daemon (%v) said %q; want it to say that another kvhost (process %s) runs on this node", err, out, pid)
	}
}
