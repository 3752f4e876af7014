// Package dl opens shared libraries at run time (dlopen) and resolves their
// symbols, so that kvhost builds without the CUDA toolkit and runs on
// machines without a GPU: packages gds and cuda bind cuFile and the
// CUDA runtime through it.
//
// dlerror's text is kept in every error: "library not found" and "found but
// a dependency is missing" need different fixes.
package dl

import "errors"

// ErrUnavailable means the library could not be opened (not installed, or a
// dependency is missing), or dynamic loading is not supported by this build
// (no cgo, not Linux). Errors wrap it with dlerror's text.
var ErrUnavailable = errors.New("dl: library unavailable")

// ErrSymbol means the library lacks a required symbol. Errors name the symbol.
var ErrSymbol = errors.New("dl: symbol not found")
