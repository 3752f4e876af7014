package clustercap

import (
	"errors"
	"fmt"
	"io"
	"io/fs"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kvhost/kvhost/fsys"
)

// DirName is the metadata directory under a mount's root. Its name starts
// with '.', so the engine's scan of the mount skips it.
const DirName = ".kvhost-cluster"

const (
	summarySuffix = ".summary"
	lockSuffix    = ".lock"
)

// Dir is a mount's metadata directory as one node uses it: it publishes
// the node's summary, reads everyone's and holds the node's lock file for
// as long as the node runs.
type Dir struct {
	fs   fsys.FS
	path string
	// real is path with the root's own symbolic links resolved at
	// OpenDir: what the Dir's opens take, with fsys.ONoLinks (noLinks).
	real    string
	node    string
	lock    fsys.File
	adopted adoptions
	read    struct {
		mu   sync.Mutex
		last map[string]*Summary // by node: its last summary ReadAll decoded
	}
	purges struct {
		mu sync.Mutex         // never held over a file operation: PurgedAt is on a lookup's path
		at map[uint64][]int64 // by fingerprint: the record times listed or written, ascending
	}
	listing struct {
		mu      sync.Mutex // held over a listing, and over a Publish's rename
		changed bool       // a Publish renamed into the directory since the last listing
	}
}

// LockWait is how long OpenDir tries a node's lock file that another
// process holds before it fails: other nodes probe a stopped node's lock
// (LockFree holds it for a round trip each interval), and a node starting
// again must not take a probe for a second copy of itself.
const LockWait = 2 * time.Second

// OpenDir creates (if missing) the metadata directory under root and takes
// node's lock file in it: an exclusive flock, held until Close. It fails
// with ErrNodeLocked if another process holds it for LockWait (the same
// node id runs twice on the mount). Every file operation of the Dir goes
// through fs (the engine's, which times each one: a hung shared mount
// shows).
//
// The directory is shared by every node, so no file of the Dir is made,
// read, renamed, flocked or removed through a symbolic link: root's own
// links (the operator's) are resolved here, once; every open after takes
// that path with fsys.ONoLinks (openat2 RESOLVE_NO_SYMLINKS), and renames
// and removals are relative to the directory opened so (fsys.AtFS). A
// link in place of the directory, of root or of one of the Dir's files
// fails the operation with an error naming the path and wrapping
// syscall.ELOOP; nothing is done where it points.
func OpenDir(fs fsys.FS, root, node string) (*Dir, error) {
	if err := checkNode(node); err != nil {
		return nil, err
	}
	if err := fs.MkdirAll(root, 0o755); err != nil {
		return nil, fmt.Errorf("clustercap: %w", err)
	}
	realRoot, err := filepath.EvalSymlinks(root)
	if err != nil {
		return nil, fmt.Errorf("clustercap: %w", err)
	}
	d := &Dir{fs: fs, path: filepath.Join(root, DirName), real: filepath.Join(realRoot, DirName), node: node}
	if err := d.mkdir(root); err != nil {
		return nil, fmt.Errorf("clustercap: %w", err)
	}
	deadline := time.Now().Add(LockWait)
	for pause := time.Millisecond; ; pause = min(2*pause, 100*time.Millisecond) {
		f, ok, err := d.tryLockPath(d.lockPath(node))
		if err != nil {
			return nil, fmt.Errorf("clustercap: %w", err)
		}
		if ok {
			d.lock = f
			break
		}
		if left := time.Until(deadline); left > 0 {
			time.Sleep(min(pause, left))
			continue
		}
		return nil, fmt.Errorf("%w: %s: node %q already runs on this mount", ErrNodeLocked, d.lockPath(node), node)
	}
	d.removeTemps(node) // left by a crash while publishing; another try next start
	return d, nil
}

// Relock checks that the node's lock is on the file at its lock path,
// and takes it anew on the file there where it is not: the file was
// removed while the node ran (a node that took this one for dead retired
// it; on NFS a lease that lapsed in a partition frees the lock without a
// word to its holder) or replaced. Without it another node's probe of the
// path finds the lock free, and a second copy of the node may start. It
// reports whether it locked a new file. It fails with ErrNodeLocked,
// holding no lock, where another process holds the file at the path: a
// second copy of this node runs (or, for a moment, another node's
// probe); the next Relock tries again. A failed check keeps the lock.
func (d *Dir) Relock() (bool, error) {
	path := d.lockPath(d.node)
	if d.lock != nil {
		at, err := fsys.IsAt(d.fs, d.lock, path)
		if err != nil {
			return false, fmt.Errorf("clustercap: check %s: %w", path, err)
		}
		if at {
			return false, nil
		}
	}
	if d.lock != nil {
		// A lock on a file no longer at the path excludes nobody; and
		// where the check erred and it is that file (an identity the
		// file system reports anew once the directory came back), this
		// process's own lock would refuse the one below, as if a second
		// copy held it.
		d.lock.Close()
		d.lock = nil
	}
	// Another node's probe holds the lock for a moment at most: a few
	// tries over a few milliseconds tell it from a second copy.
	var f fsys.File
	ok := false
	for pause := time.Millisecond; ; pause *= 2 {
		var err error
		f, ok, err = d.tryLockPath(path)
		if err != nil {
			return false, fmt.Errorf("clustercap: %w", err)
		}
		if ok || pause > relockPause {
			break
		}
		time.Sleep(pause)
	}
	if !ok {
		return false, fmt.Errorf("%w: %s: another process holds node %q's lock", ErrNodeLocked, path, d.node)
	}
	d.lock = f
	return true, nil
}

// relockPause bounds the pauses of Relock's tries of a lock another
// process holds (1, 2, 4 … ms: about 60 ms in all).
const relockPause = 32 * time.Millisecond

// LockMissing reports whether node's lock file is not in the directory:
// the node never ran on the mount, or its lock file was removed (a
// running node locks it again at its next interval). An error reading
// the directory reports false: unknown.
func (d *Dir) LockMissing(node string) bool {
	_, err := d.lstat(d.lockPath(node))
	return errors.Is(err, os.ErrNotExist)
}

// SummaryPath is the path of node's summary file.
func (d *Dir) SummaryPath(node string) string { return d.summaryPath(node) }

// ReadSummary reads and decodes node's summary file (this node's own, to
// check that it is the one it wrote: ReadAll reads the others'). A
// summary under another node's name in the file fails with ErrSummary.
func (d *Dir) ReadSummary(node string) (*Summary, error) {
	path := d.summaryPath(node)
	var b []byte
	err := retryStale(func() (err error) {
		b, err = d.readFile(path)
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("clustercap: %w", err)
	}
	s, err := Decode(b)
	if err != nil {
		return nil, err
	}
	if s.Node != node {
		return nil, fmt.Errorf("%w: %s holds node %q's summary", ErrSummary, path, s.Node)
	}
	return s, nil
}

// tryLockPath opens path (creating it; read-write where it may:
// fsys.OpenToLock) and takes an exclusive flock on it without waiting. It reports false, with no file, when
// another process holds the lock. The file it locks is the one at path
// once locked: a Retire may remove the file between the open and the
// lock, and a lock on a removed file excludes nobody.
func (d *Dir) tryLockPath(path string) (fsys.File, bool, error) {
	const tries = 8 // each a Retire between an open and a lock
	for range tries {
		f, err := fsys.OpenToLock(d.fs, d.noLinks(path), os.O_CREATE|fsys.ONoLinks, 0o644)
		err = d.linkErr(path, err)
		if err != nil {
			return nil, false, err
		}
		ok, err := fsys.TryLock(f)
		if err == nil && ok {
			ok, err = fsys.IsAt(d.fs, f, path)
			if err == nil && ok {
				return f, true, nil
			}
			if err == nil {
				f.Close()
				continue // removed meanwhile: lock the file at path now
			}
		}
		f.Close()
		if err != nil {
			err = fmt.Errorf("lock %s: %w", path, err)
		}
		return nil, false, err
	}
	return nil, false, fmt.Errorf("lock %s: removed %d times while being locked", path, tries)
}

// removeTemps removes node's summary temporaries (Publish's, left by a
// crash), which only node writes: the caller holds node's lock. Its
// listing need not be fresh (list): node's own temporaries were created
// through this client, which saw its own creations, and Retire removes a
// dead node's summary, which invalidates a cached listing, first.
func (d *Dir) removeTemps(node string) error {
	ents, err := d.list(false)
	if err != nil {
		return err
	}
	for _, ent := range ents {
		if !isTemp(ent.Name(), node) {
			continue
		}
		if err := d.remove(filepath.Join(d.path, ent.Name())); err != nil && !errors.Is(err, os.ErrNotExist) {
			return err
		}
	}
	return nil
}

// tempName is the name of a summary temporary of node: Publish's
// ".<node>.tmp-<16 hex digits>".
func tempName(node string, random uint64) string {
	return fmt.Sprintf(".%s.tmp-%016x", node, random)
}

// isTemp reports whether name is one of node's summary temporaries. The
// fixed length of the random part tells node's from those of a node
// whose name has node's as a prefix.
func isTemp(name, node string) bool {
	rest, ok := strings.CutPrefix(name, "."+node+".tmp-")
	if !ok || len(rest) != 16 {
		return false
	}
	for _, c := range rest {
		if !('0' <= c && c <= '9' || 'a' <= c && c <= 'f') {
			return false
		}
	}
	return true
}

// checkNode checks a node name: it names files in the directory.
func checkNode(node string) error {
	if node == "" || strings.ContainsAny(node, "/\x00") || strings.HasPrefix(node, ".") {
		return fmt.Errorf("clustercap: node name %q: want a non-empty name without '/' that does not start with '.'", node)
	}
	return nil
}

// ErrNodeLocked means another process holds the node's lock file.
var ErrNodeLocked = errors.New("clustercap: node lock held")

// Path is the directory's path.
func (d *Dir) Path() string { return d.path }

// Close releases the node's lock and its adoption locks. Its summary stays: its files are still
// on the mount, and another node takes them as a dead node's only once the
// summary is stale.
func (d *Dir) Close() error {
	err := d.releaseAll()
	if d.lock == nil {
		return err
	}
	if cerr := d.lock.Close(); err == nil {
		err = cerr
	}
	d.lock = nil
	return err
}

func (d *Dir) lockPath(node string) string    { return filepath.Join(d.path, node+lockSuffix) }
func (d *Dir) summaryPath(node string) string { return filepath.Join(d.path, node+summarySuffix) }

// noLinks is path, the directory's or a name in it, as an open with
// fsys.ONoLinks takes it: from d.real, root's links resolved.
func (d *Dir) noLinks(path string) string {
	if rel, ok := strings.CutPrefix(path, d.path); ok && (rel == "" || rel[0] == filepath.Separator) {
		return d.real + rel
	}
	return path
}

// linkErr is err, an operation's on path, naming the symbolic link it
// met (ELOOP) where it met one.
func (d *Dir) linkErr(path string, err error) error {
	if errors.Is(err, syscall.ELOOP) {
		return fmt.Errorf("%s, the cluster directory %s, or a directory above it, is a symbolic link: kvhost makes, reads, flocks and removes no file through it: %w", path, d.path, err)
	}
	return err
}

// open opens path, a file in the directory, with flag, never through a
// symbolic link (OpenDir).
func (d *Dir) open(path string, flag int, perm os.FileMode) (fsys.File, error) {
	f, err := d.fs.OpenFile(d.noLinks(path), flag|fsys.ONoLinks, perm)
	return f, d.linkErr(path, err)
}

// openDir opens the directory itself (O_PATH), never through a link, for
// the renames and removals relative to it.
func (d *Dir) openDir() (fsys.File, error) {
	return d.open(d.path, unix.O_PATH|unix.O_DIRECTORY, 0)
}

// mkdir makes the directory (if missing) in root, opened without links
// from its resolved path: a link in place of the directory is refused
// when it is opened, never followed.
func (d *Dir) mkdir(root string) error {
	r, err := d.fs.OpenFile(filepath.Dir(d.real), unix.O_PATH|unix.O_DIRECTORY|fsys.ONoLinks, 0)
	if err != nil {
		return d.linkErr(root, err)
	}
	defer r.Close()
	if err := fsys.MkdirAt(d.fs, r, d.path, 0o755); err != nil && !errors.Is(err, fs.ErrExist) {
		return err
	}
	dir, err := d.openDir()
	if err != nil {
		return err
	}
	return dir.Close()
}

// remove removes path, a file in the directory, relative to the
// directory opened without links (unlinkat).
func (d *Dir) remove(path string) error {
	dir, err := d.openDir()
	if err != nil {
		return err
	}
	defer dir.Close()
	return fsys.RemoveAt(d.fs, dir, path)
}

// lstat describes the name path in the directory itself, relative to
// the directory opened without links (fstatat, AT_SYMLINK_NOFOLLOW): a
// symbolic link at the name is described, never the file it points to.
func (d *Dir) lstat(path string) (os.FileInfo, error) {
	dir, err := d.openDir()
	if err != nil {
		return nil, err
	}
	defer dir.Close()
	return fsys.StatAt(d.fs, dir, path)
}

// rename renames oldpath to newpath, both in the directory, relative to
// the directory opened without links (renameat).
func (d *Dir) rename(oldpath, newpath string) error {
	dir, err := d.openDir()
	if err != nil {
		return err
	}
	defer dir.Close()
	return fsys.RenameAt(d.fs, dir, oldpath, dir, newpath, false)
}

// Publish writes s as this node's summary: a temporary file, fsynced and
// renamed over the last one, so that a reader sees one whole summary or
// the other, after a crash too.
func (d *Dir) Publish(s *Summary) error {
	if s.Node != d.node {
		return fmt.Errorf("clustercap: publish node %q's summary from node %q", s.Node, d.node)
	}
	b, err := Encode(s)
	if err != nil {
		return err
	}
	tmp, err := d.writeTemp(b)
	if err == nil {
		err = d.renameIn(tmp, d.summaryPath(d.node))
	}
	if err != nil {
		return fmt.Errorf("clustercap: publish: %w", err)
	}
	return nil
}

// writeTemp writes b to a new temporary file of this node's in the
// directory (writeFile: fsynced) and returns its path; a write that fails
// leaves no temporary file.
func (d *Dir) writeTemp(b []byte) (string, error) {
	tmp := filepath.Join(d.path, tempName(d.node, rand.Uint64()))
	if err := d.writeFile(tmp, b); err != nil {
		d.remove(tmp)
		return "", err
	}
	return tmp, nil
}

// renameIn renames tmp, a temporary file of writeTemp, to path in the
// directory, so that a reader lists a whole file or none, and marks the
// directory changed for list; a rename that fails removes tmp.
func (d *Dir) renameIn(tmp, path string) error {
	d.listing.mu.Lock()
	err := d.rename(tmp, path)
	if err == nil {
		d.listing.changed = true
	}
	d.listing.mu.Unlock()
	if err != nil {
		d.remove(tmp)
	}
	return err
}

// list lists the directory; if fresh, as it is now, not as a cache of
// the client holds it. An NFS client may answer a listing from its cache
// of the directory for up to acdirmax (60 s by default), however often
// the directory is opened anew (mounted nocto, or where the server's
// directory mtime is too coarse to show a change): a node's summary
// created since through another client is then missing from it. A file
// that this client creates, renames or removes in the directory
// invalidates that cache whatever the mount options. So unless a Publish
// renamed into the directory since the last listing (a node publishes
// before it reads: then this costs nothing), list first creates and
// removes a file there, one of this node's summary temporaries (a crash
// in between leaves one, which OpenDir and Retire remove). A touch that
// fails (a directory that takes no new file) does not fail the listing:
// it may then be as old as the client's cache, and this node's own
// publication fails as well.
func (d *Dir) list(fresh bool) ([]fs.DirEntry, error) {
	d.listing.mu.Lock()
	defer d.listing.mu.Unlock()
	if fresh && !d.listing.changed {
		d.touch() // failing, the listing may be old: not an error of the read
	}
	d.listing.changed = false
	var ents []fs.DirEntry
	err := retryStale(func() (err error) {
		ents, err = d.fs.ReadDir(d.path)
		return err
	})
	return ents, err
}

// touch creates a file in the directory and removes it (list).
func (d *Dir) touch() error {
	tmp := filepath.Join(d.path, tempName(d.node, rand.Uint64()))
	var f fsys.File
	err := retryStale(func() (err error) {
		f, err = d.open(tmp, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o644)
		return err
	})
	if err != nil {
		return err
	}
	return errors.Join(f.Close(), d.remove(tmp))
}

// writeFile creates path (a fresh name: O_EXCL), writes b into it and
// fsyncs it: renamed over a summary, it must not become an empty or
// partial one in a crash of the node or the file system.
func (d *Dir) writeFile(path string, b []byte) error {
	f, err := d.open(path, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o644)
	if err != nil {
		return err
	}
	_, err = f.WriteAt(b, 0)
	if err == nil {
		err = f.Sync()
	}
	return errors.Join(err, f.Close())
}

// readFile reads the whole file at path (a summary: a few KiB), failing
// with ErrSummary past MaxSummarySize bytes. The open does not block
// (O_NONBLOCK): anyone who can write the shared directory may put a
// named pipe at a summary's name, and a plain open of one waits for a
// writer, holding ReadAll, and with it the node's cluster tick, forever.
// Anything but a regular file at the name (a named pipe, a directory, a
// socket, a device) fails with ErrSummary, naming the path: it is no
// summary, whatever it holds.
func (d *Dir) readFile(path string) ([]byte, error) {
	f, err := d.open(path, os.O_RDONLY|syscall.O_NONBLOCK, 0)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	fi, err := fsys.Fstat(f)
	if err != nil {
		return nil, err
	}
	if !fi.Mode().IsRegular() {
		return nil, fmt.Errorf("%w: %s is not a regular file (%v)", ErrSummary, path, fi.Mode().Type())
	}
	out := make([]byte, 0, 4<<10)
	for {
		if len(out) > MaxSummarySize {
			return nil, fmt.Errorf("%w: %s: more than %d bytes", ErrSummary, filepath.Base(path), MaxSummarySize)
		}
		if len(out) == cap(out) {
			out = append(out, 0)[:len(out)] // room to read into
		}
		// Read at most one byte past the limit: enough to tell.
		n, err := f.ReadAt(out[len(out):min(cap(out), MaxSummarySize+1)], int64(len(out)))
		out = out[:len(out)+n]
		if errors.Is(err, io.EOF) {
			return out, nil
		}
		if err != nil {
			return nil, err
		}
	}
}

// ReadAll reads every node's summary but this node's. A summary file that
// does not decode (a node of another version, a file left truncated by a
// crash, anything but a regular file at the name: a named pipe is
// refused, never waited on) or cannot be read is reported beside the others as a
// *SummaryError naming its node, and the last summary of that node this
// Dir read, if any, stands in for it: one file failing does not fail the
// read. A stale file handle (ESTALE, a shared mount's file replaced under
// a cached handle) is retried. A directory that cannot be listed is an
// error with no summaries. The purge records listed are noted for
// Purges and PurgedAt. The listing is fresh on a client that caches
// listings (NFS) too: see list.
func (d *Dir) ReadAll() ([]*Summary, []error, error) {
	ents, err := d.list(true)
	if err != nil {
		return nil, nil, fmt.Errorf("clustercap: %w", err)
	}
	d.read.mu.Lock()
	defer d.read.mu.Unlock()
	last := d.read.last
	d.read.last = make(map[string]*Summary, len(last))
	var out []*Summary
	var bad []error
	for _, ent := range ents {
		name := ent.Name()
		if fp, t, ok := parsePurge(name); ok {
			d.notePurge(fp, t)
			continue
		}
		node, ok := strings.CutSuffix(name, summarySuffix)
		if !ok || strings.HasPrefix(name, ".") || node == d.node {
			continue
		}
		path := filepath.Join(d.path, name)
		var b []byte
		err := retryStale(func() (err error) {
			b, err = d.readFile(path)
			return err
		})
		if errors.Is(err, os.ErrNotExist) {
			continue // removed meanwhile
		}
		var s *Summary
		if err == nil {
			s, err = Decode(b)
		}
		if err == nil && s.Node != node {
			err = fmt.Errorf("%w: %s holds node %q's summary", ErrSummary, name, s.Node)
		}
		if err != nil {
			se := &SummaryError{Node: node, Err: err}
			if fi, err := d.lstat(path); err == nil {
				se.ModTime = fi.ModTime()
			}
			bad = append(bad, se)
			if s := last[node]; s != nil {
				d.read.last[node] = s
				out = append(out, s)
			}
			continue
		}
		d.read.last[node] = s
		out = append(out, s)
	}
	return out, bad, nil
}

// staleTries is how many times retryStale calls its function.
const staleTries = 3

// retryStale calls f until it returns an error other than ESTALE, at most
// staleTries times: a new lookup of the path gets a fresh handle.
func retryStale(f func() error) error {
	err := f()
	for i := 1; i < staleTries && errors.Is(err, syscall.ESTALE); i++ {
		err = f()
	}
	return err
}

// SummaryError is a node's summary file that ReadAll could not use: it
// does not decode (Err wraps ErrSummary: a node of another version, a
// file left empty or truncated by a crash, one over MaxSummarySize, a
// named pipe, directory or other non-regular file at the name), or
// it could not be read (Err is the file system's error). A node whose
// summary file does not decode and whose lock is free (LockFree) is not
// running: a running node holds its lock, and a stopped node of this
// version left its last summary whole. One whose file could not be read
// is unknown.
type SummaryError struct {
	Node    string    // the node the file is named for
	ModTime time.Time // the name's modification time (the file system's clock): a symbolic link's own, never its target's; zero if unknown
	Err     error     // why it could not be used
}

// Error names the file and says why it could not be used.
func (e *SummaryError) Error() string { return e.Node + summarySuffix + ": " + e.Err.Error() }

// Unwrap returns e.Err.
func (e *SummaryError) Unwrap() error { return e.Err }

// LockFree reports whether node's lock file is free: no process holds it
// (taken without waiting and released at once). A lock file that does not
// exist is free.
func (d *Dir) LockFree(node string) (bool, error) {
	f, err := fsys.OpenToLock(d.fs, d.noLinks(d.lockPath(node)), fsys.ONoLinks, 0)
	err = d.linkErr(d.lockPath(node), err)
	if errors.Is(err, os.ErrNotExist) {
		return true, nil
	}
	if err != nil {
		return false, err
	}
	defer f.Close()
	return fsys.TryLock(f)
}
