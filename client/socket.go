package client

import (
	"os"
	"path/filepath"
)

// SocketEnv is the environment variable that names the daemon's socket
// for clients that are given none.
const SocketEnv = "KVHOST_SOCKET"

// DefaultSocket is the socket a client connects to when given none:
// $KVHOST_SOCKET if set, else the daemon's own default:
// $XDG_RUNTIME_DIR/kvhost.sock, else kvhost/kvhost.sock under the user's
// cache directory ($XDG_CACHE_HOME, else ~/.cache), else under the
// system's temporary directory (config.DefaultSocket, written again here
// so that the client does not depend on the daemon's configuration).
func DefaultSocket() string {
	if p := os.Getenv(SocketEnv); p != "" {
		return p
	}
	if dir := os.Getenv("XDG_RUNTIME_DIR"); dir != "" {
		return filepath.Join(dir, "kvhost.sock")
	}
	root := filepath.Join(os.TempDir(), "kvhost")
	if dir, err := os.UserCacheDir(); err == nil {
		root = filepath.Join(dir, "kvhost")
	}
	return filepath.Join(root, "kvhost.sock")
}
