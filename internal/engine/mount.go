package engine

import (
	"errors"
	"fmt"
	"github.com/kvhost/kvhost/internal/iotune"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kvhost/kvhost/fsys"
	"github.com/kvhost/kvhost/internal/engine/space"
	"github.com/kvhost/kvhost/internal/fstype"
	"github.com/kvhost/kvhost/region"
	"github.com/kvhost/kvhost/transfer"
)

// mount is one storage root: its configuration, fixed at Open, and its
// room (sp: package space, under its lock).
type mount struct {
	idx    int
	root   string
	sp     *mountSpace
	direct bool
	// mountFS is what Open found of the mount's file system.
	mountFS
	checksums bool // payload checksums on this mount (Mount.NoChecksum, the mover)
	// checkEvery: every load verifies its checksums, even of layers
	// checked before (Mount.ChecksumEveryLoad).
	checkEvery bool
	// readers bounds the files loads read at once from the mount
	// (Mount.LoadReaders); nil on a memory file system, whose loads
	// are bounded by the file slots only.
	readers *iotune.Gate
	backend string // the host mover's name
	movers  map[region.Kind]transfer.Mover
	ioWhy   string     // how the I/O mode was chosen
	raw     *rawLayout // a vllm-fs mount; nil for kvhost's layout
	// evictMu is held by the eviction on the mount (and a store's retry
	// after ENOSPC); the first of the engine's locks, taken in mount
	// order (demoteVictim). Only capacity.go takes it (withEvictLock,
	// ifNotEvicting for others).
	evictMu sync.Mutex
	// heldIdle is when the last round of demoteHeld on the mount moved
	// no file, or zero; evictMu guards it.
	heldIdle time.Time
	cluster  *clusterMount // Mount.ClusterCapacity's state (cluster.go); nil without
	// desc is the file system and device class found at Open
	// (describeMount), what a tiering policy is told.
	desc mountDesc
	// unwritable is why Open found that no file can be made on the mount
	// (syscall.EROFS: a read-only file system; the O_DIRECT probe's
	// EACCES or EPERM: a directory the daemon's user may not write);
	// nil where it found none. Only Open reads it: spareless says, after
	// Open, whether the mount still keeps no spares for it.
	unwritable error
	// spareless: Open found the mount unwritable, and no file has been
	// made there since. Such a mount keeps no spares; the first file made
	// there (tookFile) clears it.
	spareless atomic.Bool
	// linkFree is the directory below which no directory of a data
	// file's name, nor the name itself, may be a symbolic link
	// (openNoLinks, openDir, mkdirIn): the root of a kvhost mount; the
	// data directory (<base>_r<rank>, set by openLayout) of a vllm-fs
	// mount, whose root and data directory the operator sets up, while
	// the directories below it are made by vLLM, or by anyone who can
	// write the shared directory. realLinkFree is linkFree with the
	// symbolic links of its own path resolved (at Open): the prefix
	// under which openNoLinks refuses every link.
	linkFree, realLinkFree string
	// plainRenames: the file system refused RENAME_NOREPLACE, so
	// publishing a new file looks at its path before a plain rename
	// (renameNew).
	plainRenames atomic.Bool
	// mending: a tookFile is clearing spareless (the first only).
	mending atomic.Bool
	// failing is the mount's refusal of stores (StoreFailure, never
	// changed once stored); nil while its stores succeed (mountfail.go).
	failing atomic.Pointer[StoreFailure]
	// probed is when reprobe last probed the mount (the tier driver's).
	probed time.Time
}

// mountFS is what Open found of a mount's file system, fixed after Open.
type mountFS struct {
	// memory: a memory file system (tmpfs). With it, and with buffered
	// I/O, checksums are computed inline in small chunks, in cache; with
	// O_DIRECT to a device they overlap the next transfer instead.
	memory bool
	// network: a file system other nodes may share (fstype.Kind.Network);
	// removalStales: one where a file another client removes is gone
	// under this node's open descriptors (NFS). Together with cluster
	// they say which files a client pin holds open (othersRemove).
	network, removalStales bool
	// folio is the size of the page-cache folios writes allocate where
	// larger than a page (a tmpfs with huge pages), else 0
	// (transfer.Plan.Folio).
	folio int64
	// syncFirst: a buffered mount of a file system whose clients send a
	// rename before the data written (fstype.Kind.CloseToOpen: NFS).
	// Files are fsynced before their rename (publish) whatever
	// Config.Fsync says, so that no other node sees one short.
	syncFirst bool
}

// maxRootDepth bounds the walk up from a mount's root (checkDisjoint).
const maxRootDepth = 1024

// MountsDisjoint returns the error Open returns, wrapping ErrInvalid,
// where the roots a and b (existing directories) of two mounts of
// kvhost's layout are one directory or one lies inside the other,
// through whatever names (symbolic links, bind mounts); nil where they
// are disjoint. `kvhost check` asks it of a configuration before a
// daemon is started on it.
func MountsDisjoint(a, b string) error { return checkDisjoint(fsys.OS{}, a, b) }

// checkDisjoint returns an error wrapping ErrInvalid where the kvhost
// mounts' roots a and b (absolute, existing) are one directory, or one
// lies inside the other, through whatever names: the rebuild takes every
// file under a kvhost mount's root, so the inner mount's files would be
// indexed twice, and the copy it removes as a move's leftover (dedupe)
// would be the file itself. Directories are compared by device and inode,
// and each root's ancestors are found through "..", which the kernel
// resolves to the real parent whatever symbolic links or bind mounts
// named the root.
func checkDisjoint(fs fsys.FS, a, b string) error {
	dirID := func(p string) (fsys.FileID, error) {
		fi, err := fs.Stat(p)
		if err != nil {
			return fsys.FileID{}, err
		}
		id, err := fsys.IdentityOf(fi)
		return id.FileID, err
	}
	// inside reports whether dir (of identity id) is, or is within, the
	// directory of identity of. Its path grows by "/.." at each step:
	// filepath.Join would take them away lexically.
	inside := func(dir string, id, of fsys.FileID) (bool, error) {
		for range maxRootDepth {
			if id == of {
				return true, nil
			}
			dir += "/.."
			up, err := dirID(dir)
			if err != nil {
				return false, err
			}
			if up == id {
				return false, nil // the root of the file-system tree
			}
			id = up
		}
		return false, nil
	}
	ia, err := dirID(a)
	if err != nil {
		return fmt.Errorf("engine: mount %s: %w", a, err)
	}
	ib, err := dirID(b)
	if err != nil {
		return fmt.Errorf("engine: mount %s: %w", b, err)
	}
	for _, c := range []struct {
		dir    string
		id, of fsys.FileID
	}{{a, ia, ib}, {b, ib, ia}} {
		in, err := inside(c.dir, c.id, c.of)
		if err != nil {
			return fmt.Errorf("engine: mounts %s and %s: %w", a, b, err)
		}
		if in {
			return fmt.Errorf("%w: mounts %s and %s overlap (one directory, or one inside the other): the files of the inner one would be indexed twice", ErrInvalid, a, b)
		}
	}
	return nil
}

func (m *mount) ioName() string {
	if m.direct {
		return "direct"
	}
	return "buffered"
}

// IO modes of Mount.IO.
const (
	IOAuto     = "auto"     // probe: O_DIRECT where the file system takes it
	IODirect   = "direct"   // O_DIRECT; Open fails if the file system refuses it
	IOBuffered = "buffered" // the page cache
)

func (e *Engine) openMount(i int, m Mount) (*mount, error) {
	if m.Path == "" {
		return nil, fmt.Errorf("%w: mount %d: empty path", ErrInvalid, i)
	}
	root, err := filepath.Abs(m.Path)
	if err != nil {
		return nil, fmt.Errorf("%w: mount %d: %w", ErrInvalid, i, err)
	}
	high, low := m.HighWatermark, m.LowWatermark
	if high == 0 {
		high = 0.95
	}
	if low == 0 {
		low = min(0.85, high)
	}
	if high <= 0 || high > 1 || low <= 0 || low > high || m.Capacity < 0 || m.Reserve < 0 {
		return nil, fmt.Errorf("%w: mount %s: capacity %d, reserve %d, watermarks high %v low %v: want capacity and reserve >= 0, 0 < low <= high <= 1", ErrInvalid, root, m.Capacity, m.Reserve, high, low)
	}
	if m.Preallocate < 0 && m.Preallocate != PreallocateAuto {
		return nil, fmt.Errorf("%w: mount %s: preallocate %d: want >= 0 (or PreallocateAuto)", ErrInvalid, root, m.Preallocate)
	}
	io := m.IO
	if io == "" {
		io = IOAuto
	}
	if m.NoDirect {
		io = IOBuffered
	}
	if io != IOAuto && io != IODirect && io != IOBuffered {
		return nil, fmt.Errorf("%w: mount %s: io %q: want %q, %q or %q", ErrInvalid, root, m.IO, IOAuto, IODirect, IOBuffered)
	}
	if err := e.own.dirs.mkdir(nil, root, true); err != nil {
		return nil, fmt.Errorf("engine: mount %s: %w", root, err)
	}
	st, err := e.fs.Statfs(root)
	if err != nil {
		return nil, fmt.Errorf("engine: mount %s: %w", root, err)
	}
	switch k, _ := fstype.Of(st.Type); {
	case k.MapOnly:
		return nil, fmt.Errorf("%w: mount %s: %s: its files cannot be written with write(2), only through mappings, and kvhost writes with pwrite; for files in huge pages use a tmpfs mounted with huge=within_size", ErrInvalid, root, k.Name)
	case k.Kernel:
		// Before the index rebuild, which would walk the kernel's tree.
		return nil, fmt.Errorf("%w: mount %s: %s is a kernel interface, not a file system that keeps files; name a directory on a disk or a tmpfs", ErrInvalid, root, k.Name)
	}
	if st.Total == 0 && m.Capacity == 0 {
		return nil, fmt.Errorf("%w: mount %s: the file system (%s) reports no size (statfs: 0 blocks), so the mount needs a configured capacity", ErrInvalid, root, fstype.Name(st.Type))
	}
	// The links of the root's own path are the configuration's (a
	// /var/run that is /run): resolved once, so that only a link below
	// the root fails an open of a policy's name (openNoLinks).
	realRoot, err := filepath.EvalSymlinks(root)
	if err != nil {
		return nil, fmt.Errorf("engine: mount %s: %w", root, err)
	}
	mt := &mount{
		idx: i, root: root, linkFree: root, realLinkFree: realRoot, mountFS: mountFS{memory: isMemoryFS(st.Type)}, checksums: !m.NoChecksum && !e.cfg.NoChecksum, checkEvery: m.ChecksumEveryLoad,
		sp: space.NewMount(space.MountConfig{Index: i, Root: root, Configured: m.Capacity, Derived: m.CapacityDerived, Reserve: m.Reserve, High: high, Low: low, Ahead: m.Preallocate}, st),
	}
	if st.ReadOnly {
		mt.unwritable = syscall.EROFS
	}
	switch {
	case io == IOBuffered:
		mt.ioWhy = "buffered by config"
	case mt.unwritable != nil:
		// No file can be made to probe with, and no store writes there:
		// reportMounts says so, once.
		mt.direct, mt.ioWhy = io == IODirect, "not probed: the file system is read-only"
	default:
		// The probe creates, writes and removes a small file. It must never
		// stop a start (a full file system, a read-only one that still
		// serves what it holds): a failure is buffered I/O and a log line.
		// Never through a symbolic link (the mount's directory may be
		// shared, and the root renamed away and replaced by a link since
		// its path was resolved above): made with openat2
		// RESOLVE_NO_SYMLINKS from the resolved root (openNoLinks),
		// removed relative to the root opened so (removeFile).
		probe := e.own.tempName(root, probePrefix)
		direct, made, err := fsys.ProbeDirectFile(e.fs, mt.noLinksPath(probe), fsys.ONoLinks)
		if errors.Is(err, syscall.EROFS) || errors.Is(err, syscall.EACCES) || errors.Is(err, syscall.EPERM) {
			mt.unwritable = err // no file made; reportMounts says so, once
		}
		if errors.Is(err, syscall.ELOOP) {
			err = fmt.Errorf("%s, or a directory above it, is a symbolic link since Open resolved the mount's path: kvhost makes no file through it: %w", root, err)
		}
		// The probe's file, also the one a file system without direct
		// I/O makes before it fails the open with EINVAL.
		if made {
			if rerr := e.rm.removeFile(mt, probe, fsys.Identity{}); rerr != nil && mt.unwritable == nil {
				e.cfg.Logger.Warn("engine: remove the O_DIRECT probe's file", "path", probe, "err", rerr)
			}
		}
		switch {
		case err != nil && io == IODirect:
			mt.direct, mt.ioWhy = true, "direct by config (the probe failed: "+err.Error()+")"
		case mt.unwritable != nil:
			mt.ioWhy = "buffered: the O_DIRECT probe could not make a file: " + err.Error()
		case err != nil:
			mt.ioWhy = "buffered: the O_DIRECT probe failed: " + err.Error()
			e.cfg.Logger.Warn("engine: O_DIRECT probe failed; buffered I/O on the mount", "mount", root, "err", err)
		case !direct && io == IODirect:
			return nil, fmt.Errorf("%w: mount %s: io = %q, but the file system refuses O_DIRECT", ErrInvalid, root, IODirect)
		case !direct:
			mt.ioWhy = "buffered: the file system refuses O_DIRECT"
		case io == IODirect:
			mt.direct, mt.ioWhy = true, "direct by config"
		default:
			mt.direct, mt.ioWhy = true, "direct: probed"
		}
	}
	mt.spareless.Store(mt.unwritable != nil)
	k, _ := fstype.Of(st.Type)
	mt.network, mt.removalStales = k.Network, k.RemovalStales
	if !mt.memory {
		// A local disk read with O_DIRECT by choice (io = "auto") may
		// have its loads read through the page cache where that is faster
		// (loadFile drops the pages after). A network file system's
		// page cache may hold another node's old bytes: never there.
		// Such a disk's tuned loads start buffered, as llm-d's and
		// LMCache's disk reads are, and tuning tries O_DIRECT from there
		// (RATIONALE.md, "Why do a local disk's loads start buffered?").
		n := e.cfg.IOWorkers
		if m.LoadReaders > 0 {
			n = min(m.LoadReaders, n)
		}
		modes := mt.direct && io == IOAuto && !mt.network
		mt.readers = iotune.New(iotune.Config{Max: n, Fixed: m.LoadReaders > 0,
			Buffered: !mt.direct || modes && m.LoadReaders == 0, Modes: modes, Now: e.cfg.Now})
	}
	if k.CloseToOpen && !mt.direct {
		// With O_DIRECT every write reaches the server before it returns.
		mt.syncFirst = true
	}
	if mt.memory {
		folio, err := fstype.LargeFolioOf(root)
		if err != nil {
			// Small folios: stores cut as on any tmpfs, still correct,
			// but slower on huge pages the kernel gives unseen.
			e.cfg.Logger.Info("engine: the mount's huge pages are unknown; stores write as on small pages", "mount", root, "err", err)
		}
		mt.folio = folio
	}
	return mt, nil
}

// machineMemory is configured, or else MachineMemory.
func machineMemory(configured int64) int64 {
	if configured > 0 {
		return configured
	}
	return MachineMemory()
}

// MachineMemory is the machine's memory in bytes as the kernel reports it
// (sysinfo), or 0 if it cannot.
func MachineMemory() int64 {
	var si unix.Sysinfo_t
	if unix.Sysinfo(&si) != nil {
		return 0
	}
	return int64(si.Totalram) * int64(si.Unit)
}

// isMemoryFS reports whether file system magic is a memory file system.
func isMemoryFS(magic int64) bool {
	k, _ := fstype.Of(magic)
	return k.Memory
}

// openNoLinks opens path, a file or directory under m's linkFree
// directory (that directory included), with flag, never through a
// symbolic link below it (fsys.ONoLinks, from m.realLinkFree): a link
// planted in the mount (in vLLM's shared directory, below its data
// directory), where a directory of a file's name was or will be, or at
// the name itself, fails the open with ELOOP. Every open that may make a
// file there (a store's temporary file), or read one that was not this
// engine's (a file found under a policy's name or a vllm-fs row's, a
// load's file that another replaced), and every directory the engine
// removes, renames or makes names in (openDir), goes through it, so that
// kvhost neither writes outside its mount nor serves or indexes, and
// later removes, a file outside it.
func (hr *headerReader) openNoLinks(m *mount, path string, flag int, perm os.FileMode) (fsys.File, error) {
	return m.openNoLinks(hr.fs, path, flag, perm)
}

// openNoLinks is headerReader.openNoLinks through fs.
func (m *mount) openNoLinks(fs fsys.FS, path string, flag int, perm os.FileMode) (fsys.File, error) {
	return fs.OpenFile(m.noLinksPath(path), flag|fsys.ONoLinks, perm)
}

// noLinksPath is path, under m's linkFree directory, as an open with
// fsys.ONoLinks takes it (openNoLinks): from m.realLinkFree, the
// directory's own links resolved at Open.
func (m *mount) noLinksPath(path string) string {
	if rel, ok := m.belowLinkFree(path); ok && m.realLinkFree != m.linkFree {
		return m.realLinkFree + rel
	}
	return path
}

// belowLinkFree reports whether path is m's linkFree directory or a name
// below it, with the rest of path after it ("" or a separator first).
func (m *mount) belowLinkFree(path string) (string, bool) {
	rel, ok := strings.CutPrefix(path, m.linkFree)
	if !ok || rel != "" && !strings.HasPrefix(rel, string(filepath.Separator)) {
		return "", false
	}
	return rel, true
}

// openDir opens dir, a directory under m's linkFree directory (that
// directory included), for the calls relative to it that remove, rename
// and make names there (fsys.AtFS): O_PATH, never through a symbolic link
// below linkFree (openNoLinks). A link or a file where a directory of dir
// should be fails it with an error that wraps the system's ELOOP or
// ENOTDIR and linkErr's class: ErrPolicy on a kvhost mount (a directory
// of the policy's name), ErrInvalid on a vllm-fs mount (a directory of
// vLLM's layout). Where a directory of a name is replaced by a link after
// this open, what is done relative to the descriptor stays in the
// directory opened: never where the link points.
func (hr *headerReader) openDir(m *mount, dir string) (fsys.File, error) {
	return m.openDir(hr.fs, dir)
}

// openDir is headerReader.openDir through fs.
func (m *mount) openDir(fs fsys.FS, dir string) (fsys.File, error) {
	d, err := m.openNoLinks(fs, dir, unix.O_PATH|unix.O_DIRECTORY, 0)
	if errors.Is(err, syscall.ELOOP) || errors.Is(err, syscall.ENOTDIR) {
		what, class := m.linkErr()
		return nil, fmt.Errorf("%w: %s, %s, or a directory above it in the mount, is a symbolic link or not a directory: kvhost writes, reads and removes no file through it: %w", class, dir, what, err)
	}
	return d, err
}

// linkErr names a directory of a data file's name on m, and gives the
// class of the error where a symbolic link (or a file) is found in its
// place: ErrPolicy on a kvhost mount, whose policy names the directories;
// ErrInvalid on a vllm-fs mount, whose layout (vLLM's) does: the
// directory is misplaced, and no policy named it.
func (m *mount) linkErr() (what string, class error) {
	if m.raw != nil {
		return "a directory of vLLM's layout", ErrInvalid
	}
	return "a directory of the policy's name", ErrPolicy
}

// isLinkRefusal reports whether err is openDir's (or mkdirIn's) refusal
// of a link or a file where a directory should be.
func isLinkRefusal(err error) bool {
	return (errors.Is(err, ErrPolicy) || errors.Is(err, ErrInvalid)) && (errors.Is(err, syscall.ELOOP) || errors.Is(err, syscall.ENOTDIR))
}

// mountWatch watches the mounts: their capacity from statfs
// (refreshCapacity), whether they keep spares (spareEligible), their
// refusal of stores and the probes that end it (storeEnded, reprobe:
// mountfail.go), and Open's report of them (reportMounts).
type mountWatch struct {
	mounts  []*mount // set as Open adds them
	cfg     []Mount  // Config.Mounts
	noReuse bool     // Config.NoReuse
	fsync   bool     // Config.Fsync
	memory  int64    // the machine's memory (Config.Memory)
	fs      fsys.FS
	log     *slog.Logger
	now     func() time.Time
	space   *space.Space
	own     *ownFiles // the owner files of mounts that take files late; the probes' files
	rm      *remover  // the probes' removal
}

// refreshCapacity recomputes m's capacity from statfs, at most once per
// second unless force (after an ENOSPC): other writers on the file system
// (other nodes of a shared mount, other programs) change what it can hold.
func (mw *mountWatch) refreshCapacity(m *mount, force bool) {
	mw.refreshCapacityLess(m, force, 0)
}

// refreshCapacityLess is refreshCapacity where notOnDisk bytes of the
// mount's used hold nothing on the file system (Space.Refresh).
func (mw *mountWatch) refreshCapacityLess(m *mount, force bool, notOnDisk int64) {
	if !mw.space.RefreshDue(m.sp, mw.now(), force) {
		return
	}
	st, err := mw.fs.Statfs(m.root)
	if err != nil {
		mw.log.Warn("engine: statfs", "mount", m.root, "err", err)
		return
	}
	mw.space.Refresh(m.sp, st, notOnDisk)
}

// reportMounts describes each mount (describeMount: its file system and
// the device class a tiering policy is told) and logs, once at Open, that
// description, its capacity, I/O mode, backend and checksums, and warns
// where the configured capacity is more than the file system can hold.
func (mw *mountWatch) reportMounts() {
	for i, m := range mw.mounts {
		m.desc = describeMount(mw.fs, mw.log, m, mw.cfg[i].DeviceClass)
		mw.refreshCapacity(m, true)
		used, capacity := mw.space.Usage(m.sp)
		// The budget is settled once, from the capacity at Open: 0 where
		// the mount keeps no spares, so that an Ahead above 0 alone says
		// it makes them ahead (ahead.go).
		ahead, files, most := m.sp.Ahead()
		auto := ahead == PreallocateAuto
		switch {
		case !mw.spareEligible(m):
			if ahead > 0 && m.unwritable == nil {
				mw.log.Warn("engine: preallocate has no effect on this mount: spare files are kept only on memory file systems in kvhost's layout, with reuse_files on and no cluster_capacity",
					"mount", m.root, "preallocate", ahead)
			}
			ahead = 0
		case auto:
			ahead, files = AutoPreallocate(capacity, mw.memory), MaxAutoSpareFiles
			most = AutoPreallocateMax(capacity, mw.memory)
		}
		mw.space.SetAhead(m.sp, ahead, files, most)
		configured, reserve, derived := m.sp.Configured()
		fsName, from := m.desc.fsName, "detected"
		if fsName == "" {
			fsName = "unknown"
		}
		if m.desc.configured {
			from = "configured"
		}
		mw.log.Info("engine: mount", "mount", m.root, "device_class", className(m.desc.class), "device_class_from", from,
			"fs", fsName, "fs_magic", fmt.Sprintf("%#x", m.desc.fsType), "direct_io", m.direct, "io", m.ioName(), "why", m.ioWhy, "backend", m.backend,
			"checksums", m.checksums, "fsync_before_rename", mw.fsync || m.syncFirst, "large_folio", m.folio, "capacity", capacity, "used", used, "reserve", reserve, "preallocate", ahead, "preallocate_auto", auto, "preallocate_max", max(ahead, most))
		switch {
		case mw.warnRefusing(m, fsName, capacity):
		case configured > capacity && !derived:
			mw.log.Warn("engine: the configured capacity is more than the file system can hold; using what it can hold",
				"mount", m.root, "configured", configured, "effective", capacity, "reserve", reserve)
		}
	}
}

// warnRefusing logs, where Open found that every store on m will fail —
// a read-only file system, a directory the daemon's user may not write,
// no room at all (capacity 0) — one warning naming the mount, why and what
// to do, starts m's refusal of stores (StoreFailure, no store counted) and
// reports true; else it reports false.
func (mw *mountWatch) warnRefusing(m *mount, fsName string, capacity int64) bool {
	const loads = "; the files on it are still loaded"
	var why string
	var room int64 // Open's finding: no room for any file
	switch {
	case errors.Is(m.unwritable, syscall.EROFS):
		why = "read-only file system"
		mw.log.Warn("engine: the mount is on a read-only file system: every store there fails"+loads,
			"mount", m.root, "fs", fsName, "fix", "remount it read-write (mount -o remount,rw), or name a directory on a writable file system")
	case m.unwritable != nil:
		why = "cannot make files: " + m.unwritable.Error()
		mw.log.Warn("engine: the daemon's user cannot make files on the mount: every store there fails"+loads,
			"mount", m.root, "fs", fsName, "err", m.unwritable, "fix", "give the daemon's user write access to the directory (chown, or run the daemon as its owner)")
	case capacity <= 0:
		var avail int64
		if st, err := mw.fs.Statfs(m.root); err == nil {
			avail = st.Avail
		}
		configured, reserve, _ := m.sp.Configured()
		room = probeBytes
		why = fmt.Sprintf("no room: the file system has %d bytes available, the mount's reserve is %d", avail, reserve)
		mw.log.Warn("engine: the mount has no room: every store there fails until it has"+loads,
			"mount", m.root, "fs", fsName, "fs_available", avail, "reserve", reserve, "configured", configured,
			"fix", noRoomFix)
	default:
		return false
	}
	m.refuse(why+" (found at start)", room, 0, mw.now())
	return true
}

// spareEligible reports whether m keeps evicted files as spares (not on
// a mount Open found unwritable while no file has been made there since:
// no spare could be made there).
func (mw *mountWatch) spareEligible(m *mount) bool {
	return mw.spareCapable(m) && !m.spareless.Load()
}

// spareCapable reports whether m may keep spares once it takes files: a
// memory mount in kvhost's layout, with reuse on, and no cluster capacity
// (no node's summary would count its spares against the bound).
func (mw *mountWatch) spareCapable(m *mount) bool {
	return m.memory && m.raw == nil && !mw.noReuse && mw.cfg[m.idx].ClusterCapacity == 0
}

// tookFile records that a file was made on m: a store's or a move's copy
// that succeeded, a probe that passed (reprobe). Where Open found m
// unwritable (a read-only tmpfs since remounted read-write), m keeps
// spares from then on, under an owner file made first (openOwner), as a
// mount writable at start does; the spares made ahead (Mount.Preallocate),
// whose budget Open settled at 0, wait for a restart. Elsewhere it costs
// one atomic load.
func (mw *mountWatch) tookFile(m *mount) {
	if !m.spareless.Load() || !m.mending.CompareAndSwap(false, true) {
		return // writable from the start, or another file's success came first
	}
	if mw.spareCapable(m) {
		mw.own.openOwner(m)
		mw.log.Info("engine: the mount found unwritable at start takes files: evicted files are kept as spares from now on", "mount", m.root)
	}
	m.spareless.Store(false)
}
