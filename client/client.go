// Package client is the Go client of the kvhost daemon: it dials the
// daemon's Unix socket, registers memory, declares namespaces, registers
// paged caches, and runs lookups and asynchronous store and load jobs over
// the protocol of package protocol (docs/protocol.md).
//
// A Client is safe for concurrent use: requests from many goroutines are
// pipelined on one connection, and one reader goroutine hands each reply to
// its caller by request id and each job completion to its Job.
//
// Every call returns when its context ends: while it waits for its turn
// to write (nothing is sent), while its write blocks on a daemon that
// does not read (the write is cut off; its stream out of step, the client
// sends nothing more and fails later calls with ErrClosed, while jobs the
// daemon accepted still end with their completions), or while it waits
// for the reply. A pin, region or
// cache the daemon made for a call that gave up is given back when the
// reply comes; a Store or Load whose request went out returns its Job
// with the context's error, and the Job is cancelled once the daemon has
// accepted it (the daemon may be using the blocks until the Job ends).
package client

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kvhost/kvhost/protocol"
)

// Errors of the package; errors from the daemon are *protocol.Error values.
var (
	// ErrClosed: the client was closed or its connection was lost.
	ErrClosed = errors.New("client: connection closed")
	// ErrInvalid: an argument cannot be sent (checked before sending).
	ErrInvalid = errors.New("client: invalid argument")
	// ErrUnknownDevice: the daemon names none of its GPUs by the UUID
	// asked for (it may not serve that GPU, or may not know its GPUs'
	// UUIDs: no CUDA driver API, or a daemon that predates them).
	ErrUnknownDevice = errors.New("client: no GPU of the daemon has that UUID")
	// ErrBlocksInUse: the client ended the connection (Close, or a frame
	// from the daemon that it refused) while a job's request was on the
	// daemon's side: the daemon may still be copying to or from the
	// job's blocks until it notices and has cancelled the job, and the
	// client cannot tell when. It comes with ErrClosed.
	ErrBlocksInUse = errors.New("client: the daemon may still be copying to or from the job's blocks")
	// ErrUnsupported: the daemon did not announce the feature a request
	// needs (Client.Supports), so the request was not sent: an older
	// daemon would refuse it.
	ErrUnsupported = errors.New("client: the daemon does not serve this request")
)

// Types shared with the protocol.
type (
	// Geometry is a model's KV-cache shape at one tensor-parallel rank.
	Geometry = protocol.Geometry
	// Layer is one layer's tensor of a paged cache in a registered region.
	Layer = protocol.Layer
	// Outcome is what happened to one key of a job.
	Outcome = protocol.Outcome
	// Stats are the daemon's counters.
	Stats = protocol.Stats
	// Limits are the daemon's per-connection limits, from the handshake.
	Limits = protocol.Welcome
	// Feature is a bit of what a daemon announces it serves beyond
	// protocol version 1 (Client.Supports).
	Feature = protocol.Feature
)

// FeatureLayerLoads: the daemon serves LoadLayers.
const FeatureLayerLoads = protocol.FeatureLayerLoads

// RegionID, NamespaceID and CacheID are this connection's ids for what it
// registered; they mean nothing on another connection.
type (
	RegionID    uint32
	NamespaceID uint32
	CacheID     uint32
)

// Namespace is a declared geometry.
type Namespace struct {
	ID           NamespaceID // this connection's id for the namespace
	BlocksPerKey int         // GPU blocks one key covers
	Fingerprint  uint64      // the fingerprint its keys are indexed under: the lookup table's (docs/protocol.md)
	KeyBytes     int64       // payload bytes of one key: every layer, plane and block
}

// Client is a connection to a kvhost daemon.
type Client struct {
	conn   *net.UnixConn
	limits protocol.Welcome
	nextID atomic.Uint64

	wsem    chan struct{} // a token: serializes writes; a caller waits for it as long as its context lets it
	wbuf    []byte        // the frame being written, under wsem
	sendErr error         // under wsem: set once a write failed part way; nothing is sent after it

	mu      sync.Mutex
	pending map[uint64]request
	jobs    map[uint64]*Job
	subs    map[uint32]*RemovalSubscription // removal streams (removals.go)
	err     error                           // set once the connection is lost
	done    chan struct{}
	closing atomic.Bool
}

// request is a request sent and not yet answered.
type request struct {
	t   protocol.Type // its type: the reply's is t|TypeReply (or TypeError)
	ch  chan reply    // its reply (buffered: the reader never waits for the caller)
	job *Job          // a Store's or Load's Job, which the reader binds to the reply
}

type reply struct {
	msg protocol.Message
	err error
}

// Dial connects to the daemon's socket at path ("" means DefaultSocket())
// and performs the handshake. name identifies the client in the daemon's
// logs.
//
// It speaks protocol.Version; a daemon that refuses that version (one
// older than version 2 closes the connection) is dialed again with
// protocol.MinVersion, and announces no features then.
func Dial(ctx context.Context, path, name string) (*Client, error) {
	if path == "" {
		path = DefaultSocket()
	}
	c, err := dial(ctx, path, name, protocol.Version)
	if pe := (*protocol.Error)(nil); errors.As(err, &pe) && pe.Code == protocol.CodeVersion {
		c, err = dial(ctx, path, name, protocol.MinVersion)
	}
	return c, err
}

// dial connects and performs the handshake in version.
func dial(ctx context.Context, path, name string, version uint16) (*Client, error) {
	var d net.Dialer
	nc, err := d.DialContext(ctx, "unix", path)
	if err != nil {
		return nil, fmt.Errorf("client: dial %s: %w", path, err)
	}
	c := &Client{
		conn:    nc.(*net.UnixConn),
		pending: make(map[uint64]request),
		jobs:    make(map[uint64]*Job),
		done:    make(chan struct{}),
		wsem:    make(chan struct{}, 1),
	}
	c.limits.MaxFrame = protocol.MinFrame
	go c.readLoop()
	m, err := c.call(ctx, &protocol.Hello{Version: version, Client: name}, nil)
	if err != nil {
		c.Close()
		return nil, fmt.Errorf("client: handshake: %w", err)
	}
	w := m.(*protocol.Welcome) // the reply type of Hello: deliver checked
	if w.Version < protocol.MinVersion || w.Version > version {
		// An older version this client speaks is read as that version's
		// (a version-1 Welcome announces no features).
		c.Close()
		return nil, fmt.Errorf("client: handshake: the daemon %q answered with a Welcome of protocol version %d; this client speaks version %d", w.Server, w.Version, version)
	}
	c.mu.Lock()
	c.limits = *w
	c.mu.Unlock()
	return c, nil
}

// Limits returns the daemon's limits announced in the handshake.
func (c *Client) Limits() Limits {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.limits
}

// Supports reports whether the daemon announced feature f in the
// handshake (a daemon older than protocol version 2 announces none).
func (c *Client) Supports(f Feature) bool {
	return c.Limits().Features&f == f
}

// Close closes the connection. The daemon cancels the client's unfinished
// jobs and releases its registrations; Jobs not yet complete, and Stores
// and Loads still waiting for the daemon's answer, fail at once with
// ErrClosed and ErrBlocksInUse: the daemon may still be using their
// blocks (see Job.Wait).
func (c *Client) Close() error {
	if c.closing.Swap(true) {
		<-c.done
		return nil
	}
	err := c.conn.Close()
	<-c.done
	if errors.Is(err, net.ErrClosed) {
		err = nil // the daemon had already closed it
	}
	return err
}

// readLoop reads every frame and delivers it until the connection ends.
func (c *Client) readLoop() {
	defer close(c.done)
	r := bufio.NewReaderSize(c.conn, 64<<10)
	var hdr [protocol.HeaderSize]byte
	var err error
	for {
		if _, err = io.ReadFull(r, hdr[:]); err != nil {
			if errors.Is(err, io.ErrUnexpectedEOF) {
				err = fmt.Errorf("in a frame's header: %w", err)
			}
			break
		}
		var h protocol.Header
		if h, err = protocol.ParseHeader(hdr[:], int(c.Limits().MaxFrame)); err != nil {
			break
		}
		body := make([]byte, h.Len)
		if _, err = io.ReadFull(r, body); err != nil {
			if errors.Is(err, io.EOF) { // no byte of the body came
				err = io.ErrUnexpectedEOF
			}
			err = fmt.Errorf("in the %d-byte body of a %s frame: %w", h.Len, h.Type, err)
			break
		}
		var m protocol.Message
		if m, err = protocol.Decode(h.Type, body); err != nil {
			break
		}
		if err = c.deliver(h, m); err != nil {
			break
		}
	}
	// The daemon ends a connection only once every job of it has ended
	// (docs/protocol.md, Disconnects): its close, a reset of it, or its
	// death. Otherwise the client ends the connection, and the daemon
	// goes on with its jobs until it notices.
	jobsEnded := !c.closing.Load() && (errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, unix.ECONNRESET))
	// The error says who ended the connection, for a log line to say
	// where to look.
	switch {
	case c.closing.Load():
		err = fmt.Errorf("%w by the client (Close)", ErrClosed)
	case errors.Is(err, io.EOF):
		err = fmt.Errorf("%w: the daemon closed the connection", ErrClosed)
	case errors.Is(err, io.ErrUnexpectedEOF):
		// It died, or gave up the connection, while writing a reply.
		err = fmt.Errorf("%w: the daemon closed the connection in the middle of a frame (%w)", ErrClosed, err)
	default:
		err = fmt.Errorf("%w: %w", ErrClosed, err)
	}
	c.conn.Close()
	c.mu.Lock()
	c.err = err
	pending, jobs := c.pending, c.jobs
	c.pending, c.jobs = nil, nil
	c.endSubscriptions(err)
	c.mu.Unlock()
	jobErr := err // a job's: its request was on the daemon's side
	if !jobsEnded {
		jobErr = fmt.Errorf("%w; %w until it has cancelled the job: do not reuse them", err, ErrBlocksInUse)
	}
	for _, r := range pending {
		if r.job == nil {
			r.ch <- reply{err: err}
			continue
		}
		r.ch <- reply{err: jobErr}
		r.job.finish(Result{}, jobErr)
	}
	for _, j := range jobs {
		j.finish(Result{}, jobErr)
	}
}

// deliver hands a frame to its waiter. A Store or Load reply binds its
// Job here, before the next frame (possibly its completion) is read,
// whether or not its caller still waits.
func (c *Client) deliver(h protocol.Header, m protocol.Message) error {
	if cm, ok := m.(*protocol.Completion); ok {
		c.mu.Lock()
		j := c.jobs[cm.Job]
		if j != nil && (cm.Kind != j.kind || len(cm.Keys) != j.keys) {
			// A caller indexes Result.Keys by request key. The Job stays
			// in the table: it fails with the connection.
			c.mu.Unlock()
			return fmt.Errorf("completion of job %d, a %s of %d keys, as a %s of %d keys", cm.Job, j.kind, j.keys, cm.Kind, len(cm.Keys))
		}
		delete(c.jobs, cm.Job)
		c.mu.Unlock()
		if j == nil {
			return fmt.Errorf("completion of unknown job %d", cm.Job)
		}
		j.finish(resultOf(cm), nil)
		return nil
	}
	if rm, ok := m.(*protocol.Removals); ok && h.ID == 0 {
		c.removals(rm)
		return nil
	}
	if e, isErr := m.(*protocol.Error); isErr && h.ID == 0 {
		return e // the daemon refused the connection (limit, shutdown)
	}
	c.mu.Lock()
	r, ok := c.pending[h.ID]
	if !ok {
		c.mu.Unlock()
		return fmt.Errorf("reply to unknown request %d", h.ID)
	}
	if _, isErr := m.(*protocol.Error); !isErr && m.Type() != r.t|protocol.TypeReply {
		// The daemon is out of step with the client: no later reply can
		// be trusted to answer what its id says. The request stays
		// pending: it fails with the connection.
		c.mu.Unlock()
		return fmt.Errorf("%s (request %d) answered with %s", r.t, h.ID, m.Type())
	}
	if sm, ok := m.(*protocol.RemovalsSubscribed); ok {
		c.subscribed(sm) // before the next frame, maybe its first event
	}
	if r.job != nil {
		if err := c.bind(r.job, m); err != nil {
			c.mu.Unlock()
			return err // the request stays pending: it fails with the connection
		}
	}
	delete(c.pending, h.ID)
	c.mu.Unlock()
	r.ch <- reply{msg: m}
	return nil
}

// bind settles j, a Store's or Load's Job, by the daemon's reply m (of
// the request's reply type, or an Error: deliver checked), under c.mu: a
// JobAccepted registers it under the daemon's id (and cancels it if its
// caller has given up), an Error ends it (no job ran). An id of a job
// still in flight leaves the client unable to tell which job runs on
// which blocks: an error, which fails the connection.
func (c *Client) bind(j *Job, m protocol.Message) error {
	switch m := m.(type) {
	case *protocol.JobAccepted:
		if c.jobs[m.Job] != nil {
			// Its completion could not be told from the other job's.
			return fmt.Errorf("%s accepted as job %d, a job still in flight", j.requestType(), m.Job)
		}
		j.id = m.Job
		close(j.accepted)
		c.jobs[m.Job] = j
		if j.abandoned {
			go c.cancelAbandoned(j)
		}
	case *protocol.Error:
		j.finish(Result{}, m)
	default:
		return fmt.Errorf("%s answered with %s", j.requestType(), m.Type())
	}
	return nil
}

// call sends m (with fds as SCM_RIGHTS, if any) and waits for its reply.
// An Error reply is returned as a *protocol.Error.
func (c *Client) call(ctx context.Context, m protocol.Message, fds []int) (protocol.Message, error) {
	return c.roundTrip(ctx, m, fds, nil)
}

// roundTrip is call with an undo: if ctx ends after m was sent, before
// its reply, and undo is set, undo is called with the reply when it comes
// (not an Error): what the daemon made for a caller that no longer waits
// (a pin, a region) is given back.
func (c *Client) roundTrip(ctx context.Context, m protocol.Message, fds []int, undo func(protocol.Message)) (protocol.Message, error) {
	ch, err := c.send(ctx, m, fds, nil)
	if err != nil {
		return nil, err
	}
	select {
	case r := <-ch:
		return checkReply(r)
	case <-ctx.Done():
		// The reply will arrive and be dropped by deliver (channel is
		// buffered).
		if undo != nil {
			go func() {
				if r, err := checkReply(<-ch); err == nil {
					undo(r)
				}
			}()
		}
		return nil, ctx.Err()
	}
}

// create is call for a request that makes something on the daemon (a
// pin, a region, a cache): if ctx ends after the request was sent, undo
// gives back what the reply, when it comes, says was made, so that a
// caller that gave up holds nothing it cannot name. (Declare is not one:
// declaring a geometry again answers the namespace already declared.)
func (c *Client) create(ctx context.Context, m protocol.Message, fds []int, undo func(protocol.Message)) (protocol.Message, error) {
	return c.roundTrip(ctx, m, fds, undo)
}

// undoTimeout bounds a request that gives back what an abandoned request
// made.
const undoTimeout = 30 * time.Second

// undo runs req, which gives back what an abandoned request made, with
// its own deadline; a connection lost meanwhile gave it back already.
func (c *Client) undo(req func(ctx context.Context) error) {
	ctx, cancel := context.WithTimeout(context.Background(), undoTimeout)
	defer cancel()
	req(ctx)
}

// unregisterAbandoned unregisters the region of an abandoned
// RegisterMemory's reply.
func (c *Client) unregisterAbandoned(r protocol.Message) {
	c.undo(func(ctx context.Context) error {
		return c.UnregisterMemory(ctx, RegionID(r.(*protocol.MemoryRegistered).Region))
	})
}

// checkReply returns r's message, or the error it carries or is. A
// message is of the request's reply type: deliver fails the connection
// on any other.
func checkReply(r reply) (protocol.Message, error) {
	if r.err != nil {
		return nil, r.err
	}
	if e, ok := r.msg.(*protocol.Error); ok {
		return nil, e
	}
	return r.msg, nil
}

// longAgo is a deadline in the past: it cuts off a write in progress.
var longAgo = time.Unix(1, 0)

// send writes m as a request and returns the channel its reply comes on;
// j, if set, is the Job of a Store or Load, which the reply binds. It gives up when ctx ends, while waiting for another write or
// during its own: a write cut off with nothing sent leaves the connection
// as it was; one cut off part way leaves the stream out of step, so the
// connection is closed (ErrClosed).
func (c *Client) send(ctx context.Context, m protocol.Message, fds []int, j *Job) (chan reply, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	select {
	case c.wsem <- struct{}{}:
	case <-ctx.Done():
		return nil, ctx.Err()
	}
	defer func() { <-c.wsem }()
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	if c.sendErr != nil {
		return nil, c.sendErr
	}
	id := c.nextID.Add(1)
	ch := make(chan reply, 1)
	c.mu.Lock()
	if c.err != nil {
		err := c.err
		c.mu.Unlock()
		return nil, err
	}
	c.pending[id] = request{t: m.Type(), ch: ch, job: j}
	maxFrame := int(c.limits.MaxFrame)
	c.mu.Unlock()

	c.wbuf = protocol.AppendFrame(c.wbuf[:0], id, m)
	var err error
	sent := 0
	if len(c.wbuf) > maxFrame {
		err = fmt.Errorf("%w: %s frame of %d bytes exceeds the daemon's limit of %d", ErrInvalid, m.Type(), len(c.wbuf), maxFrame)
	} else {
		stop := func() bool { return true }
		var cut chan struct{}  // closed once the deadline is set
		if ctx.Done() != nil { // a context that can end: a cut armed for the write
			cut = make(chan struct{})
			stop = context.AfterFunc(ctx, func() { c.conn.SetWriteDeadline(longAgo); close(cut) })
		}
		if len(fds) > 0 {
			sent, _, err = c.conn.WriteMsgUnix(c.wbuf, unix.UnixRights(fds...), nil)
		}
		if err == nil && sent < len(c.wbuf) {
			var n int
			n, err = c.conn.Write(c.wbuf[sent:])
			sent += n
		}
		if !stop() {
			// The cut began: once it has set the deadline, clear it for
			// the next write (stop returns before the function ends).
			<-cut
			c.conn.SetWriteDeadline(time.Time{})
			if err != nil {
				err = ctx.Err()
			}
		}
	}
	full := len(c.wbuf)
	if cap(c.wbuf) > 1<<20 {
		c.wbuf = nil
	}
	if err == nil {
		return ch, nil
	}
	c.mu.Lock()
	delete(c.pending, id)
	c.mu.Unlock()
	if errors.Is(err, net.ErrClosed) && !c.closing.Load() {
		// The read loop closed the connection under the write: the
		// daemon ended it, or sent what is no kvhost frame. Its reason
		// says why; "use of closed network connection" would not.
		<-c.done
		c.mu.Lock()
		rerr := c.err
		c.mu.Unlock()
		if rerr != nil {
			return nil, rerr
		}
	}
	switch {
	case errors.Is(err, ErrInvalid):
		return nil, err
	case sent == 0 && ctx.Err() != nil && errors.Is(err, ctx.Err()):
		return nil, err // nothing sent: the connection is as it was
	}
	// A write that failed may have sent part of the frame: the stream is
	// out of step, and nothing more is sent. The write side is shut, so
	// the daemon reads to the end, ends what it runs and closes; the read
	// loop goes on until then, so jobs the daemon accepted still end with
	// their completions.
	if sent > 0 && sent < full && ctx.Err() != nil {
		err = fmt.Errorf("%w: send of %s cut off after %d of %d bytes: %w", ErrClosed, m.Type(), sent, full, err)
	} else {
		err = fmt.Errorf("%w: send: %w", ErrClosed, err)
	}
	c.sendErr = err
	c.conn.CloseWrite()
	return nil, err
}

// RegisterMemfd registers the memory of m (made by NewMemfd). See
// RegisterFd.
func (c *Client) RegisterMemfd(ctx context.Context, m *Memfd) (RegionID, error) {
	if m == nil {
		return 0, fmt.Errorf("%w: nil memfd", ErrInvalid)
	}
	return c.RegisterFd(ctx, m.Fd(), m.Len())
}

// RegisterFd registers size bytes of the memfd fd. The daemon maps it and
// requires the F_SEAL_SHRINK seal (so that the client cannot truncate pages
// the daemon is copying); RegisterFd adds the seal if the memfd allows
// sealing and returns an error otherwise (create it with
// MFD_ALLOW_SEALING; NewMemfd does).
func (c *Client) RegisterFd(ctx context.Context, fd int, size int64) (RegionID, error) {
	if size <= 0 {
		return 0, fmt.Errorf("%w: size %d", ErrInvalid, size)
	}
	if err := SealShrink(fd); err != nil {
		return 0, err
	}
	m, err := c.create(ctx, &protocol.RegisterMemory{Kind: protocol.MemoryMemfd, Size: uint64(size)}, []int{fd}, c.unregisterAbandoned)
	if err != nil {
		return 0, err
	}
	return RegionID(m.(*protocol.MemoryRegistered).Region), nil
}

// RegisterShared registers size bytes of a shared-memory file: a memfd or
// a regular file on a memory file system, such as the /dev/shm file of
// another program's shared CPU region. Unlike RegisterFd it does not seal
// the file: its owner may still truncate it, and a job touching the
// missing pages then fails (protocol.CodeBadFd) while the daemon goes on.
// Daemons that cannot guard their copies answer protocol.CodeUnsupported.
func (c *Client) RegisterShared(ctx context.Context, fd int, size int64) (RegionID, error) {
	if size <= 0 || fd < 0 {
		return 0, fmt.Errorf("%w: fd %d size %d", ErrInvalid, fd, size)
	}
	m, err := c.create(ctx, &protocol.RegisterMemory{Kind: protocol.MemoryShared, Size: uint64(size)}, []int{fd}, c.unregisterAbandoned)
	if err != nil {
		return 0, err
	}
	return RegionID(m.(*protocol.MemoryRegistered).Region), nil
}

// RegisterCUDAIPC registers GPU memory by CUDA IPC handle: the range
// [offset, offset+size) of the allocation handle names
// (cudaIpcGetMemHandle of its base), on device, as the daemon numbers
// its devices (the daemon sees every GPU of the node: DeviceByUUID finds
// the daemon's ordinal of the client's GPU, whatever CUDA_VISIBLE_DEVICES
// does to the client's own ordinals). Where GPUs have peer access, the
// daemon cannot tell another GPU's memory from the device named: it
// accepts it and copies over the peer link.
// A handle that names no memory on that device (stale, forged, another
// device's) fails with protocol.CodeBadHandle, a range outside the
// allocation with protocol.CodeInvalid. Daemons without GPU support
// answer with protocol.CodeUnsupported.
func (c *Client) RegisterCUDAIPC(ctx context.Context, device int, handle [protocol.CUDAIPCHandleLen]byte, offset, size int64) (RegionID, error) {
	if size <= 0 || offset < 0 || device < 0 {
		return 0, fmt.Errorf("%w: device %d offset %d size %d", ErrInvalid, device, offset, size)
	}
	m, err := c.create(ctx, &protocol.RegisterMemory{Kind: protocol.MemoryCUDAIPC, Device: uint32(device), Size: uint64(size), Offset: uint64(offset), Handle: handle}, nil, c.unregisterAbandoned)
	if err != nil {
		return 0, err
	}
	return RegionID(m.(*protocol.MemoryRegistered).Region), nil
}

// UnregisterMemory releases a region that no registered cache uses.
func (c *Client) UnregisterMemory(ctx context.Context, id RegionID) error {
	_, err := c.call(ctx, &protocol.UnregisterMemory{Region: uint32(id)}, nil)
	return err
}

// Declare declares a namespace for g.
func (c *Client) Declare(ctx context.Context, g Geometry) (Namespace, error) {
	if len(g.Model) == 0 || len(g.Model) > protocol.MaxModelLen {
		return Namespace{}, fmt.Errorf("%w: model id of %d bytes", ErrInvalid, len(g.Model))
	}
	m, err := c.call(ctx, &protocol.Declare{Geometry: g}, nil)
	if err != nil {
		return Namespace{}, err
	}
	d := m.(*protocol.Declared)
	return Namespace{ID: NamespaceID(d.NS), BlocksPerKey: int(d.BlocksPerKey), Fingerprint: d.Fingerprint, KeyBytes: int64(d.KeyBytes)}, nil
}

// Undeclare gives up namespace ns on this connection; no cache registered
// on the connection may use it, and no pin the connection holds may be in
// it (the daemon answers in use naming the pins). Stored data is kept. The daemon forgets the
// geometry (it stops counting against its namespace limit) once no
// connection has it declared; closing the connection undeclares everything.
func (c *Client) Undeclare(ctx context.Context, ns NamespaceID) error {
	_, err := c.call(ctx, &protocol.Undeclare{NS: uint32(ns)}, nil)
	return err
}

// RegisterCache registers the paged cache of namespace ns: one tensor per
// layer in regions registered on this connection.
func (c *Client) RegisterCache(ctx context.Context, ns NamespaceID, layers []Layer) (CacheID, error) {
	if len(layers) == 0 || len(layers) > protocol.MaxLayers {
		return 0, fmt.Errorf("%w: %d layers", ErrInvalid, len(layers))
	}
	m, err := c.create(ctx, &protocol.RegisterCache{NS: uint32(ns), Layers: layers}, nil, func(r protocol.Message) {
		c.undo(func(ctx context.Context) error {
			return c.UnregisterCache(ctx, CacheID(r.(*protocol.CacheRegistered).Cache))
		})
	})
	if err != nil {
		return 0, err
	}
	return CacheID(m.(*protocol.CacheRegistered).Cache), nil
}

// UnregisterCache releases a cache with no job in flight.
func (c *Client) UnregisterCache(ctx context.Context, id CacheID) error {
	_, err := c.call(ctx, &protocol.UnregisterCache{Cache: uint32(id)}, nil)
	return err
}

// Lookup returns how many leading keys are stored in namespace ns.
func (c *Client) Lookup(ctx context.Context, ns NamespaceID, keys [][]byte) (int, error) {
	if err := protocol.CheckKeys(keys); err != nil {
		return 0, fmt.Errorf("%w: %w", ErrInvalid, err)
	}
	m, err := c.call(ctx, &protocol.Lookup{NS: uint32(ns), Keys: keys}, nil)
	if err != nil {
		return 0, err
	}
	return int(m.(*protocol.Count).Count), nil
}

// Delete removes keys from namespace ns and returns how many were stored.
func (c *Client) Delete(ctx context.Context, ns NamespaceID, keys [][]byte) (int, error) {
	if err := protocol.CheckKeys(keys); err != nil {
		return 0, fmt.Errorf("%w: %w", ErrInvalid, err)
	}
	m, err := c.call(ctx, &protocol.Delete{NS: uint32(ns), Keys: keys}, nil)
	if err != nil {
		return 0, err
	}
	return int(m.(*protocol.Count).Count), nil
}

// Store starts a job storing keys[i] from the cache blocks blocks[i] (each
// the namespace's BlocksPerKey long). The daemon reads the blocks until
// the job completes: do not reuse them before Wait returns.
//
// Store and Load return when the daemon has accepted the job, or when ctx
// ends. If ctx ends after the request was sent, they return the Job
// together with ctx's error, and the Job is cancelled as soon as the
// daemon has accepted it: the daemon may be reading or writing its blocks
// already, so Wait for it before reusing them. Such a Job's ID is 0 until
// the daemon's answer comes; if the daemon refuses the job, Wait returns
// the daemon's error. If the connection is lost before the answer, they
// return ErrClosed, with ErrBlocksInUse when the client ended it (Close):
// the daemon may be using the blocks then as well.
func (c *Client) Store(ctx context.Context, cache CacheID, keys [][]byte, blocks [][]uint32) (*Job, error) {
	return c.transfer(ctx, &protocol.Transfer{Kind: protocol.JobStore, Cache: uint32(cache), Keys: keys, Blocks: blocks})
}

// NoBlock, as a block id of a Load, leaves that block of the key out: the
// key's other blocks are loaded, and the daemon still reads and verifies
// the whole key (protocol.NoBlock). The daemon refuses it in a Store, and
// a Load key whose every block is NoBlock.
const NoBlock = protocol.NoBlock

// Load starts a job loading keys[i] into the cache blocks blocks[i]; a
// block id NoBlock is a block of the key that is not loaded (a load that
// starts or ends inside a key). The daemon writes the blocks until the
// job completes: do not use them before Wait returns. See Store for a
// ctx that ends.
func (c *Client) Load(ctx context.Context, cache CacheID, keys [][]byte, blocks [][]uint32) (*Job, error) {
	return c.transfer(ctx, &protocol.Transfer{Kind: protocol.JobLoad, Cache: uint32(cache), Keys: keys, Blocks: blocks})
}

// LoadLayers is Load of the layers [first, first+count) of every key only
// (count 0: every layer, first 0): the daemon reads, verifies and writes
// those layers' bytes of the blocks and leaves the other layers of the
// blocks as they are. Its Result counts the bytes of those layers. A
// range past the namespace's layers is refused by the daemon
// (protocol.CodeInvalid, naming the range). It returns ErrUnsupported,
// sending nothing, where the daemon did not announce FeatureLayerLoads.
func (c *Client) LoadLayers(ctx context.Context, cache CacheID, keys [][]byte, blocks [][]uint32, first, count int) (*Job, error) {
	if first < 0 || count < 0 || first > protocol.MaxLayers || count > protocol.MaxLayers {
		return nil, fmt.Errorf("%w: layer range first %d count %d: want first and count in 0..%d", ErrInvalid, first, count, protocol.MaxLayers)
	}
	r := &protocol.LayerRange{First: uint32(first), Count: uint32(count)}
	if err := r.Check(); err != nil {
		return nil, fmt.Errorf("%w: %w", ErrInvalid, err)
	}
	if !c.Supports(FeatureLayerLoads) {
		return nil, fmt.Errorf("%w: a load of %s: the daemon %q announced no layer-range loads (protocol version %d, features %#x)",
			ErrUnsupported, r, c.Limits().Server, c.Limits().Version, uint64(c.Limits().Features))
	}
	return c.transfer(ctx, &protocol.Transfer{Kind: protocol.JobLoad, Cache: uint32(cache), Keys: keys, Blocks: blocks, Layers: r})
}

// transfer sends m, a Store, Load or LoadLayers, and returns its Job.
func (c *Client) transfer(ctx context.Context, m *protocol.Transfer) (*Job, error) {
	keys, blocks := m.Keys, m.Blocks
	if err := protocol.CheckKeys(keys); err != nil {
		return nil, fmt.Errorf("%w: %w", ErrInvalid, err)
	}
	if len(blocks) != len(keys) {
		return nil, fmt.Errorf("%w: %d keys, %d block lists", ErrInvalid, len(keys), len(blocks))
	}
	for i, b := range blocks {
		if len(b) == 0 || len(b) != len(blocks[0]) || len(b) > protocol.MaxBlocksPerKey {
			return nil, fmt.Errorf("%w: key %d has %d blocks (key 0 has %d)", ErrInvalid, i, len(b), len(blocks[0]))
		}
	}
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	// Once the request is sent the daemon may start using the blocks, so
	// the caller gets the Job even if ctx ends before the daemon's answer:
	// the reader binds the Job to the answer whenever it comes, and the Job
	// is cancelled then.
	j := newJob(c, m)
	ch, err := c.send(ctx, m, nil, j) // a send ctx cut off sent nothing: no job
	if err != nil {
		return nil, err
	}
	var r reply
	select {
	case r = <-ch:
	case <-ctx.Done():
		c.abandon(j)
		return j, ctx.Err()
	}
	if _, err := checkReply(r); err != nil {
		return nil, err
	}
	if err := ctx.Err(); err != nil {
		c.abandon(j)
		return j, err
	}
	return j, nil
}

// abandon cancels j, whose caller's context ended after its request was
// sent, once the daemon has accepted it: now if it has (bind does it
// otherwise).
func (c *Client) abandon(j *Job) {
	c.mu.Lock()
	j.abandoned = true
	accepted := j.isAccepted()
	c.mu.Unlock()
	if accepted {
		go c.cancelAbandoned(j)
	}
}

// cancelAbandoned cancels an abandoned job (see abandon).
func (c *Client) cancelAbandoned(j *Job) {
	c.undo(func(ctx context.Context) error {
		_, err := c.Cancel(ctx, j)
		return err
	})
}

// Cancel asks the daemon to cancel a job. It reports whether the job was
// still in flight; its completion (with OutcomeCancelled for keys not
// done) follows either way when it was. A job whose Store or Load
// returned before the daemon's answer is cancelled once the answer has
// come: Cancel waits for it (as long as ctx lets it), and reports false
// with no error if the job never ran (the daemon refused it, or the
// connection was lost first). j must be a Job of c: another Client's
// fails with ErrInvalid.
func (c *Client) Cancel(ctx context.Context, j *Job) (bool, error) {
	switch {
	case j == nil:
		return false, fmt.Errorf("%w: cancel of a nil Job", ErrInvalid)
	case j.c != c:
		// Job ids are the daemon's: this connection's session would
		// answer that the job is not in flight, whatever it is doing.
		return false, fmt.Errorf("%w: cancel of a Job of another Client (job %d): cancel it through its own", ErrInvalid, j.ID())
	}
	select {
	case <-j.accepted:
	case <-j.done:
		if !j.isAccepted() {
			return false, nil // refused, or the connection was lost first: no job ran
		}
	case <-ctx.Done():
		return false, ctx.Err()
	}
	m, err := c.call(ctx, &protocol.Cancel{Job: j.id}, nil)
	if err != nil {
		return false, err
	}
	return m.(*protocol.Cancelled).InFlight, nil
}

// Stats returns the daemon's counters and this connection's usage.
func (c *Client) Stats(ctx context.Context) (Stats, error) {
	m, err := c.call(ctx, &protocol.StatsRequest{}, nil)
	if err != nil {
		return Stats{}, err
	}
	return *m.(*protocol.Stats), nil
}

// Purged is what a Purge removed: files, the keys they held and their
// bytes, and the files left because a client pin holds them.
type Purged = protocol.Purged

// Purge asks the daemon to remove every file of the namespace of
// fingerprint fp (Stats' Namespaces list them), whether or not a client
// declares it now; files a client pin holds stay. A daemon that knows no
// namespace of fp answers a *protocol.Error of protocol.CodeUnknownNS; one
// older than purge, of protocol.CodeUnknownType.
func (c *Client) Purge(ctx context.Context, fp uint64) (Purged, error) {
	return c.purge(ctx, &protocol.Purge{Fingerprint: fp})
}

// PurgeModel is Purge for every namespace declared with model id model
// since the daemon started: each geometry and tensor-parallel rank of the
// model is one.
func (c *Client) PurgeModel(ctx context.Context, model string) (Purged, error) {
	if model == "" || len(model) > protocol.MaxModelLen {
		return Purged{}, fmt.Errorf("%w: model id of %d bytes: want 1..%d", ErrInvalid, len(model), protocol.MaxModelLen)
	}
	return c.purge(ctx, &protocol.Purge{Model: model})
}

func (c *Client) purge(ctx context.Context, m *protocol.Purge) (Purged, error) {
	r, err := c.call(ctx, m, nil)
	if err != nil {
		return Purged{}, err
	}
	return *r.(*protocol.Purged), nil
}

// DeviceByUUID returns the daemon's ordinal of the GPU whose UUID is uuid
// (cuDeviceGetUuid; nvidia-smi prints it as GPU-<uuid>), for
// RegisterCUDAIPC. It fails with ErrUnknownDevice when the daemon names
// no GPU by it.
func (c *Client) DeviceByUUID(ctx context.Context, uuid [16]byte) (int, error) {
	st, err := c.Stats(ctx)
	if err != nil {
		return 0, err
	}
	named := 0
	for _, d := range st.Devices {
		if d.UUID == ([16]byte{}) {
			continue
		}
		named++
		if d.UUID == uuid {
			return int(d.Ordinal), nil
		}
	}
	return 0, fmt.Errorf("%w: %x (the daemon names %d of its %d GPUs by UUID)", ErrUnknownDevice, uuid, named, len(st.Devices))
}

// KeyResult is the outcome of one key.
type KeyResult struct {
	Outcome Outcome       // what happened to the key
	Code    protocol.Code // why the key failed (OutcomeFailed)
}

// Result is the outcome of a completed job.
type Result struct {
	Keys     []KeyResult   // one per request key, in request order
	Bytes    int64         // payload bytes moved
	Duration time.Duration // from submission to completion, as the daemon measured it
	// Message is the daemon's text for the first failed key or, if none
	// failed, why the first missing key is missing.
	Message string
}

// Count returns how many keys ended with outcome o.
func (r Result) Count(o Outcome) int {
	n := 0
	for _, k := range r.Keys {
		if k.Outcome == o {
			n++
		}
	}
	return n
}

// Err returns an error if any key failed.
func (r Result) Err() error {
	for i, k := range r.Keys {
		if k.Outcome == protocol.OutcomeFailed {
			return fmt.Errorf("key %d: %w", i, &protocol.Error{Code: k.Code, Message: r.Message})
		}
	}
	return nil
}

func resultOf(m *protocol.Completion) Result {
	r := Result{Keys: make([]KeyResult, len(m.Keys)), Bytes: int64(m.Bytes), Duration: time.Duration(m.Duration), Message: m.Message}
	for i, k := range m.Keys {
		r.Keys[i] = KeyResult{Outcome: k.Outcome, Code: k.Code}
	}
	return r
}

// Job is a store or load job in flight on the daemon.
type Job struct {
	c        *Client
	t        protocol.Type // the request's type: Store, Load or LoadLayers
	kind     protocol.JobKind
	keys     int           // the request's keys
	accepted chan struct{} // closed once id is set: the daemon accepted the job
	id       uint64
	// abandoned, under c.mu: the caller's context ended before the
	// daemon's answer; the job is cancelled once accepted.
	abandoned bool
	done      chan struct{}
	res       Result
	err       error
}

// newJob is the Job of request m.
func newJob(c *Client, m *protocol.Transfer) *Job {
	return &Job{c: c, t: m.Type(), kind: m.Kind, keys: len(m.Keys), accepted: make(chan struct{}), done: make(chan struct{})}
}

// requestType is the type of the job's request.
func (j *Job) requestType() protocol.Type { return j.t }

// isAccepted reports whether the daemon accepted the job.
func (j *Job) isAccepted() bool {
	select {
	case <-j.accepted:
		return true
	default:
		return false
	}
}

func (j *Job) finish(r Result, err error) {
	j.res, j.err = r, err
	close(j.done)
}

// ID is the daemon's id of the job, or 0 while the daemon has not yet
// accepted it (a Store or Load that returned with its context's error).
func (j *Job) ID() uint64 {
	if !j.isAccepted() {
		return 0
	}
	return j.id
}

// Done is closed when the job's completion has arrived (or the connection
// was lost, or the daemon refused a job whose Store or Load had returned
// before its answer).
func (j *Job) Done() <-chan struct{} { return j.done }

// Wait waits for the job's completion and returns its per-key outcomes.
// The error is non-nil only when no completion arrived (connection lost,
// ctx done, or, for a job whose Store or Load returned before the
// daemon's answer, the daemon's refusal: a *protocol.Error); failed keys
// are in the Result (see Result.Err).
//
// When the connection is lost, Wait returns ErrClosed at once. If the
// daemon closed the connection, the job had ended: the daemon cancels a
// connection's jobs, waits until its engine has ended them, releases the
// connection's memory and only then closes it. If the client closed it
// (Close, or a frame from the daemon that it refused), the error also
// matches ErrBlocksInUse: the daemon may still be copying to or from the
// job's blocks, in the memfd or the CUDA IPC memory, until its engine has
// ended the cancelled job, and the client cannot tell when: do not reuse
// those blocks; free the memory instead (the daemon's own mapping or
// import keeps it until then).
func (j *Job) Wait(ctx context.Context) (Result, error) {
	select {
	case <-j.done:
		return j.res, j.err
	case <-ctx.Done():
		return Result{}, ctx.Err()
	}
}

// Cancel asks the daemon to cancel the job (see Client.Cancel).
func (j *Job) Cancel(ctx context.Context) (bool, error) { return j.c.Cancel(ctx, j) }

// Outcomes of a key in a job.
const (
	OutcomeStored      = protocol.OutcomeStored
	OutcomePresent     = protocol.OutcomePresent
	OutcomeNotAdmitted = protocol.OutcomeNotAdmitted
	OutcomeLoaded      = protocol.OutcomeLoaded
	OutcomeMissing     = protocol.OutcomeMissing
	OutcomeFailed      = protocol.OutcomeFailed
	OutcomeCancelled   = protocol.OutcomeCancelled
)

// Pin is a client pin (Client.Pin, Client.PinLoadable): Keys[i] of the
// request is pinned when Held[i] is true. ID is 0 when no key was pinned.
type Pin struct {
	ID   uint64 // the daemon's id of the pin, for Unpin
	Held []bool // per request key, whether it is pinned
	// NoCache (PinLoadable only): no cache of the namespace is registered
	// on any connection, so nothing was looked up or pinned.
	NoCache bool
}

// Pin pins the stored keys of namespace ns: the daemon neither evicts nor
// deletes them until Unpin, the lease (0: none; at most 24 hours, to the
// millisecond) ends, or this connection closes. Every file is checked by
// the daemon when pinned; Held says, per key, whether it was stored and
// checked, and is now pinned.
func (c *Client) Pin(ctx context.Context, ns NamespaceID, keys [][]byte, lease time.Duration) (Pin, error) {
	return c.pin(ctx, ns, keys, lease, false, "")
}

// PinLoadable is Pin for a client whose loads go through other
// connections' caches (a scheduler beside its workers): while no
// connection of group (JoinGroup; "" for any connection) has a cache of ns
// registered, it pins nothing and answers NoCache. A daemon older than the
// frame refuses it with protocol.CodeUnknownType.
func (c *Client) PinLoadable(ctx context.Context, ns NamespaceID, keys [][]byte, lease time.Duration, group string) (Pin, error) {
	if len(group) > protocol.MaxGroupLen {
		return Pin{}, fmt.Errorf("%w: group of %d bytes: at most %d", ErrInvalid, len(group), protocol.MaxGroupLen)
	}
	return c.pin(ctx, ns, keys, lease, true, group)
}

// JoinGroup puts this connection's caches in group (1..64 bytes, compared
// as bytes), which a PinLoadable can name: one engine's workers join its
// group, so that its scheduler's pins count only their caches. Once per
// connection, before any RegisterCache.
func (c *Client) JoinGroup(ctx context.Context, group string) error {
	if group == "" || len(group) > protocol.MaxGroupLen {
		return fmt.Errorf("%w: group of %d bytes: want 1..%d", ErrInvalid, len(group), protocol.MaxGroupLen)
	}
	_, err := c.call(ctx, &protocol.Group{Name: group}, nil)
	return err
}

func (c *Client) pin(ctx context.Context, ns NamespaceID, keys [][]byte, lease time.Duration, loadable bool, group string) (Pin, error) {
	if err := protocol.CheckKeys(keys); err != nil {
		return Pin{}, fmt.Errorf("%w: %w", ErrInvalid, err)
	}
	if lease < 0 || lease > protocol.MaxLeaseMillis*time.Millisecond {
		return Pin{}, fmt.Errorf("%w: lease %v: want 0..24h", ErrInvalid, lease)
	}
	ms := uint32(lease / time.Millisecond)
	if lease > 0 && ms == 0 {
		ms = 1
	}
	unpin := func(r protocol.Message) {
		c.undo(func(ctx context.Context) error { _, err := c.Unpin(ctx, r.(*protocol.Pinned).Pin); return err })
	}
	m, err := c.create(ctx, &protocol.Pin{NS: uint32(ns), LeaseMillis: ms, Keys: keys, Loadable: loadable, Group: group}, nil, unpin)
	if err != nil {
		return Pin{}, err
	}
	r := m.(*protocol.Pinned)
	if len(r.State) != len(keys) {
		if r.Pin != 0 {
			go unpin(r) // the caller gets no id to release it with
		}
		return Pin{}, fmt.Errorf("%w: pin reply has %d states for %d keys", protocol.ErrMalformed, len(r.State), len(keys))
	}
	p := Pin{ID: r.Pin, Held: make([]bool, len(keys))}
	for i, s := range r.State {
		p.Held[i] = s == protocol.PinHeld
		p.NoCache = p.NoCache || s == protocol.PinNoCache
	}
	return p, nil
}

// Unpin releases a pin and returns how many keys it held (0 if it was
// released already or its lease ended).
func (c *Client) Unpin(ctx context.Context, id uint64) (int, error) {
	m, err := c.call(ctx, &protocol.Unpin{Pin: id}, nil)
	if err != nil {
		return 0, err
	}
	return int(m.(*protocol.Count).Count), nil
}
