package fsystest

import (
	"os"

	"golang.org/x/sys/unix"

	"github.com/kvhost/kvhost/fsys"
)

// RefusesDirect is a file system without direct I/O, as Linux shows one
// (tmpfs before 6.6, FUSE file systems without direct_io): an open with
// O_DIRECT fails with EINVAL after O_CREAT has created the file (the
// kernel checks O_DIRECT once the file exists), or, with AtWrite,
// succeeds and its file's writes fail with EINVAL. Opens without O_DIRECT
// go to FS.
type RefusesDirect struct {
	fsys.FS
	AtWrite bool
}

// OpenFile opens name, refusing O_DIRECT at the open or at the writes.
func (r RefusesDirect) OpenFile(name string, flag int, perm os.FileMode) (fsys.File, error) {
	if flag&unix.O_DIRECT == 0 {
		return r.FS.OpenFile(name, flag, perm)
	}
	f, err := r.FS.OpenFile(name, flag&^unix.O_DIRECT, perm)
	if err != nil {
		return nil, err
	}
	if r.AtWrite {
		return refusedWrites{f}, nil
	}
	f.Close()
	return nil, &os.PathError{Op: "open", Path: name, Err: unix.EINVAL}
}

// refusedWrites is a file open with O_DIRECT whose writes fail.
type refusedWrites struct{ fsys.File }

func (f refusedWrites) WriteAt([]byte, int64) (int, error) {
	return 0, &os.PathError{Op: "pwrite", Path: "direct", Err: unix.EINVAL}
}

func (f refusedWrites) WritevAt([][]byte, int64) (int, error) {
	return 0, &os.PathError{Op: "pwritev", Path: "direct", Err: unix.EINVAL}
}
