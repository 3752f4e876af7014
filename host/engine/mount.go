package engine

import (
	"fmt"
	"golang.org/x/sys/unix"
	"path/filepath"
	"sync"
	"time"

	"github.com/kvhost/kvhost/internal/fstype"
	"github.com/kvhost/kvhost/internal/fsys"
	"github.com/kvhost/kvhost/internal/region"
	"github.com/kvhost/kvhost/internal/transfer"
	"github.com/kvhost/kvhost/staging"
)

// mount is one storage root and its space accounting.
type mount struct {
	idx  int
	root string
	// movedIn and movedOut count the files moved to and from the mount
	// (demotions, promotions, tick moves); guarded by Engine.mu.
	movedIn, movedOut uint64
	// configured is Mount.Capacity (0: the file system's size); reserve
	// is Mount.Reserve; highF and lowF the watermarks as fractions.
	configured, reserve int64
	derived             bool // configured was computed, not given (Mount.CapacityDerived)
	highF, lowF         float64
	direct              bool
	// memory: a memory file system (tmpfs). With it, and with buffered
	// I/O, checksums are computed inline in small chunks, in cache; with
	// O_DIRECT to a device they overlap the next transfer instead.
	memory    bool
	checksums bool   // payload checksums on this mount (Mount.NoChecksum, the mover)
	backend   string // the host mover's name
	movers    map[region.Kind]transfer.Mover
	ioWhy     string     // how the I/O mode was chosen
	raw       *rawLayout // a vllm-fs mount; nil for kvhost's layout
	evictMu   sync.Mutex
	// guarded by Engine.mu
	capacity  int64 // effective: min(configured, what the file system can hold)
	high, low int64
	used      int64
	// orphaned is the part of used that orphans hold: files dropped from
	// the index while another job held their path, which that job
	// removes when it lets the path go (flight.go). They are on their way
	// out: an eviction frees room down to the low watermark without them,
	// but no less than a store needs beside them below the capacity.
	orphaned  int64
	entries   int
	refreshed time.Time // last capacity refresh from statfs
	// spares are evicted files kept for stores to write into, by size
	// (spares.go; a size is present only with files); spareBytes is
	// their total. They are not part of used.
	spares     map[int64][]spareFile
	spareBytes int64
	// ahead is Mount.Preallocate (PreallocateAuto resolved at Open,
	// reportMounts; 0 where m keeps no spares), and aheadFiles the most spares of a size it keeps
	// (MaxAutoSpareFiles for PreallocateAuto; 0: no bound but ahead's);
	// aheadNS what each namespace's declaration and stores say about its
	// files here (ahead.go: wantSparesLocked, predictSparesLocked; dropped at
	// Release, and where making one of its size failed); madeBytes is the
	// spares made ahead among spares (of any size).
	ahead, madeBytes int64
	aheadFiles       int
	aheadNS          map[NamespaceID]nsAhead
}

// spareFilesLocked counts m's spares.
func (m *mount) spareFilesLocked() int {
	n := 0
	for _, list := range m.spares {
		n += len(list)
	}
	return n
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
	if err := e.mkdir(root, true); err != nil {
		return nil, fmt.Errorf("engine: mount %s: %w", root, err)
	}
	st, err := e.fs.Statfs(root)
	if err != nil {
		return nil, fmt.Errorf("engine: mount %s: %w", root, err)
	}
	mt := &mount{
		idx: i, root: root, configured: m.Capacity, derived: m.CapacityDerived, reserve: m.Reserve, highF: high, lowF: low,
		memory: isMemoryFS(st.Type), checksums: !m.NoChecksum && !e.cfg.NoChecksum, ahead: m.Preallocate,
	}
	switch io {
	case IOBuffered:
		mt.ioWhy = "buffered by config"
	default:
		// The probe creates, writes and removes a small file. It must never
		// stop a start (a full file system, a read-only one that still
		// serves what it holds): a failure is buffered I/O and a log line.
		direct, err := staging.ProbeDirectFile(e.fs, e.tempName(root, probePrefix))
		switch {
		case err != nil && io == IODirect:
			mt.direct, mt.ioWhy = true, "direct by config (the probe failed: "+err.Error()+")"
		case err != nil:
			mt.ioWhy = "buffered: the O_DIRECT probe failed: " + err.Error()
			e.log.Warn("engine: O_DIRECT probe failed; buffered I/O on the mount", "mount", root, "err", err)
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
	mt.setCapacityLocked(e.fsCapacity(mt, st, 0))
	return mt, nil
}

// fsCapacity is the capacity of m given what statfs says and what the
// engine uses on it: the configured capacity (or the file system's size),
// but at most what the file system can hold for us, free space plus our
// own files, minus the reserve.
func (e *Engine) fsCapacity(m *mount, st fsys.StatFS, used int64) int64 {
	c := m.configured
	if c == 0 {
		c = st.Total
	}
	return max(0, min(c, st.Avail+used-m.reserve))
}

// setCapacityLocked sets the effective capacity and the watermarks.
func (m *mount) setCapacityLocked(c int64) {
	m.capacity = c
	m.high = int64(float64(c) * m.highF)
	m.low = int64(float64(c) * m.lowF)
}

// refreshCapacity recomputes m's capacity from statfs, at most once per
// second unless force (after an ENOSPC): other writers on the file system
// (other nodes of a shared mount, other programs) change what it can hold.
func (e *Engine) refreshCapacity(m *mount, force bool) {
	e.mu.Lock()
	if !force && e.now().Sub(m.refreshed) < time.Second {
		e.mu.Unlock()
		return
	}
	m.refreshed = e.now()
	e.mu.Unlock()
	st, err := e.fs.Statfs(m.root)
	if err != nil {
		e.log.Warn("engine: statfs", "mount", m.root, "err", err)
		return
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	// Space of stores in flight is part of used but not yet (all) taken
	// from the file system, and a file just removed is free there while
	// used counts it until its remover takes the lock again: counting
	// them as ours errs towards a larger capacity, which an ENOSPC then
	// corrects (the store's retry refreshes under the eviction lock, out
	// of the evictions' removals; other removals may still count twice
	// for that refresh).
	m.setCapacityLocked(e.fsCapacity(m, st, m.used+m.spareBytes))
}

// reportMounts logs, once at Open, each mount's capacity, I/O mode,
// backend and checksums, and warns where the configured capacity is more
// than the file system can hold.
func (e *Engine) reportMounts() {
	for _, m := range e.mounts {
		e.refreshCapacity(m, true)
		e.mu.Lock()
		capacity, used := m.capacity, m.used
		e.mu.Unlock()
		// The budget is settled once, from the capacity at Open: 0 where
		// the mount keeps no spares, so that m.ahead > 0 alone says it
		// makes them ahead (ahead.go).
		auto := m.ahead == PreallocateAuto
		switch {
		case !e.spareEligible(m):
			if m.ahead > 0 {
				e.log.Warn("engine: preallocate has no effect on this mount: spare files are kept only on memory file systems in kvhost's layout, with reuse_files on",
					"mount", m.root, "preallocate", m.ahead)
			}
			m.ahead = 0
		case auto:
			m.ahead, m.aheadFiles = AutoPreallocate(capacity, e.memory), MaxAutoSpareFiles
		}
		e.log.Info("engine: mount", "mount", m.root, "io", m.ioName(), "why", m.ioWhy, "backend", m.backend,
			"checksums", m.checksums, "capacity", capacity, "used", used, "reserve", m.reserve, "preallocate", m.ahead, "preallocate_auto", auto)
		if m.configured > capacity && !m.derived {
			e.log.Warn("engine: the configured capacity is more than the file system can hold; using what it can hold",
				"mount", m.root, "configured", m.configured, "effective", capacity, "reserve", m.reserve)
		}
	}
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
