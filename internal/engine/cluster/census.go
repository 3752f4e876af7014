package cluster

import (
	"context"
	"errors"
	"maps"
	"slices"
	"strings"
	"time"

	"github.com/kvhost/kvhost/fsys"
	"github.com/kvhost/kvhost/internal/clustercap"
)

// The census (docs/cluster.md, "Untagged files"): a paced walk of the
// mount, every censusIntervals of its interval, that finds the files of
// every writer, its index or not: files without an owner tag, or of a
// tag no summary names, written while the nodes run (a daemon of a
// kvhost before owner tags, or one without a cluster capacity, beside
// the cluster) count against the bound from the census that finds them,
// not from a lookup or this node's next start.
const (
	// censusIntervals is how many of the mount's intervals pass between
	// the end of one census and the start of the next.
	censusIntervals = 8
	// censusRate bounds the files a census visits a second: a stat each,
	// and a header read for each it has not seen in the same state
	// before. Listings are not paced.
	censusRate = 4096
	// censusBatch is how many files a census visits between two pauses.
	censusBatch = 32
	// maxWriters bounds the writers a census remembers.
	maxWriters = 16
)

// errCensusPace ends a census whose pause was cut short (the engine
// closes).
var errCensusPace = errors.New("cluster: census stopped")

// census is what the last complete census of the mount found (under
// Mount.mu).
type census struct {
	// ids holds the file id (0: none) of every data file the last census
	// found, by its identity: a file in the same state is not read again.
	ids map[fsys.Identity]uint64
	// tags holds the bytes of the files of each owner tag; noID those of
	// the files without a file id, one of them at noIDPath; paths one
	// path of each tag's.
	tags     map[uint32]int64
	paths    map[uint32]string
	noID     int64
	noIDPath string
	// writers holds the nodes that temporary files on the mount named
	// (.tmp-<node>-<pid>-…) at this census or an earlier one, at most
	// maxWriters: a writer of files no summary counts may be named among
	// them (a temporary file is there only while a store writes it).
	writers map[string]bool
	done    bool // a census completed
}

// Census is the census's walk of the mount, the Host's part: it calls
// file for each regular data file with its path and identity, and a
// function that reads its header's file id (0: a file of a format
// without one); an error file returns ends the walk. It calls temp with
// the node each temporary file names.
type Census interface {
	Census(ctx context.Context, file func(path string, id fsys.Identity, header func() (uint64, error)) error, temp func(node string)) error
}

// runCensus walks the mount (Host.Census), pacing the files it visits
// at censusRate, and installs what it found (c.census) once it completes.
// It runs without c.mu, but for the install.
func (c *Mount) runCensus(ctx context.Context) error {
	h, ok := c.Host.(Census)
	if !ok {
		return nil
	}
	c.mu.Lock()
	known := c.census.ids
	next := census{ids: map[fsys.Identity]uint64{}, tags: map[uint32]int64{}, paths: map[uint32]string{}, writers: maps.Clone(c.census.writers), done: true}
	// The nodes with summaries write temporary files too: not remembered.
	nodes := map[string]bool{c.Node: true}
	for _, p := range slices.Concat(c.peers, c.unclaimed) {
		nodes[p.Node] = true
	}
	for node := range c.bad {
		nodes[node] = true
	}
	c.mu.Unlock()
	if next.writers == nil {
		next.writers = map[string]bool{}
	}
	visited := 0
	start := time.Now()
	err := h.Census(ctx, func(path string, id fsys.Identity, header func() (uint64, error)) error {
		if visited++; visited%censusBatch == 0 {
			// Pace: censusBatch files, then wait as censusRate asks (the
			// walk stats the next file once this returns).
			due := start.Add(time.Duration(visited) * time.Second / censusRate)
			if wait := time.Until(due); wait > 0 {
				t := time.NewTimer(wait)
				select {
				case <-ctx.Done():
					t.Stop()
					return errCensusPace
				case <-t.C:
				}
			}
		}
		fid, seen := known[id]
		if !seen {
			var err error
			if fid, err = header(); err != nil {
				return nil // not a kvhost file, or gone: nobody's to count
			}
		}
		next.ids[id] = fid
		tag, tagged := clustercap.Owner(fid)
		switch {
		case !tagged:
			next.noID += id.Size
			if next.noIDPath == "" || path < next.noIDPath {
				next.noIDPath = path
			}
		default:
			next.tags[tag] += id.Size
			if p, ok := next.paths[tag]; !ok || path < p {
				next.paths[tag] = path
			}
		}
		return nil
	}, func(node string) {
		if !nodes[node] && len(next.writers) < maxWriters {
			next.writers[node] = true
		}
	})
	if err != nil {
		return err
	}
	c.mu.Lock()
	c.census = next
	c.mu.Unlock()
	return nil
}

// untagged is what the census found of the files no summary
// counts: the bytes of those without an owner tag and of tags not in
// named, one of their paths, and the writers named by temporary files
// that are not in nodes (the nodes with summaries, this one included).
// Called with Mount.mu held.
func (cs *census) untagged(named map[uint32]bool, nodes map[string]bool) (bytes int64, path string, writers []string) {
	if !cs.done {
		return 0, "", nil
	}
	bytes, path = cs.noID, cs.noIDPath
	for tag, n := range cs.tags {
		if named[tag] {
			continue
		}
		bytes += n
		if p := cs.paths[tag]; path == "" || p < path {
			path = p
		}
	}
	for w := range cs.writers {
		if !nodes[w] {
			writers = append(writers, w)
		}
	}
	return bytes, path, writers
}

// writersNote names the writers of files no summary counts, as the
// census found them named by their temporary files, for a warning.
func writersNote(writers []string) string {
	if len(writers) == 0 {
		return "not named by any temporary file on the mount"
	}
	slices.Sort(writers)
	return strings.Join(writers, ", ")
}
