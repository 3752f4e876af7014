package conformance

import (
	"fmt"
	"strings"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/host/policy/policytest"
)

// Memory limit check: the plugin runs under its initial memory plus
// memoryHeadroom, and is sent up to memoryEntries entries.
const (
	memoryHeadroom = 2 << 20
	memoryEntries  = 50_000
	wasmPage       = 64 << 10
)

// outOfBounds is the trap of an access past the memory: what a plugin
// that ignores a refused memory.grow ends in.
const outOfBounds = "out of bounds memory access"

// memoryLimit runs the plugin under a tight memory limit, names keys and
// inserts entries until its memory runs out or memoryEntries: a failure
// status or a clean exit at the limit is allowed, an access past the
// memory it has is not.
func (s *suite) memoryLimit() (string, error) {
	if s.native != nil {
		return "a native policy has no linear memory: nothing to check", nil
	}
	limit := int64(s.report.Info.MemoryMin)*wasmPage + memoryHeadroom
	before := s.fails.len()
	msg, err := s.underLimit(limit)
	failures := s.fails.since(before)
	for _, f := range failures {
		if strings.Contains(f, outOfBounds) {
			return "", fmt.Errorf("under a memory limit of %d bytes: %s: the plugin used memory it did not get (a refused memory.grow returns -1; fail the call with STATUS_NO_MEMORY or carry on without it)", limit, f)
		}
	}
	if err != nil && strings.Contains(err.Error(), outOfBounds) {
		return "", fmt.Errorf("under a memory limit of %d bytes: %w", limit, err)
	}
	// Failures at the limit that are no access past the memory are the
	// plugin's right answer to a refused grow: not this check's failures.
	s.fails.truncate(before)
	if err != nil {
		return fmt.Sprintf("under a memory limit of %d bytes the plugin failed cleanly (%v)%s", limit, err, msg), nil
	}
	if len(failures) > 0 {
		return fmt.Sprintf("under a memory limit of %d bytes: %d clean failures (the first: %s)%s", limit, len(failures), failures[0], msg), nil
	}
	return fmt.Sprintf("under a memory limit of %d bytes: no failure%s", limit, msg), nil
}

// underLimit drives a host of one shard under limit bytes of memory; it
// returns what it did and the first error of a call.
func (s *suite) underLimit(limit int64) (string, error) {
	cfg := s.config(1)
	cfg.MemoryLimit = limit
	idx := policytest.NewIndex()
	h, err := s.openConfig(idx, cfg)
	if err != nil {
		return "", fmt.Errorf("starting: %w", err)
	}
	defer h.Close(s.ctx)
	for _, in := range namespaceFixtures() {
		out, err := h.Namespace(s.ctx, in)
		if err != nil {
			return "", fmt.Errorf("declaring namespace %d: %w", in.NS, err)
		}
		idx.AddNamespace(out)
	}
	sent := 0
	for sent < memoryEntries {
		names := nameSet(s.ns)
		if err := s.name(h, names); err != nil {
			return fmt.Sprintf(", after %d entries", sent), err
		}
		recs := s.inserts(abi.MaxBatch, uint32(sent/abi.MaxBatch), 4096)
		idx.Apply(recs)
		if err := s.timed(func() error { return h.Access(s.ctx, recs) }); err != nil {
			return fmt.Sprintf(", after %d entries", sent), err
		}
		sent += len(recs)
	}
	return fmt.Sprintf(", %d entries inserted", sent), nil
}
