package engine

import (
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kvhost/kvhost/fsys"
	"github.com/kvhost/kvhost/internal/engine/space"
)

// Temporary files (docs/engine.md, "Temporary files").
//
// A store writes .tmp-<node>-<pid>-<token><16 hex> and holds an exclusive
// flock on it until it is renamed or removed; the O_DIRECT probe does the
// same with .probe-direct-<node>-<pid>-<token><16 hex>. At Open, a leftover
// is removed only when it is provably abandoned: its flock is free, and
// either it belongs to this node and its process is gone, or it is older
// than TempGrace (another node's, or a name without an owner, written
// before owners). A name with this node and this process's pid but not
// this engine's token (owner.go) is a predecessor's that had the pid: a
// restarted container's daemon often has its predecessor's pid and node.

// DefaultTempGrace is Config.TempGrace when it is zero.
const DefaultTempGrace = 10 * time.Minute

// nodeName returns the node part of temporary names: name (or the host
// name) with every byte outside [A-Za-z0-9._] replaced by '_', so that '-'
// separates the fields.
func nodeName(name string) string {
	if name == "" {
		name, _ = os.Hostname()
	}
	if name == "" {
		name = "node"
	}
	b := []byte(name)
	for i, c := range b {
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '.' || c == '_') {
			b[i] = '_'
		}
	}
	if len(b) > 64 {
		b = b[:64]
	}
	return string(b)
}

// ownFiles are the files the engine makes under names of its own
// (tempfiles.go, owner.go, spares.go): temporary files and spares, named with this
// engine's owner token; the owner files that say its spares are live;
// and the node lock (Config.LockFile). It makes their directories
// through the directory cache, opens files under a mount's rules
// (mount.openNoLinks, mount.openDir) and removes them through the
// remover.
type ownFiles struct {
	fs    fsys.FS
	log   *slog.Logger
	now   func() time.Time
	grace time.Duration // Config.TempGrace
	node  string        // this node's name in temporary file names
	token string        // names this engine's owner files and spares (owner.go)
	dirs  *dirCache
	rm    *remover  // removes files under a mount's rules (removal.go)
	lock  fsys.File // Config.LockFile, flocked for the engine's life
	// The spares (spares.go): their room on the mounts, which mounts
	// keep them (mountWatch.spareEligible), and the count of those reused
	// (Stats.Reused).
	sp       *space.Space
	eligible func(*mount) bool
	reused   *atomic.Uint64

	mu     sync.Mutex  // guards owners and done (tookFile adds one after Open); no I/O under it
	owners []ownerFile // this engine's owner files, flocked for its life
	// done: closeOwners ran; openOwner makes no owner file after it.
	done bool
}

// tempName returns a fresh temporary name with prefix (tmpPrefix,
// probePrefix or sparePrefix) in dir, owned by this engine: its random
// part begins with the engine's owner token (owner.go).
func (o *ownFiles) tempName(dir, prefix string) string {
	return filepath.Join(dir, fmt.Sprintf("%s%s-%d-%s%016x", prefix, o.node, os.Getpid(), o.token, rand.Uint64()))
}

// createTemp creates an owned temporary file (O_EXCL, plus extra flags)
// in dir on m, creating dir first (again, if it was removed behind the
// engine's back), flocks it ("in use", to cleaners on this node and,
// where the file system shares flocks, on others: docs/engine.md) and
// allocates size bytes. On failure nothing is left behind; op names the
// failed step ("mkdir", "create", "lock", "allocate").
func (o *ownFiles) createTemp(m *mount, dir string, extra int, size int64) (f fsys.File, tmp, op string, err error) {
	return o.createFile(m, dir, tmpPrefix, extra, size)
}

// createFile is createTemp for a temporary name with prefix (tmpPrefix,
// or sparePrefix for a spare made ahead of stores).
func (o *ownFiles) createFile(m *mount, dir, prefix string, extra int, size int64) (f fsys.File, tmp, op string, err error) {
	if err := o.dirs.mkdir(m, dir, false); err != nil {
		return nil, "", "mkdir", err
	}
	flag := os.O_WRONLY | os.O_CREATE | os.O_EXCL | extra
	for try := 1; ; try++ {
		tmp = o.tempName(dir, prefix)
		// Never through a link (openNoLinks): mkdir checked dir's
		// directories when it first met them, and one may have been
		// replaced by a link to a directory outside the mount since.
		f, err = m.openNoLinks(o.fs, tmp, flag, 0o644)
		if errors.Is(err, os.ErrNotExist) || errors.Is(err, syscall.ELOOP) {
			// The directory was removed behind our back, or a link
			// planted on its way: checked again (mkdirIn: ErrPolicy,
			// ErrInvalid on a vllm-fs mount, where the link is still
			// there) and made again.
			if err = o.dirs.mkdir(m, dir, true); err == nil {
				f, err = m.openNoLinks(o.fs, tmp, flag, 0o644)
			}
		}
		if err != nil {
			return nil, "", "create", err
		}
		err = o.lockTemp(f, tmp, fsys.FileID{}, true)
		if err == nil {
			break
		}
		if !errors.Is(err, errTempGone) {
			o.rm.removeTemp(m, tmp, f, size)
			f.Close()
			return nil, "", "lock", err
		}
		f.Close()
		if try == tempTries {
			return nil, "", "create", fmt.Errorf("%w: %d temporary files in %s", err, try, dir)
		}
	}
	if err := f.Allocate(size); err != nil {
		o.rm.removeTemp(m, tmp, f, size)
		f.Close()
		return nil, "", "allocate", err
	}
	return f, tmp, "", nil
}

// tempTries is how many fresh temporary files createFile makes, each
// removed before it was locked (lockTemp), before it fails.
const tempTries = 4

// errTempGone says that a temporary file this engine had just made was
// removed before it was locked (lockTemp).
var errTempGone = errors.New("engine: removed by another engine's check of its leftovers before it was locked")

// lockTemp flocks f, a temporary file this engine has just made at path,
// and checks that f is still the file at path (errTempGone if not). Until
// the flock is taken, another engine's check of its leftovers (cleanTemp,
// at its Open) may take the file for abandoned: a daemon of this node
// name in a container of its own, whose pids this process does not see
// or whose pid is this one's, takes it for a predecessor's, and finds its
// flock free. With wait (a file just created, O_EXCL: no descriptor of it
// but this one and such checks exists) lockTemp waits while a check holds
// the flock, a moment; without (a spare renamed there, whose earlier
// descriptors a mover may keep, flock and all) it only tries, and a flock
// held already is taken for the file's protection. Then it looks at
// path: a file a check removed is no file to write, and the caller makes
// another. A flock that fails (a file system without flocks) is no error:
// the file's age (temp_grace) is then what protects it. A failed stat is.
// id is f's identity where the caller has it (a spare's: its inode
// survives the rename), sparing an fstat; a zero id is read from f.
func (o *ownFiles) lockTemp(f fsys.File, path string, id fsys.FileID, wait bool) error {
	var err error
	if wait {
		err = fsys.Lock(f)
	} else {
		_, err = fsys.TryLock(f)
	}
	if err != nil {
		o.log.Debug("engine: flock of a temporary file", "path", path, "err", err)
	}
	var at bool
	if id.Ino != 0 {
		at, err = fsys.InodeAt(o.fs, id, path)
	} else {
		at, err = fsys.IsAt(o.fs, f, path)
	}
	if err != nil {
		return err
	}
	if !at {
		return errTempGone
	}
	return nil
}

// tempOwner parses the owner of a temporary name (without its prefix):
// node and pid, or ok false for a name without an owner.
func tempOwner(rest string) (node string, pid int, ok bool) {
	i := strings.LastIndexByte(rest, '-')
	if i < 0 {
		return "", 0, false
	}
	j := strings.LastIndexByte(rest[:i], '-')
	if j <= 0 {
		return "", 0, false
	}
	pid, err := strconv.Atoi(rest[j+1 : i])
	if err != nil || pid <= 0 {
		return "", 0, false
	}
	return rest[:j], pid, true
}

// tempRest is the part of a temporary file's name after its prefix
// (tmpPrefix or probePrefix); ok is false for other names.
func tempRest(name string) (rest string, ok bool) {
	rest, ok = strings.CutPrefix(name, tmpPrefix)
	if !ok {
		rest, ok = strings.CutPrefix(name, probePrefix)
	}
	return rest, ok
}

// processAlive reports whether a process with this pid exists on this
// node (a reused pid reads as alive: the safe side).
func processAlive(pid int) bool {
	err := unix.Kill(pid, 0)
	return err == nil || errors.Is(err, unix.EPERM)
}

// cleanTemp applies the leftover rule to the temporary file at path on m with
// name's part after its prefix. It reports whether it removed the file.
func (o *ownFiles) cleanTemp(m *mount, path, rest string) (bool, error) {
	f, err := fsys.OpenToLock(o.fs, path, syscall.O_NOFOLLOW, 0)
	if err != nil {
		if errors.Is(err, os.ErrNotExist) {
			return false, nil
		}
		return false, err
	}
	defer f.Close() // releases the lock, after the remove
	free, err := fsys.TryLock(f)
	if err != nil || !free {
		return false, err // in use by a writer (or locks do not work: keep)
	}
	id, err := fileIdentity(f)
	if err != nil {
		return false, err
	}
	node, pid, owned := tempOwner(rest)
	abandoned := false
	switch {
	case owned && node == o.node && pid == os.Getpid():
		// This engine's own (a store in flight), or a predecessor's
		// that had this pid: only this engine's names carry its token.
		abandoned = !strings.HasPrefix(rest[strings.LastIndexByte(rest, '-')+1:], o.token)
	case owned && node == o.node:
		abandoned = !processAlive(pid)
	default:
		abandoned = o.now().Sub(time.Unix(0, id.Mtime)) > o.grace
	}
	if !abandoned {
		return false, nil
	}
	// Remove the file we locked, not a name: if the path now names another
	// file, leave it.
	fi, err := o.fs.Stat(path)
	if err != nil {
		return false, nil
	}
	if now, err := fsys.IdentityOf(fi); err != nil || !now.Same(id) {
		return false, nil
	}
	if err := o.rm.removeFile(m, path, id); err != nil {
		return false, err
	}
	return true, nil
}

// lockedError is the ErrLocked error for the node lock file f at path,
// which another process holds: it names that process, from the pid the
// holder wrote into the file.
func lockedError(f io.ReaderAt, path string) error {
	buf := make([]byte, 32)
	n, _ := f.ReadAt(buf, 0)
	holder := strings.TrimSpace(string(buf[:n]))
	if _, err := strconv.Atoi(holder); err != nil {
		holder = "unknown"
	}
	return fmt.Errorf("%w: %s is held by process %s: another kvhost runs on this node", ErrLocked, path, holder)
}

// ProbeNodeLock reports whether another process holds the node lock file
// at path (Config.LockFile), without creating it or keeping it: an error
// wrapping ErrLocked, naming the holder, where one does; nil where the
// file does not exist or is free. A daemon calls it before it takes
// what a second daemon would find taken before the lock (a metrics
// port), so that the second one is told why.
func ProbeNodeLock(path string) error {
	f, err := os.Open(path)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("engine: lock file: %w", err)
	}
	defer f.Close()
	free, err := fsys.TryLock(f)
	if err != nil {
		return fmt.Errorf("engine: lock file %s: flock: %w", path, err)
	}
	if !free {
		return lockedError(f, path)
	}
	return nil // closing f releases the lock taken
}

// lockNode opens (creating) the node-local lock file and takes an exclusive
// flock on it without waiting; it writes this process's pid into it for the
// message the next one gets.
func lockNode(fs fsys.FS, path string) (fsys.File, error) {
	if err := fs.MkdirAll(filepath.Dir(path), 0o750); err != nil {
		return nil, fmt.Errorf("engine: lock file: %w", err)
	}
	f, err := fs.OpenFile(path, os.O_RDWR|os.O_CREATE, 0o644)
	if err != nil {
		return nil, fmt.Errorf("engine: lock file: %w", err)
	}
	free, err := fsys.TryLock(f)
	if err != nil {
		f.Close()
		return nil, fmt.Errorf("engine: lock file %s: flock: %w", path, err)
	}
	if !free {
		err := lockedError(f, path)
		f.Close()
		return nil, err
	}
	pid := []byte(strconv.Itoa(os.Getpid()) + "\n")
	if _, err := f.WriteAt(pid, 0); err == nil {
		// Best effort: the pid only makes the message above better (and a
		// full file system must not stop a start).
		_ = unix.Ftruncate(int(f.Fd()), int64(len(pid)))
	}
	return f, nil
}

// ioError wraps a file-system error of a store; ENOSPC also wraps ErrNoSpace
// and names the mount.
func ioError(m *mount, op string, err error) error {
	if errors.Is(err, syscall.ENOSPC) {
		return fmt.Errorf("%w: mount %s: %s: %w", ErrNoSpace, m.root, op, err)
	}
	return fmt.Errorf("engine: store on mount %s: %s: %w", m.root, op, err)
}

// dirCache is what mkdir knows of the directories: those known to exist,
// and those created and not yet fsynced (Config.Fsync).
type dirCache struct {
	fs       fsys.FS
	fsync    bool         // Config.Fsync
	known    sync.Map     // directories known to exist (mkdir); forgotten past max
	n        atomic.Int64 // entries added to known since it was last cleared
	max      int64        // the most known holds before it is cleared (maxKnownDirs)
	unsynced sync.Map     // directories created, not yet fsynced (Config.Fsync)
}

// newDirCache returns an empty cache of at most maxKnownDirs directories.
func newDirCache(fs fsys.FS, fsync bool) *dirCache {
	return &dirCache{fs: fs, fsync: fsync, max: maxKnownDirs}
}

// maxKnownDirs bounds dirCache.known, the directories mkdir knows to exist.
// A vllm-fs layout has 4096 × 256 directories per KV-cache group, and a
// policy may name as many: remembered for the engine's life, they would
// grow the map without end. Forgetting is safe: a forgotten directory is
// walked and checked for links again (mkdirIn) at its next store. At
// about 200 bytes an entry, 1<<15 of them are some 6 MiB. A variable
// for tests.
var maxKnownDirs int64 = 1 << 15

// mkdir creates dir (and parents) once (until the engine forgets it:
// maxKnownDirs); force re-creates it. With
// Config.Fsync, every directory it creates is fsynced, and so is its
// parent, before mkdir returns: a file published there and reported durable
// cannot vanish with its directory on a power loss. With m set (dir is
// the directory of a data file on m: a policy's name, a vllm-fs row's),
// every directory from m's linkFree directory (its root; a vllm-fs
// mount's data directory) down to dir must be one, not a symbolic link
// someone planted in the mount: the file would otherwise be written, and
// later removed, wherever the link points, outside the mount; they are
// made one at a time, each in the one above opened without following a
// link (mkdirIn), never by a MkdirAll, which would follow a link planted
// between a check and the make. With m nil (a mount's root, a vllm-fs
// mount's base and data directories: the operator's, links included),
// MkdirAll.
func (c *dirCache) mkdir(m *mount, dir string, force bool) error {
	if !force {
		if _, ok := c.known.Load(dir); ok {
			return nil
		}
	}
	if m != nil {
		if err := c.mkdirIn(m, dir); err != nil {
			return err
		}
	} else {
		if c.fsync {
			// The directories about to be created: from dir up to the
			// first that exists. They stay listed until synced, so that
			// a failed sync is tried again by the next store.
			for d := dir; ; {
				if _, err := c.fs.Stat(d); err == nil {
					break
				} else if !errors.Is(err, os.ErrNotExist) {
					return err
				}
				c.unsynced.Store(d, struct{}{})
				p := filepath.Dir(d)
				if p == d {
					break
				}
				d = p
			}
		}
		if err := c.fs.MkdirAll(dir, 0o755); err != nil {
			return err
		}
	}
	if c.fsync {
		if err := c.syncNewDirs(dir); err != nil {
			return err
		}
	}
	// Past its bound the cache is forgotten whole (maxKnownDirs): no
	// order to keep on the hits, which stay one Load. Concurrent mkdirs
	// may miscount by one each; the next clear takes what slipped by.
	if c.n.Add(1) > c.max {
		c.n.Store(1)
		c.known.Clear()
	}
	c.known.Store(dir, struct{}{})
	return nil
}

// mkdirIn makes every directory below m.linkFree down to dir that is not
// there, one at a time, and checks every one that is: each is made
// (mkdirat) in the one above it as opened without following a symbolic
// link below linkFree (openDir), and then opened so itself: a policy's
// names, and a vllm-fs layout's, never leave the mount lexically
// (resolve, vllmfs.Layout.Path), and a link planted under the root (below
// vLLM's data directory), before or during the walk, must not take them
// out of it either. A link or a file in place of one of the directories
// fails it with ErrPolicy on a kvhost mount, ErrInvalid on a vllm-fs
// mount (openDir), and nothing is made where a link points. With Config.Fsync, each directory
// it makes is listed for syncNewDirs. The walk is made when mkdir first
// meets dir (and again once dir was found removed), not per file: two
// system calls and a close per directory.
func (c *dirCache) mkdirIn(m *mount, dir string) error {
	root := m.linkFree
	rel, err := filepath.Rel(root, dir)
	if err != nil || rel == ".." || strings.HasPrefix(rel, ".."+string(filepath.Separator)) {
		_, class := m.linkErr()
		return fmt.Errorf("%w: directory %s is not under %s", class, dir, root)
	}
	if rel == "." {
		return nil
	}
	at, err := m.openDir(c.fs, root)
	if err != nil {
		return err
	}
	defer func() { at.Close() }()
	p := root
	for _, name := range strings.Split(rel, string(filepath.Separator)) {
		p = filepath.Join(p, name)
		err := fsys.MkdirAt(c.fs, at, p, 0o755)
		switch {
		case err == nil:
			if c.fsync {
				c.unsynced.Store(p, struct{}{})
			}
		case !errors.Is(err, fs.ErrExist):
			return err
		}
		next, err := m.openDir(c.fs, p)
		if err != nil {
			return err
		}
		at.Close()
		at = next
	}
	return nil
}

// syncNewDirs fsyncs every directory from dir upwards that mkdir created
// and has not synced yet, and its parent (which holds its entry).
func (c *dirCache) syncNewDirs(dir string) error {
	synced := map[string]bool{}
	for d := dir; ; {
		p := filepath.Dir(d)
		if _, ok := c.unsynced.Load(d); ok {
			for _, s := range []string{d, p} {
				if synced[s] {
					continue
				}
				if err := c.fs.SyncDir(s); err != nil {
					return fmt.Errorf("fsync of new directory: %w", err)
				}
				synced[s] = true
			}
			c.unsynced.Delete(d)
		}
		if p == d {
			return nil
		}
		d = p
	}
}
