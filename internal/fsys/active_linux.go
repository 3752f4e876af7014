//go:build linux

package fsys

import (
	"os"
	"runtime"

	"github.com/kvhost/kvhost/internal/region"
	"golang.org/x/sys/unix"
)

// activeAttr is the extended attribute MarkPagesActive sets.
const (
	activeAttr  = "user.kvhost.pages"
	activeValue = "active"
)

func (f *osFile) activatePages(n int64) (int, error) {
	var st unix.Stat_t
	if err := unix.Fstat(f.fd, &st); err != nil {
		return 0, f.wrap("fstat", err)
	}
	page := int64(unix.Getpagesize())
	n = min((n+page-1)/page*page, st.Size)
	if n <= 0 {
		return 0, nil
	}
	pages := 0
	for range 2 { // the first unmap marks a page referenced, the second activates it
		b, err := unix.Mmap(f.fd, 0, int(n), unix.PROT_READ, unix.MAP_SHARED)
		if err != nil {
			return 0, f.wrap("mmap", err)
		}
		var sum byte
		pages = 0
		err = region.Guard(func() error {
			for off := int64(0); off < n; off += page {
				sum += b[off]
				pages++
			}
			return nil
		})
		runtime.KeepAlive(sum) // keeps the reads
		if uerr := unix.Munmap(b); err == nil && uerr != nil {
			err = &os.PathError{Op: "munmap", Path: f.name, Err: uerr}
		}
		if err != nil {
			return 0, &os.PathError{Op: "activate", Path: f.name, Err: err}
		}
	}
	return pages, nil
}

func (f *osFile) markPagesActive() error {
	if err := unix.Fsetxattr(f.fd, activeAttr, []byte(activeValue), 0); err != nil {
		return f.wrap("setxattr", err)
	}
	return nil
}

func (f *osFile) pagesActive() bool {
	var buf [len(activeValue)]byte
	n, err := unix.Fgetxattr(f.fd, activeAttr, buf[:])
	return err == nil && string(buf[:n]) == activeValue
}
