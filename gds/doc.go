// Package gds is kvhost's GPUDirect Storage path: NVIDIA's cuFile library,
// loaded with dlopen at run time (so kvhost builds without the CUDA toolkit
// and runs on machines without a GPU; without cgo the package builds and
// Open reports ErrUnavailable).
//
// Open loads libcufile, resolves every symbol it calls and opens the cuFile
// driver. The Driver owns a refcounted, bounded LRU cache of registered file
// handles keyed by file identity (invalidated by Mover.Forget when the
// engine removes or replaces a file), and one Capability per mount (direct,
// compat or unusable), found once and logged once. A Mover (Driver.NewMover)
// carries out transfer plans for device regions with cuFileRead and
// cuFileWrite on its own workers, each locked to an OS thread and bound to
// its device, or with cuFile's batch API where MoverConfig.IO asks for it (a
// reused batch context per worker, completions polled with a timeout, a
// mount whose library refuses batches falling back to per-call I/O, logged
// once); where cuFile cannot serve a mount it answers
// transfer.ErrUnsupported before moving anything, and the engine takes the
// staging path. cuFile status codes are the error type Status. docs/gds.md
// has the details.
package gds
