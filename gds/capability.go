package gds

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"sync"

	"golang.org/x/sys/unix"

	"github.com/kvhost/kvhost/internal/fstype"
)

// Capability is what cuFile can do on one mount (one st_dev), found once by
// the first registration on it (or by ProbeDir) and cached.
type Capability struct {
	// Mode is what cuFile does there (ModeUnknown until found).
	Mode Mode
	// Dev is the mount's device number.
	Dev uint64
	// Mount is the mount point, from /proc/self/mountinfo ("" if not found).
	Mount string
	// FSType names the file system (statfs f_type).
	FSType string
	// Err is why the mount is unusable (the registration error), or nil.
	Err error
	// batch is what is known of batch I/O on the mount; BatchErr is the
	// library's refusal when batch is batchStateRefused.
	batch    batchState
	batchErr error
	// buffered says the capability is a file's, open without O_DIRECT,
	// on a direct mount: compat for that file (forFile).
	buffered bool
}

// forFile is the capability as a file open with flags mode (a
// handleKey's: O_ACCMODE and O_DIRECT) meets it. nvidia-fs moves only
// O_DIRECT I/O: on a direct mount, a file open without O_DIRECT can only
// take cuFile's POSIX path, compat mode, and is treated as compat
// (AllowCompat, and no batches where compat has none).
func (c Capability) forFile(mode int) Capability {
	if c.Mode == ModeDirect && mode&unix.O_DIRECT == 0 {
		c.Mode, c.buffered = ModeCompat, true
	}
	return c
}

// batchState is what a mount is known to do with cuFile's batch API.
type batchState int

// Batch states.
const (
	batchStateUnknown batchState = iota // no batch tried yet (or batches not used)
	batchStateRefused                   // the library refused a batch: per-call I/O only
)

// String names the state.
func (b batchState) String() string {
	if b == batchStateRefused {
		return "refused"
	}
	return "unknown"
}

// String is the capability as logged: "mount /x (ext4): compat".
func (c Capability) String() string {
	s := fmt.Sprintf("mount %s (%s): %s", c.mountName(), c.FSType, c.Mode)
	if c.buffered {
		s += " (direct mount, file not open with O_DIRECT)"
	}
	if c.Err != nil {
		s += ": " + c.Err.Error()
	}
	if c.batch == batchStateRefused {
		s += "; batch I/O refused: " + c.batchErr.Error()
	}
	return s
}

func (c Capability) mountName() string {
	if c.Mount != "" {
		return c.Mount
	}
	return fmt.Sprintf("dev %d:%d", unix.Major(c.Dev), unix.Minor(c.Dev))
}

// capabilities caches one Capability per mount; the first report of each
// is logged, once.
type capabilities struct {
	d  *Driver
	mu sync.Mutex
	m  map[uint64]Capability
}

func newCapabilities(d *Driver) *capabilities {
	return &capabilities{d: d, m: map[uint64]Capability{}}
}

// get returns the mount's capability, ModeUnknown if not yet found.
func (cs *capabilities) get(dev uint64) Capability {
	cs.mu.Lock()
	defer cs.mu.Unlock()
	if c, ok := cs.m[dev]; ok {
		return c
	}
	return Capability{Dev: dev}
}

// settles reports whether a registration's outcome err says what cuFile
// can do on the mount: success, or cuFile's own refusal (a Status). Other
// failures (the descriptor could not be duplicated, out of descriptors,
// the file changed under the check), and cuFile statuses of a passing
// condition (no descriptor or memory left, an internal or CUDA driver
// error, the driver closing), say nothing of the mount, and would
// otherwise mark it unusable for the daemon's life: they fail this
// transfer only, and the next registration settles the mount.
func settles(err error) bool {
	var st Status
	if err == nil {
		return true
	}
	if !errors.As(err, &st) {
		return false
	}
	switch st {
	case statusGetNewFDFailed, statusNoMemory, statusInternalError, statusCUDADriverError, statusDriverClosing:
		return false
	}
	return true
}

// settle records the outcome of the first registration on the mount of the
// file open at fd (regErr nil: registration worked) and returns the
// capability now cached: the first outcome wins and is logged once.
func (cs *capabilities) settle(dev uint64, fd int, regErr error) Capability {
	cs.mu.Lock()
	if c, ok := cs.m[dev]; ok {
		cs.mu.Unlock()
		return c
	}
	cs.mu.Unlock()
	c := Capability{Dev: dev, Mount: mountPoint(dev)}
	var fs fstype.Kind
	var sfs unix.Statfs_t
	if err := unix.Fstatfs(fd, &sfs); err == nil {
		c.FSType = fstype.Name(int64(sfs.Type))
		fs, _ = fstype.Of(int64(sfs.Type))
	} else {
		c.FSType = "unknown"
	}
	p := cs.d.props
	switch {
	case regErr != nil:
		c.Mode, c.Err = ModeUnusable, regErr
	case p.NVFSLoaded && fs.CuFileDirect:
		c.Mode = ModeDirect
	case p.CompatAllowed:
		c.Mode = ModeCompat
	default:
		// Registration worked but there is no path cuFile can take.
		c.Mode, c.Err = ModeUnusable, errors.New("nvidia-fs not loaded and compat mode not allowed")
	}
	cs.mu.Lock()
	if old, ok := cs.m[dev]; ok {
		cs.mu.Unlock()
		return old
	}
	cs.m[dev] = c
	cs.mu.Unlock()
	if c.Mode == ModeUnusable {
		cs.d.log.Warn(fmt.Sprintf("cufile: mount %s: unusable: %v; falling back to staging", c.mountName(), c.Err),
			"mount", c.mountName(), "fs", c.FSType, "mode", c.Mode.String())
	} else {
		cs.d.log.Info(fmt.Sprintf("cufile: mount %s: %s", c.mountName(), c.Mode),
			"mount", c.mountName(), "fs", c.FSType, "mode", c.Mode.String())
	}
	return c
}

// refuseBatch records that the library refused batch I/O on a mount (the
// first refusal wins), logs it once and counts it: the mount's jobs go
// per call from then on.
func (cs *capabilities) refuseBatch(dev uint64, err error) {
	cs.mu.Lock()
	c, ok := cs.m[dev]
	if !ok || c.batch == batchStateRefused {
		// Refused already (or, impossibly, not settled: a transfer
		// settles its mount before any I/O).
		cs.mu.Unlock()
		cs.d.batch.fallbacks.Add(1)
		return
	}
	c.batch, c.batchErr = batchStateRefused, err
	cs.m[dev] = c
	cs.mu.Unlock()
	cs.d.batch.refusals.Add(1)
	cs.d.batch.fallbacks.Add(1)
	cs.d.log.Warn(fmt.Sprintf("cufile: mount %s: batch I/O refused: %v; per-call I/O", c.mountName(), err),
		"mount", c.mountName(), "mode", c.Mode.String())
}

// ProbeDir finds what cuFile can do on the mount holding directory dir, if
// not known yet: it creates a small file there (O_DIRECT where the file
// system allows it), registers it with cuFile, deregisters and removes it.
// The result is cached per mount and logged once. A registration failure
// that says nothing of the mount (see settles: out of memory or
// descriptors, an internal error) is returned as the error, and nothing
// is cached.
func (d *Driver) ProbeDir(dir string) (Capability, error) {
	f, err := os.CreateTemp(dir, ".kvhost-cufile-probe-*")
	if err != nil {
		return Capability{}, fmt.Errorf("gds: probe %s: %w", dir, err)
	}
	name := f.Name()
	f.Close()
	defer os.Remove(name)
	fd, err := unix.Open(name, unix.O_RDWR|unix.O_DIRECT|unix.O_CLOEXEC, 0)
	if err != nil {
		fd, err = unix.Open(name, unix.O_RDWR|unix.O_CLOEXEC, 0)
	}
	if err != nil {
		return Capability{}, fmt.Errorf("gds: probe %s: %w", dir, err)
	}
	defer unix.Close(fd)
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return Capability{}, fmt.Errorf("gds: probe %s: %w", dir, err)
	}
	dev := uint64(st.Dev)
	if c := d.caps.get(dev); c.Mode != ModeUnknown {
		return c, nil
	}
	// Counted as the handle cache's work, so that Close waits for it;
	// none once Close began, which unloads the library.
	if !d.cache.enter() {
		return Capability{}, errClosed
	}
	defer d.cache.exit()
	var regErr error
	err = d.onDevice(0, func() error {
		h, err := d.api.handleRegister(fd)
		if err != nil {
			regErr = fmt.Errorf("cuFileHandleRegister: %w", err)
			return nil
		}
		d.api.handleDeregister(h)
		return nil
	})
	if err != nil {
		return Capability{}, err
	}
	if !settles(regErr) {
		// A passing failure says nothing of the mount: the next probe
		// or registration settles it.
		return Capability{}, fmt.Errorf("gds: probe %s: %w", dir, regErr)
	}
	return d.caps.settle(dev, fd, regErr), nil
}

// mountPoint finds the mount point of a device in /proc/self/mountinfo.
func mountPoint(dev uint64) string {
	ms, err := fstype.Mounts()
	if err != nil {
		return ""
	}
	want := strconv.FormatUint(uint64(unix.Major(dev)), 10) + ":" + strconv.FormatUint(uint64(unix.Minor(dev)), 10)
	for _, m := range ms {
		if m.Dev == want {
			return filepath.Clean(m.Point)
		}
	}
	return ""
}
