package fsys

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"syscall"
	"time"
)

// Identity is what the file system says identifies a file at one moment:
// the file (FileID: device and inode, and its generation where the caller
// read one), its size and status-change time. ext4 reuses an inode number
// as soon as it is freed, so (Dev, Ino) alone names a different file after
// a remove and a create; Ctime (nanoseconds, set by the kernel at create,
// write and rename, never by a user) tells them apart on file systems with
// fine timestamps, and the file's own id (format.Header.ID) everywhere.
// IdentityOf leaves Gen empty: reading it is one more system call, and
// the engine tells files apart by Ctime and the header's id; the data
// movers, which keep state per file, read it (FileIDOf).
type Identity struct {
	FileID
	Size  int64       // bytes
	Ctime int64       // Unix nanoseconds
	Mtime int64       // Unix nanoseconds
	Mode  fs.FileMode // type and permission bits (FileInfo.Mode)
}

// Same reports whether two identities name the same file in the same state:
// same device, inode, size and ctime, and the same generation where both
// have one.
func (a Identity) Same(b Identity) bool {
	return a.Dev == b.Dev && a.Ino == b.Ino && a.Size == b.Size && a.Ctime == b.Ctime &&
		(a.Gen == b.Gen || a.Gen == "" || b.Gen == "")
}

// IdentityOf extracts the identity from a FileInfo returned by FS.Stat or
// Fstat. It fails if the FileInfo carries no stat data.
func IdentityOf(fi os.FileInfo) (Identity, error) {
	st, ok := fi.Sys().(*syscall.Stat_t)
	if !ok {
		return Identity{}, fmt.Errorf("fsys: %s: no stat data (%T)", fi.Name(), fi.Sys())
	}
	return Identity{
		FileID: FileID{Dev: uint64(st.Dev), Ino: st.Ino}, Size: st.Size,
		Ctime: st.Ctim.Nano(), Mtime: st.Mtim.Nano(), Mode: fi.Mode(),
	}, nil
}

// Stater is implemented by Files that can stat themselves (fstat).
type Stater interface {
	// Stat returns the open file's FileInfo, whose Sys() is a
	// *syscall.Stat_t.
	Stat() (os.FileInfo, error)
}

// Fstat returns the FileInfo of an open file: its own Stat if it has one,
// else fstat(2) of its descriptor. Sys() is a *syscall.Stat_t, as with
// os.Stat.
func Fstat(f File) (os.FileInfo, error) {
	if s, ok := f.(Stater); ok {
		return s.Stat()
	}
	return fstatFd(int(f.Fd()), "")
}

func fstatFd(fd int, name string) (os.FileInfo, error) {
	var st syscall.Stat_t
	if err := syscall.Fstat(fd, &st); err != nil {
		return nil, &os.PathError{Op: "fstat", Path: name, Err: err}
	}
	return &statInfo{name: name, st: st}, nil
}

// statInfo is an os.FileInfo over a syscall.Stat_t.
type statInfo struct {
	name string
	st   syscall.Stat_t
}

func (s *statInfo) Name() string       { return s.name }
func (s *statInfo) Size() int64        { return s.st.Size }
func (s *statInfo) ModTime() time.Time { return time.Unix(0, s.st.Mtim.Nano()) }
func (s *statInfo) IsDir() bool        { return s.Mode().IsDir() }
func (s *statInfo) Sys() any           { return &s.st }

func (s *statInfo) Mode() fs.FileMode {
	m := fs.FileMode(s.st.Mode & 0o777)
	switch s.st.Mode & syscall.S_IFMT {
	case syscall.S_IFDIR:
		m |= fs.ModeDir
	case syscall.S_IFLNK:
		m |= fs.ModeSymlink
	case syscall.S_IFIFO:
		m |= fs.ModeNamedPipe
	case syscall.S_IFSOCK:
		m |= fs.ModeSocket
	case syscall.S_IFCHR:
		m |= fs.ModeDevice | fs.ModeCharDevice
	case syscall.S_IFBLK:
		m |= fs.ModeDevice
	}
	return m
}

// IsAt reports whether path on fs names the file open as f (the same
// device and inode): false where path names another file or none, as
// after a removal or a rename behind f's holder's back.
func IsAt(fs FS, f File, path string) (bool, error) {
	fi, err := Fstat(f)
	if err != nil {
		return false, err
	}
	id, err := IdentityOf(fi)
	if err != nil {
		return false, err
	}
	return InodeAt(fs, id.FileID, path)
}

// InodeAt reports whether path on fs names the file of id (its device
// and inode; the generation is not read): IsAt for a caller that has
// the file's identity in hand.
func InodeAt(fs FS, id FileID, path string) (bool, error) {
	fi, err := fs.Stat(path)
	if errors.Is(err, os.ErrNotExist) {
		return false, nil
	}
	if err != nil {
		return false, err
	}
	now, err := IdentityOf(fi)
	if err != nil {
		return false, err
	}
	return now.Inode() == id.Inode(), nil
}
