package engine

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/fsys"
	"github.com/kvhost/kvhost/host/policy"
	"github.com/kvhost/kvhost/internal/clustercap"
	"github.com/kvhost/kvhost/internal/engine/cluster"
	"github.com/kvhost/kvhost/internal/engine/index"
)

// Cluster-wide capacity (docs/cluster.md, "Cluster-wide capacity"): the
// state and the work of a mount with Mount.ClusterCapacity are package
// cluster's (cluster.Mount, its loops cluster.Run); the engine opens
// them, calls their operations, and serves them as their cluster.Host
// (clusterHost).

// DefaultClusterInterval is Mount.ClusterInterval when it is zero.
const DefaultClusterInterval = cluster.DefaultInterval

// fileID draws the id of a file about to be written: with a cluster
// mount among mounts, tagged with this node's owner tag.
func fileID(mounts []*mount) uint64 {
	for _, m := range mounts {
		if m.cluster != nil {
			return m.cluster.FileID()
		}
	}
	return newFileID()
}

// clusters is the cluster state of the mounts of mounts with a cluster
// capacity.
func clusters(mounts []*mount) []*clusterMount {
	var out []*clusterMount
	for _, m := range mounts {
		if m.cluster != nil {
			out = append(out, m.cluster)
		}
	}
	return out
}

// openCluster sets up the cluster state of every mount of e with a
// cluster capacity (cluster.Open): its directory and lock, no spares made
// ahead there, and checks that no live node shares this node's tag. Open
// calls it before the rebuild (cluster.Open says why). Its first summary
// waits for countCluster. On an error the caller closes the cluster
// (cluster.Run.Close).
func openCluster(e *Engine) error {
	for i, cm := range e.cfg.Mounts {
		if cm.ClusterCapacity == 0 {
			continue
		}
		m := e.mounts[i]
		if cm.ClusterCapacity < 0 || cm.ClusterInterval < 0 || m.raw != nil {
			return fmt.Errorf("%w: mount %s: cluster capacity %d, interval %v: want >= 0, on a mount of kvhost's layout", ErrInvalid, m.root, cm.ClusterCapacity, cm.ClusterInterval)
		}
		hf, lf := m.sp.Watermarks()
		b, err := clustercap.NewBound(cm.ClusterCapacity, hf, lf)
		if err != nil {
			return fmt.Errorf("%w: mount %s: %w", ErrInvalid, m.root, err)
		}
		g := cluster.Group{Idx: m.idx, Root: m.root, Node: e.own.node, Log: e.cfg.Logger, Host: clusterHost{e, m}, Index: e.ix, Space: e.space, Sp: m.sp, Policy: e.cfg.PolicyName}
		c, err := cluster.Open(e.fs, g, b, cm.ClusterInterval)
		if c != nil {
			m.cluster = c // it keeps no spares (spareCapable)
		}
		var te *cluster.TagError
		switch {
		case errors.As(err, &te):
			return fmt.Errorf("%w: mount %s: %w", ErrInvalid, m.root, err)
		case err != nil:
			return fmt.Errorf("engine: mount %s: %w", m.root, err)
		}
	}
	return nil
}

// countCluster publishes the first summary of every cluster mount of
// mounts, after the rebuild (it counts the files already there).
func countCluster(ctx context.Context, mounts []*mount) error {
	for _, m := range mounts {
		if m.cluster == nil {
			continue
		}
		m.cluster.Tick(ctx)
		if err := ctx.Err(); err != nil { // the tick stopped short: no summary
			return fmt.Errorf("engine: mount %s: %w", m.root, err)
		}
	}
	return nil
}

// clusterNoSpace is err, a cluster mount's, as the engine's: its
// cluster.NoSpaceError wrapped with ErrNoSpace.
func clusterNoSpace(err error) error {
	var ns *cluster.NoSpaceError
	if errors.As(err, &ns) {
		return fmt.Errorf("%w: %w", ErrNoSpace, err)
	}
	return err
}

// mayEvict reports whether this node may remove en's file: anywhere but
// on a cluster mount, where cluster.Mount.MayEvict says.
func (m *mount) mayEvict(en *entry) bool {
	return m.cluster == nil || m.cluster.MayEvict(en)
}

// clusterHost is the engine as a cluster mount's cluster.Host: m is the
// mount.
type clusterHost struct {
	e *Engine
	m *mount
}

// Now is the engine's clock.
func (h clusterHost) Now() time.Time { return h.e.cfg.Now() }

// Access tells the policy of recs.
func (h clusterHost) Access(ctx context.Context, recs []abi.AccessRecord) { h.e.access(ctx, recs) }

// Evicted removes the files of claimed, counts the evictions of recs and
// tells the policy of them.
func (h clusterHost) Evicted(ctx context.Context, claimed []*index.Entry, recs []abi.AccessRecord) {
	h.e.capacity.evicted(ctx, claimed, recs)
}

// Clustered reports whether mount has a cluster capacity.
func (h clusterHost) Clustered(mount int) bool { return h.e.mounts[mount].cluster != nil }

// CleanTemp applies the leftover rule (cleanTemp: flock free, older than
// temp_grace) to the temporary file at path and reports whether it is
// gone.
func (h clusterHost) CleanTemp(path string) (bool, error) {
	rest, _ := tempRest(filepath.Base(path))
	removed, err := h.e.own.cleanTemp(h.m, path, rest)
	if _, serr := h.e.fs.Stat(path); removed || errors.Is(serr, os.ErrNotExist) {
		return true, err
	}
	return false, err
}

// Purge drops ens as a purge does (purgeEntries: a file this node may
// remove is removed, another node's only leaves the index, and a file a
// client pin holds stays, to go at the first tick after its pin ends).
func (h clusterHost) Purge(ctx context.Context, ens []*index.Entry) {
	var r PurgeResult
	h.e.rm.purgeEntries(ctx, ens, mayPurge(h.e.mounts), &r, "purged on the cluster")
	if r.Files+r.Left+r.Others > 0 {
		h.e.cfg.Logger.Info("engine: cluster: dropped the files of purged namespaces (a purge record)", "mount", h.m.root,
			"files", r.Files, "keys", r.Keys, "bytes", r.Bytes, "others", r.Others, "pinned", r.Pinned, "left", r.Left)
	}
}

// Rank asks the engine's policy for the ranks of recs. It reports false,
// asking nothing, when the policy cannot rank (no policy.Ranker, or no
// abi.FeatureRank).
func (h clusterHost) Rank(ctx context.Context, recs []abi.RankRecord) (bool, error) {
	p := h.e.pol.Policy
	if sp, ok := p.(*switchPolicy); ok {
		hd := sp.acquire()
		defer hd.calls.Done()
		p = hd.p
	}
	r, ok := p.(policy.Ranker)
	if !ok || !p.Features().Has(abi.FeatureRank) {
		return false, nil
	}
	if err := r.Rank(ctx, recs); err != nil {
		return false, err
	}
	return true, nil
}

// AdoptFiles indexes the files on m whose owner tag is in tags (dead
// nodes this node has just adopted): a dead node's files written after
// this node's start are not in its index. It lists each directory afresh
// (touchDir): a listing the file system client answered from its cache
// could miss the dead node's newest files, and a node whose walk found
// none of its files left is retired, its files then counted and removed
// by no node. A file gone meanwhile, or not a kvhost file (the rebuild's
// business), is skipped; one of those nodes' files that is shorter than
// its header says (shortFileError) is removed, as a load removes a
// corrupt file: its owner is dead, and no node would count or remove it. So is a file whose read fails (readFailed: it
// may be the dead node's); a dead node's file whose path a job of this
// engine holds (errPathHeld: a store that fails leaves it there), or
// whose stat fails; and a directory that cannot be read or not be listed
// afresh. It returns their errors once the walk is done (the caller walks
// again). The temporary
// files of those nodes it adds to temps, with their owner's tag
// (the cluster Mount's adoption part: cleanTemps). It returns how many files it indexed.
func (h clusterHost) AdoptFiles(ctx context.Context, tags map[uint32]bool, temps map[string]uint32) (int, error) {
	e, m := h.e, h.m
	n := 0
	var errs []error
	var walk func(dir string) error
	walk = func(dir string) error {
		if err := ctx.Err(); err != nil {
			return err
		}
		if err := h.touchDir(dir); err != nil {
			// The listing may be as old as the client's cache of it: the
			// walk is not complete (the caller walks again).
			errs = append(errs, fmt.Errorf("engine: listing %s afresh: %w", dir, err))
		}
		ents, err := e.fs.ReadDir(dir)
		if err != nil {
			errs = append(errs, err)
			return nil
		}
		for _, d := range ents {
			name := d.Name()
			path := filepath.Join(dir, name)
			if strings.HasPrefix(name, ".") { // metadata, temporaries, spares
				if rest, ok := tempRest(name); ok && d.Type().IsRegular() {
					if node, _, owned := tempOwner(rest); owned && tags[clustercap.Tag(node)] {
						temps[path] = clustercap.Tag(node)
					}
				}
				continue
			}
			if d.IsDir() {
				if err := walk(path); err != nil {
					return err
				}
				continue
			}
			if !d.Type().IsRegular() {
				continue
			}
			if err := ctx.Err(); err != nil {
				return err
			}
			en, err := e.hd.readEntry(m.idx, path)
			e.st.scanned.Add(1) // progress for Activity: the walk may take minutes, stores waiting on it
			var short *shortFileError
			if errors.As(err, &short) {
				en, err = short.en, nil // a dead node's is indexed, then dropped below
			}
			if err != nil {
				if readFailed(err) {
					// Whose file it is cannot be told: the walk is not
					// complete (the caller walks again).
					errs = append(errs, fmt.Errorf("engine: reading %s: %w", path, err))
				}
				continue
			}
			if o, ok := clustercap.Owner(en.FID); !ok || !tags[o] {
				continue
			}
			got, err := e.shared.adoptFound(ctx, en)
			switch {
			case got != nil && short != nil:
				// Cut short, and its owner dead: no node will finish or
				// load it. Dropped as a load drops a corrupt file, through
				// the index (the path held, the file removed only if it is
				// still this one); a removal that fails leaves it counted
				// on this node's mount (index.Leaving's left) and tried again.
				e.st.corrupt.Add(1)
				e.cfg.Logger.Warn("engine: cluster: a dead node's corrupt file removed", "mount", m.root, "err", short)
				e.rm.drop(ctx, got, true, "corrupt")
			case got != nil:
				n++
			case errors.Is(err, errPathHeld) || readFailed(err):
				// A job of this engine holds the path (a store that may
				// fail and leave the file), or its stat failed: the walk
				// is not complete (the caller walks again).
				errs = append(errs, fmt.Errorf("engine: indexing %s: %w", path, err))
			}
		}
		return nil
	}
	err := walk(m.root)
	return n, errors.Join(append(errs, err)...)
}

// Census walks m's data files for the cluster's census
// (cluster.Census): every regular file whose name does not start with a
// dot (metadata, temporary and spare files do), with its identity from
// the listing's lstat and its header's file id read on demand, and the
// node that each temporary file names. A directory it cannot list, or a
// file it cannot stat, is passed over (the next census tries again).
func (h clusterHost) Census(ctx context.Context, file func(path string, id fsys.Identity, header func() (uint64, error)) error, temp func(node string)) error {
	e, m := h.e, h.m
	var walk func(dir string) error
	walk = func(dir string) error {
		if err := ctx.Err(); err != nil {
			return err
		}
		ents, err := e.fs.ReadDir(dir)
		if err != nil {
			return nil
		}
		for _, d := range ents {
			name := d.Name()
			path := filepath.Join(dir, name)
			switch {
			case strings.HasPrefix(name, "."):
				if rest, ok := tempRest(name); ok && d.Type().IsRegular() {
					if node, _, owned := tempOwner(rest); owned {
						temp(node)
					}
				}
			case d.IsDir():
				if err := walk(path); err != nil {
					return err
				}
			case d.Type().IsRegular():
				if err := ctx.Err(); err != nil {
					return err // the engine closes: not another file
				}
				fi, err := d.Info()
				if err != nil {
					continue
				}
				id, err := fsys.IdentityOf(fi)
				if err != nil {
					continue
				}
				header := func() (uint64, error) {
					en, err := e.hd.readEntry(m.idx, path)
					if short := (*shortFileError)(nil); errors.As(err, &short) {
						return short.en.FID, nil
					}
					if err != nil {
						return 0, err
					}
					return en.FID, nil
				}
				if err := file(path, id, header); err != nil {
					return err
				}
			}
		}
		return nil
	}
	return walk(m.root)
}

// readFailed reports whether err, readEntry's, is the file system's
// failure (an I/O error, a stale handle, a refused open) rather than the
// file's being gone or not a kvhost file: the file may be anyone's.
func readFailed(err error) bool {
	var errno syscall.Errno
	return errors.As(err, &errno) && !errors.Is(err, os.ErrNotExist)
}

// touchDir creates a temporary file in dir and removes it, so that the
// next listing of dir is as dir is now: an NFS client may answer a
// listing from its cache of the directory for up to acdirmax (mounted
// nocto, or where the server's directory mtime is too coarse to show a
// change), missing files created since through other clients, and a
// change through the client itself invalidates that cache whatever the
// mount options (clustercap lists its directory so too). A crash in
// between leaves a temporary file of this node, which the leftover rule
// removes. dir is a directory of m, found by a walk: one replaced by a
// symbolic link since gets no file through it (openNoLinks), and the
// file is removed as a store's temporary is (removeFile, relative to its
// directory opened without links).
func (h clusterHost) touchDir(dir string) error {
	e, m := h.e, h.m
	tmp := e.own.tempName(dir, tmpPrefix)
	f, err := e.hd.openNoLinks(m, tmp, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o644)
	if err != nil {
		return err
	}
	id, _ := fileIdentity(f)
	err = f.Close()
	if rerr := e.rm.removeFile(m, tmp, id); rerr != nil {
		err = errors.Join(err, rerr)
	}
	return err
}
