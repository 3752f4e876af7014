package fsys

import (
	"strconv"

	"golang.org/x/sys/unix"
)

// FileID names a file for the state a data mover keeps of it (a cuFile
// handle and its descriptor, a CUDA registration of its pages): device,
// inode number, and a generation that tells apart two files that had the
// same inode number at different times. The engine forgets a file before
// it removes it, but another node on a shared mount removes files this
// engine never forgets, and a file system may then give the number to a
// new file while the movers still hold the old one: NFS frees the inode
// on the server, and tmpfs (without inode64) hands out 32-bit numbers
// that wrap while old files are still open.
//
// The generation is the file's handle (name_to_handle_at): what NFS
// itself uses to tell a reused inode number from the file that had it.
// ext4, XFS, Btrfs and tmpfs put the inode's generation in it, and an NFS
// client's is the server's file handle, which does the same; it never
// changes while the file lives (writes, renames and spares reused in
// place keep it), and reading it asks no server. Where the file system
// has no handles (some FUSE and overlay mounts) it is the birth time
// (statx), and where there is neither it is empty: (Dev, Ino) alone, as
// before. Not the ctime: every write changes it, so a file the engine
// writes in place (a spare reused) would look like another file at each
// store.
type FileID struct {
	Dev, Ino uint64 // st_dev and st_ino
	Gen      string // "h" and the file handle, "b" and the birth time, or empty
}

// Inode is id without its generation: the key under which a mover keeps
// at most one file per inode number, comparing Gen when it finds one.
func (id FileID) Inode() FileID { return FileID{Dev: id.Dev, Ino: id.Ino} }

// FileIDOf is the identity of the file open at fd, whose stat st the
// caller took.
func FileIDOf(fd int, st *unix.Stat_t) FileID {
	return FileID{Dev: uint64(st.Dev), Ino: st.Ino, Gen: Generation(fd)}
}

// Generation is the generation of the file open at fd (see FileID): "h"
// and its file handle, else "b" and its birth time, else "".
func Generation(fd int) string {
	if h, _, err := unix.NameToHandleAt(fd, "", unix.AT_EMPTY_PATH); err == nil {
		t := h.Type()
		return string(append([]byte{'h', byte(t), byte(t >> 8), byte(t >> 16), byte(t >> 24)}, h.Bytes()...))
	}
	var sx unix.Statx_t
	if err := unix.Statx(fd, "", unix.AT_EMPTY_PATH, unix.STATX_BTIME, &sx); err == nil && sx.Mask&unix.STATX_BTIME != 0 {
		return "b" + strconv.FormatInt(sx.Btime.Sec, 10) + "." + strconv.FormatUint(uint64(sx.Btime.Nsec), 10)
	}
	return ""
}
