// Package gds will hold kvhost's GPUDirect Storage path: libcufile loaded with
// dlopen at run time (so kvhost builds without the CUDA toolkit and runs on
// machines without a GPU), a cache of registered file handles, and the
// fallback chain cuFile direct → staging → POSIX described in docs/design.md.
package gds
