package region

import (
	"fmt"
	"runtime/debug"
)

// Guard runs fn on the calling goroutine with debug.SetPanicOnFault set,
// and turns a memory fault in fn (SIGBUS or SIGSEGV at a non-nil address:
// a page of a shared file its owner truncated, a mapping that went away)
// into an error wrapping ErrFault, instead of a crash of the process. Any
// other panic propagates unchanged, nil-pointer dereferences included.
//
// Only fn's own goroutine is guarded: goroutines fn starts must call Guard
// themselves. After a fault, fn stopped half-way; whatever it was copying
// is incomplete and must be treated as failed.
func Guard(fn func() error) (err error) {
	old := debug.SetPanicOnFault(true)
	defer func() {
		debug.SetPanicOnFault(old)
		r := recover()
		if r == nil {
			return
		}
		// A fault at a non-nil address panics with a runtime.Error that
		// carries the address (runtime.errorAddressString).
		if f, ok := r.(interface {
			error
			Addr() uintptr
		}); ok {
			err = fmt.Errorf("%w at %#x: %v", ErrFault, f.Addr(), f)
			return
		}
		panic(r)
	}()
	return fn()
}

// SafeCopy is copy(dst, src) under Guard: if dst or src is memory that
// faults (a shared file truncated under its mapping), it returns an error
// wrapping ErrFault instead of crashing. n is meaningless after an error.
func SafeCopy(dst, src []byte) (n int, err error) {
	err = Guard(func() error {
		n = copy(dst, src)
		return nil
	})
	return n, err
}
