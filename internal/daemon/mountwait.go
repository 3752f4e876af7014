package daemon

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/kvhost/kvhost/internal/config"
)

// ErrNoAnswer is the error of a call to a mount's file system that did
// not answer in time (AnswerWithin).
var ErrNoAnswer = errors.New("the file system did not answer (an NFS or FUSE server that stopped answering?)")

// HungMount is the error of the mount at path whose statfs did not answer
// (err wraps ErrNoAnswer): the daemon's start refuses it (mountCapacity),
// and `kvhost config show` says so.
func HungMount(path string, err error) error {
	return fmt.Errorf("mount %s: statfs: %w: the daemon does not start on a hung mount; mend or unmount it, or remove its [[mount]]", path, err)
}

// AnswerWithin returns f's answer, or an error wrapping ErrNoAnswer where
// it has not come within wait, or ctx's error where
// ctx ends first. f runs on a goroutine of its own, which is left running
// where it does not answer: nothing cancels a system call blocked in a
// hung NFS or FUSE mount. Its answer, should it come, is dropped. The
// callers' wait is server.statfs_timeout (RATIONALE.md, "Why do check and
// the start give a mount's statfs 5 s by default?"); 0 or less, which
// its validation refuses, is config.DefaultStatfsTimeout.
func AnswerWithin[T any](ctx context.Context, wait time.Duration, f func() (T, error)) (T, error) {
	if wait <= 0 {
		wait = config.DefaultStatfsTimeout
	}
	type answer struct {
		v   T
		err error
	}
	answered := make(chan answer, 1) // f's send never blocks, read or not
	go func() {
		v, err := f()
		answered <- answer{v, err}
	}()
	timer := time.NewTimer(wait)
	defer timer.Stop()
	var zero T
	select {
	case a := <-answered:
		return a.v, a.err
	case <-timer.C:
		return zero, fmt.Errorf("%w within %v", ErrNoAnswer, wait)
	case <-ctx.Done():
		return zero, ctx.Err()
	}
}
