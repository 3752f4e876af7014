package server

import (
	"context"
	"fmt"
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
