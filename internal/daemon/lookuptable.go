package daemon

import (
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"

	"github.com/kvhost/kvhost/internal/config"
	"github.com/kvhost/kvhost/internal/engine"
	"github.com/kvhost/kvhost/internal/fstype"
	"github.com/kvhost/kvhost/internal/lookuptable"
	"github.com/kvhost/kvhost/internal/server"
	"golang.org/x/sys/unix"
)

// openLookupTable creates the daemon's shared lookup table beside the
// socket (readable by whoever may connect to the socket) and mirrors the
// engine's keys into it; nil where engine.lookup_table is false. Misses
// read from it are final only where no mount is shared with other
// writers (sharedMount).
func openLookupTable(cfg config.Config, eng *engine.Engine, log *slog.Logger) (*lookuptable.Table, error) {
	if !cfg.Engine.Lookups() {
		return nil, nil
	}
	gid := -1
	if cfg.Server.SocketGroup != "" {
		g, err := server.LookupGroup(cfg.Server.SocketGroup)
		if err != nil {
			return nil, err
		}
		gid = g
	}
	// Absolute: clients are told this path, and do not share the daemon's
	// working directory, against which a relative socket is bound.
	path, err := filepath.Abs(cfg.Server.Socket + ".lookup")
	if err != nil {
		return nil, fmt.Errorf("lookup table: %w", err)
	}
	if err := os.MkdirAll(filepath.Dir(path), 0o750); err != nil {
		return nil, fmt.Errorf("lookup table: %w", err)
	}
	slots := cfg.Engine.LookupTableSlots
	if slots == 0 {
		slots = config.DefaultLookupTableSlots
	}
	final, shared := true, ""
	for _, m := range cfg.Mounts {
		if sharedMount(m) {
			final, shared = false, m.Path
			break
		}
	}
	if cfg.Objects.Endpoint != "" {
		// The bucket's keys are the engine's to answer (objstore.Has).
		final, shared = false, cfg.Objects.Endpoint
	}
	// Clients need to read the table only, and whoever may connect to the
	// socket may ask what it holds: a read bit for each write bit of the
	// socket's (connecting to a Unix socket takes write permission).
	t, err := lookuptable.Create(path, slots, (os.FileMode(cfg.Server.SocketMode)&0o222)<<1, gid, final)
	if err != nil && gid >= 0 && errors.Is(err, unix.EPERM) {
		// Giving the table to the group was refused: the group changed
		// since the start's probe (server.PrepareSocketDir).
		err = server.ChownGroupError(cfg.Server.SocketGroup, gid, err)
	}
	if err != nil {
		return nil, err
	}
	eng.MirrorKeys(t)
	if final {
		log.Info("shared lookup table", "path", path, "slots", t.Slots())
	} else {
		log.Info("shared lookup table; clients ask the daemon about keys it lacks, a mount being shared", "path", path, "slots", t.Slots(), "shared", shared)
	}
	return t, nil
}

// sharedMount reports whether other nodes or programs may write files into
// m: its shared setting, else a vllm-fs layout or a network or FUSE file
// system. Its statfs has no bound (AnswerWithin): it comes after the
// engine's Open, which statfs'd this very directory and walked it, so it
// hangs only on a mount that stopped answering since, which the start's
// first statfs does not catch either (RATIONALE.md, "Why do check and the
// start give a mount's statfs 5 s by default?").
func sharedMount(m config.Mount) bool {
	if m.Shared != nil {
		return *m.Shared
	}
	if m.Layout == config.LayoutVLLMFS {
		return true
	}
	var st unix.Statfs_t
	if err := unix.Statfs(m.Path, &st); err != nil {
		return true // cannot tell: the safe answer
	}
	k, ok := fstype.Of(int64(st.Type))
	return !ok || k.Network
}
