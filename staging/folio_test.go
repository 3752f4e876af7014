package staging

import (
	"bytes"
	"context"
	"path/filepath"
	"testing"

	"github.com/kvhost/kvhost/fsys/fsystest"
	"github.com/kvhost/kvhost/internal/crc32c"
	"github.com/kvhost/kvhost/transfer"
)

// TestStoresFromHostMemoryFillLargeFoliosInOneWrite: with Plan.Folio, a
// store of host memory behind a header, in pages of 48 KiB (which no
// batch divides), writes each large folio's part in one write, with
// checksums (fused batches) and without (batches of up to chunkMax); the bytes and checksums are
// those of the pages. Without Folio the same stores cut folios (the check
// sees the cost it guards against).
func TestStoresFromHostMemoryFillLargeFoliosInOneWrite(t *testing.T) {
	const (
		folio  = 512 << 10 // scaled down: larger than a fused batch
		header = 4096
		page   = 48 << 10
		pages  = 200 // more than a write without checksums takes (chunkMax)
	)
	ctx := context.Background()
	mv := newTestMover(t, Config{Workers: 2})
	src := hostRegion(t, "src", pages*page)
	for i := range src.Bytes() {
		src.Bytes()[i] = byte(i*131 + i>>11)
	}
	// Pages in reverse order, so that the file's runs are not the memory's.
	var ext []transfer.Extent
	var want []byte
	var wantSum uint32
	for i := range pages {
		off := int64(pages-1-i) * page
		ext = append(ext, transfer.Extent{FileOff: header + int64(i)*page, Region: src, RegionOff: off, Len: page, Sum: 0})
		b := src.Bytes()[off : off+page]
		want = append(want, b...)
		wantSum = crc32c.Update(wantSum, b)
	}
	dir := t.TempDir()
	for _, c := range []struct {
		name  string
		folio int64
		sums  bool
	}{
		{"fused batches", folio, true},
		{"without checksums", folio, false},
		{"without Folio", 0, true},
		{"without Folio or checksums", 0, false},
	} {
		t.Run(c.name, func(t *testing.T) {
			f := openFile(t, filepath.Join(dir, c.name), 0)
			w := &fsystest.WriteLog{File: f}
			var sums []uint32
			if c.sums {
				sums = make([]uint32, 1)
			}
			p := &transfer.Plan{Extents: ext, Sums: 1, Memory: true, Folio: c.folio}
			if n, err := mv.For(false).WriteFile(ctx, w, p, sums); err != nil || n != p.Bytes() {
				t.Fatalf("WriteFile = %d, %v; want %d", n, err, p.Bytes())
			}
			got := make([]byte, len(want))
			if _, err := f.ReadAt(got, header); err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(got, want) {
				t.Fatal("file bytes differ from the pages in plan order")
			}
			if c.sums && sums[0] != wantSum {
				t.Fatalf("checksum %#x, want %#x", sums[0], wantSum)
			}
			bad := fsystest.PartlyFirstWritten(w.Writes(), folio)
			if c.folio > 0 && len(bad) > 0 {
				t.Fatalf("folios %v first written in part; writes %v", bad, w.Writes())
			}
			if c.folio == 0 && len(bad) == 0 {
				t.Fatalf("no folio first written in part without Folio: the check sees nothing; writes %v", w.Writes())
			}
		})
	}
}
