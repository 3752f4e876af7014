//go:build linux && cgo

package dl

/*
#cgo LDFLAGS: -ldl
#include <dlfcn.h>
#include <stdlib.h>
*/
import "C"

import (
	"fmt"
	"runtime"
	"unsafe"
)

// Supported reports whether this build can open libraries (Linux with cgo).
const Supported = true

// Library is an open shared library.
type Library struct {
	h    unsafe.Pointer
	path string
}

// Open opens the first of paths that loads (dlopen with RTLD_NOW|RTLD_LOCAL).
// A path without a slash is searched by the dynamic linker. The error lists
// every path tried with dlerror's text for each.
func Open(paths ...string) (*Library, error) {
	if len(paths) == 0 {
		return nil, fmt.Errorf("%w: no path given", ErrUnavailable)
	}
	// dlerror is per thread: dlopen and dlerror must run on one thread.
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	var tried []string
	for _, p := range paths {
		cp := C.CString(p)
		h := C.dlopen(cp, C.RTLD_NOW|C.RTLD_LOCAL)
		C.free(unsafe.Pointer(cp))
		if h != nil {
			return &Library{h: h, path: p}, nil
		}
		msg := "unknown error"
		if e := C.dlerror(); e != nil {
			msg = C.GoString(e)
		}
		tried = append(tried, msg)
	}
	return nil, fmt.Errorf("%w: %q", ErrUnavailable, tried)
}

// Path is the path the library was opened by.
func (l *Library) Path() string { return l.path }

// Sym resolves a symbol. The error names it and keeps dlerror's text.
func (l *Library) Sym(name string) (unsafe.Pointer, error) {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	cn := C.CString(name)
	defer C.free(unsafe.Pointer(cn))
	C.dlerror() // clear
	p := C.dlsym(l.h, cn)
	if p == nil {
		msg := "null symbol"
		if e := C.dlerror(); e != nil {
			msg = C.GoString(e)
		}
		return nil, fmt.Errorf("%w: %s in %s: %s", ErrSymbol, name, l.path, msg)
	}
	return p, nil
}

// Close closes the library. Function pointers resolved from it must not be
// called afterwards.
func (l *Library) Close() error {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	if C.dlclose(l.h) != 0 {
		msg := "unknown error"
		if e := C.dlerror(); e != nil {
			msg = C.GoString(e)
		}
		return fmt.Errorf("dl: close %s: %s", l.path, msg)
	}
	return nil
}
