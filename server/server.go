// Package server is the kvhost daemon's protocol front end: it accepts
// connections on the Unix socket, runs one session per client, checks every
// request against what that client registered and its limits, dispatches to
// the storage engine, and pushes job completions back.
//
// A session owns what its client registered: memory regions (mapped
// memfds), namespaces and caches, by ids that mean nothing on another
// connection. When the client goes away, the session cancels its jobs,
// waits until the engine has finished with every one of them, and only
// then unregisters its caches and unmaps its regions: a job never touches
// unmapped memory.
package server

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kvhost/kvhost/host/engine"
	"github.com/kvhost/kvhost/protocol"
)

// Engine is what a session asks of the storage engine (*engine.Engine).
type Engine interface {
	Declare(ctx context.Context, g engine.Geometry) (engine.NamespaceID, error)
	RegisterCache(ns engine.NamespaceID, layers []engine.LayerTensor) (engine.CacheID, error)
	UnregisterCache(id engine.CacheID) error
	Store(ctx context.Context, req engine.StoreRequest) (*engine.Job, error)
	Load(ctx context.Context, req engine.LoadRequest) (*engine.Job, error)
	Lookup(ctx context.Context, ns engine.NamespaceID, keys [][]byte) (int, error)
	Delete(ctx context.Context, ns engine.NamespaceID, keys [][]byte) (int, error)
	Stats() engine.Stats
}

var _ Engine = (*engine.Engine)(nil)

// Config configures a Server. Zero fields take the defaults noted.
type Config struct {
	// MaxClients bounds concurrent connections (default 64).
	MaxClients int
	// MaxFrame bounds one frame, header included (default 4 MiB, at least
	// protocol.MinFrame).
	MaxFrame int
	// MaxRegistrations bounds a connection's memory regions (default 64).
	MaxRegistrations int
	// MaxInflightJobs bounds a connection's unfinished jobs (default 256).
	MaxInflightJobs int
	// MaxNamespaces and MaxCaches bound a connection's declarations and
	// cache registrations (default 64 each).
	MaxNamespaces, MaxCaches int
	// MaxRegisteredBytes bounds the bytes of memory one connection may
	// register, and MaxTotalRegisteredBytes those of all connections
	// together (defaults: the machine's physical memory, and twice it).
	// Registered memory is mapped into the daemon, so without a bound a
	// client could exhaust the daemon's address space with sparse memfds.
	MaxRegisteredBytes, MaxTotalRegisteredBytes int64
	// ShutdownTimeout is how long Serve, once its context is done, lets
	// in-flight jobs finish before cancelling them (default 0: cancel at once).
	ShutdownTimeout time.Duration
	// Name is sent to clients in the handshake (default "kvhost").
	Name string
	// Logger receives the server's logs (default slog.Default()).
	Logger *slog.Logger
}

func (c Config) withDefaults() (Config, error) {
	def := func(v *int, d int) {
		if *v == 0 {
			*v = d
		}
	}
	def(&c.MaxClients, 64)
	def(&c.MaxFrame, 4<<20)
	def(&c.MaxRegistrations, 64)
	def(&c.MaxInflightJobs, 256)
	def(&c.MaxNamespaces, 64)
	def(&c.MaxCaches, 64)
	if c.MaxRegisteredBytes == 0 || c.MaxTotalRegisteredBytes == 0 {
		var si unix.Sysinfo_t
		ram := int64(64 << 30)
		if err := unix.Sysinfo(&si); err == nil && si.Totalram > 0 {
			ram = int64(si.Totalram) * int64(si.Unit)
		}
		if c.MaxRegisteredBytes == 0 {
			c.MaxRegisteredBytes = ram
		}
		if c.MaxTotalRegisteredBytes == 0 {
			c.MaxTotalRegisteredBytes = 2 * ram
		}
	}
	switch {
	case c.MaxRegisteredBytes < 0 || c.MaxTotalRegisteredBytes < 0:
		return c, errors.New("server: negative registered-bytes limit")
	case c.MaxFrame < protocol.MinFrame || c.MaxFrame > 1<<30:
		return c, fmt.Errorf("server: MaxFrame %d: want %d..1GiB", c.MaxFrame, protocol.MinFrame)
	case c.MaxClients < 0 || c.MaxRegistrations < 0 || c.MaxInflightJobs < 0 || c.MaxNamespaces < 0 || c.MaxCaches < 0:
		return c, errors.New("server: negative limit")
	case c.ShutdownTimeout < 0:
		return c, errors.New("server: negative ShutdownTimeout")
	}
	if c.Name == "" {
		c.Name = "kvhost"
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	return c, nil
}

// Server serves the kvhost protocol over a listener.
type Server struct {
	eng Engine
	cfg Config
	log *slog.Logger

	mu       sync.Mutex
	sessions map[*session]struct{}
	stopping bool
	wg       sync.WaitGroup // sessions
	connSeq  atomic.Uint64  // numbers connections in logs
	regBytes atomic.Int64   // memory registered by all sessions
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
	return &Server{eng: eng, cfg: cfg, log: cfg.Logger, sessions: make(map[*session]struct{})}, nil
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

// start registers and runs a session, or refuses the connection.
func (s *Server) start(c *net.UnixConn) *session {
	s.mu.Lock()
	if s.stopping || len(s.sessions) >= s.cfg.MaxClients {
		stopping := s.stopping
		s.mu.Unlock()
		code, msg := protocol.CodeLimit, fmt.Sprintf("the daemon serves at most %d clients", s.cfg.MaxClients)
		if stopping {
			code, msg = protocol.CodeShuttingDown, "the daemon is shutting down"
		}
		c.SetWriteDeadline(time.Now().Add(time.Second))
		c.Write(protocol.AppendFrame(nil, 0, &protocol.Error{Code: code, Message: msg}))
		c.Close()
		return nil
	}
	sess := newSession(s, c)
	s.sessions[sess] = struct{}{}
	s.wg.Add(1)
	s.mu.Unlock()
	go func() {
		defer s.wg.Done()
		sess.run()
		s.mu.Lock()
		delete(s.sessions, sess)
		s.mu.Unlock()
	}()
	return sess
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

// clients is the number of live sessions.
func (s *Server) clients() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.sessions)
}
