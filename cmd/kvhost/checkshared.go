package main

// kvhost check on a shared file system: what the engine's cross-node
// guarantees rest on there (docs/cluster.md).

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"github.com/kvhost/kvhost/fsys"
	"github.com/kvhost/kvhost/internal/fstype"
)

// probeFlock takes an exclusive flock on a hidden probe file in dir on fs
// and tries a second one on another open file description of it, which
// must be refused: nil when flock works and excludes on this node.
// Whether other nodes see the lock is not something one node can probe.
func probeFlock(fs fsys.FS, dir string) error {
	name := filepath.Join(dir, fmt.Sprintf(".probe-flock-%d", os.Getpid()))
	f, err := fs.OpenFile(name, os.O_RDWR|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return err
	}
	defer fs.Remove(name)
	defer f.Close()
	switch ok, err := fsys.TryLock(f); {
	case err != nil:
		return fmt.Errorf("flock: %w", err)
	case !ok:
		return errors.New("flock: refused, with no other holder of the new file")
	}
	// Read-write, as the engine opens what it locks: an NFS client
	// refuses an exclusive flock on a file not open for writing.
	g, err := fsys.OpenToLock(fs, name, 0, 0)
	if err != nil {
		return err
	}
	defer g.Close()
	switch ok, err := fsys.TryLock(g); {
	case err != nil:
		return fmt.Errorf("second flock: %w", err)
	case ok:
		return errors.New("a second exclusive flock was granted beside the first")
	}
	return nil
}

// nfsLocalLocks returns the option of an NFS mount (mnt, of magic) that
// keeps its flocks on the client ("local_lock=flock", "local_lock=all" or
// "nolock"), or "" where it has none or is no NFS mount.
func nfsLocalLocks(magic int64, mnt fstype.Mount, mntErr error) string {
	if magic != fstype.NFS || mntErr != nil {
		return ""
	}
	if v, ok := mnt.Option("local_lock"); ok && (v == "flock" || v == "all") {
		return "local_lock=" + v
	}
	if _, ok := mnt.Option("nolock"); ok {
		return "nolock"
	}
	return ""
}

// sharedFindings says, for a file system of magic that kvhost takes for a
// shared one, which file system it is (for FUSE, from its mount's type:
// mnt, or mntErr where /proc/self/mountinfo did not say), what its clients
// see of each other's files, what guards another node's stores in flight
// (flock where the file system shares it, flockErr being the local
// probe's result; the temp_grace age otherwise), whether a client's pin
// keeps a file another node removes, and which GPU paths apply. It
// returns nothing for a local file system.
func sharedFindings(magic int64, mnt fstype.Mount, mntErr error, flockErr error, tempGrace time.Duration) []checkItem {
	kind, ok := fstype.Of(magic)
	if !ok || !kind.Network {
		return nil
	}
	var out []checkItem
	add := func(level, what, fix string) { out = append(out, checkItem{Level: level, What: what, Fix: fix}) }
	name := kind.Name
	var fuse fstype.FUSEKind
	known := false
	if magic == fstype.FUSE {
		switch sub := mnt.Subtype(); {
		case mntErr != nil:
			name = fmt.Sprintf("FUSE (f_type %#x; which one is unknown: %v)", fstype.FUSE, mntErr)
			add(levelInfo, "shared file system "+name, "")
		case sub == "":
			name = fmt.Sprintf("FUSE (f_type %#x, mounted as %q)", fstype.FUSE, mnt.Type)
			add(levelInfo, "shared file system "+name, "")
		default:
			fuse, known = fstype.FUSEOf(sub)
			if !known {
				name = fmt.Sprintf("%s through FUSE (f_type %#x; %s at %s)", sub, fstype.FUSE, mnt.Type, mnt.Point)
				add(levelInfo, "shared file system "+name+": kvhost knows nothing more of it", "")
				break
			}
			name = fuse.Name
			what := fmt.Sprintf("shared file system %s through FUSE (f_type %#x; %s at %s): %s", fuse.Name, fstype.FUSE, mnt.Type, mnt.Point, fuse.Coherence)
			if fuse.Advice != "" {
				add(levelWarn, what, fuse.Advice)
			} else {
				add(levelInfo, what, "")
			}
		}
	}
	switch local := nfsLocalLocks(magic, mnt, mntErr); {
	case flockErr == nil && local != "":
		add(levelWarn, fmt.Sprintf("%s: mounted %s: flocks stay on this node, so no other node sees them: another node's stores in flight are protected only by temp_grace (%v), and with cluster_capacity no node takes another for dead on its free lock, so a dead node's files are never adopted", name, local, tempGrace),
			"mount without nolock and with local_lock=none (the default), on every node")
	case flockErr != nil:
		add(levelWarn, fmt.Sprintf("%s: flock does not work here (%v); another node's stores in flight are protected only by temp_grace (%v)", name, flockErr, tempGrace),
			"set [engine] temp_grace above the longest store on any node")
	case known && fuse.SharedFlock:
		add(levelOK, fmt.Sprintf("%s: flock works on this node (probed) and a lock taken through one client excludes one through another (the file system shares it): another node's stores in flight keep their temporary files; temp_grace (%v) is the second guard", name, tempGrace),
			"")
	default:
		add(levelInfo, fmt.Sprintf("%s: flock works on this node (probed); whether other nodes see it depends on the file system (CephFS: yes), which one node cannot probe, so temp_grace (%v) also guards other nodes' stores in flight", name, tempGrace),
			"give every node its own [engine] node_id and a temp_grace above the longest store")
	}
	if kind.RemovalStales {
		add(levelWarn, fmt.Sprintf("%s: a file another node removes is gone under this node's open descriptors (ESTALE), so a pin cannot keep it: a key a client pinned here whose file another node evicts, deletes or purges before the key's load fails that load, which stops vLLM's worker", name),
			"stop a model's instances on every node before purging it, and give the mount room enough that eviction seldom takes a file another node just looked up")
	} else if (magic != fstype.FUSE || known) && kind.Name != "smb2" && kind.Name != "cifs" {
		add(levelInfo, fmt.Sprintf("%s: a client's pin holds open the files another node may remove, so a pinned key loads even after another node evicts, deletes or purges its file (up to an eighth of the daemon's descriptor limit held open; past it a pin checks by name, counted in kvhost_pinned_files_unopened_total)", name), "")
	} else {
		add(levelInfo, fmt.Sprintf("%s: a client's pin holds open the files another node may remove; whether that keeps a pinned key loadable after another node removes its file depends on this file system keeping a removed file readable through an open descriptor, which kvhost does not know of it", name), "")
	}
	if !kind.CuFileDirect && !kind.Memory {
		add(levelInfo, fmt.Sprintf("%s: GPU memory moves through the staging pipeline's pinned buffers here: cuFile has no GPUDirect path to this file system (compatibility mode at best), and files are mapped and registered with CUDA only on memory file systems", name), "")
	}
	return out
}
