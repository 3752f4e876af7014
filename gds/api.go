package gds

// api is the cuFile library as the rest of the package uses it: the cgo
// binding of a dlopen'ed libcufile in production, a Go fake in unit tests of
// the handle cache. Every method is safe for concurrent use, as cuFile's
// functions are.
type api interface {
	// path is the file the library was loaded from.
	path() string
	driverOpen() error
	driverClose() error
	// properties is cuFileDriverGetProperties; ok is false when the library
	// lacks the symbol.
	properties() (p rawProps, ok bool, err error)
	// version is cuFileGetVersion; ok is false when the library lacks it.
	version() (v int, ok bool, err error)
	handleRegister(fd int) (uintptr, error)
	handleDeregister(h uintptr)
	bufRegister(ptr uintptr, size int64, flags int) error
	bufDeregister(ptr uintptr) error
	// read and write move size bytes between file offset off and the
	// memory at base+bufOff. They return the bytes moved, which may be
	// fewer than size, or an error (a Status, or an errno).
	read(h, base uintptr, size, off, bufOff int64) (int64, error)
	write(h, base uintptr, size, off, bufOff int64) (int64, error)
	// hasBatch reports whether the batch API symbols are present.
	hasBatch() bool
	// unload closes the library (dlclose).
	unload() error
}

// rawProps is CUfileDrvProps_t.
type rawProps struct {
	nvfsMajor, nvfsMinor   uint32
	pollThreshKiB          uint64
	maxDirectIOKiB         uint64
	statusFlags            uint32
	controlFlags           uint32
	featureFlags           uint32
	maxDeviceCacheKiB      uint32
	perBufferCacheKiB      uint32
	maxDevicePinnedKiB     uint32
	maxBatchIOSize         uint32
	maxBatchIOTimeoutMsecs uint32
}
