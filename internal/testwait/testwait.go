// Package testwait is for tests that wait for a condition another goroutine
// or process brings about: Until polls it with a backoff, instead of
// sleeping a fixed time and hoping.
package testwait

import (
	"testing"
	"time"
)

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
