package server_test

import (
	"context"
	"encoding/binary"
	"path/filepath"
	"testing"

	"github.com/kvhost/kvhost/client"
	"github.com/kvhost/kvhost/internal/engine"
	"github.com/kvhost/kvhost/internal/lookuptable"
	"github.com/kvhost/kvhost/internal/server"
	"github.com/kvhost/kvhost/internal/vllmfs"
)

// TestReviewDeclaredFingerprintFindsVLLMFSKeysInTheLookupTable: the shared
// lookup table is keyed by "the namespace fingerprint (the Declared
// reply's)" (docs/protocol.md). For a namespace served by a vllm-fs mount
// the engine indexes (and mirrors into the table) its keys under the
// mount's layout fingerprint, while the server's Declared reply carries
// geo.Fingerprint(): a client probing the table with the Declared
// fingerprint never finds a key the daemon holds, and where the table's
// misses are final (no mount shared: a vllm-fs mount with shared = false)
// it answers 0 for stored keys.
// TestDeclaredFingerprintFindsVLLMFSKeysInTheLookupTable: the Declared
// reply's fingerprint is the one a vllm-fs namespace's keys are mirrored
// into the lookup table under (the mount's, not the geometry's), so a
// probe with it finds a key the daemon holds; with misses final, the
// geometry's answered 0.
func TestDeclaredFingerprintFindsVLLMFSKeysInTheLookupTable(t *testing.T) {
	const row = 4096
	const model = "vllm:test-model:r0"
	fields := &vllmfs.Fields{ModelName: "test/model", TokensPerHash: 16, BlocksPerFile: 1, TPSize: 1, PPSize: 1, PCPSize: 1, DCPSize: 1,
		Dtype: "bfloat16", KVCacheGroups: []vllmfs.Group{{TokensPerBlock: 16, LayerNames: []string{"l0"}}}, NotParallelAgnostic: true}
	f := newFixtureWith(t, server.Config{}, func(c *engine.Config) {
		c.Mounts[0].VLLMFS = &engine.VLLMFS{Fields: fields, Namespace: model, RowBytes: row}
	}, nil)
	tbl, err := lookuptable.Create(filepath.Join(t.TempDir(), "s.lookup"), 1024, 0o600, -1, true /* misses final */)
	if err != nil {
		t.Fatal(err)
	}
	defer tbl.Close()
	f.eng.MirrorKeys(tbl)
	rd, err := lookuptable.Open(tbl.Path())
	if err != nil {
		t.Fatal(err)
	}
	defer rd.Close()

	c := f.dial(t)
	ctx := context.Background()
	g := client.Geometry{Model: model, Layers: 1, KVHeads: row / 4096, HeadSize: 4096, DtypeSize: 1, MLA: true, TokensPerBlock: 1, TokensPerKey: 1, TPSize: 1}
	ns, err := c.Declare(ctx, g)
	if err != nil {
		t.Fatal(err)
	}
	mem, err := client.NewMemfd("t", 8*row)
	if err != nil {
		t.Fatal(err)
	}
	defer mem.Close()
	rid, err := c.RegisterMemfd(ctx, mem)
	if err != nil {
		t.Fatal(err)
	}
	cid, err := c.RegisterCache(ctx, ns.ID, []client.Layer{{Region: uint32(rid), NumBlocks: 8, BlockStride: row}})
	if err != nil {
		t.Fatal(err)
	}
	key := make([]byte, 36)
	for i := 0; i < 32; i++ {
		key[i] = byte(i*7 + 1)
	}
	binary.BigEndian.PutUint32(key[32:], 0)
	job, err := c.Store(ctx, cid, [][]byte{key}, [][]uint32{{0}})
	if err != nil {
		t.Fatal(err)
	}
	res, err := job.Wait(ctx)
	if err != nil || res.Keys[0].Outcome != client.OutcomeStored {
		t.Fatalf("store: %v %+v %s", err, res.Keys, res.Message)
	}
	daemon, err := c.Lookup(ctx, ns.ID, [][]byte{key})
	if err != nil || daemon != 1 {
		t.Fatalf("daemon lookup: %d %v", daemon, err)
	}
	if st := tbl.Stats(); st.Keys != 1 {
		t.Fatalf("table holds %d keys, want 1", st.Keys)
	}
	n, final, ok := rd.Leading(ns.Fingerprint, [][]byte{key})
	if !ok || n != 1 {
		t.Fatalf("table lookup with the Declared fingerprint %#x: %d leading keys (final %v, ok %v); the daemon says 1", ns.Fingerprint, n, final, ok)
	}
}
