//go:build !linux || !cgo

package dl

import (
	"fmt"
	"unsafe"
)

// Supported reports whether this build can open libraries (Linux with cgo).
const Supported = false

// Library is an open shared library; this build cannot open any.
type Library struct{}

// Open fails: this build has no dynamic loader (needs Linux and cgo).
func Open(paths ...string) (*Library, error) {
	return nil, fmt.Errorf("%w: built without cgo or not on Linux", ErrUnavailable)
}

// Path is empty.
func (l *Library) Path() string { return "" }

// Sym fails.
func (l *Library) Sym(name string) (unsafe.Pointer, error) {
	return nil, fmt.Errorf("%w: %s: built without cgo", ErrSymbol, name)
}

// Close does nothing.
func (l *Library) Close() error { return nil }
