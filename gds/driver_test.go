package gds

import (
	"fmt"

	"golang.org/x/sys/unix"
)

// Accessors of the driver's state for the package's tests only.

// batchStats reports the driver's batch counters.
func (d *Driver) batchStats() batchStats {
	c := &d.batch
	return batchStats{
		SetUps: c.setUps.Load(), Batches: c.batches.Load(), Entries: c.entries.Load(),
		Short: c.short.Load(), Abandoned: c.abandoned.Load(), Stuck: c.stuck.Load(),
		Refusals: c.refusals.Load(), Fallbacks: c.fallbacks.Load(),
	}
}

// capability returns the cached capability of the mount holding path,
// probing it (ProbeDir) if it is not known yet.
func (d *Driver) capability(dir string) (Capability, error) {
	var st unix.Stat_t
	if err := unix.Stat(dir, &st); err != nil {
		return Capability{}, fmt.Errorf("gds: stat %s: %w", dir, err)
	}
	if c := d.caps.get(uint64(st.Dev)); c.Mode != ModeUnknown {
		return c, nil
	}
	return d.ProbeDir(dir)
}

// fileHandle registers the file open at fd with cuFile through the
// driver's handle cache; the caller releases the handle. On a GPU it must
// run on a thread bound to the device (Driver.onDevice).
func fileHandle(d *Driver, fd int) (*handle, error) {
	key, err := d.cache.identify(fd)
	if err != nil {
		return nil, err
	}
	return d.cache.acquire(fd, key)
}
