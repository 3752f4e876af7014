package engine

import (
	"errors"
	"fmt"
	"syscall"
	"time"

	"github.com/kvhost/kvhost/internal/engine/space"
)

// mountFault reports whether err, the failure of a store's file on its
// mount, is the mount's own: ErrNoSpace (no room after evicting what could
// be), or a file system's error about itself from a file operation. A cancelled job, a
// fault in the client's memory, the policy's or a GPU's failure are not.
func mountFault(err error) bool {
	if errors.Is(err, ErrNoSpace) {
		return true
	}
	var errno syscall.Errno
	if !errors.As(err, &errno) {
		return false
	}
	// The errors a file system returns for itself: the mount, not the
	// request, is what fails (RATIONALE.md, "Why does a mount's refusal
	// of stores count only the mount's own errors?").
	switch errno {
	case syscall.EROFS, // mounted (or remounted, after an error) read-only
		syscall.EIO,       // the device or the server failed the I/O
		syscall.EACCES,    // the daemon's user may not create files there
		syscall.EPERM,     // likewise (an immutable directory, an LSM's refusal)
		syscall.ENOSPC,    // full, from outside (kvhost's own files were evicted first)
		syscall.EDQUOT,    // the daemon's user's quota
		syscall.ESTALE,    // an NFS handle the server no longer knows
		syscall.ENOTCONN,  // a FUSE or network file system whose server left
		syscall.ENODEV,    // the device went away
		syscall.ENXIO,     // likewise
		syscall.EREMOTEIO, // a remote I/O error
		syscall.EUCLEAN,   // a corrupt file system (ext4, XFS)
		syscall.ETIMEDOUT: // a network file system that does not answer
		return true
	}
	return false
}

// refuse starts m's StoreFailure, or extends the one it has, with a
// failure of text why (room: for lack of room for a file of that many
// bytes; 0 for another reason), adding stores to its count.
func (m *mount) refuse(why string, room int64, stores uint64, now time.Time) {
	for {
		old := m.failing.Load()
		f := &StoreFailure{Since: now, Last: now, Stores: stores, Err: why, room: room}
		if old != nil {
			f.Since, f.Stores = old.Since, old.Stores+stores
		}
		if m.failing.CompareAndSwap(old, f) {
			return
		}
	}
}

// storeFailure is a copy of m's StoreFailure, or nil.
func (m *mount) storeFailure() *StoreFailure {
	f := m.failing.Load()
	if f == nil {
		return nil
	}
	c := *f
	return &c
}

const (
	// reprobeAfter is how long a mount's refusal of stores stands, since
	// its latest failure and since the mount's last probe, before
	// reprobe probes the mount.
	reprobeAfter = 30 * time.Second
	// reprobeTick is how often the tier driver looks for mounts to probe.
	reprobeTick = time.Second
	// probeBytes is the size of a probe's file.
	probeBytes = 4096
)

// storeEnded records how the store of one file of size bytes on m ended
// (storeFile, and the copy of a move to m: copyFile):
// a success ends the mount's StoreFailure, a failure of the mount's own
// (mountFault) starts or extends it, and any other failure leaves it as
// it is. A success is also a file made on m (tookFile). A success costs
// two atomic loads while the mount stores (and a swap where it ends a
// failure); the clock is read only for a failure.
func (mw *mountWatch) storeEnded(m *mount, size int64, err error) {
	if err == nil {
		if f := m.failing.Load(); f != nil {
			m.failing.CompareAndSwap(f, nil) // a newer failure stays
		}
		mw.tookFile(m)
		return
	}
	if !mountFault(err) {
		return
	}
	var room int64
	if errors.Is(err, ErrNoSpace) || errors.Is(err, syscall.ENOSPC) || errors.Is(err, syscall.EDQUOT) {
		room = max(size, 1)
	}
	m.refuse(err.Error(), room, 1, mw.now())
}

// reprobe ends the refusal of stores of each mount where it has stood
// for reprobeAfter since its latest failure and since the mount's last
// probe, if the mount takes a file again (takesFiles). Without it a
// mount that no store or move reaches (a cold tier while nothing is
// demoted, an idle daemon) would report its refusal for ever once the
// operator has mended it (RATIONALE.md, "Why does the engine probe a
// mount that refuses stores?"). Only the tier driver calls it.
func (mw *mountWatch) reprobe() {
	now := mw.now()
	for _, m := range mw.mounts {
		f := m.failing.Load()
		if f == nil || now.Sub(f.Last) < reprobeAfter || now.Sub(m.probed) < reprobeAfter {
			continue
		}
		var err error
		if !m.ifNotEvicting(func() {
			m.probed = now
			err = mw.takesFiles(m, f.room)
		}) {
			continue // an eviction runs there: a store's outcome is on its way
		}
		if err != nil {
			mw.log.Debug("engine: the mount still refuses stores", "mount", m.root, "err", err)
			continue
		}
		mw.tookFile(m)
		if m.failing.CompareAndSwap(f, nil) { // a newer failure stays
			mw.log.Info("engine: the mount takes stores again", "mount", m.root, "refused_since", f.Since, "stores_failed", f.Stores)
		}
	}
}

// takesFiles returns nil where a file can be made on m again, as Open's
// probe makes one: created, written and removed in its root; with room
// (a refusal for lack of room for a file of room bytes), m must also have
// room for such a file below its high watermark, its capacity refreshed
// from statfs first, and, on a cluster mount, this node room for it
// within the cluster's bound as last read: a store of the size that
// failed fails for lack of either, and the probe's own small file may
// fit where it does not. Else it returns why not.
func (mw *mountWatch) takesFiles(m *mount, room int64) error {
	f, tmp, op, err := mw.own.createFile(m, m.root, probePrefix, 0, probeBytes)
	if err != nil {
		return fmt.Errorf("engine: probe %s: %s: %w", m.root, op, err)
	}
	_, err = f.WriteAt(make([]byte, probeBytes), 0)
	if err == nil && room > probeBytes {
		// The file system's own refusal (ENOSPC, a quota's EDQUOT),
		// which statfs may not show: allocate the size that failed.
		err = f.Allocate(room)
	}
	mw.rm.removeTemp(m, tmp, f, probeBytes)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return fmt.Errorf("engine: probe %s: write: %w", m.root, err)
	}
	if room <= 0 {
		return nil
	}
	mw.refreshCapacity(m, true)
	if !mw.space.Fits(m.sp, room, space.High) {
		used, capacity := mw.space.Usage(m.sp)
		return fmt.Errorf("%w: mount %s: %d of %d bytes used, no room for %d below the high watermark", ErrNoSpace, m.root, used, capacity, room)
	}
	if c := m.cluster; c != nil && !c.FitsBound(room) {
		return fmt.Errorf("%w: mount %s: no room for %d bytes of this node's within the cluster's capacity of %d", ErrNoSpace, m.root, room, c.Capacity())
	}
	return nil
}
