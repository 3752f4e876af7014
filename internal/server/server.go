// Package server is the kvhost daemon's protocol front end: it accepts
// connections on the Unix socket, runs one session per client, checks every
// request against what that client registered and its limits, dispatches to
// the storage engine, and pushes job completions back.
//
// A session owns what its client registered: memory regions (mapped
// memfds and shared-memory files, imported CUDA IPC memory), namespaces
// and caches, by ids that mean nothing on another
// connection. When the client goes away, the session cancels its jobs,
// waits until the engine has finished with every one of them, and only
// then unregisters its caches and unmaps its regions: a job never touches
// unmapped memory. One daemon serves every GPU of the node: a GPU
// registration names its device (Config.OpenDevice).
package server

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"net"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kvhost/kvhost/internal/engine"
	"github.com/kvhost/kvhost/internal/engine/removals"
	"github.com/kvhost/kvhost/protocol"
	"github.com/kvhost/kvhost/region"
)

// Engine is what a session asks of the storage engine (*engine.Engine).
type Engine interface {
	// Declare returns the namespace of g, the same id for the same
	// geometry.
	Declare(ctx context.Context, g engine.Geometry) (engine.NamespaceID, error)
	// Fingerprint is the fingerprint ns's keys are indexed and mirrored
	// into the lookup table under (the Declared reply's).
	Fingerprint(ns engine.NamespaceID) (uint64, error)
	// RegisterCache registers a worker's paged KV cache for ns, one tensor
	// per layer.
	RegisterCache(ns engine.NamespaceID, layers []engine.LayerTensor) (engine.CacheID, error)
	// UnregisterCache forgets a cache; jobs already submitted keep using
	// it.
	UnregisterCache(id engine.CacheID) error
	// Store starts storing keys from cache blocks; the Job reports each
	// key's outcome.
	Store(ctx context.Context, req engine.StoreRequest) (*engine.Job, error)
	// Load starts loading keys into cache blocks; the Job reports each
	// key's outcome.
	Load(ctx context.Context, req engine.LoadRequest) (*engine.Job, error)
	// Lookup returns how many leading keys of ns are stored.
	Lookup(ctx context.Context, ns engine.NamespaceID, keys [][]byte) (int, error)
	// Delete removes the files holding keys and returns how many of the
	// keys were stored and are now removed.
	Delete(ctx context.Context, ns engine.NamespaceID, keys [][]byte) (int, error)
	// Purge removes every file of the namespace of a fingerprint, but
	// those a client pin holds; PurgeModel those of every namespace
	// declared with a model id.
	Purge(ctx context.Context, fp uint64) (engine.PurgeResult, error)
	PurgeModel(ctx context.Context, model string) (engine.PurgeResult, error)
	// Release tells the engine that no client uses the namespace any more
	// (it no longer counts against the engine's namespace limit).
	Release(ns engine.NamespaceID) error
	// Stats returns the engine's counters and per-mount usage.
	Stats() engine.Stats
}

var _ Engine = (*engine.Engine)(nil)

// Config configures a Server. Zero fields take the defaults noted.
type Config struct {
	// MaxClients bounds connections that have completed the handshake
	// (default 64).
	MaxClients int
	// MaxClientsPerPeer bounds the connections through the handshake of
	// one peer process (its pid, from SO_PEERCRED), so that one client
	// opening connections cannot take every slot of MaxClients (default
	// half of MaxClients, at least 1). A peer whose pid the kernel
	// does not give (another pid namespace) is not bounded by it.
	MaxClientsPerPeer int
	// MaxHandshakes bounds connections accepted but not yet through Hello
	// (default 16). A new connection beyond it closes the oldest of them:
	// silent connections cannot keep a client that speaks from getting in.
	MaxHandshakes int
	// MaxFrame bounds one frame, header included (default 4 MiB,
	// protocol.MinFrame..protocol.MaxFrame).
	MaxFrame int
	// MaxRegistrations bounds a connection's memory regions (default 256).
	MaxRegistrations int
	// MaxInflightJobs bounds a connection's unfinished jobs (default 256).
	MaxInflightJobs int
	// MaxNamespaces and MaxCaches bound a connection's declarations and
	// cache registrations (default 64 each).
	MaxNamespaces, MaxCaches int
	// MaxInflightBytes bounds the memory the store and load jobs in
	// flight of all connections hold, as JobBytes counts it (default
	// DefaultMaxInflightBytes, or 4 × MaxJobBytes(MaxFrame) if that is
	// more): a job beyond it is refused with CodeLimit until others end.
	MaxInflightBytes int64
	// MaxInflightBytesPerPeer bounds the same for the jobs of one peer
	// process's connections (its pid, from SO_PEERCRED), so that one
	// client cannot take all of MaxInflightBytes (default half of it). A
	// connection whose peer's pid the kernel does not give is a process
	// of its own. At least MaxJobBytes(MaxFrame): one job of the largest
	// frame must fit.
	MaxInflightBytesPerPeer int64
	// MaxDescriptors bounds the clients' descriptors all connections
	// together make the daemon hold: one per host memory region
	// registered, and those sent with frames not yet answered (default
	// DefaultMaxDescriptors()). A descriptor received beyond it is closed
	// at once, and the registration it came with refused with CodeLimit.
	MaxDescriptors int
	// MaxDescriptorsPerPeer bounds the same for the connections of one
	// peer process (its pid, from SO_PEERCRED), those not through Hello
	// included, so that one client cannot take all of MaxDescriptors
	// (default half of it). A connection whose peer's pid the kernel does
	// not give is a process of its own.
	MaxDescriptorsPerPeer int
	// MaxPinnedKeys bounds the keys the pins of all connections hold
	// (Pin requests; a pin with a lease counts until the lease ends;
	// default DefaultMaxPinnedKeys). A Pin beyond it is refused with
	// CodeLimit. At least protocol.MaxKeysPerRequest.
	MaxPinnedKeys int
	// MaxPinnedKeysPerPeer bounds the same for the pins of one peer
	// process's connections (its pid, from SO_PEERCRED), so that one
	// client cannot pin every key it may (default half of MaxPinnedKeys).
	// A connection whose peer's pid the kernel does not give is a process
	// of its own. At least protocol.MaxKeysPerRequest: one Pin of the
	// most keys a request carries must fit.
	MaxPinnedKeysPerPeer int
	// MaxIncomingBytes bounds the bytes of the frames all connections
	// together have the daemon hold while it reads and answers them
	// (default DefaultMaxIncomingBytes, or 4 × MaxFrame if that is more).
	// A frame's body is allocated once its header is read; a frame that
	// would pass the bound waits, unread, until frames before it are
	// answered, and its FrameTimeout counts from the end of that wait.
	// Bodies of UncountedBody bytes or less are not counted. At least
	// MaxIncomingBytesPerPeer.
	MaxIncomingBytes int64
	// MaxIncomingBytesPerPeer bounds the same for the frames of one peer
	// process's connections (its pid, from SO_PEERCRED), so that one
	// client cannot take all of MaxIncomingBytes (default half of it). A
	// connection whose peer's pid the kernel does not give is a process
	// of its own. At least MaxFrame: one frame of the largest size must
	// fit.
	MaxIncomingBytesPerPeer int64
	// MaxCacheLayers bounds the layers of the caches all connections
	// hold registered (default DefaultMaxCacheLayers): each costs the
	// daemon some 52 bytes until the cache is unregistered. A
	// RegisterCache beyond it is refused with CodeLimit. At least
	// MaxCacheLayersPerPeer.
	MaxCacheLayers int
	// MaxCacheLayersPerPeer bounds the same for the caches of one peer
	// process's connections (its pid, from SO_PEERCRED), so that one
	// client cannot take all of MaxCacheLayers (default half of it). A
	// connection whose peer's pid the kernel does not give is a process
	// of its own. At least protocol.MaxLayers: one cache of the most
	// layers a registration carries must fit.
	MaxCacheLayersPerPeer int
	// MaxNamespacesPerPeer bounds the distinct geometries the connections
	// of one peer process (its pid, from SO_PEERCRED) hold declared
	// together (default MaxNamespaces), so that one client opening
	// connections cannot take every namespace the engine knows. A
	// connection whose peer's pid the kernel does not give is a process
	// of its own.
	MaxNamespacesPerPeer int
	// Now is the clock that ends the charges of pins with a lease
	// (default time.Now).
	Now func() time.Time
	// MaxTotalRegisteredBytes bounds the bytes of memory all connections
	// together may register, that is map into the daemon (default 64 TiB,
	// half of the x86-64 user address space). Each connection is
	// guaranteed its share, MaxTotalRegisteredBytes / MaxClients, and may
	// register at most the smaller of that share and MaxRegisteredBytes
	// (default: the machine's physical memory): whatever one client
	// registers, sparse memfds included, every other client can still
	// register its share. See docs/serve.md.
	MaxRegisteredBytes, MaxTotalRegisteredBytes int64
	// HandshakeTimeout is how long a new connection has to complete its
	// Hello (default 5s).
	HandshakeTimeout time.Duration
	// FrameTimeout bounds the time from a frame's first byte to its last
	// (default 10s): a client that stops in the middle of a frame is
	// disconnected.
	FrameTimeout time.Duration
	// IdleTimeout closes a connection that holds nothing (no memory
	// region, no namespace) and has sent no frame for this long
	// (default 60s). Connections holding registrations are never idle-closed.
	IdleTimeout time.Duration
	// WriteTimeout closes a connection whose reply or completion could not
	// be written for this long (default 10s): the client does not read.
	WriteTimeout time.Duration
	// ShutdownTimeout is how long Serve, once its context is done, lets
	// in-flight jobs finish before cancelling them (default 0: cancel at once).
	ShutdownTimeout time.Duration
	// Name is sent to clients in the handshake (default "kvhost").
	Name string
	// Logger receives the server's logs (default slog.Default()).
	Logger *slog.Logger

	// OpenDevice imports GPU memory a client registered by CUDA IPC: the
	// range [offset, offset+size) of the allocation handle names, on
	// device ordinal. Nil: the daemon has no GPU support and answers CUDA
	// IPC registrations with CodeUnsupported. The server checks ordinal,
	// offset and size against its limits before calling it, and closes
	// the memory it returns (cudaIpcCloseMemHandle) when the client
	// unregisters it or goes away, after every job using it has ended.
	// Errors wrapping region.ErrBounds (a range outside the exported
	// allocation) reach the client as CodeInvalid, *protocol.Error values
	// as they are, any other as CodeBadHandle (a stale or forged handle,
	// or another device's). Package server/cudaipc provides one.
	OpenDevice func(ctx context.Context, ordinal int, handle [protocol.CUDAIPCHandleLen]byte, offset, size int64) (DeviceMemory, error)
	// Devices is the number of GPUs clients may register memory on: CUDA
	// IPC registrations name ordinals 0..Devices-1. Required with
	// OpenDevice.
	Devices int
	// DeviceUUIDs are the GPUs' UUIDs by ordinal, reported in Stats replies
	// so that a client can find the ordinal of its own GPU whatever
	// CUDA_VISIBLE_DEVICES says; a missing or zero entry is unknown.
	DeviceUUIDs [][16]byte
	// DeviceFaults reports, per device ordinal, the jobs and
	// registrations that failed with a sticky CUDA error (the device's
	// context is broken until the daemon restarts), for Stats replies and
	// so `kvhost health`; nil: none known.
	DeviceFaults func() map[int]uint64
	// MaxDeviceBytes bounds the GPU memory all clients together may
	// register on each device (default DefaultMaxDeviceBytes; set it to
	// the device's memory). Registered GPU memory is the clients' own
	// allocations, mapped, not copied: the bound catches a client that
	// registers one allocation over and over.
	MaxDeviceBytes int64

	// OnRequest, if set, is called after the reply to each control
	// request (every request after the handshake but Store and Load, whose
	// jobs the engine's Observer sees) with the request's type and the
	// time from its frame read to its reply written (metrics:
	// kvhost_request_duration_seconds). It runs on the connection's
	// goroutine and must be fast.
	OnRequest func(t protocol.Type, took time.Duration)

	// Daemon, if set, supplies the daemon section of Stats replies (start
	// time, policy, reloads); the server fills in its own figures and the
	// engine's mounts.
	Daemon func() protocol.DaemonStats
	// LookupTable, if set, is the path of the daemon's shared lookup
	// table (internal/lookuptable), which a client asks for once
	// (protocol.TypeLookupTable) to answer lookups from its own mapping.
	LookupTable string

	// SharedFiles accepts MemoryShared registrations: memfds and
	// /dev/shm files not sealed against shrinking, which their owner may
	// truncate under a job. Set it only when the engine's CPU copies of
	// shrinkable host regions run under region.Guard, which fails such a
	// job instead of crashing the daemon on SIGBUS. Without it those
	// registrations are answered CodeUnsupported.
	SharedFiles bool
}

// DeviceMemory is GPU memory a client registered, as OpenDevice imports
// it: a region.Device the engine's GPU movers copy to and from, closed by
// the server when no job uses it any more.
type DeviceMemory interface {
	region.Device
	// Close releases the import. It is called once, from any goroutine.
	Close() error
}

// DefaultMaxDeviceBytes is Config.MaxDeviceBytes when it is zero: more
// than the memory of any single GPU of 2026.
const DefaultMaxDeviceBytes = 256 << 30

// DefaultMaxDescriptors is Config.MaxDescriptors when it is zero: a
// quarter of the descriptors the process may open (RLIMIT_NOFILE) and of
// the mappings it may have (vm.max_map_count), whichever is fewer; a
// registration holds one of each. The GPU path's file registrar keeps
// itself to another quarter, and the rest is the engine's and the
// runtime's. 16,382 with Linux's default mapping limit.
func DefaultMaxDescriptors() int {
	n := math.MaxInt32
	var lim unix.Rlimit
	if err := unix.Getrlimit(unix.RLIMIT_NOFILE, &lim); err == nil && lim.Cur/4 < uint64(n) {
		n = int(lim.Cur / 4)
	}
	if b, err := os.ReadFile("/proc/sys/vm/max_map_count"); err == nil {
		if m, err := strconv.Atoi(strings.TrimSpace(string(b))); err == nil && m/4 < n {
			n = m / 4
		}
	}
	return max(n, 2)
}

// DefaultMaxPinnedKeys is Config.MaxPinnedKeys when it is zero: 4 Mi
// keys, some 32 MiB of the engine's references to pinned files, and
// many times the blocks of the GPUs of a node that the keys pinned ahead
// of loads are meant for.
const DefaultMaxPinnedKeys = 1 << 22

// DefaultMaxIncomingBytes is Config.MaxIncomingBytes when it is zero and
// MaxFrame is at most 64 MiB: what 64 connections (MaxClients' default)
// each reading a frame of 4 MiB (MaxFrame's) hold.
const DefaultMaxIncomingBytes = 256 << 20

// UncountedBody is the largest frame body that is not counted against
// MaxIncomingBytes: the connections of a daemon, each reading one frame
// at a time, hold at most 64 KiB each in such frames, and the small
// requests that free room (unregistrations, cancels, unpins) never wait.
const UncountedBody = protocol.MinFrame

// DefaultMaxCacheLayers is Config.MaxCacheLayers when it is zero: 1 Mi
// layers, some 52 MiB of the engine's copy of each layer's tensor (48
// bytes) and the server's region id (4): a cache of 4,096 layers was
// measured to hold 209 KiB. Half of it, a process's share, is 4,161
// caches of Llama 3.1 405B's 126 layers.
const DefaultMaxCacheLayers = 1 << 20

// DefaultMaxInflightBytes is Config.MaxInflightBytes when it is zero and
// MaxFrame is at most 64 MiB: some 2 million keys of jobs in flight,
// thirty times what the vLLM workers of an eight-GPU node keep in flight
// at their defaults (65,536 keys each being stored).
const DefaultMaxInflightBytes = 1 << 30

// What a job in flight holds until it ends, as JobBytes counts it: its
// two goroutines (the engine's and the completion's) and state, and per
// key its copies of the key and of its block list in the engine, its
// outcome and the store's or load's bookkeeping. Measured with stores
// of 20-byte keys of 2 blocks held at the engine's file system: 2.7 KiB
// of heap and 10 KiB of stacks per job, 480 bytes per key.
const (
	jobBaseBytes  = 16 << 10
	jobKeyBytes   = 512 // and the key's own bytes
	jobBlockBytes = 8   // an int in the engine's copy of the block list
)

// JobBytes is the memory a store or load job of keys, blocksPerKey blocks
// each, is counted to hold until it ends, against MaxInflightBytes and
// MaxInflightBytesPerPeer.
func JobBytes(keys [][]byte, blocksPerKey int) int64 {
	n := int64(jobBaseBytes)
	for _, k := range keys {
		n += jobKeyBytes + int64(len(k))
	}
	return n + int64(len(keys))*int64(blocksPerKey)*jobBlockBytes
}

// MaxJobBytes is the most JobBytes one Store or Load frame of maxFrame
// bytes can carry: at most protocol.MaxKeysPerRequest keys, and at most
// twice the frame's bytes in keys and block lists (a key of L bytes and B
// blocks takes 1 + L + 4B bytes of the frame and counts L + 8B).
func MaxJobBytes(maxFrame int) int64 {
	return jobBaseBytes + protocol.MaxKeysPerRequest*jobKeyBytes + 2*int64(maxFrame)
}

// DefaultMaxTotalRegisteredBytes is Config.MaxTotalRegisteredBytes when it
// is zero: half of the 128 TiB user address space of x86-64 and arm64
// (4-level page tables).
const DefaultMaxTotalRegisteredBytes = 64 << 40

// WithDefaults returns c with every limit and timeout left zero set to
// the default New runs with, on this machine (some depend on its memory
// and descriptor limits), and the error New would refuse c with.
func (c Config) WithDefaults() (Config, error) { return c.withDefaults() }

func (c Config) withDefaults() (Config, error) {
	def := func(v *int, d int) {
		if *v == 0 {
			*v = d
		}
	}
	def(&c.MaxClients, 64)
	def(&c.MaxClientsPerPeer, max(1, c.MaxClients/2))
	def(&c.MaxHandshakes, 16)
	def(&c.MaxFrame, 4<<20)
	def(&c.MaxRegistrations, 256)
	def(&c.MaxInflightJobs, 256)
	def(&c.MaxNamespaces, 64)
	def(&c.MaxCaches, 64)
	def(&c.MaxNamespacesPerPeer, c.MaxNamespaces)
	if c.Now == nil {
		c.Now = time.Now
	}
	defDur := func(v *time.Duration, d time.Duration) {
		if *v == 0 {
			*v = d
		}
	}
	defDur(&c.HandshakeTimeout, 5*time.Second)
	defDur(&c.FrameTimeout, 10*time.Second)
	defDur(&c.IdleTimeout, 60*time.Second)
	defDur(&c.WriteTimeout, 10*time.Second)
	if c.MaxTotalRegisteredBytes == 0 {
		c.MaxTotalRegisteredBytes = DefaultMaxTotalRegisteredBytes
	}
	if c.MaxDeviceBytes == 0 {
		c.MaxDeviceBytes = DefaultMaxDeviceBytes
	}
	def(&c.MaxPinnedKeys, DefaultMaxPinnedKeys)
	def(&c.MaxPinnedKeysPerPeer, c.MaxPinnedKeys/2)
	def(&c.MaxCacheLayers, DefaultMaxCacheLayers)
	def(&c.MaxCacheLayersPerPeer, c.MaxCacheLayers/2)
	def(&c.MaxDescriptors, DefaultMaxDescriptors())
	def(&c.MaxDescriptorsPerPeer, max(1, c.MaxDescriptors/2))
	if c.MaxInflightBytes == 0 {
		c.MaxInflightBytes = max(DefaultMaxInflightBytes, 4*MaxJobBytes(c.MaxFrame))
	}
	if c.MaxInflightBytesPerPeer == 0 {
		c.MaxInflightBytesPerPeer = c.MaxInflightBytes / 2
	}
	if c.MaxIncomingBytes == 0 {
		c.MaxIncomingBytes = max(DefaultMaxIncomingBytes, 4*int64(c.MaxFrame))
	}
	if c.MaxIncomingBytesPerPeer == 0 {
		c.MaxIncomingBytesPerPeer = c.MaxIncomingBytes / 2
	}
	if c.MaxRegisteredBytes == 0 {
		var si unix.Sysinfo_t
		ram := int64(64 << 30)
		if err := unix.Sysinfo(&si); err == nil && si.Totalram > 0 {
			ram = int64(si.Totalram) * int64(si.Unit)
		}
		c.MaxRegisteredBytes = ram
	}
	switch {
	case c.MaxRegisteredBytes < 0 || c.MaxTotalRegisteredBytes < 0 || c.MaxDeviceBytes < 0:
		return c, errors.New("server: negative registered-bytes limit")
	case c.Devices < 0 || c.Devices > protocol.MaxDevices: // a Stats reply carries at most as many
		return c, fmt.Errorf("server: Devices %d: want 0..%d", c.Devices, protocol.MaxDevices)
	case c.OpenDevice != nil && c.Devices == 0:
		return c, errors.New("server: OpenDevice without Devices: say how many GPUs clients may register memory on")
	case c.MaxFrame < protocol.MinFrame || c.MaxFrame > protocol.MaxFrame:
		return c, fmt.Errorf("server: MaxFrame %d: want %d..1GiB", c.MaxFrame, protocol.MinFrame)
	case c.MaxClients < 0 || c.MaxClientsPerPeer < 0 || c.MaxHandshakes < 0 || c.MaxRegistrations < 0 || c.MaxInflightJobs < 0 || c.MaxNamespaces < 0 || c.MaxCaches < 0 || c.MaxNamespacesPerPeer < 0:
		return c, errors.New("server: negative limit")
	case int64(c.MaxRegistrations)+int64(c.MaxNamespaces)+int64(c.MaxCaches) >= math.MaxUint32:
		// A connection's ids are u32 and never 0: a free one must remain.
		return c, fmt.Errorf("server: MaxRegistrations + MaxNamespaces + MaxCaches %d: want less than %d", int64(c.MaxRegistrations)+int64(c.MaxNamespaces)+int64(c.MaxCaches), uint32(math.MaxUint32))
	case c.ShutdownTimeout < 0 || c.HandshakeTimeout < 0 || c.FrameTimeout < 0 || c.IdleTimeout < 0 || c.WriteTimeout < 0:
		return c, errors.New("server: negative timeout")
	}
	for _, b := range []struct {
		key                 string
		total, share, least int64
		why                 string
	}{
		{"max_descriptors", int64(c.MaxDescriptors), int64(c.MaxDescriptorsPerPeer), 0, ""},
		{"max_inflight_bytes", c.MaxInflightBytes, c.MaxInflightBytesPerPeer, MaxJobBytes(c.MaxFrame),
			fmt.Sprintf("what one job in a frame of max_frame (%d bytes) holds: raise max_inflight_bytes (the default per peer is half of it) or lower max_frame", c.MaxFrame)},
		{"max_incoming_bytes", c.MaxIncomingBytes, c.MaxIncomingBytesPerPeer, int64(c.MaxFrame),
			"max_frame: one frame of the largest size must fit (the default per peer is half of max_incoming_bytes)"},
		{"max_pinned_keys", int64(c.MaxPinnedKeys), int64(c.MaxPinnedKeysPerPeer), protocol.MaxKeysPerRequest,
			"one Pin of the most keys a request carries must fit"},
		{"max_cache_layers", int64(c.MaxCacheLayers), int64(c.MaxCacheLayersPerPeer), protocol.MaxLayers,
			"one cache of the most layers a registration carries must fit"},
	} {
		if err := checkShare(b.key, b.total, b.share, b.least, b.why); err != nil {
			return c, err
		}
	}
	if c.Name == "" {
		c.Name = "kvhost"
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	return c, nil
}

// checkShare checks a daemon-wide bound, the key server.KEY, and its
// per-peer share, KEY_per_peer: neither negative, and the share at most
// the total and at least least (why says what least must hold).
func checkShare(key string, total, share, least int64, why string) error {
	switch {
	case total < 0 || share < 0:
		return fmt.Errorf("server: %s %d, %s_per_peer %d: want no negative limit", key, total, key, share)
	case share > total:
		return fmt.Errorf("server: %s_per_peer %d: want at most %s, %d", key, share, key, total)
	case share < least:
		return fmt.Errorf("server: %s_per_peer %d: want at least %d, %s", key, share, least, why)
	}
	return nil
}

// regShare is the most bytes one connection may register: its guaranteed
// share of the daemon's total, or less if MaxRegisteredBytes says so.
func (c Config) regShare() int64 {
	return min(c.MaxRegisteredBytes, c.MaxTotalRegisteredBytes/int64(max(c.MaxClients, 1)))
}

// bound is a limit a request can be refused by (CodeLimit): counted in
// Stats.Refusals under its name.
type bound uint8

const (
	boundClients bound = iota
	boundClientsPerPeer
	boundRegistrations
	boundRegisteredBytes
	boundTotalRegisteredBytes
	boundDeviceBytes
	boundDescriptors
	boundDescriptorsPerPeer
	boundInflightJobs
	boundInflightBytes
	boundInflightBytesPerPeer
	boundNamespacesPerPeer
	boundNamespaces
	boundCaches
	boundPins
	boundPinnedKeys
	boundPinnedKeysPerPeer
	boundNamespacesPerDaemon
	boundCacheLayers
	boundCacheLayersPerPeer
	numBounds
)

// boundNames name the bounds: a configuration key, the protocol's
// per-connection limit, or namespaces_per_daemon (the engine's
// MaxNamespaces, which has no key).
var boundNames = [numBounds]string{
	"server.max_clients", "server.max_clients_per_peer", "server.max_registrations",
	"server.max_registered_bytes", "server.max_total_registered_bytes", "server.max_device_registered_bytes",
	"server.max_descriptors", "server.max_descriptors_per_peer", "server.max_inflight_jobs",
	"server.max_inflight_bytes", "server.max_inflight_bytes_per_peer", "server.max_namespaces_per_peer",
	"namespaces_per_connection", "caches_per_connection", "pins_per_connection",
	"server.max_pinned_keys", "server.max_pinned_keys_per_peer", "namespaces_per_daemon",
	"server.max_cache_layers", "server.max_cache_layers_per_peer",
}

// refuse counts a refusal by b and returns the error the client gets.
func (s *Server) refuse(b bound, format string, args ...any) *protocol.Error {
	s.refusals[b].Add(1)
	return perr(protocol.CodeLimit, format, args...)
}

// Server serves the kvhost protocol over a listener.
type Server struct {
	eng  Engine
	cfg  Config
	log  *slog.Logger
	feed *removals.Feed // the engine's removal feed (RemovalSource), or nil

	mu       sync.Mutex
	sessions map[*session]struct{} // every live connection
	pending  map[*session]uint64   // not through Hello yet, by accept number
	admitted int                   // sessions through Hello
	peers    map[int32]*peer       // the peers of live sessions, by pid (known pids only)
	changed  chan struct{}         // closed and replaced when sessions change
	stopping bool
	wg       sync.WaitGroup // sessions
	connSeq  atomic.Uint64  // numbers connections in logs
	regBytes atomic.Int64   // memory registered by all sessions
	jobBytes atomic.Int64   // JobBytes of every session's jobs in flight
	fds      atomic.Int64   // clients' descriptors held (Config.MaxDescriptors)
	regions  atomic.Int64   // host regions registered by all sessions
	layers   atomic.Int64   // layers of every session's registered caches
	refusals [numBounds]atomic.Uint64
	started  time.Time
	devices  []deviceUse // per GPU: memory registered by all sessions

	// incoming is the room of the frames all sessions read and answer
	// (Config.MaxIncomingBytes); incomingWaiting counts the frames
	// waiting for room, here or in their peer's, and incomingWaits the
	// frames that waited.
	incoming        room
	incomingWaiting atomic.Int64
	incomingWaits   atomic.Uint64

	// pinMu guards the pinned keys' counts, every peer's included, and
	// the heap of pins with a lease, by the end of their lease.
	pinMu     sync.Mutex
	pinned    int64
	pinLeases pinHeap

	// nsMu guards the namespaces' counts, every peer's included. It is
	// not held across the engine's Declare, which may wait on the policy
	// plugin: while declarations are in the engine (nsDeclaring), a
	// namespace whose last user lets it go is not released but put in
	// nsIdle, and the last declaration to leave the engine releases those
	// still unused, so that no namespace is released while a session is
	// declaring it.
	nsMu        sync.Mutex
	nsRefs      map[engine.NamespaceID]int // sessions that declared it
	nsCaches    map[cacheGroup]int         // caches registered, all sessions', by namespace and group
	nsDeclaring int                        // declarations in the engine's Declare
	nsIdle      []engine.NamespaceID       // let go while nsDeclaring > 0
}

// peer is what the connections of one client process (its pid, from
// SO_PEERCRED) hold together, bounded by the Config's per-peer limits. A
// session whose peer's pid is unknown (0) has a peer of its own.
type peer struct {
	pid   int32
	refs  int // sessions of the peer; guarded by Server.mu
	conns int // of those, the sessions through Hello; guarded by Server.mu
	// namespaces counts, per geometry, the peer's sessions that hold it
	// declared; guarded by Server.nsMu.
	namespaces map[engine.Geometry]int
	jobBytes   atomic.Int64 // JobBytes of the peer's jobs in flight
	fds        atomic.Int64 // the peer's descriptors held
	layers     atomic.Int64 // layers of the peer's registered caches
	incoming   room         // the room of its sessions' frames (Config.MaxIncomingBytesPerPeer)
	pinned     int64        // the keys the peer's pins hold; guarded by Server.pinMu
}

// holdDescriptor counts a descriptor received from a session of p
// against MaxDescriptors and MaxDescriptorsPerPeer, or says which it
// would pass.
func (s *Server) holdDescriptor(p *peer) *protocol.Error {
	if total := s.fds.Add(1); total > int64(s.cfg.MaxDescriptors) {
		s.fds.Add(-1)
		return s.refuse(boundDescriptors, "the daemon holds %d descriptors of clients (registered memory, descriptors sent with frames), the most it may (server.max_descriptors): the descriptor was closed",
			total-1)
	}
	if held := p.fds.Add(1); held > int64(s.cfg.MaxDescriptorsPerPeer) {
		p.fds.Add(-1)
		s.fds.Add(-1)
		return s.refuse(boundDescriptorsPerPeer, "the daemon holds %d descriptors of %s, the most one process may have it hold (server.max_descriptors_per_peer): the descriptor was closed; unregister memory first",
			held-1, p)
	}
	return nil
}

// releaseDescriptor gives back a descriptor holdDescriptor counted.
func (s *Server) releaseDescriptor(p *peer) {
	p.fds.Add(-1)
	s.fds.Add(-1)
}

// reserveJob counts n bytes of a new job of a session of p against
// MaxInflightBytes and MaxInflightBytesPerPeer, or says which it would
// pass.
func (s *Server) reserveJob(p *peer, n int64) error {
	if total := s.jobBytes.Add(n); total > s.cfg.MaxInflightBytes {
		s.jobBytes.Add(-n)
		return s.refuse(boundInflightBytes, "the jobs in flight of all clients hold %d bytes; this job's %d would pass the daemon's limit of %d (server.max_inflight_bytes): retry once jobs have ended",
			total-n, n, s.cfg.MaxInflightBytes)
	}
	if held := p.jobBytes.Add(n); held > s.cfg.MaxInflightBytesPerPeer {
		p.jobBytes.Add(-n)
		s.jobBytes.Add(-n)
		return s.refuse(boundInflightBytesPerPeer, "the jobs in flight of %s hold %d bytes; this job's %d would pass the most one process may hold, %d (server.max_inflight_bytes_per_peer): retry once its jobs have ended",
			p, held-n, n, s.cfg.MaxInflightBytesPerPeer)
	}
	return nil
}

// releaseJob gives back what reserveJob counted.
func (s *Server) releaseJob(p *peer, n int64) {
	p.jobBytes.Add(-n)
	s.jobBytes.Add(-n)
}

// takeIncoming takes room for a frame body of n bytes a session of p has
// begun to read, from p's share and then from all connections', waiting,
// frames before it first, until there is, or until ctx is done. It
// reports whether it waited.
func (s *Server) takeIncoming(ctx context.Context, p *peer, n int64) (bool, error) {
	waitedPeer, err := p.incoming.take(ctx, n)
	if err != nil {
		return waitedPeer, err
	}
	waited, err := s.incoming.take(ctx, n)
	if err != nil {
		p.incoming.give(n)
		return true, err
	}
	if waited = waited || waitedPeer; waited {
		s.incomingWaits.Add(1)
	}
	return waited, nil
}

// giveIncoming gives back what takeIncoming took.
func (s *Server) giveIncoming(p *peer, n int64) {
	s.incoming.give(n)
	p.incoming.give(n)
}

// newPeer returns the peer of a process (pid 0: unknown) with nothing
// held.
func (s *Server) newPeer(pid int32) *peer {
	p := &peer{pid: pid, namespaces: make(map[engine.Geometry]int)}
	p.incoming.size, p.incoming.waiting = s.cfg.MaxIncomingBytesPerPeer, &s.incomingWaiting
	return p
}

// reserveLayers counts the n layers of a cache a session of p registers
// against MaxCacheLayers and MaxCacheLayersPerPeer, or says which it
// would pass.
func (s *Server) reserveLayers(p *peer, n int) error {
	if total := s.layers.Add(int64(n)); total > int64(s.cfg.MaxCacheLayers) {
		s.layers.Add(-int64(n))
		return s.refuse(boundCacheLayers, "the caches of all clients hold %d layers; this cache's %d would pass the daemon's limit of %d (server.max_cache_layers): unregister caches first",
			total-int64(n), n, s.cfg.MaxCacheLayers)
	}
	if held := p.layers.Add(int64(n)); held > int64(s.cfg.MaxCacheLayersPerPeer) {
		p.layers.Add(-int64(n))
		s.layers.Add(-int64(n))
		return s.refuse(boundCacheLayersPerPeer, "the caches of %s hold %d layers; this cache's %d would pass the most one process may hold, %d (server.max_cache_layers_per_peer): unregister caches first",
			p, held-int64(n), n, s.cfg.MaxCacheLayersPerPeer)
	}
	return nil
}

// cacheGroup is a namespace and a group of connections (Group): what
// PinLoadable asks for. The group "" counts every connection's caches.
type cacheGroup struct {
	ns    engine.NamespaceID
	group string
}

// countCache adds d (1 or -1) to the caches registered in namespace id by
// a session of group (and to those of every group).
func (s *Server) countCache(id engine.NamespaceID, group string, d int) {
	s.nsMu.Lock()
	defer s.nsMu.Unlock()
	add := func(k cacheGroup) {
		if s.nsCaches[k] += d; s.nsCaches[k] <= 0 {
			delete(s.nsCaches, k)
		}
	}
	add(cacheGroup{id, ""}) // every group's
	if group != "" {
		add(cacheGroup{id, group})
	}
}

// hasCache reports whether a cache is registered in namespace id on a
// connection of group ("": any connection), for PinLoadable.
func (s *Server) hasCache(id engine.NamespaceID, group string) bool {
	s.nsMu.Lock()
	defer s.nsMu.Unlock()
	return s.nsCaches[cacheGroup{id, group}] > 0
}

// cachesByFingerprint returns the caches registered on all connections,
// by the fingerprint of their namespace (the Stats reply's caches
// section).
//
// The ids are mapped under nsMu: a namespace whose last cache went could
// otherwise be released and its id given to another geometry between the
// count and the mapping. The engine is called under nsMu where namespaces
// are released too (releaseLocked), so the lock order holds.
func (s *Server) cachesByFingerprint() map[uint64]uint32 {
	s.nsMu.Lock()
	defer s.nsMu.Unlock()
	out := make(map[uint64]uint32, len(s.nsCaches))
	for k, n := range s.nsCaches {
		if k.group != "" {
			continue
		}
		if fp, err := s.eng.Fingerprint(k.ns); err == nil {
			out[fp] += uint32(n)
		}
	}
	return out
}

// releaseLayers gives back what reserveLayers counted.
func (s *Server) releaseLayers(p *peer, n int) {
	p.layers.Add(-int64(n))
	s.layers.Add(-int64(n))
}

// New returns a Server dispatching to eng.
func New(eng Engine, cfg Config) (*Server, error) {
	cfg, err := cfg.withDefaults()
	if err != nil {
		return nil, err
	}
	if eng == nil {
		return nil, errors.New("server: nil engine")
	}
	s := &Server{
		eng: eng, cfg: cfg, log: cfg.Logger,
		sessions: make(map[*session]struct{}), pending: make(map[*session]uint64),
		changed: make(chan struct{}), nsRefs: make(map[engine.NamespaceID]int),
		nsCaches: make(map[cacheGroup]int), peers: make(map[int32]*peer),
		devices: make([]deviceUse, cfg.Devices), started: time.Now(),
	}
	s.incoming.size, s.incoming.waiting = cfg.MaxIncomingBytes, &s.incomingWaiting
	if src, ok := eng.(RemovalSource); ok {
		s.feed = src.Removals()
	}
	return s, nil
}

// deviceUse is the GPU memory registered on one device.
type deviceUse struct {
	regions, bytes atomic.Int64
}

// reserveDevice accounts size bytes registered on device d against
// MaxDeviceBytes.
func (s *Server) reserveDevice(d int, size int64) error {
	u := &s.devices[d]
	if total := u.bytes.Add(size); total > s.cfg.MaxDeviceBytes {
		u.bytes.Add(-size)
		return s.refuse(boundDeviceBytes, "registering %d bytes on device %d would exceed the daemon's limit of %d bytes of registered GPU memory per device (%d registered; server.max_device_registered_bytes)",
			size, d, s.cfg.MaxDeviceBytes, total-size)
	}
	u.regions.Add(1)
	return nil
}

func (s *Server) releaseDevice(d int, size int64) {
	s.devices[d].bytes.Add(-size)
	s.devices[d].regions.Add(-1)
}

// deviceStats reports the GPU memory registered on every device.
func (s *Server) deviceStats() []protocol.DeviceStats {
	if len(s.devices) == 0 {
		return nil
	}
	out := make([]protocol.DeviceStats, len(s.devices))
	var faults map[int]uint64
	if s.cfg.DeviceFaults != nil {
		faults = s.cfg.DeviceFaults()
	}
	for i := range s.devices {
		out[i] = protocol.DeviceStats{Ordinal: uint32(i), Regions: uint64(s.devices[i].regions.Load()),
			Registered: uint64(s.devices[i].bytes.Load()), Limit: uint64(s.cfg.MaxDeviceBytes)}
		if i < len(s.cfg.DeviceUUIDs) {
			out[i].UUID = s.cfg.DeviceUUIDs[i]
		}
		out[i].Faults = faults[i]
	}
	return out
}

// Serve accepts connections on l until ctx is done, then shuts down: it
// stops accepting, stops reading requests, lets in-flight jobs finish for up
// to ShutdownTimeout (delivering their completions), cancels the rest, waits
// for every job to end and releases every session. It returns nil after a
// shutdown, or the listener's error. Serve closes l.
func (s *Server) Serve(ctx context.Context, l *net.UnixListener) error {
	acceptErr := make(chan error, 1)
	go func() {
		var backoff time.Duration
		for {
			c, err := l.AcceptUnix()
			if err != nil {
				if !retryableAccept(err) {
					acceptErr <- err
					return
				}
				// Out of descriptors or memory for a moment: keep serving
				// the clients we have and try again, as net/http does.
				backoff = min(max(2*backoff, 5*time.Millisecond), time.Second)
				s.log.Warn("accept failed; retrying", "err", err, "in", backoff.String())
				select {
				case <-ctx.Done():
					return
				case <-time.After(backoff):
				}
				continue
			}
			backoff = 0
			s.start(c)
		}
	}()
	var err error
	select {
	case <-ctx.Done():
	case err = <-acceptErr:
		err = fmt.Errorf("server: accept: %w", err)
	}
	l.Close()
	s.Shutdown()
	return err
}

// retryableAccept reports whether an accept error is a passing shortage
// (descriptors, memory, an aborted connection) rather than a closed listener.
func retryableAccept(err error) bool {
	for _, e := range []error{unix.EMFILE, unix.ENFILE, unix.ENOBUFS, unix.ENOMEM, unix.ECONNABORTED, unix.EINTR} {
		if errors.Is(err, e) {
			return true
		}
	}
	return false
}

// start registers and runs a session, or refuses the connection. A
// connection counts against MaxHandshakes until its Hello and against
// MaxClients after it; when MaxHandshakes are waiting, the oldest of them
// is closed to make room.
func (s *Server) start(c *net.UnixConn) *session {
	s.mu.Lock()
	if s.stopping {
		s.mu.Unlock()
		c.SetWriteDeadline(time.Now().Add(time.Second))
		c.Write(protocol.AppendFrame(nil, 0, errShuttingDown()))
		c.Close()
		return nil
	}
	var evict *session
	if len(s.pending) >= s.cfg.MaxHandshakes {
		var oldest uint64
		for p, seq := range s.pending {
			if evict == nil || seq < oldest {
				evict, oldest = p, seq
			}
		}
		delete(s.pending, evict)
	}
	sess := newSession(s, c)
	sess.pid = peerPID(c)
	sess.peer = s.peers[sess.pid]
	if sess.peer == nil {
		sess.peer = s.newPeer(sess.pid)
		if sess.pid > 0 {
			s.peers[sess.pid] = sess.peer
		}
	}
	sess.peer.refs++
	s.sessions[sess] = struct{}{}
	s.pending[sess] = sess.seq
	s.notifyLocked()
	s.wg.Add(1)
	s.mu.Unlock()
	if evict != nil {
		evict.log.Info("closing a connection that has not said hello: newer connections need the slot", "max_handshakes", s.cfg.MaxHandshakes)
		evict.abort(perr(protocol.CodeTimeout, "no hello before %d newer connections arrived", s.cfg.MaxHandshakes))
	}
	go func() {
		defer s.wg.Done()
		sess.run()
		s.mu.Lock()
		delete(s.sessions, sess)
		delete(s.pending, sess)
		p := sess.peer
		if sess.admitted {
			s.admitted--
			p.conns--
		}
		if p.refs--; p.refs == 0 && p.pid > 0 {
			delete(s.peers, p.pid)
		}
		s.notifyLocked()
		s.mu.Unlock()
	}()
	return sess
}

// peerPID is the pid of the process at the other end of c (SO_PEERCRED),
// or 0 where the kernel does not give it (a peer in another pid
// namespace, an error).
func peerPID(c *net.UnixConn) int32 {
	raw, err := c.SyscallConn()
	if err != nil {
		return 0
	}
	var pid int32
	raw.Control(func(fd uintptr) {
		if cred, err := unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED); err == nil {
			pid = cred.Pid
		}
	})
	return max(pid, 0)
}

// admit moves a session that said Hello from the handshaking connections to
// the clients, or says why it cannot be a client.
func (s *Server) admit(sess *session) *protocol.Error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if _, ok := s.pending[sess]; !ok {
		// Closed to make room while its Hello was being read.
		return perr(protocol.CodeTimeout, "no hello before %d newer connections arrived", s.cfg.MaxHandshakes)
	}
	delete(s.pending, sess)
	switch {
	case s.stopping:
		return errShuttingDown()
	case s.admitted >= s.cfg.MaxClients:
		return s.refuse(boundClients, "the daemon serves at most %d clients (server.max_clients)", s.cfg.MaxClients)
	}
	p := sess.peer
	if p.pid > 0 && p.conns >= s.cfg.MaxClientsPerPeer {
		return s.refuse(boundClientsPerPeer, "process %d already has %d connections, the most one process may hold (server.max_clients_per_peer)", p.pid, p.conns)
	}
	p.conns++
	s.admitted++
	sess.admitted = true
	s.notifyLocked()
	return nil
}

func (s *Server) notifyLocked() {
	close(s.changed)
	s.changed = make(chan struct{})
}

// declare declares g for a session of p and counts the session as a user
// of the namespace. A geometry new to p is refused, before the engine
// sees it, when p holds MaxNamespacesPerPeer already. The engine's Declare
// runs without nsMu: other sessions' undeclares and closes do not wait
// for it.
func (s *Server) declare(ctx context.Context, p *peer, g engine.Geometry) (engine.NamespaceID, error) {
	s.nsMu.Lock()
	if held := len(p.namespaces); p.namespaces[g] == 0 && held >= s.cfg.MaxNamespacesPerPeer {
		s.nsMu.Unlock()
		return 0, s.refuse(boundNamespacesPerPeer, "%s already holds %d geometries declared, the most one process may hold (server.max_namespaces_per_peer): undeclare one first",
			p, held)
	}
	// The declaration counts against p's bound while it is in the engine:
	// p's sessions cannot pass the bound by declaring at once.
	p.namespaces[g]++
	s.nsDeclaring++
	s.nsMu.Unlock()

	id, err := s.eng.Declare(ctx, g)

	s.nsMu.Lock()
	defer s.nsMu.Unlock()
	if err == nil {
		s.nsRefs[id]++
	} else if p.namespaces[g]--; p.namespaces[g] <= 0 {
		delete(p.namespaces, g)
	}
	if s.nsDeclaring--; s.nsDeclaring == 0 {
		idle := s.nsIdle
		s.nsIdle = nil
		for _, ns := range idle {
			s.releaseLocked(ns)
		}
	}
	if errors.Is(err, engine.ErrLimit) {
		// The engine knows as many namespaces as it may: a limit, which
		// clients may wait out, not a fault of the geometry.
		return 0, s.refuse(boundNamespacesPerDaemon, "the daemon knows as many geometries as it may (namespaces_per_daemon): retry once connections have undeclared or closed theirs: %v", err)
	}
	if err != nil {
		return 0, err
	}
	return id, nil
}

// String names the peer in refusals.
func (p *peer) String() string {
	if p.pid > 0 {
		return fmt.Sprintf("process %d", p.pid)
	}
	return "this connection (its process is unknown)"
}

// undeclare drops a session's use of namespace id, of geometry g, by a
// session of p, and releases it in the engine when no session uses it any
// more: at once, or when the declarations in the engine are done.
func (s *Server) undeclare(p *peer, g engine.Geometry, id engine.NamespaceID) {
	s.nsMu.Lock()
	defer s.nsMu.Unlock()
	if p.namespaces[g]--; p.namespaces[g] <= 0 {
		delete(p.namespaces, g)
	}
	s.nsRefs[id]--
	if s.nsRefs[id] > 0 {
		return
	}
	delete(s.nsRefs, id)
	if s.nsDeclaring > 0 {
		// A declaration in the engine may be handed this namespace.
		if !slices.Contains(s.nsIdle, id) {
			s.nsIdle = append(s.nsIdle, id)
		}
		return
	}
	s.releaseLocked(id)
}

// releaseLocked releases namespace id in the engine unless a session
// declared it again since it was let go. s.nsMu is held.
func (s *Server) releaseLocked(id engine.NamespaceID) {
	if s.nsRefs[id] > 0 {
		return
	}
	if err := s.eng.Release(id); err != nil {
		s.log.Warn("release namespace", "ns", id, "err", err)
	}
}

// Shutdown stops every session as Serve does after its context ends and
// waits for them. New connections are refused from then on.
func (s *Server) Shutdown() {
	s.mu.Lock()
	s.stopping = true
	sessions := make([]*session, 0, len(s.sessions))
	for sess := range s.sessions {
		sessions = append(sessions, sess)
	}
	s.mu.Unlock()
	for _, sess := range sessions {
		sess.stop(s.cfg.ShutdownTimeout)
	}
	s.wg.Wait()
}

// isStopping reports whether Shutdown has begun.
func (s *Server) isStopping() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.stopping
}

// errShuttingDown is what a client is told when the daemon stops: a new
// connection at once, a connected one after its jobs' completions.
func errShuttingDown() *protocol.Error {
	return &protocol.Error{Code: protocol.CodeShuttingDown, Message: "the daemon is shutting down"}
}

// clients is the number of sessions through the handshake.
func (s *Server) clients() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.admitted
}
