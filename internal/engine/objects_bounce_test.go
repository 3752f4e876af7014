//go:build invariants

package engine

import (
	"context"
	"math/rand/v2"
	"slices"
	"testing"
	"time"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/internal/crc32c"
	"github.com/kvhost/kvhost/region"
	"github.com/kvhost/kvhost/transfer"
)

// BenchmarkObjectBounce loads 8 keys of 8 MiB from an object mount in
// memory (memObjects) into device memory (the fake GPU mover, a copy),
// which goes through a memory file of the daemon's (loadBounced): with
// the engine's pool of memory files, and on an engine whose pool is
// closed, which makes, maps and faults in a memfd per load as before the
// pool. In the same iterations it measures the ceiling: the same bytes
// read into one buffer made once, checksummed, and copied into the device
// memory. It reports the three rates and each load's share of the
// ceiling.
func BenchmarkObjectBounce(b *testing.B) {
	g := Geometry{Model: "bench/bounce", Layers: 8, KVHeads: 8, HeadSize: 128, DtypeSize: 2, TokensPerBlock: 16, TokensPerKey: 256, TPSize: 1}
	const n, nb = 8, 256
	bpk := g.BlocksPerKey()
	objs := newMemObjects(b)
	ctx := context.Background()
	open := func() (*Engine, NamespaceID) {
		e := openEngine(b, Config{Mounts: []Mount{{Path: b.TempDir()}}, Policy: newTestPolicy(1, abi.OrderLayerMajor), Objects: objs,
			Movers: map[region.Kind]MoverFactory{region.KindDevice: func(MountInfo) (transfer.Mover, error) { return &fakeMover{}, nil }}})
		ns, err := e.Declare(ctx, g)
		if err != nil {
			b.Fatal(err)
		}
		return e, ns
	}
	a, nsA := open()
	src := newTestCache(b, a, nsA, g, nb, layoutPlaneFirst)
	r := rand.New(rand.NewPCG(8, 8))
	keys := testKeys("bounce", n)
	from := blockLists(r, n, bpk, 0)
	for _, bl := range from {
		src.fill(r, bl)
	}
	storeAndCheck(b, a, src, keys, from)

	pooled, nsP := open()
	cidP, _ := registerFakeDevice(b, pooled, nsP, g, 81, nb)
	unpooled, nsU := open()
	unpooled.objs.bounce.close() // every load makes its own memfd
	cidU, _ := registerFakeDevice(b, unpooled, nsU, g, 82, nb)
	into := blockLists(r, n, bpk, 0)

	// The ceiling's buffer and device memory, made once.
	size := 4096 + g.KeyBytes()
	buf := make([]byte, size)
	dev := make([]byte, g.KeyBytes())
	files := make([]*memObject, n)
	for i, k := range keys {
		files[i] = &memObject{o: objs, name: objName(g.Fingerprint(), k)}
	}
	load := func(e *Engine, cid CacheID) time.Duration {
		t0 := time.Now()
		res := wait(b)(e.Load(ctx, LoadRequest{Cache: cid, Keys: keys, Blocks: into}))
		d := time.Since(t0)
		for i, k := range res.Keys {
			if k.Outcome != OutcomeLoaded {
				b.Fatalf("key %s: %v (%v)", keys[i], k.Outcome, k.Err)
			}
		}
		return d
	}
	var dPooled, dUnpooled, dCeiling time.Duration
	for b.Loop() {
		t0 := time.Now()
		for _, f := range files {
			if _, err := f.ReadvAt([][]byte{buf}, 0); err != nil {
				b.Fatal(err)
			}
			_ = crc32c.Update(0, buf[4096:])
			copy(dev, buf[4096:])
		}
		dCeiling += time.Since(t0)
		dPooled += load(pooled, cidP)
		dUnpooled += load(unpooled, cidU)
	}
	bytes := float64(b.N) * float64(n*size)
	b.ReportMetric(bytes/dPooled.Seconds()/1e9, "pooled-GB/s")
	b.ReportMetric(bytes/dUnpooled.Seconds()/1e9, "unpooled-GB/s")
	b.ReportMetric(bytes/dCeiling.Seconds()/1e9, "ceiling-GB/s")
	b.ReportMetric(dCeiling.Seconds()/dPooled.Seconds(), "pooled/ceiling")
	b.ReportMetric(dCeiling.Seconds()/dUnpooled.Seconds(), "unpooled/ceiling")
}

// TestTheBouncePoolReusesAMemoryFileThatFitsAndKeepsTheLargest: a memory
// file given back serves the next load of an object no larger; one too
// small is not taken; past maxIdleBounces the smallest goes; a closed
// pool keeps nothing.
func TestTheBouncePoolReusesAMemoryFileThatFitsAndKeepsTheLargest(t *testing.T) {
	var p bouncePool
	t.Cleanup(p.close)
	get := func(size int64) *bounce {
		t.Helper()
		b, err := p.get(size)
		if err != nil {
			t.Fatal(err)
		}
		if int64(len(b.mem)) < size {
			t.Fatalf("a memory file of %d bytes for %d", len(b.mem), size)
		}
		return b
	}
	small := get(4096)
	p.put(small)
	if b := get(4096); b != small {
		t.Fatal("a memory file given back was not reused for an object of its size")
	} else {
		p.put(b)
	}
	large := get(8192)
	if large == small {
		t.Fatal("a memory file too small was taken")
	}
	p.put(large)
	var held []*bounce
	for range maxIdleBounces + 1 {
		held = append(held, get(1)) // the smallest idle first
	}
	if !slices.Contains(held, small) || !slices.Contains(held, large) {
		t.Fatal("the idle memory files were not all reused")
	}
	for i := range held {
		p.put(held[len(held)-1-i])
	}
	if len(p.idle) != maxIdleBounces || !slices.Contains(p.idle, large) {
		t.Fatalf("%d idle after %d given back, the largest kept: %v; want %d and the largest", len(p.idle), len(held), slices.Contains(p.idle, large), maxIdleBounces)
	}
	p.close()
	p.put(get(1))
	if len(p.idle) != 0 {
		t.Fatalf("a closed pool keeps %d memory files", len(p.idle))
	}
}
