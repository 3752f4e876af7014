package server

import (
	"context"
	"fmt"
	"os"
)

// RetryableAccept exports retryableAccept to the tests.
var RetryableAccept = retryableAccept

// WaitSessions waits until the server has n live connections, those still
// in their handshake included.
func (s *Server) WaitSessions(ctx context.Context, n int) error {
	for {
		s.mu.Lock()
		got, changed := len(s.sessions), s.changed
		s.mu.Unlock()
		if got == n {
			return nil
		}
		select {
		case <-changed:
		case <-ctx.Done():
			return fmt.Errorf("server: %d sessions, want %d: %w", got, n, ctx.Err())
		}
	}
}

// InflightPerPeer is Config.MaxInflightBytesPerPeer as the server runs it.
func (s *Server) InflightPerPeer() int64 { return s.cfg.MaxInflightBytesPerPeer }

// Accounts is what a Server holds beside the figures of Stats: the tests
// that check every charge is given back read it.
type Accounts struct {
	Peers          int // entries of the per-peer map (peers of a known pid)
	NamespaceRefs  int // namespaces some session holds declared
	NamespacesIdle int // declarations in the engine, and namespaces let go meanwhile
	PinLeases      int // pin charges waiting for the end of their lease
	IncomingQueued int // frames queued for the room of all connections
	CacheGroups    int // namespaces and groups with caches counted (PinLoadable)
}

// Accounts returns what s holds.
func (s *Server) Accounts() Accounts {
	var a Accounts
	s.mu.Lock()
	a.Peers = len(s.peers)
	s.mu.Unlock()
	s.nsMu.Lock()
	a.NamespaceRefs = len(s.nsRefs)
	a.NamespacesIdle = len(s.nsIdle) + s.nsDeclaring
	a.CacheGroups = len(s.nsCaches)
	s.nsMu.Unlock()
	s.pinMu.Lock()
	a.PinLeases = len(s.pinLeases)
	s.pinMu.Unlock()
	s.incoming.mu.Lock()
	a.IncomingQueued = s.incoming.waiters.Len()
	s.incoming.mu.Unlock()
	return a
}

// PeerRecord is the record of one peer process, which a test may keep
// past the record's removal from the server's map.
type PeerRecord struct{ p *peer }

// PeerAccount is what a peer record counts held.
type PeerAccount struct {
	PID                                int32
	Sessions, Clients, Namespaces      int
	JobBytes, Descriptors, CacheLayers int64
	IncomingBytes, PinnedKeys          int64
	IncomingQueued                     int
}

// PeerRecords returns the records of the peers of every live session,
// those of an unknown pid (not in the map) included.
func (s *Server) PeerRecords() []PeerRecord {
	s.mu.Lock()
	defer s.mu.Unlock()
	seen := make(map[*peer]bool)
	var out []PeerRecord
	add := func(p *peer) {
		if !seen[p] {
			seen[p] = true
			out = append(out, PeerRecord{p})
		}
	}
	for sess := range s.sessions {
		add(sess.peer)
	}
	for _, p := range s.peers {
		add(p)
	}
	return out
}

// PeerAccount returns what r counts held, read under the locks of s that
// guard it.
func (s *Server) PeerAccount(r PeerRecord) PeerAccount {
	p := r.p
	a := PeerAccount{PID: p.pid, JobBytes: p.jobBytes.Load(), Descriptors: p.fds.Load(), CacheLayers: p.layers.Load()}
	s.mu.Lock()
	a.Sessions, a.Clients = p.refs, p.conns
	s.mu.Unlock()
	s.nsMu.Lock()
	a.Namespaces = len(p.namespaces)
	s.nsMu.Unlock()
	s.pinMu.Lock()
	a.PinnedKeys = p.pinned
	s.pinMu.Unlock()
	p.incoming.mu.Lock()
	a.IncomingBytes, a.IncomingQueued = p.incoming.used, p.incoming.waiters.Len()
	p.incoming.mu.Unlock()
	return a
}

// PrepareSocketDirChown is PrepareSocketDir with the probe file's chown.
func PrepareSocketDirChown(path, group string, chown func(f *os.File, uid, gid int) error) (int, error) {
	return prepareSocketDir(path, group, chowns{probe: chown})
}

// PrepareSocketDirChowns is PrepareSocketDir with the chown of the
// directories it makes and that of the probe file.
func PrepareSocketDirChowns(path, group string, dir func(name string, uid, gid int) error, probe func(f *os.File, uid, gid int) error) (int, error) {
	return prepareSocketDir(path, group, chowns{dir: dir, probe: probe})
}
