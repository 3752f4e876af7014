// Package testwait is for tests that wait for a condition another goroutine
// or process brings about: Until polls it with a backoff, instead of
// sleeping a fixed time and hoping.
package testwait

import (
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
