package gds

import (
	"fmt"
	"time"
)

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
	// read and write move size bytes between file offset off and the
	// memory at base+bufOff. They return the bytes moved, which may be
	// fewer than size, or an error (a Status, or an errno).
	read(h, base uintptr, size, off, bufOff int64) (int64, error)
	write(h, base uintptr, size, off, bufOff int64) (int64, error)
	// hasBatch reports whether the batch API symbols are present.
	hasBatch() bool
	// batchSetUp is cuFileBatchIOSetUp: a batch context with room for
	// maxNr entries. It fails when the library has no batch API.
	batchSetUp(maxNr int) (batchCtx, error)
	// unload closes the library (dlclose).
	unload() error
}

// batchCtx is one cuFile batch context (CUfileBatchHandle_t) and the
// memory its entries and events live in, which stays valid until destroy:
// the library may read a submitted entry until it completes. A context runs
// one submission at a time and is used by one goroutine at a time.
type batchCtx interface {
	// submit is cuFileBatchIOSubmit of ios (at most the context's maxNr).
	submit(ios []batchIO) error
	// status is cuFileBatchIOGetStatus: it waits up to timeout for at
	// least minNr completions and returns how many of ev it filled.
	status(minNr int, ev []batchEvent, timeout time.Duration) (int, error)
	// cancel is cuFileBatchIOCancel: entries not yet complete are dropped.
	cancel() error
	// destroy is cuFileBatchIODestroy; the context is unusable after.
	destroy()
}

// batchIO is one entry of a batch (CUfileIOParams_t in CUFILE_BATCH mode).
type batchIO struct {
	h       uintptr // CUfileHandle_t
	base    uintptr // devPtr_base
	bufOff  int64   // devPtr_offset
	fileOff int64
	n       int64
	write   bool
	cookie  uintptr // returned in the entry's event
}

// batchEvent is one completion (CUfileIOEvents_t).
type batchEvent struct {
	cookie uintptr
	status batchStatus
	// ret is the bytes moved, or a negative error: -errno or -Status.
	ret int64
}

// batchStatus is CUfileStatus_t, a bit per state.
type batchStatus int

// Batch entry states (CUfileStatus_t).
const (
	batchWaiting  batchStatus = 1 << 0
	batchPending  batchStatus = 1 << 1
	batchInvalid  batchStatus = 1 << 2
	batchCanceled batchStatus = 1 << 3
	batchComplete batchStatus = 1 << 4
	batchTimeout  batchStatus = 1 << 5
	batchFailed   batchStatus = 1 << 6
)

// final says whether an entry in the state is back from the library:
// complete, failed, canceled, invalid or timed out.
func (s batchStatus) final() bool {
	switch s {
	case batchComplete, batchFailed, batchCanceled, batchInvalid, batchTimeout:
		return true
	}
	return false
}

// String names the state as cufile.h does.
func (s batchStatus) String() string {
	switch s {
	case batchWaiting:
		return "CUFILE_WAITING"
	case batchPending:
		return "CUFILE_PENDING"
	case batchInvalid:
		return "CUFILE_INVALID"
	case batchCanceled:
		return "CUFILE_CANCELED"
	case batchComplete:
		return "CUFILE_COMPLETE"
	case batchTimeout:
		return "CUFILE_TIMEOUT"
	case batchFailed:
		return "CUFILE_FAILED"
	}
	return fmt.Sprintf("CUfileStatus(%#x)", int(s))
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
