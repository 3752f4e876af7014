package client_test

import (
	"testing"

	"github.com/kvhost/kvhost/client"
	"github.com/kvhost/kvhost/internal/config"
)

// TestDefaultSocketMatchesDaemon: without KVHOST_SOCKET the client
// connects where the daemon listens by default; KVHOST_SOCKET overrides it.
func TestDefaultSocketMatchesDaemon(t *testing.T) {
	tests := []struct {
		name              string
		env, runtime, xdg string
		want              string // "" means the daemon's default
	}{
		{"runtime dir", "", "/run/user/7", "", ""},
		{"cache dir", "", "", "/tmp/xdg-cache", ""},
		{"KVHOST_SOCKET wins", "/run/kvhost/kvhost.sock", "/run/user/7", "", "/run/kvhost/kvhost.sock"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Setenv("KVHOST_SOCKET", tc.env)
			t.Setenv("XDG_RUNTIME_DIR", tc.runtime)
			t.Setenv("XDG_CACHE_HOME", tc.xdg)
			want := tc.want
			if want == "" {
				want = config.DefaultSocket(config.DefaultRoot())
			}
			if got := client.DefaultSocket(); got != want {
				t.Fatalf("DefaultSocket() = %q, want %q", got, want)
			}
		})
	}
}
