package gds

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"runtime"
	"sync"

	"github.com/kvhost/kvhost/fsys"
)

// Errors of the package.
var (
	// ErrUnavailable: libcufile could not be loaded (absent, a dependency
	// missing, a required symbol missing), or this build cannot load
	// libraries (no cgo). Errors wrap it with the loader's text.
	ErrUnavailable = errors.New("gds: cuFile unavailable")
	// errClosed: the driver or mover was closed.
	errClosed = errors.New("gds: closed")
)

// DefaultLibraryPaths returns the places Open looks for libcufile, in
// order: the dynamic linker's search path first, then the CUDA toolkit's
// usual locations. The slice is the caller's.
func DefaultLibraryPaths() []string {
	return []string{
		"libcufile.so.0",
		"libcufile.so",
		"/usr/local/cuda/lib64/libcufile.so.0",
		"/usr/local/cuda/targets/x86_64-linux/lib/libcufile.so.0",
		"/usr/local/cuda/targets/sbsa-linux/lib/libcufile.so.0",
	}
}

// Config configures Open. The zero value is usable.
type Config struct {
	// LibraryPaths are tried in order; empty means DefaultLibraryPaths.
	LibraryPaths []string
	// Logger receives the once-per-mount capability reports and lifecycle
	// messages; nil means slog.Default().
	Logger *slog.Logger
	// BindDevice makes the calling OS thread's current CUDA device the
	// given ordinal (cudaSetDevice). cuFile calls use the thread's current
	// device: every worker calls it once per device before its first
	// cuFile call there. Nil leaves the thread's device as it is (device 0
	// on a fresh thread), which is right only with one GPU.
	BindDevice func(ordinal int) error
	// MaxHandles bounds the cached cuFile file handles that no transfer is
	// using; 0 means 1024.
	MaxHandles int
	// ConfigJSON is the cufile.json read for allow_compat_mode when the
	// library does not report its properties; empty means
	// $CUFILE_ENV_PATH_JSON, else /etc/cufile.json.
	ConfigJSON string
	// NVFSPath is a file that exists when the nvidia-fs kernel module is
	// loaded; empty means /proc/driver/nvidia-fs/version.
	NVFSPath string
	// BatchEntries bounds the batch entries in flight at once across the
	// driver's movers (a batch waits for room before it is submitted);
	// 0 means cuFile's count of GPU bounce buffers (max_device_cache_size
	// / per_buffer_cache_size from the driver's properties), or 128 when
	// it reports none. Batches of unregistered memory hold a bounce
	// buffer per entry; more entries than buffers in flight hung
	// cuFileBatchIOSubmit on the H100 machine (docs/gds.md).
	BatchEntries int
}

// Properties describe the loaded library and the platform it found.
type Properties struct {
	// Library is the path libcufile was loaded from.
	Library string
	// Version is cuFileGetVersion's value (1000*major + 10*minor, e.g.
	// 1151), 0 when the library does not export it.
	Version int
	// NVFSLoaded says the nvidia-fs kernel module is loaded: transfers can
	// be direct (GPU ↔ storage DMA) on file systems that support it.
	NVFSLoaded bool
	// NVFSVersion is the nvidia-fs version the library reports ("2.17"),
	// empty when it reports none.
	NVFSVersion string
	// CompatAllowed says cuFile falls back to its compatibility mode (a
	// POSIX bounce through host memory inside libcufile) where direct I/O
	// is impossible.
	CompatAllowed bool
	// CompatSource says where CompatAllowed was read: "properties",
	// the cufile.json path, or "default".
	CompatSource string
	// MaxDirectIO is the largest single direct I/O in bytes (0: unknown).
	MaxDirectIO int64
	// MaxBatchIO is the most entries of one batch (0: unknown).
	MaxBatchIO int
	// BatchTimeoutMsecs is cuFile's batch I/O timeout in milliseconds
	// (max_batch_io_timeout_msecs; 0: unknown).
	BatchTimeoutMsecs int
	// PollThreshold is the size up to which cuFile polls for completion.
	PollThreshold int64
	// MaxDeviceCache, PerBufferCache and MaxDevicePinned are cuFile's
	// limits on its GPU bounce buffers and pinned GPU memory, in bytes.
	MaxDeviceCache, PerBufferCache, MaxDevicePinned int64
	// NVFSStatusFlags are the nvidia-fs driver's status bits (one per
	// storage kind it serves: bit 4 NVMe, 2 NFS, ...); FeatureFlags the
	// library's feature bits (bit 1 batch I/O, bit 2 streams).
	NVFSStatusFlags, FeatureFlags uint32
	// BatchAPI says the library exports the batch API.
	BatchAPI bool
}

// Mode is what cuFile can do: on a mount, or in general.
type Mode int

// Modes.
const (
	ModeUnknown  Mode = iota // not yet probed
	ModeDirect               // GPUDirect: storage DMA into GPU memory
	ModeCompat               // cuFile's compatibility mode: a host bounce inside libcufile
	ModeUnusable             // cuFile refuses the mount (or the platform)
)

// String names the mode.
func (m Mode) String() string {
	switch m {
	case ModeDirect:
		return "direct"
	case ModeCompat:
		return "compat"
	case ModeUnusable:
		return "unusable"
	}
	return "unknown"
}

// Mode is the best the platform offers: direct with nvidia-fs, compat
// without it where compat mode is allowed, unusable otherwise.
func (p Properties) Mode() Mode {
	switch {
	case p.NVFSLoaded:
		return ModeDirect
	case p.CompatAllowed:
		return ModeCompat
	}
	return ModeUnusable
}

// Driver is an open cuFile library and driver session: it owns the handle
// cache and the per-mount capabilities. Its
// methods are safe for concurrent use.
type Driver struct {
	api      api
	cfg      Config
	log      *slog.Logger
	props    Properties
	cache    *handleCache
	caps     *capabilities
	batch    batchCounters
	inflight *entryBudget

	mu     sync.Mutex
	closed bool
	movers map[*Mover]struct{}
}

// Open loads libcufile, resolves every symbol it needs, and opens the
// cuFile driver. Without the library (or without cgo) it returns an error
// wrapping ErrUnavailable, and the caller uses another data path.
func Open(cfg Config) (*Driver, error) {
	paths := cfg.LibraryPaths
	if len(paths) == 0 {
		paths = DefaultLibraryPaths()
	}
	a, err := loadAPI(paths)
	if err != nil {
		return nil, err
	}
	return openAPI(a, cfg)
}

// openAPI opens the driver over a loaded library.
func openAPI(a api, cfg Config) (*Driver, error) {
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if cfg.MaxHandles <= 0 {
		cfg.MaxHandles = 1024
	}
	if cfg.NVFSPath == "" {
		cfg.NVFSPath = "/proc/driver/nvidia-fs/version"
	}
	if cfg.ConfigJSON == "" {
		cfg.ConfigJSON = os.Getenv("CUFILE_ENV_PATH_JSON")
		if cfg.ConfigJSON == "" {
			cfg.ConfigJSON = "/etc/cufile.json"
		}
	}
	d := &Driver{api: a, cfg: cfg, log: cfg.Logger, movers: map[*Mover]struct{}{}}
	// The driver session belongs to the process, but cuFile initializes
	// CUDA state on the calling thread: open it on a thread bound to
	// device 0, which ends afterwards (onDevice).
	err := d.onDevice(0, a.driverOpen)
	if err != nil {
		a.unload()
		return nil, fmt.Errorf("%w: cuFileDriverOpen: %w", ErrUnavailable, err)
	}
	d.props, err = d.readProperties()
	if err != nil {
		d.onDevice(0, a.driverClose)
		a.unload()
		return nil, err
	}
	d.inflight = newEntryBudget(batchEntries(cfg.BatchEntries, d.props))
	d.cache = newHandleCache(a, cfg.MaxHandles)
	// onDevice runs f on a thread of its own: the caller may be a mover
	// worker, whose thread stays bound to its own device.
	d.cache.onThread = func(f func() error) error { return d.onDevice(0, f) }
	d.caps = newCapabilities(d)
	d.log.Info("cufile: driver open", "library", d.props.Library, "version", d.props.Version,
		"nvidia_fs", d.props.NVFSLoaded, "compat_allowed", d.props.CompatAllowed,
		"compat_source", d.props.CompatSource, "mode", d.props.Mode().String())
	return d, nil
}

// onDevice runs f on a thread of its own bound to the device and waits
// for it. The thread is never unlocked (BindDevice cannot be undone, and
// cuFile leaves state on it): it ends with its goroutine. The caller's
// thread, which may be locked to another device, is not touched.
func (d *Driver) onDevice(ordinal int, f func() error) error {
	ch := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		if d.cfg.BindDevice != nil {
			if err := d.cfg.BindDevice(ordinal); err != nil {
				ch <- fmt.Errorf("gds: bind device %d: %w", ordinal, err)
				return
			}
		}
		ch <- f()
	}()
	return <-ch
}

// cuFileDrvProps_t control flag bit: compat mode allowed.
const controlAllowCompat = 1 << 1

func (d *Driver) readProperties() (Properties, error) {
	p := Properties{Library: d.api.path(), BatchAPI: d.api.hasBatch()}
	if v, ok, err := d.api.version(); ok {
		if err != nil {
			return p, fmt.Errorf("gds: cuFileGetVersion: %w", err)
		}
		p.Version = v
	}
	if _, err := os.Stat(d.cfg.NVFSPath); err == nil {
		p.NVFSLoaded = true
	}
	raw, ok, err := d.api.properties()
	if ok && err != nil && !p.NVFSLoaded {
		// Without nvidia-fs some versions refuse to report properties;
		// the JSON below still says whether compat mode is allowed.
		ok = false
	} else if ok && err != nil {
		return p, fmt.Errorf("gds: cuFileDriverGetProperties: %w", err)
	}
	if ok {
		if raw.nvfsMajor != 0 || raw.nvfsMinor != 0 {
			p.NVFSVersion = fmt.Sprintf("%d.%d", raw.nvfsMajor, raw.nvfsMinor)
		}
		p.CompatAllowed = raw.controlFlags&controlAllowCompat != 0
		p.CompatSource = "properties"
		p.MaxDirectIO = int64(raw.maxDirectIOKiB) << 10
		p.MaxBatchIO = int(raw.maxBatchIOSize)
		p.BatchTimeoutMsecs = int(raw.maxBatchIOTimeoutMsecs)
		p.PollThreshold = int64(raw.pollThreshKiB) << 10
		p.MaxDeviceCache = int64(raw.maxDeviceCacheKiB) << 10
		p.PerBufferCache = int64(raw.perBufferCacheKiB) << 10
		p.MaxDevicePinned = int64(raw.maxDevicePinnedKiB) << 10
		p.NVFSStatusFlags, p.FeatureFlags = raw.statusFlags, raw.featureFlags
		return p, nil
	}
	allowed, found, err := readAllowCompat(d.cfg.ConfigJSON)
	switch {
	case err != nil:
		d.log.Warn("cufile: cannot read allow_compat_mode; assuming cuFile's default (true)", "path", d.cfg.ConfigJSON, "err", err)
		p.CompatAllowed, p.CompatSource = true, "default"
	case found:
		p.CompatAllowed, p.CompatSource = allowed, d.cfg.ConfigJSON
	default:
		p.CompatAllowed, p.CompatSource = true, "default"
	}
	return p, nil
}

// readAllowCompat reads properties.allow_compat_mode from a cufile.json,
// which may hold // comments. found is false when the file or the key is
// absent.
func readAllowCompat(path string) (allowed, found bool, err error) {
	b, err := os.ReadFile(path)
	if errors.Is(err, os.ErrNotExist) {
		return false, false, nil
	}
	if err != nil {
		return false, false, err
	}
	var doc struct {
		Properties struct {
			AllowCompatMode *bool `json:"allow_compat_mode"`
		} `json:"properties"`
	}
	if err := json.Unmarshal(stripJSONComments(b), &doc); err != nil {
		return false, false, fmt.Errorf("gds: %s: %w", path, err)
	}
	if doc.Properties.AllowCompatMode == nil {
		return false, false, nil
	}
	return *doc.Properties.AllowCompatMode, true, nil
}

// stripJSONComments blanks // line comments outside strings, as cufile.json
// uses them.
func stripJSONComments(b []byte) []byte {
	out := bytes.Clone(b)
	inStr, esc := false, false
	for i := 0; i < len(out); i++ {
		c := out[i]
		switch {
		case inStr:
			switch {
			case esc:
				esc = false
			case c == '\\':
				esc = true
			case c == '"':
				inStr = false
			}
		case c == '"':
			inStr = true
		case c == '/' && i+1 < len(out) && out[i+1] == '/':
			for i < len(out) && out[i] != '\n' {
				out[i] = ' '
				i++
			}
		}
	}
	return out
}

// Properties returns what Open found.
func (d *Driver) Properties() Properties { return d.props }

// forget drops the cached handles of a file (its device and inode
// number, of any generation) that the engine is about to remove or
// replace. A handle in use is deregistered when its last transfer ends.
func (d *Driver) forget(id fsys.FileID) { d.cache.forget(id) }

// HandleStats reports the handle cache's counters.
func (d *Driver) HandleStats() HandleStats { return d.cache.stats() }

// Close closes the movers, deregisters every handle (held ones included)
// and registered buffer, closes the cuFile driver and unloads the
// library. Nothing calls cuFile afterwards: a handle released later, a
// Forget or a probe finds nothing to do or fails.
func (d *Driver) Close() error {
	d.mu.Lock()
	if d.closed {
		d.mu.Unlock()
		return errClosed
	}
	d.closed = true
	movers := make([]*Mover, 0, len(d.movers))
	for m := range d.movers {
		movers = append(movers, m)
	}
	d.mu.Unlock()
	var errs []error
	for _, m := range movers {
		if err := m.Close(); err != nil && !errors.Is(err, errClosed) {
			errs = append(errs, err)
		}
	}
	// Every handle is deregistered, held ones included (no mover runs
	// any more), and the cuFile calls under way end, before the driver is
	// closed and the library unloaded: afterwards the cache refuses
	// acquisitions and probes, and a release, a Forget or a sweep has no
	// registration left to undo.
	d.cache.close()
	if err := d.onDevice(0, d.api.driverClose); err != nil {
		errs = append(errs, fmt.Errorf("gds: cuFileDriverClose: %w", err))
	}
	if err := d.api.unload(); err != nil {
		errs = append(errs, err)
	}
	return errors.Join(errs...)
}
