package engine

import (
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"

	"github.com/kvhost/kvhost/fsys"
)

// Spare owners (docs/engine.md, "Spare files").
//
// Several engines may share a memory mount's directory: one daemon per
// GPU of a node, each with its own socket, or a benchmark's second
// engine. Each keeps spares there, files no index holds. An engine that
// opens must remove the spares of engines that ended (a crashed one's
// would hold their pages forever) and keep those of engines still
// running, whose stores are about to write into them. Neither a spare's
// pid nor its node can tell which is which: a restarted container's
// daemon often has its predecessor's pid and host name. So each engine
// holds an owner file in the root of every mount it makes spares on,
// .owner-<node>-<pid>-<token>, flocked for its life, and names its spares
// .spare-<node>-<pid>-<token><random>. A spare is live exactly while its
// owner file exists and its flock is held: the kernel drops the flock
// when the process ends, however it ends. A spare without a token (named
// before owners) is removed, as every spare was then. An owner file is
// looked for in the root of the mount whose walk found the spare: engines
// whose mount roots nest on one file system (one on /dev/shm, another on
// /dev/shm/b) do not see each other's owners, and remove each other's
// spares as before.

// ownerPrefix names an engine's owner file (spare owners above).
const ownerPrefix = ".owner-"

// tokenLen is the length of an owner token in hex digits.
const tokenLen = 16

// newToken returns a fresh owner token.
func newToken() string {
	var b [tokenLen / 2]byte
	rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

// ownerName is the owner file's name for node, pid and token.
func ownerName(node string, pid int, token string) string {
	return ownerPrefix + node + "-" + strconv.Itoa(pid) + "-" + token
}

// ownerName is the name of this engine's owner files.
func (o *ownFiles) ownerName() string { return ownerName(o.node, os.Getpid(), o.token) }

// lockNode takes the node-local lock at path (lockNode), held until
// unlockNode.
func (o *ownFiles) lockNode(path string) error {
	lock, err := lockNode(o.fs, path)
	if err != nil {
		return err
	}
	o.lock = lock
	return nil
}

// unlockNode lets go of the node lock, if lockNode took it.
func (o *ownFiles) unlockNode() {
	if o.lock != nil {
		o.lock.Close() // releases the flock
	}
}

// openOwners makes and flocks this engine's owner file in the root of
// every mount it may keep spares on; closeOwners removes them. The file
// is made under a temporary name, locked, then renamed, so that no other
// engine's walk finds it unlocked. Where it cannot be made or locked the
// engine's spares are unprotected, as all spares were before owners:
// another engine's Open removes them, and a store that finds its spare
// gone writes a fresh file.
func (o *ownFiles) openOwners(mounts []*mount, eligible func(*mount) bool) {
	for _, m := range mounts {
		if eligible(m) {
			o.openOwner(m)
		}
	}
}

// openOwner makes and flocks this engine's owner file in m's root, as
// openOwners does; a mount Open found unwritable gets one once it takes
// files (tookFile). After closeOwners it removes the file it made.
//
// The mount's directory may be shared (another engine's, another
// node's, a user's), so the file is made, renamed and later removed
// never through a symbolic link: created with openNoLinks (a link in
// place of the root, or of a directory above it, since Open resolved its
// path fails the create with ELOOP), renamed into place relative to the
// root opened so (openDir), and removed as a data file is (removeFile:
// the name must still be this file). A link found refuses the owner file
// with a warning naming the path; the engine's spares are then
// unprotected, as where the file cannot be made.
func (o *ownFiles) openOwner(m *mount) {
	path := filepath.Join(m.root, o.ownerName())
	f, err := o.makeOwner(m, path)
	if err != nil {
		o.log.Warn("engine: no spare owner file: another engine opening on the mount removes this one's spares", "mount", m.root, "err", err)
		return
	}
	of := ownerFile{m: m, path: path, f: f}
	o.mu.Lock()
	done := o.done
	if !done {
		o.owners = append(o.owners, of)
	}
	o.mu.Unlock()
	if done {
		of.close(o) // the engine closed meanwhile
	}
}

// makeOwner makes the owner file at path in m's root (openOwner): under
// a temporary name, locked, then renamed, so that no other engine's walk
// finds it unlocked; nothing is left behind where it fails.
func (o *ownFiles) makeOwner(m *mount, path string) (fsys.File, error) {
	tmp := o.tempName(m.root, tmpPrefix)
	f, err := m.openNoLinks(o.fs, tmp, os.O_RDWR|os.O_CREATE|os.O_EXCL, 0o644)
	if errors.Is(err, syscall.ELOOP) {
		return nil, fmt.Errorf("engine: owner file %s: the mount's root, or a directory above it, is a symbolic link: kvhost makes no file through it: %w", tmp, err)
	}
	if err != nil {
		return nil, err
	}
	// Waiting: another engine's walk may hold the new file's flock a
	// moment to check it (cleanTemp), and lets it go.
	err = fsys.Lock(f)
	if err == nil {
		var dir fsys.File
		if dir, err = m.openDir(o.fs, m.root); err == nil {
			err = fsys.RenameAt(o.fs, dir, tmp, dir, path, false)
			dir.Close()
		}
	}
	if err != nil {
		id, _ := fileIdentity(f)
		if rerr := o.rm.removeFile(m, tmp, id); rerr != nil {
			o.log.Warn("engine: remove a temporary file", "path", tmp, "err", rerr)
		}
		f.Close()
		return nil, err
	}
	return f, nil
}

// ownerFile is an owner file this engine holds.
type ownerFile struct {
	m    *mount
	path string
	f    fsys.File
}

// closeOwners removes this engine's owner files and releases their
// flocks: its spares are then anyone's to remove.
func (o *ownFiles) closeOwners() {
	o.mu.Lock()
	o.done = true
	owners := o.owners
	o.owners = nil
	o.mu.Unlock()
	for _, of := range owners {
		of.close(o)
	}
}

// close removes the owner file and releases its flock. It removes the
// file as a data file is removed (removeFile): relative to the root
// opened without following a link, and only where the name still holds
// this file; a link in place of the root is refused, and nothing where
// it points is removed.
func (of ownerFile) close(o *ownFiles) {
	id, _ := fileIdentity(of.f)
	if err := o.rm.removeFile(of.m, of.path, id); err != nil {
		o.log.Warn("engine: remove the spare owner file", "path", of.path, "err", err)
	}
	of.f.Close()
}

// liveOwners remembers, during Open's walk of the mounts, which owner
// files are held by a running engine.
type liveOwners struct {
	mu   sync.Mutex
	live map[string]bool // owner file path → held
}

// spareLive reports whether the spare named .spare-<rest> on the mount
// m belongs to an engine still running: its name has an
// owner token, and that owner's file in root is flocked.
func (o *ownFiles) spareLive(lo *liveOwners, m *mount, rest string) bool {
	node, pid, ok := tempOwner(rest)
	if !ok {
		return false
	}
	suffix := rest[strings.LastIndexByte(rest, '-')+1:]
	if len(suffix) != 2*tokenLen {
		return false // named before owners
	}
	return lo.held(o, m, filepath.Join(m.root, ownerName(node, pid, suffix[:tokenLen])))
}

// held reports whether the owner file at path, in m's root, is held by
// a running engine (ownerHeld), asking each path once.
func (lo *liveOwners) held(o *ownFiles, m *mount, path string) bool {
	lo.mu.Lock()
	defer lo.mu.Unlock()
	if held, ok := lo.live[path]; ok {
		return held
	}
	held := o.ownerHeld(m, path)
	if lo.live == nil {
		lo.live = map[string]bool{}
	}
	lo.live[path] = held
	return held
}

// ownerHeld reports whether the owner file at path (in m's root) exists and another
// open of it holds its flock: another engine's, in this process or
// another, this engine's own included (flocks conflict between open
// file descriptions of one process). Where that cannot be told (the
// flock fails) it reports held: a live engine's spares are worth more
// than a dead one's room. While it checks a dead owner's file it holds
// that file's flock a moment, so a second engine opening at the same
// instant may keep the dead spares, for the next Open to remove.
func (o *ownFiles) ownerHeld(m *mount, path string) bool {
	// O_NONBLOCK: a FIFO planted under the name must not stall Open.
	// Never through a link (openNoLinks): a root replaced by one since
	// Open would have the flock taken on a file elsewhere.
	f, err := fsys.OpenToLock(o.fs, m.noLinksPath(path), syscall.O_NONBLOCK|fsys.ONoLinks, 0)
	if err != nil {
		return false
	}
	defer f.Close() // releases the flock taken below, if any
	free, err := fsys.TryLock(f)
	if err != nil {
		o.log.Warn("engine: flock a spare owner file: its spares are kept", "path", path, "err", err)
		return true
	}
	return !free
}
