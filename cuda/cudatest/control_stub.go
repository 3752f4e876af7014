//go:build !linux || !cgo

package cudatest

import "testing"

const supported = false

// Fake controls a loaded fake library; this build cannot load one.
type Fake struct{}

// Open skips the test: this build cannot load libraries.
func Open(t testing.TB, path string) *Fake {
	Unavailable(t, "cudatest: needs cgo on Linux")
	return nil
}

// Fail does nothing.
func (f *Fake) Fail(op Op, n int, code int) {}

// Count is 0.
func (f *Fake) Count(op Op) int { return 0 }

// PeerAccess does nothing.
func (f *Fake) PeerAccess(on bool) {}

// Busy does nothing.
func (f *Fake) Busy(n int) {}

// HoldRegistrations does nothing.
func (f *Fake) HoldRegistrations(hold bool) {}

// WaitingRegistrations is 0.
func (f *Fake) WaitingRegistrations() int { return 0 }

// BreakDevice does nothing.
func (f *Fake) BreakDevice(d int, code int) {}

// Unload does nothing.
func (f *Fake) Unload(on bool) {}

// CallsAfterUnload is 0.
func (f *Fake) CallsAfterUnload() int { return 0 }

// Contexts is nil.
func (f *Fake) Contexts() []int { return nil }

// ForgetContexts does nothing.
func (f *Fake) ForgetContexts() {}

// CurrentContext is -1.
func (f *Fake) CurrentContext() int { return -1 }

// NewThread does nothing.
func (f *Fake) NewThread() {}

// Registrations is 0.
func (f *Fake) Registrations() int { return 0 }

// StrayCopies is 0.
func (f *Fake) StrayCopies() int { return 0 }

// BusyDestroys is 0.
func (f *Fake) BusyDestroys() int { return 0 }

// DeadHandles is 0.
func (f *Fake) DeadHandles() int { return 0 }
