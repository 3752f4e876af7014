package main

// kvhost check on a shared file system: what the engine's cross-node
// guarantees rest on there (docs/cluster.md).

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kvhost/kvhost/internal/fstype"
)

// probeFlock takes an exclusive flock on a hidden probe file in dir and
// tries a second one on another open file description of it, which must
// be refused: nil when flock works and excludes on this node. Whether
// other nodes see the lock is not something one node can probe.
func probeFlock(dir string) error {
	name := filepath.Join(dir, fmt.Sprintf(".probe-flock-%d", os.Getpid()))
	f, err := os.OpenFile(name, os.O_RDWR|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return err
	}
	defer os.Remove(name)
	defer f.Close()
	if err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB); err != nil {
		return fmt.Errorf("flock: %w", err)
	}
	g, err := os.Open(name)
	if err != nil {
		return err
	}
	defer g.Close()
	switch err := unix.Flock(int(g.Fd()), unix.LOCK_EX|unix.LOCK_NB); {
	case err == nil:
		return errors.New("a second exclusive flock was granted beside the first")
	case !errors.Is(err, unix.EWOULDBLOCK):
		return fmt.Errorf("second flock: %w", err)
	}
	return nil
}

// sharedFinding says, for a file system of magic that kvhost takes for a
// shared one, what guards another node's stores in flight: flock where
// the file system shares it (flockErr is the local probe's result), the
// temp_grace age otherwise. level is "" for a local file system.
func sharedFinding(magic int64, flockErr error, tempGrace time.Duration) (level, what, fix string) {
	kind, ok := fstype.Of(magic)
	if !ok || !kind.Network {
		return "", "", ""
	}
	name := kind.Name
	if magic == fstype.FUSE {
		name = fmt.Sprintf("FUSE (f_type %#x: ceph-fuse, GlusterFS, …)", fstype.FUSE)
	}
	if flockErr != nil {
		return levelWarn, fmt.Sprintf("shared file system %s: flock does not work here (%v); another node's stores in flight are protected only by temp_grace (%v)", name, flockErr, tempGrace),
			"set [engine] temp_grace above the longest store on any node"
	}
	return levelInfo, fmt.Sprintf("shared file system %s: flock works on this node (probed); whether other nodes see it depends on the file system (CephFS: yes), which one node cannot probe, so temp_grace (%v) also guards other nodes' stores in flight", name, tempGrace),
		"give every node its own [engine] node_id and a temp_grace above the longest store"
}
