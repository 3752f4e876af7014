package gpu

import (
	"bytes"
	"context"
	"math/rand/v2"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/kvhost/kvhost/cuda"
	"github.com/kvhost/kvhost/fsys"
	"github.com/kvhost/kvhost/fsys/fsystest"
)

// TestStoresFillLargeFoliosInOneWrite: on a mount whose writes allocate
// large folios (transfer.Plan.Folio), a store's first write into each
// folio covers all of the folio the store writes, behind a header and
// across chunks, with checksums (fused pieces) and without (a write per
// chunk), direct and buffered, and with a chunk size the folio does not
// divide; the file's bytes and checksums are those of the pages. Without
// Folio, the same stores cut folios (the check sees the cost it guards
// against).
func TestStoresFillLargeFoliosInOneWrite(t *testing.T) {
	const folio = 512 << 10 // scaled down: larger than fuseBatch, a divisor of the chunk
	e := newEnv(t)
	g := geometry{layers: 8, numBlocks: 32, pageBytes: 32 << 10, blocksPerKey: 16, headerBytes: 4096}
	kv := newCache(t, e.w, g)
	orig := kv.randomize(t, e.w, 7)
	host := hostCopies(kv, orig)
	dir := fsDir(t, true)
	for _, c := range []struct {
		name   string
		folio  int64
		chunk  int
		direct bool
		nosums bool
	}{
		{"fused pieces", folio, 1 << 20, false, false},
		{"fused pieces, direct", folio, 1 << 20, true, false},
		{"a write per chunk", folio, 1 << 20, false, true},
		{"a chunk size that is not a multiple of the folio", folio, 768 << 10, false, true},
		{"without Folio", 0, 1 << 20, false, false},
		{"without Folio, a write per chunk", 0, 1 << 20, false, true},
	} {
		t.Run(c.name, func(t *testing.T) {
			m := e.mover(t, Config{Devices: []int{0}, MaxStaging: 16 << 20, Chunk: c.chunk, Copy: cuda.CopyBatch, NoChecksums: c.nosums})
			p := kv.plan(keyBlocks(rand.New(rand.NewPCG(7, 1)), g.numBlocks, g.blocksPerKey), c.direct)
			p.Memory, p.Folio = true, c.folio
			want, wantSums := expect(p, host)
			flag := 0
			if c.direct {
				if !fsDirectOK(dir) {
					t.Skipf("%s refuses O_DIRECT", dir)
				}
				flag = unix.O_DIRECT
			}
			f := &fsystest.WriteLog{File: createFileIn(t, dir, c.name, flag)}
			sums := make([]uint32, p.Sums)
			if n, err := m.WriteFile(context.Background(), f, p, sums); err != nil || n != p.Bytes() {
				t.Fatalf("WriteFile = %d, %v; want %d", n, err, p.Bytes())
			}
			got := fsys.AlignedBuffer(len(want))
			if _, err := f.ReadAt(got, int64(g.headerBytes)); err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(got, want) {
				t.Fatal("file bytes differ from the pages in plan order")
			}
			if !c.nosums && !equal(sums, wantSums) {
				t.Fatalf("checksums %x, want %x", sums, wantSums)
			}
			bad := fsystest.PartlyFirstWritten(f.Writes(), folio)
			if c.folio > 0 && len(bad) > 0 {
				t.Fatalf("folios %v first written in part; writes %v", bad, f.Writes())
			}
			if c.folio == 0 && len(bad) == 0 {
				t.Fatalf("no folio first written in part without Folio: the check sees nothing; writes %v", f.Writes())
			}
		})
	}
}
