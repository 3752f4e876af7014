package bench

import (
	"bytes"
	"context"
	"encoding/xml"
	"errors"
	"fmt"
	"io"
	"math"
	"os"
	"path/filepath"
	"reflect"
	"strconv"
	"strings"
	"testing"
	"time"
)

// sliceMemory is Memory over a byte slice.
type sliceMemory []byte

func (m sliceMemory) WriteAt(p []byte, off int64) error { copy(m[off:], p); return nil }
func (m sliceMemory) ReadAt(p []byte, off int64) error  { copy(p, m[off:]); return nil }

// load copies key k's source pages to its destination pages, as a correct
// engine load does.
func load(l *Layout, m sliceMemory, k int) {
	for layer := range l.Layers {
		base := int64(layer) * l.LayerBytes()
		for j := range l.BlocksPerKey {
			copy(m[base+int64(l.Dst[k][j])*l.PageBytes:][:l.PageBytes], m[base+int64(l.Src[k][j])*l.PageBytes:][:l.PageBytes])
		}
	}
}

func TestLayoutPagesAreDistinctAndScattered(t *testing.T) {
	l := NewLayout(3, 1024, 4, 8, 1)
	seen := map[int]bool{}
	for k := range l.Keys {
		for j := range l.BlocksPerKey {
			for _, b := range []int{l.Src[k][j], l.Dst[k][j]} {
				if b < 0 || b >= l.NumBlocks || seen[b] {
					t.Fatalf("key %d block %d: page %d out of range or used twice", k, j, b)
				}
				seen[b] = true
			}
			if l.Src[k][j] >= l.NumBlocks/2 || l.Dst[k][j] < l.NumBlocks/2 {
				t.Fatalf("key %d: sources must be in the lower half, destinations in the upper: %d, %d", k, l.Src[k][j], l.Dst[k][j])
			}
		}
	}
	if len(seen) != l.NumBlocks {
		t.Fatalf("%d pages used, want all %d", len(seen), l.NumBlocks)
	}
}

func TestVerifyAcceptsACorrectLoadAndCatchesEveryFault(t *testing.T) {
	cases := []struct {
		name  string
		fault func(l *Layout, m sliceMemory)
		want  error
	}{
		{"correct", func(*Layout, sliceMemory) {}, nil},
		{"one byte of a loaded page differs", func(l *Layout, m sliceMemory) {
			m[int64(l.LayerBytes())+int64(l.Dst[2][1])*l.PageBytes+17] ^= 1
		}, ErrMismatch},
		{"two keys' pages swapped", func(l *Layout, m sliceMemory) { load(l, m, 0); copyKey(l, m, 1, 0) }, ErrMismatch},
		{"a missed key's page written", func(l *Layout, m sliceMemory) { m[int64(l.Dst[3][0])*l.PageBytes] = 0 }, ErrMismatch},
		{"a page never loaded (still poisoned)", func(l *Layout, m sliceMemory) {
			p := m[2*l.LayerBytes()+int64(l.Dst[0][2])*l.PageBytes:][:l.PageBytes]
			for i := range p {
				p[i] = Poison
			}
		}, ErrMismatch},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			l := NewLayout(3, 512, 4, 4, 7)
			m := make(sliceMemory, l.Bytes())
			src, err := l.Fill(m, 3)
			if err != nil {
				t.Fatal(err)
			}
			if err := l.Poison(m); err != nil {
				t.Fatal(err)
			}
			keys, hit := []int{0, 1, 2, 3}, []bool{true, true, true, false}
			for k := range 3 {
				load(l, m, k)
			}
			c.fault(l, m)
			n, err := l.Verify(m, src, keys, hit)
			if !errors.Is(err, c.want) {
				t.Fatalf("Verify = %d, %v; want %v", n, err, c.want)
			}
			if c.want == nil && n != int64(l.Layers*l.Keys*l.BlocksPerKey)*l.PageBytes {
				t.Fatalf("verified %d bytes, want every destination page (%d)", n, int64(l.Layers*l.Keys*l.BlocksPerKey)*l.PageBytes)
			}
		})
	}
}

// copyKey loads key from's sources into key to's destinations (a mix-up).
func copyKey(l *Layout, m sliceMemory, from, to int) {
	for layer := range l.Layers {
		base := int64(layer) * l.LayerBytes()
		for j := range l.BlocksPerKey {
			copy(m[base+int64(l.Dst[to][j])*l.PageBytes:][:l.PageBytes], m[base+int64(l.Src[from][j])*l.PageBytes:][:l.PageBytes])
		}
	}
}

func TestHitSpreadsTheRatio(t *testing.T) {
	for _, c := range []struct {
		ratio float64
		n     int
		want  int
	}{{1, 10, 10}, {0, 10, 0}, {0.5, 10, 5}, {0.25, 16, 4}, {0.9, 100, 90}, {0.3, 10, 3}} {
		got := 0
		for i := range c.n {
			if Hit(i, c.ratio) {
				got++
			}
		}
		if got != c.want {
			t.Errorf("Hit over %d keys at %v: %d hits, want %d", c.n, c.ratio, got, c.want)
		}
	}
}

func TestCeilingsWriteAndReadEveryByte(t *testing.T) {
	dir := t.TempDir()
	const files = 5
	sizes := []int64{4096, 8192, 12288, 4096, 65536}
	paths := make([]string, files)
	for i := range paths {
		paths[i] = filepath.Join(dir, fmt.Sprintf("f%d", i))
	}
	for _, direct := range []bool{false, true} {
		t.Run(fmt.Sprintf("direct=%v", direct), func(t *testing.T) {
			bufs := make([][]byte, 2)
			for i := range bufs {
				b, err := AlignedBuffer(65536)
				if err != nil {
					t.Fatal(err)
				}
				defer FreeBuffer(b)
				for j := range b {
					b[j] = byte(j)
				}
				bufs[i] = b
			}
			n, d, err := WriteFiles(context.Background(), paths, sizes, bufs, direct, true)
			if direct && err != nil && strings.Contains(err.Error(), "invalid argument") {
				t.Skipf("the file system of %s refuses O_DIRECT: %v", dir, err)
			}
			if err != nil || n != 94208 || d <= 0 {
				t.Fatalf("WriteFiles = %d, %v, %v; want 94208 bytes", n, d, err)
			}
			for i, p := range paths {
				b, err := os.ReadFile(p)
				if err != nil || int64(len(b)) != sizes[i] || !bytes.Equal(b, bufs[0][:sizes[i]]) {
					t.Fatalf("%s: %d bytes, %v; want the buffer's first %d", p, len(b), err, sizes[i])
				}
			}
			if _, err := DropCaches(paths); err != nil {
				t.Fatal(err)
			}
			n, _, err = ReadFiles(context.Background(), paths, bufs, direct)
			if err != nil || n != 94208 {
				t.Fatalf("ReadFiles = %d, %v; want 94208", n, err)
			}
		})
	}
}

func TestOverwriteFilesWritesIntoTheSameFilesAndNeedsThem(t *testing.T) {
	dir := t.TempDir()
	paths := []string{filepath.Join(dir, "a"), filepath.Join(dir, "b")}
	sizes := []int64{8192, 4096}
	bufs := [][]byte{bytes.Repeat([]byte{1}, 8192)}
	if _, _, err := WriteFiles(context.Background(), paths, sizes, bufs, false, false); err != nil {
		t.Fatal(err)
	}
	before, err := os.Stat(paths[0])
	if err != nil {
		t.Fatal(err)
	}
	bufs[0] = bytes.Repeat([]byte{2}, 8192)
	n, _, err := OverwriteFiles(context.Background(), paths, sizes, bufs, false, false)
	if err != nil || n != 12288 {
		t.Fatalf("OverwriteFiles = %d, %v; want 12288 bytes", n, err)
	}
	after, err := os.Stat(paths[0])
	if err != nil || !os.SameFile(before, after) {
		t.Fatalf("%s: not the same file after the overwrite (%v)", paths[0], err)
	}
	for i, p := range paths {
		if b, err := os.ReadFile(p); err != nil || !bytes.Equal(b, bufs[0][:sizes[i]]) {
			t.Fatalf("%s: %d bytes, %v; want the new buffer's first %d", p, len(b), err, sizes[i])
		}
	}
	missing := []string{filepath.Join(dir, "missing")}
	if _, _, err := OverwriteFiles(context.Background(), missing, sizes[:1], bufs, false, false); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("overwriting a missing file: %v, want ErrNotExist", err)
	}
}

func TestReadFilesRefusesASmallBuffer(t *testing.T) {
	p := filepath.Join(t.TempDir(), "f")
	if err := os.WriteFile(p, make([]byte, 10000), 0o600); err != nil {
		t.Fatal(err)
	}
	_, _, err := ReadFiles(context.Background(), []string{p}, [][]byte{make([]byte, 4096)}, false)
	if err == nil || !strings.Contains(err.Error(), "buffer") {
		t.Fatalf("ReadFiles into a 4 KiB buffer of a 10000-byte file = %v, want an error naming the buffer", err)
	}
}

func sampleReport() *Report {
	r := &Report{Schema: Schema, Dir: "/x", FSType: "tmpfs", Memory: "gpu", Device: "H100", Model: Geometry{32, 8, 128, 2, 16},
		Ceilings: []Ceiling{{Name: "pinned H2D", GBps: 55}}}
	for _, sums := range []bool{true, false} {
		for _, j := range []int{1, 8, 16} {
			for _, dir := range []string{Store, Load} {
				g := float64(j) * 1.5
				c := Ceiling{Name: "pread buffered", GBps: float64(j) * 2, Threads: j}
				r.Runs = append(r.Runs, Run{Path: "staging", Mover: "gpu-staging", IO: "buffered", Checksums: sums, Direction: dir,
					Jobs: j, KeyBytes: 32 << 20, Keys: 8, Hits: 8, Bytes: 8 << 25, GBps: g, Ceiling: c, Fraction: g / c.GBps,
					RoundFractions: []float64{g / c.GBps * 1.1, g / c.GBps * 0.9, g / c.GBps}})
			}
		}
	}
	return r
}

func TestRoundSpreadIsLeastMedianGreatest(t *testing.T) {
	for _, c := range []struct {
		fs     []float64
		column bool
		want   string
	}{
		{nil, true, "\t"},
		{[]float64{0.9}, true, "\t"},
		{[]float64{0.9, 0.7}, true, "0.70 0.80 0.90\t"},
		{[]float64{0.94, 0.82, 0.88}, true, "0.82 0.88 0.94\t"},
		{[]float64{1.2, 0.5, 0.9, 0.8}, true, "0.50 0.85 1.20\t"},
		{[]float64{0.9, 0.7}, false, ""}, // a table without the column
	} {
		if got := roundSpread(c.fs, c.column); got != c.want {
			t.Errorf("roundSpread(%v, %v) = %q, want %q", c.fs, c.column, got, c.want)
		}
	}
}

func TestReportJSONRoundTrips(t *testing.T) {
	r := sampleReport()
	var b bytes.Buffer
	if err := r.WriteJSON(&b); err != nil {
		t.Fatal(err)
	}
	got, err := ReadJSON(&b)
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(got.Runs, r.Runs) || got.Ceilings[0] != r.Ceilings[0] {
		t.Fatalf("round trip changed the report: %+v", got)
	}
	if _, err := ReadJSON(strings.NewReader(`{"schema":"other/9"}`)); err == nil {
		t.Fatal("ReadJSON accepted another schema")
	}
}

// TestVersion1ReportsReadButTakeNoVersion2Runs: a report whose ceilings
// were taken the old way still renders, but runs measured the new way are
// never mixed into it.
func TestVersion1ReportsReadButTakeNoVersion2Runs(t *testing.T) {
	old, err := ReadJSON(strings.NewReader(`{"schema":"` + SchemaV1 + `","dir":"/d","memory":"host"}`))
	if err != nil {
		t.Fatalf("a version 1 report: %v", err)
	}
	later := sampleReport()
	later.Schema, later.Dir, later.Memory = Schema, "/d", "host"
	if err := old.Append(later); err == nil || !strings.Contains(err.Error(), SchemaV1) {
		t.Fatalf("Append of a %s report onto a %s one: %v, want a refusal naming both", Schema, SchemaV1, err)
	}
}

func TestTableShowsEachFigureNextToItsCeiling(t *testing.T) {
	var b bytes.Buffer
	if err := sampleReport().WriteTable(&b); err != nil {
		t.Fatal(err)
	}
	out := b.String()
	for _, want := range []string{"ceiling GB/s", "fraction", "24.00", "32.00", "0.75", "pinned H2D 55.00 GB/s", "32MiB"} {
		if !strings.Contains(out, want) {
			t.Errorf("table lacks %q:\n%s", want, out)
		}
	}
}

func TestSVGIsWellFormedWithSolidRunsAndDashedCeilings(t *testing.T) {
	var b bytes.Buffer
	if err := sampleReport().WriteSVG(&b); err != nil {
		t.Fatal(err)
	}
	dec := xml.NewDecoder(&b)
	solid, dashed, panels := 0, 0, 0
	for {
		tok, err := dec.Token()
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatalf("not well-formed XML: %v", err)
		}
		se, ok := tok.(xml.StartElement)
		if !ok {
			continue
		}
		switch se.Name.Local {
		case "polyline":
			d := false
			for _, a := range se.Attr {
				if a.Name.Local == "stroke-dasharray" {
					d = true
				}
			}
			if d {
				dashed++
			} else {
				solid++
			}
		case "text":
			var s string
			if err := dec.DecodeElement(&s, &se); err == nil && strings.Contains(s, "keys, checksums") {
				panels++
			}
		}
	}
	// Two panels (checksums on, off), each with a store and a load line
	// and the two directions' ceilings.
	if panels != 2 || solid != 4 || dashed != 4 {
		t.Fatalf("panels %d, solid lines %d, dashed %d; want 2, 4, 4", panels, solid, dashed)
	}
}

func TestPercentileByNearestRank(t *testing.T) {
	var ds []time.Duration
	for i := 100; i >= 1; i-- {
		ds = append(ds, time.Duration(i)*time.Millisecond)
	}
	if p50, p99 := Percentile(ds, 0.5), Percentile(ds, 0.99); p50 != 50 || p99 != 99 {
		t.Fatalf("p50 %v, p99 %v; want 50, 99", p50, p99)
	}
	if Percentile(nil, 0.5) != 0 {
		t.Fatal("percentile of nothing should be 0")
	}
}

func TestNiceMax(t *testing.T) {
	for _, c := range []struct{ in, want float64 }{{0, 1}, {0.03, 0.1}, {3.2, 5}, {41, 50}, {10, 10}, {12, 20}} {
		if got := niceMax(c.in); got != c.want {
			t.Errorf("niceMax(%v) = %v, want %v", c.in, got, c.want)
		}
	}
}

func TestFinishHoldsEachRunToTheBestCeilingOfItsKind(t *testing.T) {
	r := sampleReport()
	r.Finish()
	for _, x := range r.Runs {
		// sampleReport's ceilings grow with jobs: the best is at 16.
		if x.CeilingBest.GBps != 32 || x.CeilingBest.Threads != 16 {
			t.Fatalf("run %d jobs %s: best ceiling %+v, want the 16-thread one (32 GB/s)", x.Jobs, x.Direction, x.CeilingBest)
		}
		if want := x.GBps / 32; x.FractionBest != want {
			t.Fatalf("run %d jobs: fraction of best %v, want %v", x.Jobs, x.FractionBest, want)
		}
	}
}

// A GPU phase's share of the link is over the pinned copy it crosses:
// host to device for loads, device to host for stores; a report without
// copy ceilings (host memory) has none, and its table no column for it.
func TestLinkFractionIsOverThePinnedCopyOfTheSameDirection(t *testing.T) {
	r := sampleReport()
	r.Ceilings = []Ceiling{{Name: CeilingH2D + " (256 MiB copy)", GBps: 50}, {Name: CeilingD2H + " (256 MiB copy)", GBps: 40}}
	r.Finish()
	for _, x := range r.Runs {
		link := map[string]float64{Load: 50, Store: 40}[x.Direction]
		if want := x.GBps / link; math.Abs(x.FractionLink-want) > 1e-12 {
			t.Fatalf("%s of %.1f GB/s: link fraction %.4f, want %.4f", x.Direction, x.GBps, x.FractionLink, want)
		}
	}
	var b bytes.Buffer
	if err := r.WriteTable(&b); err != nil {
		t.Fatal(err)
	}
	// 16 jobs move 24 GB/s: 0.48 of the 50 GB/s H2D, 0.60 of the 40 D2H.
	for _, want := range []string{"of link", "0.48", "0.60", "of link: of the pinned copy ceiling"} {
		if !strings.Contains(b.String(), want) {
			t.Errorf("table lacks %q:\n%s", want, b.String())
		}
	}

	host := sampleReport()
	host.Memory, host.Ceilings = "host", nil
	host.Finish()
	b.Reset()
	if err := host.WriteTable(&b); err != nil {
		t.Fatal(err)
	}
	if host.Runs[0].FractionLink != 0 || strings.Contains(b.String(), "of link") {
		t.Fatalf("a host-memory report: link fraction %v, table:\n%s", host.Runs[0].FractionLink, b.String())
	}
}

// TestSVGLegendFitsTheChart: every legend entry, long series names and
// more entries than one panel row is tall included, lies inside the
// chart's width and height (at textWidth's bound of a name's width).
func TestSVGLegendFitsTheChart(t *testing.T) {
	r := sampleReport()
	for i := range 24 { // many series: a legend taller than one panel row
		r.Runs = append(r.Runs, Run{Path: fmt.Sprintf("a path with a long descriptive name %d", i), Mover: "gpu-staging-registered-files",
			IO: "direct", Checksums: true, Direction: Load, Jobs: 1, KeyBytes: 32 << 20, GBps: 1,
			Ceiling: Ceiling{Name: fmt.Sprintf("pinned H2D through the long named ceiling %d", i), GBps: 2}})
	}
	var b bytes.Buffer
	if err := r.WriteSVG(&b); err != nil {
		t.Fatal(err)
	}
	dec := xml.NewDecoder(&b)
	var width, height int
	for {
		tok, err := dec.Token()
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		se, ok := tok.(xml.StartElement)
		if !ok {
			continue
		}
		attr := func(name string) int {
			for _, a := range se.Attr {
				if a.Name.Local == name {
					n, _ := strconv.Atoi(a.Value)
					return n
				}
			}
			return 0
		}
		switch se.Name.Local {
		case "svg":
			width, height = attr("width"), attr("height")
		case "text":
			x, y := attr("x"), attr("y")
			var s string
			if err := dec.DecodeElement(&s, &se); err != nil {
				t.Fatal(err)
			}
			if x+textWidth(s) > width || y > height {
				t.Errorf("text %q at (%d, %d), %d wide, is cut off by the %d×%d chart", s, x, y, textWidth(s), width, height)
			}
		}
	}
}

// An appended invocation's runs keep their own pinned copy ceilings: each
// run's fraction_link is over the link measured in its own invocation.
func TestAppendKeepsEachRunsOwnLink(t *testing.T) {
	report := func(link, gbps float64) *Report {
		r := &Report{Schema: Schema, Dir: "/d", Memory: "gpu",
			Ceilings: []Ceiling{{Name: CeilingH2D + " (256 MiB copy)", GBps: link}, {Name: CeilingD2H + " (256 MiB copy)", GBps: link}},
			Runs:     []Run{{Direction: Load, GBps: gbps, KeyBytes: 1}}}
		r.Finish()
		return r
	}
	a, b := report(50, 45), report(40, 38)
	if err := a.Append(b); err != nil {
		t.Fatal(err)
	}
	for i, want := range []float64{45.0 / 50, 38.0 / 40} {
		if got := a.Runs[i].FractionLink; math.Abs(got-want) > 1e-9 {
			t.Errorf("run %d: fraction_link %.3f, want %.3f (over its own invocation's link)", i, got, want)
		}
	}
}
