package clustercap

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"
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

// PurgeAhead is how far ahead of a reader's clock a purge record's time
// may be and still apply: a record further ahead (a garbage name, or a
// file system clock far off the reader's) would purge every file of its
// namespace written until then, new ones too, so it waits until the
// reader's clock is within PurgeAhead of it, and the next purge of its
// fingerprint removes it (WritePurge).
const PurgeAhead = time.Hour

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
	tmp, err := d.writeTemp(fmt.Appendf(nil, "purge %016x by node %s\n", fp, d.node))
	if err != nil {
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
	if err := d.renameIn(tmp, filepath.Join(d.path, purgeName(fp, t))); err != nil {
		return 0, fmt.Errorf("clustercap: purge record: %w", err)
	}
	d.notePurge(fp, t)
	ents, err := d.list(false)
	if err != nil {
		return t, nil // the older records stay: covered, harmless
	}
	for _, ent := range ents {
		// Older records are covered by this one; records further ahead of
		// it than PurgeAhead are of a clock far off (or garbage), which
		// this purge replaces.
		if f, at, ok := parsePurge(ent.Name()); ok && f == fp && (at < t || at-t > int64(PurgeAhead)) {
			if err := d.remove(filepath.Join(d.path, ent.Name())); err != nil && !errors.Is(err, os.ErrNotExist) {
				break // tried again at the next purge of fp
			}
		}
	}
	return t, nil
}

// Purges returns the purge records as ReadAll listed them, and those
// this Dir wrote: per fingerprint, the latest record's time at or before
// limit (the reader's clock plus PurgeAhead), in applied; the
// fingerprints whose latest record is after limit, with its time, in
// ahead, which the caller logs (a clock far off, or a garbage name).
// Records are never taken back, so a listing that misses one (a
// client's cached listing) does not drop a record read before; the
// records older than the latest at or before limit are forgotten, as it
// covers them.
func (d *Dir) Purges(limit int64) (applied, ahead map[uint64]int64) {
	d.purges.mu.Lock()
	defer d.purges.mu.Unlock()
	applied = make(map[uint64]int64, len(d.purges.at))
	for fp, times := range d.purges.at {
		if t, ok := latestBy(times, limit); ok {
			applied[fp] = t
			i, _ := slices.BinarySearch(times, t)
			d.purges.at[fp] = times[i:]
		}
		if last := times[len(times)-1]; last > limit {
			if ahead == nil {
				ahead = map[uint64]int64{}
			}
			ahead[fp] = last
		}
	}
	return applied, ahead
}

// PurgedAt returns the time of the latest purge record of fp listed or
// written at or before limit (Purges), and whether there is one.
func (d *Dir) PurgedAt(fp uint64, limit int64) (int64, bool) {
	d.purges.mu.Lock()
	defer d.purges.mu.Unlock()
	return latestBy(d.purges.at[fp], limit)
}

// latestBy returns the latest of times (ascending) at or before limit,
// and whether there is one.
func latestBy(times []int64, limit int64) (int64, bool) {
	i, found := slices.BinarySearch(times, limit)
	if found {
		return limit, true
	}
	if i == 0 {
		return 0, false
	}
	return times[i-1], true
}

// notePurge records the purge record of fp at t.
func (d *Dir) notePurge(fp uint64, t int64) {
	d.purges.mu.Lock()
	defer d.purges.mu.Unlock()
	if d.purges.at == nil {
		d.purges.at = map[uint64][]int64{}
	}
	times := d.purges.at[fp]
	if i, found := slices.BinarySearch(times, t); !found {
		d.purges.at[fp] = slices.Insert(times, i, t)
	}
}
