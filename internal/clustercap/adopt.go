package clustercap

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sync"

	"github.com/kvhost/kvhost/fsys"
)

const adoptSuffix = ".adopt"

// adoptions are the adoption locks a Dir holds, by dead node name.
type adoptions struct {
	mu    sync.Mutex
	locks map[string]fsys.File
}

// Adopt takes the adoption lock of node, a node proven dead (Live is
// false): an exclusive flock on .kvhost-cluster/<node>.adopt, held until
// Release or Close. The holder counts the dead node's files as its own
// and may evict them; exactly one live node holds it, so the files are
// counted once. It reports false when another process holds it, true
// when this Dir holds it (already or now).
func (d *Dir) Adopt(node string) (bool, error) {
	if err := checkNode(node); err != nil {
		return false, err
	}
	d.adopted.mu.Lock()
	defer d.adopted.mu.Unlock()
	if d.adopted.locks[node] != nil {
		return true, nil
	}
	f, ok, err := d.tryLockPath(filepath.Join(d.path, node+adoptSuffix))
	if err != nil {
		return false, fmt.Errorf("clustercap: adopt %q: %w", node, err)
	}
	if !ok {
		return false, nil
	}
	if d.adopted.locks == nil {
		d.adopted.locks = map[string]fsys.File{}
	}
	d.adopted.locks[node] = f
	return true, nil
}

// Release gives up the adoption of node (it runs again): another node,
// or the node itself, counts its files from now on. Releasing a node not
// adopted does nothing.
func (d *Dir) Release(node string) error {
	d.adopted.mu.Lock()
	defer d.adopted.mu.Unlock()
	f := d.adopted.locks[node]
	if f == nil {
		return nil
	}
	delete(d.adopted.locks, node)
	return f.Close()
}

// Adopted lists the nodes this Dir holds the adoption of.
func (d *Dir) Adopted() []string {
	d.adopted.mu.Lock()
	defer d.adopted.mu.Unlock()
	out := make([]string, 0, len(d.adopted.locks))
	for n := range d.adopted.locks {
		out = append(out, n)
	}
	return out
}

// releaseAll closes every adoption lock.
func (d *Dir) releaseAll() error {
	d.adopted.mu.Lock()
	defer d.adopted.mu.Unlock()
	var first error
	for n, f := range d.adopted.locks {
		if err := f.Close(); err != nil && first == nil {
			first = err
		}
		delete(d.adopted.locks, n)
	}
	return first
}

// Retire removes the metadata of node, a dead node whose adoption this
// Dir holds and whose files are gone from the mount (the caller knows):
// its summary, its summary temporaries, its lock file and its adoption
// file, and releases the adoption. It holds node's lock while it removes
// them, so that the node cannot start meanwhile; it reports false,
// removing nothing, when another process holds that lock (the node runs
// again). Nothing then remains of the node for any reader to read or
// probe. An error leaves the adoption held; what was removed stays so.
func (d *Dir) Retire(node string) (bool, error) {
	if err := checkNode(node); err != nil {
		return false, err
	}
	d.adopted.mu.Lock()
	defer d.adopted.mu.Unlock()
	adopt := d.adopted.locks[node]
	if adopt == nil {
		return false, fmt.Errorf("clustercap: retire %q: not adopted by node %q", node, d.node)
	}
	lock, ok, err := d.tryLockPath(d.lockPath(node))
	if err != nil || !ok {
		if err != nil {
			err = fmt.Errorf("clustercap: retire %q: %w", node, err)
		}
		return false, err
	}
	defer lock.Close()
	for _, path := range []string{d.summaryPath(node), d.lockPath(node), filepath.Join(d.path, node+adoptSuffix)} {
		if path == d.lockPath(node) {
			if err := d.removeTemps(node); err != nil {
				return false, fmt.Errorf("clustercap: retire %q: %w", node, err)
			}
		}
		if err := d.remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
			return false, fmt.Errorf("clustercap: retire %q: %w", node, err)
		}
	}
	delete(d.adopted.locks, node)
	if err := adopt.Close(); err != nil {
		return true, fmt.Errorf("clustercap: retire %q: %w", node, err)
	}
	return true, nil
}
