package staging

import "golang.org/x/sys/unix"

// Yielder gives its thread's CPU up (sched_yield) each time the bytes a
// copying loop reports reach Every, so that a thread woken on that CPU
// (the daemon's network poller with a lookup, a thread of the inference
// server) waits for about one such copy instead of the rest of the
// kernel's time slice: with every core copying, a lookup beside loads
// otherwise waited milliseconds (RATIONALE: "Why do I/O workers yield
// their CPU every megabyte?"). A yield with nothing else runnable on the
// CPU returns at once. The zero Yielder never yields. A Yielder belongs
// to one goroutine.
type Yielder struct {
	// Every is the bytes moved between yields; 0 or less: never.
	Every int64
	// Yield, if set, is called instead of sched_yield (tests count calls).
	Yield func()

	since int64
}

// Moved counts n bytes moved and yields once they add up to Every, at
// most once per call. Loops report pieces no larger than Every where they
// can (CPU work through Steps); a larger piece (a chunk written or read
// in one system call) yields once.
func (y *Yielder) Moved(n int64) {
	if y.Every <= 0 {
		return
	}
	y.since += n
	if y.since < y.Every {
		return
	}
	// The remainder counts toward the next yield, so that pieces which do
	// not divide Every (a chunk's first piece, cut short at an aligned
	// offset) still yield once per Every bytes.
	y.since %= y.Every
	if y.Yield != nil {
		y.Yield()
		return
	}
	unix.Syscall(unix.SYS_SCHED_YIELD, 0, 0, 0) // cannot fail on Linux
}

// Steps runs do over [0, n) in consecutive ranges of at most limit bytes
// (0: no limit) and of at most Every, reporting each range to Moved
// after do ran: CPU work on a piece larger than Every (a checksum of a
// 2 MiB folio) still yields once per Every bytes.
func (y *Yielder) Steps(n, limit int, do func(lo, hi int)) {
	step := n
	if limit > 0 {
		step = min(step, limit)
	}
	if y.Every > 0 {
		step = min(step, int(y.Every))
	}
	for lo := 0; lo < n; {
		hi := min(lo+step, n)
		do(lo, hi)
		y.Moved(int64(hi - lo))
		lo = hi
	}
}
