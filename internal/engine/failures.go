package engine

import (
	"context"
	"errors"
	"log/slog"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
)

// Failures counts the keys of jobs that ended OutcomeFailed, by reason.
type Failures struct {
	NoSpace  uint64 // ErrNoSpace: no space on the mount or the file system
	Corrupt  uint64 // ErrCorrupt: a file failed its checks (loads)
	Policy   uint64 // ErrPolicy: the policy failed, or its name was refused
	Canceled uint64 // the job was cancelled or the engine closed
	IO       uint64 // another I/O error (EIO, EACCES, EROFS...)
	Other    uint64 // anything else
}

// failure reasons, the order of Failures' fields.
const (
	failNoSpace = iota
	failCorrupt
	failPolicy
	failCanceled
	failIO
	failOther
	numFailReasons
)

var failNames = [numFailReasons]string{"no space", "corrupt", "policy", "canceled", "io", "other"}

func failReason(err error) int {
	var errno syscall.Errno
	switch {
	case errors.Is(err, ErrNoSpace), errors.Is(err, syscall.ENOSPC), errors.Is(err, syscall.EDQUOT):
		return failNoSpace
	case errors.Is(err, ErrCorrupt):
		return failCorrupt
	case errors.Is(err, ErrPolicy):
		return failPolicy
	case errors.Is(err, context.Canceled), errors.Is(err, context.DeadlineExceeded), errors.Is(err, ErrClosed):
		return failCanceled
	case errors.As(err, &errno):
		return failIO
	}
	return failOther
}

// failureLog counts failed keys by reason and logs them, at most one line
// per reason and job kind per interval, with the count of the failures it
// did not log (an operator whose disk fills up sees it, without a line per
// key).
type failureLog struct {
	log      *slog.Logger
	interval time.Duration
	counts   [2][numFailReasons]atomic.Uint64 // store, load

	mu         sync.Mutex
	last       [2][numFailReasons]time.Time
	suppressed [2][numFailReasons]uint64
}

func (f *failureLog) add(kind string, err error, now time.Time) {
	k := 0
	if kind == "load" {
		k = 1
	}
	r := failReason(err)
	f.counts[k][r].Add(1)
	f.mu.Lock()
	if now.Sub(f.last[k][r]) < f.interval {
		f.suppressed[k][r]++
		f.mu.Unlock()
		return
	}
	n := f.suppressed[k][r]
	f.suppressed[k][r] = 0
	f.last[k][r] = now
	f.mu.Unlock()
	lvl := slog.LevelWarn
	if r == failCanceled {
		lvl = slog.LevelDebug
	}
	f.log.Log(context.Background(), lvl, "engine: "+kind+" failed", "reason", failNames[r], "err", err, "not_logged_since_last", n)
}

func (f *failureLog) stats(kind int) Failures {
	c := &f.counts[kind]
	return Failures{
		NoSpace: c[failNoSpace].Load(), Corrupt: c[failCorrupt].Load(), Policy: c[failPolicy].Load(),
		Canceled: c[failCanceled].Load(), IO: c[failIO].Load(), Other: c[failOther].Load(),
	}
}
