// Package testwait is for tests that wait for a condition another goroutine
// or process brings about: Until polls it with a backoff, instead of
// sleeping a fixed time and hoping.
package testwait

import (
	"os"
	"syscall"
	"testing"
	"time"
)

// Hang is the timeout of a wait that only catches a hang, the one to pass
// Until unless a test has a reason for another. It is long: it costs
// nothing when the condition comes, and background work (tickers,
// sweeps, registrars) ran many times slower under the race detector on a
// 2-core machine beside other builds, where bounds of 10 and 30 s failed
// correct code.
const Hang = 2 * time.Minute

// Until polls cond, starting every 100 µs and backing off to every 20 ms,
// until it holds; it fails the test naming what was awaited if timeout
// passes first.
func Until(t testing.TB, what string, timeout time.Duration, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for d := 100 * time.Microsecond; !cond(); d = min(2*d, 20*time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %v waiting for %s", timeout, what)
		}
		time.Sleep(d)
	}
}

// ReturnsDespitePipe runs fn and fails the test, naming what, if it has
// not returned after Hang (a guard against a wait that never ends, not a
// timing): fn must not wait on the named pipe at pipe. It then opens the
// pipe (read-write, which never waits on Linux) until fn returns: that
// ends the wait of a reader blocked opening it, so that the test can
// close what it opened.
func ReturnsDespitePipe(t testing.TB, what, pipe string, fn func()) {
	t.Helper()
	done := make(chan struct{})
	go func() {
		defer close(done)
		fn()
	}()
	select {
	case <-done:
		return
	case <-time.After(Hang):
	}
	for {
		if f, err := os.OpenFile(pipe, os.O_RDWR|syscall.O_NONBLOCK, 0); err == nil {
			f.Close()
		}
		select {
		case <-done:
			t.Fatalf("%s waited on the named pipe at %s", what, pipe)
		case <-time.After(10 * time.Millisecond):
		}
	}
}
