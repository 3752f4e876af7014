package server

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math"
	"net"
	"os"
	"slices"
	"sync"
	"sync/atomic"
	"time"
	"unicode/utf8"

	"golang.org/x/sys/unix"

	"github.com/kvhost/kvhost/internal/engine"
	"github.com/kvhost/kvhost/protocol"
	"github.com/kvhost/kvhost/region"
)

// memRegion is memory a client registered: a mapped memfd or shared
// file (host), or imported GPU memory (dev).
type memRegion struct {
	reg  region.Region // host or dev
	host *region.Host
	dev  DeviceMemory
	refs int // layers of registered caches in it
}

// namespace is a declared geometry.
type namespace struct {
	id  engine.NamespaceID
	geo engine.Geometry
}

// cache is a registered paged cache.
type cache struct {
	id        engine.CacheID
	ns        *namespace
	regions   []uint32 // one per layer: as many as the layers counted (reserveLayers)
	numBlocks uint32   // the smallest NumBlocks of its layers
	inflight  int      // jobs in flight; guarded by session.jmu
	// shrinkable are its distinct host regions whose file may be
	// truncated by the client (MemoryShared), checked before each job.
	shrinkable []*region.Host
	group      string // the session's group when it was registered (PinLoadable)
}

// jobEntry is a job in flight.
type jobEntry struct {
	job   *engine.Job
	cache *cache
}

// session serves one connection. Registrations are touched only by the
// run goroutine; jobs are shared with their completion goroutines under jmu.
type session struct {
	srv     *Server
	conn    *net.UnixConn
	log     *slog.Logger
	rd      *frameReader
	ctx     context.Context
	stopCtx context.CancelFunc
	seq     uint64    // accept number
	born    time.Time // accept time: the handshake deadline counts from it
	// readCtx ends when reading stops (stop): a frame waiting for room
	// (Config.MaxIncomingBytes) waits no more, and the engine's answer to
	// a request under way (a purge, a lookup, a declaration) is
	// cancelled. Jobs run on ctx: they get the shutdown's grace period.
	readCtx  context.Context
	stopRead context.CancelFunc

	wmu   sync.Mutex
	wbuf  []byte
	wdl   time.Time    // the write deadline set on conn
	wdead bool         // a write failed: the stream is cut mid-frame
	wcap  atomic.Int64 // unix ns; writes end by then (set by stop and release)

	admitted   bool  // through Hello and counted as a client; guarded by srv.mu
	pid        int32 // the peer's pid (SO_PEERCRED), 0 if unknown; set before run
	peer       *peer // what the peer's sessions hold together; set before run
	hello      bool
	regions    map[uint32]*memRegion
	regBytes   int64 // bytes of the regions, counted against the limits
	namespaces map[uint32]*namespace
	caches     map[uint32]*cache
	group      string // the caches' group (Group); "" for none
	nextID     uint32
	pins       sessionPins               // pins.go
	streams    map[uint32]*removalStream // removal subscriptions (removals.go)
	nextStream uint32

	jmu     sync.Mutex
	jobs    map[uint64]*jobEntry
	jobWG   sync.WaitGroup // engine jobs not yet done
	writeWG sync.WaitGroup // completion goroutines

	stopOnce sync.Once
	grace    atomic.Int64 // nanoseconds; set by stop
	released chan struct{}
}

func newSession(s *Server, c *net.UnixConn) *session {
	ctx, cancel := context.WithCancel(context.Background())
	readCtx, stopRead := context.WithCancel(ctx)
	seq := s.connSeq.Add(1)
	// Until its Hello, a connection's frames are bounded by the
	// handshake's limit, not MaxFrame: a peer that has not said who it is
	// cannot make the daemon read (and allocate) MaxFrame bytes for each of
	// MaxHandshakes connections.
	sess := &session{
		srv:        s,
		conn:       c,
		seq:        seq,
		born:       time.Now(),
		log:        s.log.With("conn", seq),
		rd:         newFrameReader(c, protocol.MaxHandshakeFrame, s.cfg.MaxRegistrations+maxFdsPerMsg, s.cfg.FrameTimeout),
		ctx:        ctx,
		stopCtx:    cancel,
		readCtx:    readCtx,
		stopRead:   stopRead,
		regions:    make(map[uint32]*memRegion),
		namespaces: make(map[uint32]*namespace),
		caches:     make(map[uint32]*cache),
		jobs:       make(map[uint64]*jobEntry),
		released:   make(chan struct{}),
	}
	// Every descriptor the client sends counts against the daemon's and
	// its process's bounds until it is closed.
	sess.rd.hold = func() *protocol.Error { return s.holdDescriptor(sess.peer) }
	sess.rd.drop = func() { s.releaseDescriptor(sess.peer) }
	// Every frame body beyond UncountedBody bytes holds room in the
	// daemon's and its process's bounds until it is answered.
	sess.rd.room = func(n int) (bool, error) { return s.takeIncoming(sess.readCtx, sess.peer, int64(n)) }
	sess.rd.free = func(n int) { s.giveIncoming(sess.peer, int64(n)) }
	return sess
}

// stop makes run return: reading stops at once; jobs get grace to finish.
func (s *session) stop(grace time.Duration) {
	s.stopOnce.Do(func() {
		s.grace.Store(int64(grace))
		// A client that does not read must not hold the shutdown: writes
		// blocked past the grace period fail.
		s.capWrites(time.Now().Add(grace + time.Second))
		s.stopRead()
		s.conn.CloseRead()
	})
}

// abort tells the client why and ends the session (reading stops; jobs are
// cancelled).
func (s *session) abort(why *protocol.Error) {
	s.send(0, why)
	s.stop(0)
}

// capWrites makes every write, the one in progress included, end by t.
func (s *session) capWrites(t time.Time) {
	s.wcap.Store(t.UnixNano())
	s.conn.SetWriteDeadline(t)
}

// readDeadlines returns the deadlines of the next frame (see
// frameReader.next): before Hello, the handshake's for the whole frame;
// after it, the idle limit while the session holds nothing.
func (s *session) readDeadlines() (wait, by time.Time) {
	cfg := s.srv.cfg
	if !s.hello {
		dl := s.born.Add(cfg.HandshakeTimeout)
		return dl, dl
	}
	if len(s.regions) == 0 && len(s.namespaces) == 0 {
		// No cache without a namespace, no job without a cache.
		return time.Now().Add(cfg.IdleTimeout), time.Time{}
	}
	return time.Time{}, time.Time{}
}

// run reads and dispatches requests until the client goes away, then
// releases everything the session holds.
func (s *session) run() {
	defer s.release()
	for {
		h, body, err := s.rd.next(s.readDeadlines())
		if err != nil {
			cfg := s.srv.cfg
			switch {
			case errors.Is(err, errWaitTimeout) && !s.hello, errors.Is(err, errFrameTimeout) && !s.hello:
				s.log.Info("closing a connection that did not complete its hello in time", "timeout", cfg.HandshakeTimeout.String())
				s.send(0, perr(protocol.CodeTimeout, "no hello within %v of connecting", cfg.HandshakeTimeout))
			case errors.Is(err, errWaitTimeout):
				s.log.Info("closing an idle connection that holds no registration", "timeout", cfg.IdleTimeout.String())
				s.send(0, perr(protocol.CodeTimeout, "idle for %v holding no memory region or namespace", cfg.IdleTimeout))
			case errors.Is(err, errFrameTimeout):
				s.log.Warn("closing a connection that stopped in the middle of a frame", "err", err)
				s.send(0, perr(protocol.CodeTimeout, "a frame did not complete within %v: %v", cfg.FrameTimeout, err))
			case errors.Is(err, io.EOF), errors.Is(err, net.ErrClosed), errors.Is(err, context.Canceled):
			case errors.Is(err, protocol.ErrTooLarge) && !s.hello:
				s.log.Info("closing a connection whose first frame exceeds the handshake's limit", "err", err)
				s.send(h.ID, perr(protocol.CodeMalformed, "before the handshake: %v", err))
			case errors.Is(err, protocol.ErrTooLarge), errors.Is(err, protocol.ErrMalformed), errors.Is(err, errProtocol):
				s.log.Warn("closing connection", "err", err)
				s.send(h.ID, &protocol.Error{Code: protocol.CodeMalformed, Message: err.Error()})
			default:
				s.log.Debug("connection ended", "err", err)
			}
			return
		}
		ok := s.handle(h, body)
		s.rd.done()
		if !ok {
			return
		}
	}
}

// send writes one frame. A write that cannot complete within WriteTimeout
// (the client does not read) or fails otherwise cuts the stream: later
// frames are dropped and reading stops, so the session ends.
func (s *session) send(id uint64, m protocol.Message) {
	s.wmu.Lock()
	defer s.wmu.Unlock()
	if s.wdead {
		return
	}
	s.wbuf = protocol.AppendFrame(s.wbuf[:0], id, m)
	// Move the deadline only when half of it is used up: back-to-back
	// frames cost no timer update.
	timeout := s.srv.cfg.WriteTimeout
	if now := time.Now(); s.wcap.Load() == 0 && s.wdl.Sub(now) < timeout/2 {
		s.wdl = now.Add(timeout)
		s.conn.SetWriteDeadline(s.wdl)
		if c := s.wcap.Load(); c != 0 {
			// capWrites ran meanwhile: its deadline stands.
			s.conn.SetWriteDeadline(time.Unix(0, c))
		}
	}
	if _, err := s.conn.Write(s.wbuf); err != nil {
		s.wdead = true
		if errors.Is(err, os.ErrDeadlineExceeded) && s.wcap.Load() == 0 {
			s.log.Warn("closing a connection that does not read its replies", "timeout", timeout.String())
		} else {
			s.log.Debug("write failed", "err", err)
		}
		s.conn.CloseRead()
	}
	if cap(s.wbuf) > 1<<20 {
		s.wbuf = nil
	}
}

func perr(code protocol.Code, format string, args ...any) *protocol.Error {
	return &protocol.Error{Code: code, Message: fmt.Sprintf(format, args...)}
}

// handle dispatches one frame; false ends the session.
func (s *session) handle(h protocol.Header, body []byte) bool {
	if !s.hello {
		if h.Type != protocol.TypeHello {
			s.send(h.ID, perr(protocol.CodeHandshake, "the first frame must be hello, got %s", h.Type))
			return false
		}
		var m protocol.Hello
		if err := m.DecodeBody(body); err != nil {
			s.send(h.ID, perr(protocol.CodeMalformed, "%v", err))
			return false
		}
		if m.Version < protocol.MinVersion || m.Version > protocol.Version {
			s.send(h.ID, perr(protocol.CodeVersion, "client speaks version %d, this daemon speaks %d to %d", m.Version, protocol.MinVersion, protocol.Version))
			return false
		}
		if e := s.srv.admit(s); e != nil {
			s.send(h.ID, e)
			return false
		}
		s.hello = true
		s.log = s.log.With("name", m.Client)
		c := s.srv.cfg
		s.rd.maxFrame = c.MaxFrame
		// The Welcome of the client's version: a version-1 client reads
		// no features (and refuses bytes after the server name).
		s.send(h.ID, &protocol.Welcome{
			Version: m.Version, MaxFrame: uint32(c.MaxFrame),
			MaxRegistrations: uint32(c.MaxRegistrations), MaxInflightJobs: uint32(c.MaxInflightJobs),
			MaxNamespaces: uint32(c.MaxNamespaces), MaxCaches: uint32(c.MaxCaches),
			MaxKeys: protocol.MaxKeysPerRequest, MaxKeyLen: protocol.MaxKeyLen, Server: c.Name,
			Features: s.srv.features(),
		})
		s.log.Debug("client connected")
		return true
	}
	if h.Type&protocol.TypeReply != 0 || h.Type == protocol.TypeCompletion || h.Type == protocol.TypeHello {
		s.send(h.ID, perr(protocol.CodeUnknownType, "%s is not a request (after the handshake)", h.Type))
		return true
	}
	var start time.Time
	if s.srv.cfg.OnRequest != nil {
		start = time.Now()
	}
	m, err := protocol.Decode(h.Type, body)
	if err != nil {
		code := protocol.CodeMalformed
		if errors.Is(err, protocol.ErrUnknownType) {
			code = protocol.CodeUnknownType
		}
		s.send(h.ID, perr(code, "%v", err))
		return true
	}
	var reply protocol.Message
	var after func() // what follows the reply (a removal stream's start)
	switch m := m.(type) {
	case *protocol.RegisterMemory:
		reply, err = s.registerMemory(m)
	case *protocol.UnregisterMemory:
		reply, err = s.unregisterMemory(m)
	case *protocol.Declare:
		reply, err = s.declare(m)
	case *protocol.Undeclare:
		reply, err = s.undeclare(m)
	case *protocol.RegisterCache:
		reply, err = s.registerCache(m)
	case *protocol.UnregisterCache:
		reply, err = s.unregisterCache(m)
	case *protocol.Lookup:
		reply, err = s.lookup(m)
	case *protocol.Delete:
		reply, err = s.delete(m)
	case *protocol.Transfer:
		return s.transfer(h.ID, m)
	case *protocol.Cancel:
		reply, err = s.cancel(m)
	case *protocol.StatsRequest:
		reply, err = s.stats()
	case *protocol.Purge:
		reply, err = s.purge(m)
	case *protocol.Pin:
		reply, err = s.pin(m)
	case *protocol.Unpin:
		reply, err = s.unpin(m)
	case *protocol.Group:
		reply, err = s.joinGroup(m)
	case *protocol.SubscribeRemovals:
		reply, after, err = s.subscribeRemovals(m)
	case *protocol.UnsubscribeRemovals:
		reply, err = s.unsubscribeRemovals(m)
	case *protocol.LookupTableRequest:
		if s.srv.cfg.LookupTable == "" {
			err = perr(protocol.CodeUnsupported, "this daemon keeps no shared lookup table (engine.lookup_table = false)")
		} else {
			reply = &protocol.TableLocation{Path: s.srv.cfg.LookupTable}
		}
	default:
		err = perr(protocol.CodeUnknownType, "%s is not a request", h.Type)
	}
	if err != nil {
		reply = errorOf(err)
	}
	s.send(h.ID, reply)
	if after != nil {
		after()
	}
	if s.srv.cfg.OnRequest != nil {
		s.srv.cfg.OnRequest(h.Type, time.Since(start))
	}
	return true
}

// newID returns the next region, namespace or cache id: one counter for
// all three, never 0 and, once the counter has wrapped, never an id still
// in use. A free id always exists: a session holds fewer than 2^32-1
// (Config.withDefaults bounds MaxRegistrations + MaxNamespaces +
// MaxCaches).
func (s *session) newID() uint32 {
	for {
		s.nextID++
		id := s.nextID
		if id == 0 || s.regions[id] != nil || s.namespaces[id] != nil || s.caches[id] != nil {
			continue
		}
		return id
	}
}

func (s *session) registerMemory(m *protocol.RegisterMemory) (protocol.Message, error) {
	if m.Kind == protocol.MemoryCUDAIPC {
		return s.registerDevice(m)
	}
	fd, refused := s.rd.takeFd()
	if refused != nil {
		return nil, refused
	}
	if fd < 0 {
		return nil, perr(protocol.CodeNoFd, "%s registration without a descriptor (send it as SCM_RIGHTS with the frame)", m.Kind)
	}
	if len(s.regions) >= s.srv.cfg.MaxRegistrations {
		s.closeFd(fd)
		return nil, s.srv.refuse(boundRegistrations, "at most %d memory regions per connection (server.max_registrations)", s.srv.cfg.MaxRegistrations)
	}
	size := int64(m.Size)
	if size < 0 || size > math.MaxInt {
		s.closeFd(fd)
		return nil, perr(protocol.CodeInvalid, "size %d does not fit the address space", m.Size)
	}
	open := region.OpenMemfd
	if m.Kind == protocol.MemoryShared {
		if !s.srv.cfg.SharedFiles {
			s.closeFd(fd)
			return nil, perr(protocol.CodeUnsupported, "this daemon does not accept unsealed shared-memory files; register a memfd sealed with F_SEAL_SHRINK")
		}
		open = region.OpenShared
	} else if err := checkMemfd(fd, size); err != nil {
		s.closeFd(fd)
		return nil, err
	}
	if err := s.reserveBytes(size); err != nil {
		s.closeFd(fd)
		return nil, err
	}
	h, err := open(fd, size)
	if err != nil {
		s.releaseBytes(size)
		s.closeFd(fd)
		return nil, perr(protocol.CodeBadFd, "%v", err)
	}
	id := s.newID()
	s.regions[id] = &memRegion{reg: h, host: h}
	return &protocol.MemoryRegistered{Region: id, Inode: h.ID()}, nil
}

// registerDevice imports a client's GPU memory by CUDA IPC handle.
func (s *session) registerDevice(m *protocol.RegisterMemory) (protocol.Message, error) {
	cfg := s.srv.cfg
	if cfg.OpenDevice == nil {
		return nil, perr(protocol.CodeUnsupported, "GPU memory (CUDA IPC) registration is not supported on this daemon (no GPU support); register host memory by memfd")
	}
	if m.Device >= uint32(cfg.Devices) {
		return nil, perr(protocol.CodeInvalid, "device %d: this daemon serves GPUs 0..%d", m.Device, cfg.Devices-1)
	}
	if len(s.regions) >= cfg.MaxRegistrations {
		return nil, s.srv.refuse(boundRegistrations, "at most %d memory regions per connection (server.max_registrations)", cfg.MaxRegistrations)
	}
	off, size := int64(m.Offset), int64(m.Size)
	if off < 0 || size <= 0 || size > math.MaxInt64-off {
		return nil, perr(protocol.CodeInvalid, "range [%d, +%d) of the IPC allocation overflows", m.Offset, m.Size)
	}
	dev := int(m.Device)
	if size > cfg.MaxDeviceBytes {
		return nil, s.srv.refuse(boundDeviceBytes, "registering %d bytes on device %d exceeds the daemon's limit of %d bytes of registered GPU memory per device (server.max_device_registered_bytes)", size, dev, cfg.MaxDeviceBytes)
	}
	if err := s.srv.reserveDevice(dev, size); err != nil {
		return nil, err
	}
	mem, err := cfg.OpenDevice(s.ctx, dev, m.Handle, off, size)
	if err != nil {
		s.srv.releaseDevice(dev, size)
		var pe *protocol.Error
		switch {
		case errors.As(err, &pe):
			return nil, pe
		case errors.Is(err, region.ErrBounds):
			return nil, perr(protocol.CodeInvalid, "device %d: [%d, +%d) is not inside the exported allocation: %v", dev, off, size, err)
		}
		return nil, perr(protocol.CodeBadHandle, "device %d: the IPC handle names no memory this daemon can import there (stale, forged, or another device's): %v", dev, err)
	}
	if mem.Ordinal() != dev || mem.Len() != size {
		mem.Close()
		s.srv.releaseDevice(dev, size)
		return nil, perr(protocol.CodeInternal, "device %d: the import is %d bytes on device %d, want %d bytes", dev, mem.Len(), mem.Ordinal(), size)
	}
	id := s.newID()
	s.regions[id] = &memRegion{reg: mem, dev: mem}
	s.log.Debug("registered GPU memory", "device", dev, "bytes", size, "region", id)
	return &protocol.MemoryRegistered{Region: id}, nil
}

// closeRegion gives back a region's accounting and unmaps or closes it.
// No job may be using it.
func (s *session) closeRegion(r *memRegion) {
	if r.dev != nil {
		s.srv.releaseDevice(r.dev.Ordinal(), r.dev.Len())
		if err := r.dev.Close(); err != nil {
			s.log.Warn("close imported GPU memory", "device", r.dev.Ordinal(), "err", err)
		}
		return
	}
	s.releaseBytes(r.host.Len())
	if err := r.host.Close(); err != nil {
		s.log.Warn("unmap region", "err", err)
	}
	s.srv.releaseDescriptor(s.peer) // the region held the client's descriptor
}

// closeFd closes a client's descriptor the session took and no region
// holds, and gives it back.
func (s *session) closeFd(fd int) {
	unix.Close(fd)
	s.srv.releaseDescriptor(s.peer)
}

// checkMemfd accepts a regular shared-memory file of at least size bytes
// sealed against shrinking: the client cannot pull pages from under a copy.
func checkMemfd(fd int, size int64) error {
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return perr(protocol.CodeBadFd, "fstat: %v", err)
	}
	if st.Mode&unix.S_IFMT != unix.S_IFREG {
		return perr(protocol.CodeBadFd, "descriptor is not a memfd (mode %o)", st.Mode)
	}
	if st.Size < size {
		return perr(protocol.CodeBadFd, "memfd has %d bytes, registration asks for %d", st.Size, size)
	}
	if size > math.MaxInt {
		return perr(protocol.CodeBadFd, "size %d does not fit the address space", size)
	}
	seals, err := unix.FcntlInt(uintptr(fd), unix.F_GET_SEALS, 0)
	if err != nil {
		return perr(protocol.CodeBadFd, "descriptor is not a memfd (F_GET_SEALS: %v)", err)
	}
	if seals&unix.F_SEAL_SHRINK == 0 {
		return perr(protocol.CodeBadFd, "memfd is not sealed with F_SEAL_SHRINK (create it with MFD_ALLOW_SEALING and add the seal)")
	}
	return nil
}

func (s *session) unregisterMemory(m *protocol.UnregisterMemory) (protocol.Message, error) {
	r := s.regions[m.Region]
	if r == nil {
		return nil, perr(protocol.CodeUnknownRegion, "region %d", m.Region)
	}
	if r.refs > 0 {
		return nil, perr(protocol.CodeInUse, "region %d holds %d layers of registered caches", m.Region, r.refs)
	}
	delete(s.regions, m.Region)
	s.closeRegion(r)
	return &protocol.Empty{T: protocol.TypeUnregisterMemory | protocol.TypeReply}, nil
}

// reserveBytes accounts size bytes of registered memory against the
// connection's and the daemon's limits, before the memory is mapped.
func (s *session) reserveBytes(size int64) error {
	cfg := s.srv.cfg
	if share := cfg.regShare(); s.regBytes+size > share {
		return s.srv.refuse(boundRegisteredBytes, "registering %d bytes would exceed this connection's limit of %d bytes of registered memory (%d registered; server.max_registered_bytes, or max_total_registered_bytes / max_clients if less)",
			size, share, s.regBytes)
	}
	if total := s.srv.regBytes.Add(size); total > cfg.MaxTotalRegisteredBytes {
		s.srv.regBytes.Add(-size)
		return s.srv.refuse(boundTotalRegisteredBytes, "registering %d bytes would exceed the daemon's limit of %d bytes of registered memory (server.max_total_registered_bytes)",
			size, cfg.MaxTotalRegisteredBytes)
	}
	s.regBytes += size
	s.srv.regions.Add(1)
	return nil
}

func (s *session) releaseBytes(size int64) {
	s.regBytes -= size
	s.srv.regBytes.Add(-size)
	s.srv.regions.Add(-1)
}

func (s *session) declare(m *protocol.Declare) (protocol.Message, error) {
	g := m.Geometry
	geo := engine.Geometry{
		Model: g.Model, Layers: int(g.Layers), KVHeads: int(g.KVHeads), HeadSize: int(g.HeadSize),
		DtypeSize: int(g.DtypeSize), MLA: g.MLA, TokensPerBlock: int(g.TokensPerBlock),
		TokensPerKey: int(g.TokensPerKey), TPRank: int(g.TPRank), TPSize: int(g.TPSize),
	}
	if err := geo.Validate(); err != nil {
		return nil, err
	}
	// The fingerprint the namespace's keys are indexed (and mirrored into
	// the lookup table) under: a vllm-fs mount's files carry the mount's.
	reply := func(id uint32, ns engine.NamespaceID) (protocol.Message, error) {
		fp, err := s.srv.eng.Fingerprint(ns)
		if err != nil {
			return nil, err
		}
		return &protocol.Declared{NS: id, BlocksPerKey: uint32(geo.BlocksPerKey()), Fingerprint: fp, KeyBytes: uint64(geo.KeyBytes())}, nil
	}
	for id, ns := range s.namespaces {
		if ns.geo == geo {
			return reply(id, ns.id)
		}
	}
	if len(s.namespaces) >= s.srv.cfg.MaxNamespaces {
		return nil, s.srv.refuse(boundNamespaces, "at most %d namespaces per connection", s.srv.cfg.MaxNamespaces)
	}
	nsID, err := s.srv.declare(s.readCtx, s.peer, geo)
	if err != nil {
		return nil, err
	}
	id := s.newID()
	r, err := reply(id, nsID)
	if err != nil { // the engine is closing: the declaration is not kept
		s.srv.undeclare(s.peer, geo, nsID)
		return nil, err
	}
	s.namespaces[id] = &namespace{id: nsID, geo: geo}
	return r, nil
}

func (s *session) undeclare(m *protocol.Undeclare) (protocol.Message, error) {
	ns := s.namespaces[m.NS]
	if ns == nil {
		return nil, perr(protocol.CodeUnknownNS, "namespace %d", m.NS)
	}
	for id, c := range s.caches {
		if c.ns == ns {
			return nil, perr(protocol.CodeInUse, "namespace %d has registered cache %d", m.NS, id)
		}
	}
	// A pin lasts until Unpin, its lease's end or the connection's end
	// (docs/protocol.md): the namespace it is in stays declared.
	if held := s.heldPins(m.NS); len(held) > 0 {
		return nil, perr(protocol.CodeInUse, "namespace %d has held pin(s) %s: unpin them first", m.NS, pinList(held))
	}
	delete(s.namespaces, m.NS)
	s.srv.undeclare(s.peer, ns.geo, ns.id)
	return &protocol.Empty{T: protocol.TypeUndeclare | protocol.TypeReply}, nil
}

// extent returns the end of the last byte a layer addresses, or false when
// the arithmetic overflows.
func extent(l protocol.Layer, planes int, blockBytes int64) (int64, bool) {
	end := l.Offset
	add := func(n, stride int64) bool {
		if n == 0 || stride == 0 {
			return true
		}
		if stride > (math.MaxInt64-end)/n {
			return false
		}
		end += n * stride
		return true
	}
	ok := add(int64(planes-1), l.PlaneStride) && add(int64(l.NumBlocks)-1, l.BlockStride) && add(1, blockBytes)
	return end, ok
}

func (s *session) registerCache(m *protocol.RegisterCache) (protocol.Message, error) {
	ns := s.namespaces[m.NS]
	if ns == nil {
		return nil, perr(protocol.CodeUnknownNS, "namespace %d", m.NS)
	}
	if len(m.Layers) != ns.geo.Layers {
		return nil, perr(protocol.CodeInvalid, "%d layer tensors for a geometry of %d layers", len(m.Layers), ns.geo.Layers)
	}
	if len(s.caches) >= s.srv.cfg.MaxCaches {
		return nil, s.srv.refuse(boundCaches, "at most %d caches per connection", s.srv.cfg.MaxCaches)
	}
	layers := make([]engine.LayerTensor, len(m.Layers))
	regions := make([]uint32, len(m.Layers))
	minBlocks := uint32(math.MaxUint32)
	var shrinkable []*region.Host
	for i, l := range m.Layers {
		r := s.regions[l.Region]
		if r == nil {
			return nil, perr(protocol.CodeUnknownRegion, "layer %d: region %d", i, l.Region)
		}
		if l.NumBlocks == 0 {
			return nil, perr(protocol.CodeInvalid, "layer %d: 0 blocks", i)
		}
		end, ok := extent(l, ns.geo.Planes(), ns.geo.BlockBytes())
		if !ok || end > r.reg.Len() {
			return nil, perr(protocol.CodeInvalid, "layer %d: %d blocks of %d bytes at offset %d (block stride %d, plane stride %d) do not fit region %d of %d bytes",
				i, l.NumBlocks, ns.geo.BlockBytes(), l.Offset, l.BlockStride, l.PlaneStride, l.Region, r.reg.Len())
		}
		if r.host != nil && r.host.Shrinkable() && !slices.Contains(shrinkable, r.host) {
			shrinkable = append(shrinkable, r.host)
		}
		layers[i] = engine.LayerTensor{Region: r.reg, Offset: l.Offset, BlockStride: l.BlockStride, PlaneStride: l.PlaneStride, NumBlocks: int(l.NumBlocks)}
		regions[i] = l.Region
		minBlocks = min(minBlocks, l.NumBlocks)
	}
	if err := s.srv.reserveLayers(s.peer, len(layers)); err != nil {
		return nil, err
	}
	cid, err := s.srv.eng.RegisterCache(ns.id, layers)
	if err != nil {
		s.srv.releaseLayers(s.peer, len(layers))
		return nil, err
	}
	for _, r := range regions {
		s.regions[r].refs++
	}
	s.srv.countCache(ns.id, s.group, 1)
	id := s.newID()
	s.caches[id] = &cache{id: cid, ns: ns, regions: regions, numBlocks: minBlocks, shrinkable: shrinkable, group: s.group}
	return &protocol.CacheRegistered{Cache: id}, nil
}

func (s *session) unregisterCache(m *protocol.UnregisterCache) (protocol.Message, error) {
	c := s.caches[m.Cache]
	if c == nil {
		return nil, perr(protocol.CodeUnknownCache, "cache %d", m.Cache)
	}
	s.jmu.Lock()
	inflight := c.inflight
	s.jmu.Unlock()
	if inflight > 0 {
		return nil, perr(protocol.CodeInUse, "cache %d has %d jobs in flight", m.Cache, inflight)
	}
	if err := s.srv.eng.UnregisterCache(c.id); err != nil {
		return nil, err
	}
	delete(s.caches, m.Cache)
	s.srv.countCache(c.ns.id, c.group, -1)
	s.srv.releaseLayers(s.peer, len(c.regions))
	for _, r := range c.regions {
		s.regions[r].refs--
	}
	return &protocol.Empty{T: protocol.TypeUnregisterCache | protocol.TypeReply}, nil
}

func (s *session) lookup(m *protocol.Lookup) (protocol.Message, error) {
	ns := s.namespaces[m.NS]
	if ns == nil {
		return nil, perr(protocol.CodeUnknownNS, "namespace %d", m.NS)
	}
	n, err := s.srv.eng.Lookup(s.readCtx, ns.id, m.Keys)
	if err != nil {
		return nil, err
	}
	return &protocol.Count{T: protocol.TypeLookup | protocol.TypeReply, Count: uint32(n)}, nil
}

func (s *session) delete(m *protocol.Delete) (protocol.Message, error) {
	ns := s.namespaces[m.NS]
	if ns == nil {
		return nil, perr(protocol.CodeUnknownNS, "namespace %d", m.NS)
	}
	n, err := s.srv.eng.Delete(s.readCtx, ns.id, m.Keys)
	if err != nil {
		return nil, err
	}
	return &protocol.Count{T: protocol.TypeDelete | protocol.TypeReply, Count: uint32(n)}, nil
}

// purge removes every file of a namespace, declared by any client or by
// none (an operator's kvhost purge).
func (s *session) purge(m *protocol.Purge) (protocol.Message, error) {
	var r engine.PurgeResult
	var err error
	what := []any{"fingerprint", fmt.Sprintf("%016x", m.Fingerprint)}
	if m.Model != "" {
		r, err = s.srv.eng.PurgeModel(s.readCtx, m.Model)
		what = []any{"model", m.Model}
	} else {
		r, err = s.srv.eng.Purge(s.readCtx, m.Fingerprint)
	}
	if err != nil {
		return nil, err
	}
	s.log.Info("server: purged", append(what, "pid", s.pid, "namespaces", r.Namespaces, "files", r.Files, "keys", r.Keys, "bytes", r.Bytes,
		"pinned", r.Pinned, "left", r.Left, "others", r.Others, "objects", r.Objects)...)
	return &protocol.Purged{Namespaces: uint64(r.Namespaces), Files: uint64(r.Files), Keys: uint64(r.Keys), Bytes: uint64(max(r.Bytes, 0)),
		Pinned: uint64(r.Pinned), Left: uint64(r.Left)}, nil
}

// transfer starts a store or load job: the reply (its id) is written before
// its completion goroutine starts, so the completion always follows it.
func (s *session) transfer(id uint64, m *protocol.Transfer) bool {
	fail := func(err error) bool {
		s.send(id, errorOf(err))
		return true
	}
	c := s.caches[m.Cache]
	if c == nil {
		return fail(perr(protocol.CodeUnknownCache, "cache %d", m.Cache))
	}
	bpk := c.ns.geo.BlocksPerKey()
	if err := m.CheckNoBlock(); err != nil {
		return fail(perr(protocol.CodeInvalid, "%v", err))
	}
	// Every key's block count first: the blocks are sized from the
	// namespace's count, which a request that gives each key fewer must
	// not make the daemon allocate (up to 4096 keys × 4096 blocks).
	for i, b := range m.Blocks {
		if len(b) != bpk {
			return fail(perr(protocol.CodeInvalid, "key %d: %d blocks, the namespace has %d per key", i, len(b), bpk))
		}
	}
	blocks := make([][]int, len(m.Blocks))
	flat := make([]int, 0, len(m.Blocks)*bpk)
	for i, b := range m.Blocks {
		for _, blk := range b {
			if blk == protocol.NoBlock { // a load's (CheckNoBlock): not loaded
				flat = append(flat, engine.NoBlock)
				continue
			}
			if blk >= c.numBlocks {
				return fail(perr(protocol.CodeInvalid, "key %d: block %d: the cache has %d blocks", i, blk, c.numBlocks))
			}
			flat = append(flat, int(blk))
		}
		blocks[i] = flat[len(flat)-bpk : len(flat) : len(flat)]
	}
	for _, h := range c.shrinkable {
		// A file already truncated fails here with a clear message; one
		// truncated during the job fails the job (region.Guard).
		if err := h.CheckSize(); err != nil {
			return fail(perr(protocol.CodeBadFd, "cache %d: %v", m.Cache, err))
		}
	}
	s.jmu.Lock()
	if len(s.jobs) >= s.srv.cfg.MaxInflightJobs {
		s.jmu.Unlock()
		return fail(s.srv.refuse(boundInflightJobs, "at most %d jobs in flight per connection (server.max_inflight_jobs)", s.srv.cfg.MaxInflightJobs))
	}
	charge := JobBytes(m.Keys, bpk)
	if err := s.srv.reserveJob(s.peer, charge); err != nil {
		s.jmu.Unlock()
		return fail(err)
	}
	var job *engine.Job
	var err error
	if m.Kind == protocol.JobLoad {
		req := engine.LoadRequest{Cache: c.id, Keys: m.Keys, Blocks: blocks}
		if r := m.Layers; r != nil { // a LoadLayers: the engine checks the range against the namespace's layers
			req.Layers = engine.LayerRange{First: int(r.First), Count: int(r.Count)}
		}
		job, err = s.srv.eng.Load(s.ctx, req)
	} else {
		job, err = s.srv.eng.Store(s.ctx, engine.StoreRequest{Cache: c.id, Keys: m.Keys, Blocks: blocks})
	}
	if err != nil {
		s.srv.releaseJob(s.peer, charge)
		s.jmu.Unlock()
		return fail(err)
	}
	jid := uint64(job.ID())
	s.jobs[jid] = &jobEntry{job: job, cache: c}
	c.inflight++
	s.jobWG.Add(1)
	s.writeWG.Add(1)
	s.jmu.Unlock()
	s.send(id, &protocol.JobAccepted{T: m.Type() | protocol.TypeReply, Job: jid})
	go s.complete(jid, m.Kind, len(m.Keys), job, c, charge)
	return true
}

// complete waits for a job, releases its slot and the bytes it was
// counted to hold, and pushes its completion.
func (s *session) complete(id uint64, kind protocol.JobKind, nkeys int, job *engine.Job, c *cache, charge int64) {
	defer s.writeWG.Done()
	<-job.Done()
	res, err := job.Wait(context.Background())
	s.jmu.Lock()
	delete(s.jobs, id)
	c.inflight--
	s.jmu.Unlock()
	s.srv.releaseJob(s.peer, charge)
	s.jobWG.Done()
	s.send(0, completionOf(id, kind, nkeys, res, err))
}

func completionOf(id uint64, kind protocol.JobKind, nkeys int, res engine.Result, err error) *protocol.Completion {
	m := &protocol.Completion{Job: id, Kind: kind, Bytes: uint64(res.Bytes), Duration: uint64(res.Duration), Keys: make([]protocol.KeyOutcome, nkeys)}
	for i := range m.Keys {
		var k engine.KeyResult
		switch {
		case i < len(res.Keys):
			k = res.Keys[i]
		case err != nil:
			k = engine.KeyResult{Outcome: engine.OutcomeFailed, Err: err}
		default:
			k = engine.KeyResult{Outcome: engine.OutcomeFailed, Err: errors.New("server: the engine returned no outcome for the key")}
		}
		// No key is sent pending, nor failed or cancelled without a code
		// (docs/protocol.md; clients refuse such a completion).
		// One vocabulary (package outcome): the engine's outcome is the
		// wire's, but that the engine has no cancelled.
		o, known := k.Outcome, k.Outcome <= engine.OutcomeFailed
		var code protocol.Code
		switch {
		case errors.Is(k.Err, context.Canceled) || k.Outcome == engine.OutcomePending:
			o, code = protocol.OutcomeCancelled, protocol.CodeCancelled
		case !known: // an outcome past the engine's
			o, code = protocol.OutcomeFailed, protocol.CodeInternal
		case o == protocol.OutcomeFailed && k.Err != nil:
			code = errorOf(k.Err).Code
		}
		if o == protocol.OutcomeFailed && code == protocol.CodeOK {
			code = protocol.CodeInternal // an error that names no code
		}
		m.Keys[i] = protocol.KeyOutcome{Outcome: o, Code: code}
		if code != protocol.CodeOK && m.Message == "" && k.Err != nil {
			m.Message = fmt.Sprintf("key %d: %v", i, k.Err)
		}
	}
	if m.Message != "" {
		return m
	}
	// No key failed: the message says why the first missing key is
	// missing (not indexed, file vanished, replaced...).
	for i, k := range res.Keys {
		if k.Outcome == engine.OutcomeMissing && k.Err != nil {
			m.Message = fmt.Sprintf("key %d: missing: %v", i, k.Err)
			break
		}
	}
	return m
}

func (s *session) cancel(m *protocol.Cancel) (protocol.Message, error) {
	s.jmu.Lock()
	e := s.jobs[m.Job]
	s.jmu.Unlock()
	if e != nil {
		e.job.Cancel()
	}
	return &protocol.Cancelled{InFlight: e != nil}, nil
}

func (s *session) stats() (protocol.Message, error) {
	st := s.srv.eng.Stats()
	s.jmu.Lock()
	inflight := len(s.jobs)
	s.jmu.Unlock()
	m := &protocol.Stats{
		Entries: uint64(st.Entries), Keys: uint64(st.Keys), Stores: st.Stores, Loads: st.Loads,
		Hits: st.Hits, Misses: st.Misses, Evictions: st.Evictions, Failures: st.Failures,
		Corrupt: st.Corrupt, Vanished: st.Vanished, BytesWritten: st.BytesWritten, BytesRead: st.BytesRead,
		Clients: uint64(s.srv.clients()), Regions: uint64(len(s.regions)), Caches: uint64(len(s.caches)),
		InflightJobs: uint64(inflight), Devices: s.srv.deviceStats(), Daemon: s.srv.daemonStats(st.Mounts, st.Budgets),
	}
	m.Spares = &protocol.SpareStats{Reused: st.Reused, Made: st.SparesMade}
	m.StoresFailing = make([]protocol.MountFailure, 0, len(st.Mounts))
	ts := st.Tiering
	m.Tiering = &protocol.TierStats{Demotions: ts.Demotions, Promotions: ts.Promotions, Moves: ts.Moves,
		MoveFailures: ts.MoveFailures, DemotionDeletes: ts.DemotionDeletes, FallbackPolicy: m.Daemon.FallbackPolicy}
	for _, mt := range st.Mounts {
		m.Mounts = append(m.Mounts, protocol.MountStats{Capacity: uint64(mt.Capacity), Used: uint64(mt.Used), Entries: uint64(mt.Entries), Direct: mt.Direct})
		m.Spares.Mounts = append(m.Spares.Mounts, protocol.SpareMount{Files: uint64(mt.SpareFiles), Bytes: uint64(max(mt.SpareBytes, 0))})
		m.Tiering.Mounts = append(m.Tiering.Mounts, protocol.TierMount{MovedIn: mt.MovedIn, MovedOut: mt.MovedOut})
		var f protocol.MountFailure
		if sf := mt.StoresFailing; sf != nil {
			f = protocol.MountFailure{Since: sf.Since.UnixNano(), Last: sf.Last.UnixNano(), Stores: sf.Stores, Err: sf.Err}
		}
		m.StoresFailing = append(m.StoresFailing, f)
	}
	// A client reads frames of MaxFrame at most, and ends a connection
	// that sends a longer one: the mounts' failure texts are cut to fit
	// (where max_frame is small and the mounts many, with long paths),
	// and a reply that fits not even without them is refused instead.
	room := s.srv.cfg.MaxFrame - protocol.HeaderSize - protocol.EmptyNamespacesBytes
	body := len(m.AppendBody(nil))
	if over := body - room; over > 0 {
		if !cutFailureTexts(m.StoresFailing, over) {
			return nil, perr(protocol.CodeLimit, "the Stats reply of %d mounts does not fit a frame of %d bytes (server.max_frame): raise it", len(m.Mounts), s.srv.cfg.MaxFrame)
		}
		body = len(m.AppendBody(nil))
	}
	room -= body
	// The namespaces, the most bytes first, as many as the frame holds
	// beside the other sections, the rest counted as left out.
	m.Namespaces = &protocol.NamespaceList{}
	caches := s.srv.cachesByFingerprint()
	for i, ns := range st.Namespaces {
		n := protocol.NamespaceStats{Fingerprint: ns.Fingerprint, Model: ns.Model, Declared: ns.Declared,
			Files: uint64(ns.Files), Keys: uint64(ns.Keys), Bytes: uint64(max(ns.Bytes, 0)), Caches: caches[ns.Fingerprint]}
		if room -= protocol.NamespaceBytes(n); i == protocol.MaxStatsNamespaces || room < 0 {
			m.Namespaces.LeftOut = uint64(len(st.Namespaces) - i)
			break
		}
		m.Namespaces.List = append(m.Namespaces.List, n)
	}
	return m, nil
}

// cutFailureTexts shortens the longest of fs' failure texts, each to no
// less than the others it is cut to, until over bytes are gone, marking
// each it cut; false where cutting every text to its marker frees too
// little.
func cutFailureTexts(fs []protocol.MountFailure, over int) bool {
	const mark = "…"
	freed := func(keep int) int { // by cutting every text to keep bytes
		n := 0
		for _, f := range fs {
			n += max(len(f.Err)-max(keep, len(mark)), 0)
		}
		return n
	}
	if freed(0) < over {
		return false
	}
	// The longest text a failure may keep: the largest keep whose cuts
	// free at least over bytes, found by halving.
	lo, hi := 0, 0
	for _, f := range fs {
		hi = max(hi, len(f.Err))
	}
	for lo < hi {
		if mid := (lo + hi + 1) / 2; freed(mid) >= over {
			lo = mid
		} else {
			hi = mid - 1
		}
	}
	keep := max(lo, len(mark))
	for i, f := range fs {
		if len(f.Err) > keep {
			cut := keep - len(mark)
			for cut > 0 && !utf8.RuneStart(f.Err[cut]) {
				cut--
			}
			fs[i].Err = f.Err[:cut] + mark
		}
	}
	return true
}

// release ends the session: jobs first (finished within the grace period
// or cancelled, and waited for), then caches, then regions, then the
// connection. A job never outlives the memory it copies.
func (s *session) release() {
	defer close(s.released)
	s.conn.CloseRead()
	if grace := time.Duration(s.grace.Load()); grace > 0 {
		s.jmu.Lock()
		pending := make([]*engine.Job, 0, len(s.jobs))
		for _, e := range s.jobs {
			pending = append(pending, e.job)
		}
		s.jmu.Unlock()
		deadline := time.NewTimer(grace)
	wait:
		for _, j := range pending {
			select {
			case <-j.Done():
			case <-deadline.C:
				break wait
			}
		}
		deadline.Stop()
	}
	s.jmu.Lock()
	for _, e := range s.jobs {
		e.job.Cancel()
	}
	n := len(s.jobs)
	s.jmu.Unlock()
	s.stopCtx()
	if n > 0 {
		// A client gone with jobs in flight (it exited, was killed, or
		// closed early) is worth a line at the default level: its memory
		// is released only once these jobs have ended.
		s.log.Info("client left with jobs in flight: cancelled them", "jobs", n)
	}
	s.waitJobs()
	s.releasePins()
	for _, c := range s.caches {
		if err := s.srv.eng.UnregisterCache(c.id); err != nil {
			s.log.Warn("unregister cache", "err", err)
		}
		s.srv.countCache(c.ns.id, c.group, -1)
		s.srv.releaseLayers(s.peer, len(c.regions))
	}
	s.caches = nil
	for _, ns := range s.namespaces {
		s.srv.undeclare(s.peer, ns.geo, ns.id)
	}
	s.namespaces = nil
	// Completions still being written get a moment, then the connection
	// goes and their writes fail.
	if c := s.wcap.Load(); c == 0 || time.Unix(0, c).After(time.Now().Add(time.Second)) {
		s.capWrites(time.Now().Add(time.Second))
	}
	s.writeWG.Wait()
	if s.srv.isStopping() {
		// The client's requests still waiting fail with why, after the
		// completions of its jobs, not with a bare close.
		s.send(0, errShuttingDown())
	}
	for _, r := range s.regions {
		s.closeRegion(r)
	}
	s.regions = nil
	s.rd.closeFds()
	s.conn.Close()
	s.log.Debug("client released")
}

// waitJobs waits until the engine has finished every job of the session,
// however long that takes: unmapping a region under a running copy would
// fault the daemon. It says so in the log while it waits.
func (s *session) waitJobs() {
	done := make(chan struct{})
	go func() {
		s.jobWG.Wait()
		close(done)
	}()
	tick := time.NewTicker(10 * time.Second)
	defer tick.Stop()
	for {
		select {
		case <-done:
			return
		case <-tick.C:
			s.jmu.Lock()
			n := len(s.jobs)
			s.jmu.Unlock()
			s.log.Warn("waiting for cancelled jobs to end before unmapping the client's memory", "jobs", n)
		}
	}
}

// errorOf turns an error into the Error frame a client gets.
func errorOf(err error) *protocol.Error {
	var pe *protocol.Error
	if errors.As(err, &pe) {
		return pe
	}
	code := protocol.CodeInternal
	switch {
	case errors.Is(err, context.Canceled):
		code = protocol.CodeCancelled
	case errors.Is(err, engine.ErrInvalid), errors.Is(err, region.ErrBounds):
		code = protocol.CodeInvalid
	case errors.Is(err, engine.ErrLimit):
		code = protocol.CodeLimit
	case errors.Is(err, engine.ErrUnknownNamespace):
		code = protocol.CodeUnknownNS
	case errors.Is(err, engine.ErrUnknownCache):
		code = protocol.CodeUnknownCache
	case errors.Is(err, engine.ErrNoSpace):
		code = protocol.CodeNoSpace
	case errors.Is(err, engine.ErrNotFound), errors.Is(err, engine.ErrMismatch):
		code = protocol.CodeNotFound
	case errors.Is(err, engine.ErrCorrupt):
		code = protocol.CodeCorrupt
	case errors.Is(err, engine.ErrDestinationChanged):
		// The client's own memory changed under the load: not the
		// daemon's fault, nor the file's.
		code = protocol.CodeDestinationChanged
	case errors.Is(err, engine.ErrPolicy):
		code = protocol.CodePolicy
	case errors.Is(err, engine.ErrClosed):
		code = protocol.CodeShuttingDown
	case errors.Is(err, region.ErrFault), errors.Is(err, region.ErrTruncated):
		// The client truncated its shared file under the job.
		code = protocol.CodeBadFd
	}
	return &protocol.Error{Code: code, Message: err.Error()}
}
