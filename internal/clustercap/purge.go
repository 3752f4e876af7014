package clustercap

import (
	"errors"
	"fmt"
	"maps"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strconv"
	"strings"
)

// Purge records: a node purging a namespace (the engine's Purge) tells
// every node of the mount by a file in the directory, named
// "<fingerprint>-<time>.purge" (16 hex digits, then the record's
// modification time in Unix nanoseconds, the file system's clock): every
// file of the namespace on the mount last written at or before that time
// is purged. Each node drops such files from its index at its next read
// and removes those it may remove (its own, an adopted dead node's), as
// it evicts; a node starting applies the records after its rebuild. The
// name carries all of it, so a listing the read makes anyway reads the
// records without opening one.

const purgeSuffix = ".purge"

// purgeName is the name of the purge record of fp made at t.
func purgeName(fp uint64, t int64) string {
	return fmt.Sprintf("%016x-%d%s", fp, t, purgeSuffix)
}

// parsePurge reads a purge record's name: its fingerprint and time.
func parsePurge(name string) (fp uint64, t int64, ok bool) {
	rest, ok := strings.CutSuffix(name, purgeSuffix)
	if !ok || len(rest) < 18 || rest[16] != '-' {
		return 0, 0, false
	}
	fp, err := strconv.ParseUint(rest[:16], 16, 64)
	if err != nil {
		return 0, 0, false
	}
	t, err = strconv.ParseInt(rest[17:], 10, 64)
	if err != nil || t <= 0 {
		return 0, 0, false
	}
	return fp, t, true
}

// WritePurge records on the mount that every file of the namespace of
// fingerprint fp last written at or before now is purged, and returns
// the record's time (its modification time, Unix nanoseconds: the file
// system's clock, which stamps the files it judges). The record is a
// temporary file of this node's, fsynced, then renamed to its name, so
// that a reader lists a whole record or none; the older records of fp,
// which it covers, are removed. A record stays on the mount: a node that
// starts later, and an adopter of a dead node's files, apply it too.
func (d *Dir) WritePurge(fp uint64) (int64, error) {
	tmp := filepath.Join(d.path, tempName(d.node, rand.Uint64()))
	if err := d.writeFile(tmp, fmt.Appendf(nil, "purge %016x by node %s\n", fp, d.node)); err != nil {
		d.remove(tmp)
		return 0, fmt.Errorf("clustercap: purge record: %w", err)
	}
	fi, err := d.lstat(tmp)
	if err == nil && fi.ModTime().UnixNano() <= 0 {
		err = fmt.Errorf("%s: modification time %v", tmp, fi.ModTime())
	}
	if err != nil {
		d.remove(tmp)
		return 0, fmt.Errorf("clustercap: purge record: %w", err)
	}
	t := fi.ModTime().UnixNano()
	d.listing.mu.Lock()
	err = d.rename(tmp, filepath.Join(d.path, purgeName(fp, t)))
	if err == nil {
		d.listing.changed = true
	}
	d.listing.mu.Unlock()
	if err != nil {
		d.remove(tmp)
		return 0, fmt.Errorf("clustercap: purge record: %w", err)
	}
	d.notePurge(fp, t)
	ents, err := d.list(false)
	if err != nil {
		return t, nil // the older records stay: covered, harmless
	}
	for _, ent := range ents {
		if f, at, ok := parsePurge(ent.Name()); ok && f == fp && at < t {
			if err := d.remove(filepath.Join(d.path, ent.Name())); err != nil && !errors.Is(err, os.ErrNotExist) {
				break // tried again at the next purge of fp
			}
		}
	}
	return t, nil
}

// Purges returns the purge records as ReadAll listed them, and those
// this Dir wrote: per fingerprint, the latest record's time. Records are
// never taken back, so a listing that misses one (a client's cached
// listing) does not drop a record read before.
func (d *Dir) Purges() map[uint64]int64 {
	d.purges.mu.Lock()
	defer d.purges.mu.Unlock()
	return maps.Clone(d.purges.at)
}

// PurgedAt returns the time of the latest purge record of fp listed or
// written, and whether there is one.
func (d *Dir) PurgedAt(fp uint64) (int64, bool) {
	d.purges.mu.Lock()
	defer d.purges.mu.Unlock()
	t, ok := d.purges.at[fp]
	return t, ok
}

// notePurge records the purge record of fp at t.
func (d *Dir) notePurge(fp uint64, t int64) {
	d.purges.mu.Lock()
	defer d.purges.mu.Unlock()
	if d.purges.at == nil {
		d.purges.at = map[uint64]int64{}
	}
	d.purges.at[fp] = max(d.purges.at[fp], t)
}
