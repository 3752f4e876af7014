package gpu

import (
	"fmt"
	"sync"
	"sync/atomic"
	"time"
)

// How a load reads a memory-mount file that is not registered into the
// pinned buffers (Config.Reads; docs/gpu.md, "Reads through the pinned
// buffers").
//
// Two ways, and which is faster depends on the state of the file's pages,
// which nothing cheap tells. A pread marks each page accessed: the first
// read of pages written since activates them, under a lock every reading
// CPU shares, while pages already active (read before, or pinned by a
// registration, as a spare's are) cost nothing more. A copy from a
// mapping advised MADV_SEQUENTIAL leaves the pages' LRU state alone but
// pays its faults and its unmap. On the H100 machine, 16 jobs of 32 MiB
// files: another engine's fresh files loaded through mappings at 33.4
// GB/s where a plain pread pipeline read them at 25.1 (1.33 of it); the
// same engine's spares loaded through mappings at 25.1–30.5 GB/s where
// pread read them at 43.4–50.3 (0.50–0.64 of it). So by default the
// mover measures both and takes the one that has been faster.

// ReadWay says how loads read files through the pinned buffers.
type ReadWay int

const (
	// ReadsAdaptive (the default) takes, for each load, the way whose
	// recent loads moved their bytes faster, and tries the other way on
	// one load in exploreEvery.
	ReadsAdaptive ReadWay = iota
	// ReadsMapped copies every file out of a mapping.
	ReadsMapped
	// ReadsPread reads every file with pread.
	ReadsPread
)

// ParseReadWay parses gpu.pinned_reads: "auto", "mapped" or "pread".
func ParseReadWay(s string) (ReadWay, error) {
	switch s {
	case "", "auto":
		return ReadsAdaptive, nil
	case "mapped":
		return ReadsMapped, nil
	case "pread":
		return ReadsPread, nil
	}
	return 0, fmt.Errorf("%w: pinned reads %q (want auto, mapped or pread)", errConfig, s)
}

// exploreEvery: the adaptive reads try the way that has been slower on
// one load in this many, so that a change in the pages' state (another
// workload's files) is noticed; the cost is bounded by that share of the
// loads going the slower way.
const exploreEvery = 8

// costWeight is the weight of a load's cost in the running mean of its
// way's cost: about the last ten loads count.
const costWeight = 0.2

// readChoice picks the way of each load (Config.Reads) and keeps, for
// the adaptive choice, each way's running mean cost per byte.
type readChoice struct {
	way ReadWay

	mu    sync.Mutex
	picks uint64
	cost  [2]float64 // ns per byte, by way (0: mapped, 1: pread); 0 before a load went that way

	// Counts by way of the loads that succeeded (ReadCounts).
	mapped, pread atomic.Uint64
}

// pick reports whether the next load reads through a mapping.
func (c *readChoice) pick() bool {
	switch c.way {
	case ReadsMapped:
		return true
	case ReadsPread:
		return false
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	switch {
	case c.cost[0] == 0:
		return true
	case c.cost[1] == 0:
		return false
	}
	c.picks++
	mapped := c.cost[0] <= c.cost[1]
	if c.picks%exploreEvery == 0 {
		mapped = !mapped
	}
	return mapped
}

// record counts a load that succeeded, which read n bytes the way
// mapped says in d, and where it was picked (choice: a file large enough
// to map), adds its cost to that way's running mean.
func (c *readChoice) record(mapped, choice bool, n int64, d time.Duration) {
	w := 1
	if mapped {
		w = 0
		c.mapped.Add(1)
	} else {
		c.pread.Add(1)
	}
	if c.way != ReadsAdaptive || !choice || n <= 0 || d <= 0 {
		return
	}
	cost := float64(d) / float64(n)
	c.mu.Lock()
	if c.cost[w] == 0 {
		c.cost[w] = cost
	} else {
		c.cost[w] += costWeight * (cost - c.cost[w])
	}
	c.mu.Unlock()
}
