// Package gds will hold kvhost's GPUDirect Storage path: libcufile loaded with
// dlopen at run time (so kvhost builds without the CUDA toolkit and runs on
// machines without a GPU), a cache of registered file handles, and the
// fallback chain cuFile direct → cuFile compat → staging → POSIX described in
// DESIGN.md. It is the subject of the GPU data-path issue and holds no code yet.
package gds
