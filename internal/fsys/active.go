package fsys

import (
	"errors"
	"fmt"
)

// Pages a load reads with pread(2) rather than through a mapping.
//
// On a memory file system (tmpfs) the first read(2) of a page that was
// written or touched since it was last read moves it to the kernel's
// active list, under a lock that every reading CPU shares: 16 threads
// reading freshly written files that way ran at 21 GB/s on the 16-core
// GPU machine, through a mapping (Mapping) at 26–28, and by read(2) once
// the pages were active at 35–44. A page read again stays where it is.
// So the engine puts the pages of the spare files it makes ahead of
// stores on the active list off every job's path (ActivatePages), marks
// such a file (MarkPagesActive), and a load of a marked file reads it with
// pread (PagesActive); any other memory file is read through a mapping.
// See RATIONALE.md, "Why are the pages of spare files made ahead put on
// the active list?".

// ErrNoActivation: the file cannot have its pages put on the active list
// or be marked (not an operating-system file, or a file system without
// user extended attributes).
var ErrNoActivation = errors.New("fsys: pages cannot be activated")

// pageActivator is implemented by files whose pages can be put on the
// kernel's active list and marked so (the operating system's files).
type pageActivator interface {
	activatePages(n int64) (touched int, err error)
	markPagesActive() error
	pagesActive() bool
}

// ActivatePages puts the pages of f's first n bytes (whole pages, no
// further than the end of the file) on the kernel's active list: it maps
// them twice, reading a byte of every page and unmapping, and an unmap
// marks each page it found referenced (twice: activated). f must be open
// for reading. It returns the number of pages touched in each pass. The
// pages' contents do not change; allocated pages never written read as
// zeros and are zeroed by the first pass.
func ActivatePages(f File, n int64) (int, error) {
	a, ok := f.(pageActivator)
	if !ok {
		return 0, ErrNoActivation
	}
	return a.activatePages(n)
}

// MarkPagesActive records on f (an extended attribute, user.kvhost.pages)
// that its pages were put on the active list, for PagesActive. A file
// system without user extended attributes fails with an error wrapping
// ErrNoActivation.
func MarkPagesActive(f File) error {
	a, ok := f.(pageActivator)
	if !ok {
		return ErrNoActivation
	}
	if err := a.markPagesActive(); err != nil {
		return fmt.Errorf("%w: %w", ErrNoActivation, err)
	}
	return nil
}

// PagesActive reports whether f carries MarkPagesActive's mark. The mark
// says where the pages were put, not where the kernel keeps them: under
// memory pressure it may move them back, and a read then pays the first
// read's cost again (the bytes are the same either way).
func PagesActive(f File) bool {
	a, ok := f.(pageActivator)
	return ok && a.pagesActive()
}
