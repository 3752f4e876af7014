// Package reliability holds kvhost's black-box reliability suite: scenarios
// that run the real kvhost binary on real directories (a loop-mounted ext4
// image, a small tmpfs) and drive it through the Go client over its socket
// while it is killed, shares a directory with another daemon, runs out of
// space or faces hostile clients. Every scenario counts what it checked and
// what went wrong, logs the counts, and fails on any wrong byte, lost
// acknowledged key or client locked out.
//
// The package has no API: it is its tests. `go test ./reliability` runs the
// bounded suite (part of `make test`); `make reliability-long` (the -long
// flag, or KVHOST_RELIABILITY_LONG=1) runs the long one. docs/reliability.md
// describes each scenario and the counts of the last long run.
package reliability
