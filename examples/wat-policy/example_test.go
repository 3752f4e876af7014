// Package example tests the hand-written WebAssembly-text policy
// (policy.wat, built to policy.wasm by `make wasm`) by loading it with wazero
// directly, writing real ABI v1 records into its scratch area and reading
// its outputs back: the same conversation kvhost's policy host has with it.
package example

import (
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"slices"
	"testing"

	"github.com/kvhost/kvhost/abi"
	"github.com/tetratelabs/wazero"
	"github.com/tetratelabs/wazero/api"
)

// plugin is one instance of policy.wasm.
type plugin struct {
	t       *testing.T
	ctx     context.Context
	mod     api.Module
	scratch uint32
	buf     []byte // aligned staging copy of the scratch area
}

func load(t *testing.T) *plugin {
	t.Helper()
	wasm, err := os.ReadFile("policy.wasm")
	if err != nil {
		t.Fatalf("%v (build it with `make wasm` or `wat2wasm policy.wat -o policy.wasm`)", err)
	}
	ctx := context.Background()
	r := wazero.NewRuntime(ctx)
	t.Cleanup(func() { r.Close(ctx) })
	mod, err := r.Instantiate(ctx, wasm)
	if err != nil {
		t.Fatal(err)
	}
	p := &plugin{t: t, ctx: ctx, mod: mod, buf: abi.AlignedBuffer(abi.MaxBatch*abi.NameRecordSize + abi.EvictHeaderSize)}
	if v := p.call(abi.ExportABIVersion); v != abi.Version {
		t.Fatalf("ABI version %d, want %d", v, abi.Version)
	}
	if f := abi.Feature(p.call(abi.ExportFeatures)); f != 0 {
		t.Fatalf("features %v, want none", f)
	}
	p.scratch = uint32(p.call(abi.ExportScratch, uint64(len(p.buf))))
	if p.scratch == 0 || p.scratch%abi.ScratchAlign != 0 {
		t.Fatalf("scratch at %#x: want a non-zero, %d-aligned pointer", p.scratch, abi.ScratchAlign)
	}
	if st := p.call(abi.ExportInit, 0); st != 0 {
		t.Fatalf("kvhost_init: %v", abi.Status(st))
	}
	return p
}

// call calls an export and returns its result as an int64 (i32 results sign-extended).
func (p *plugin) call(name string, args ...uint64) int64 {
	p.t.Helper()
	f := p.mod.ExportedFunction(name)
	if f == nil {
		p.t.Fatalf("export %s missing", name)
	}
	res, err := f.Call(p.ctx, args...)
	if err != nil {
		p.t.Fatalf("%s: %v", name, err)
	}
	if len(res) != 1 {
		p.t.Fatalf("%s: %d results", name, len(res))
	}
	if f.Definition().ResultTypes()[0] == api.ValueTypeI32 {
		return int64(int32(res[0]))
	}
	return int64(res[0])
}

func (p *plugin) write(n int) {
	if !p.mod.Memory().Write(p.scratch, p.buf[:n]) {
		p.t.Fatal("scratch write out of range")
	}
}

func (p *plugin) read(n int) {
	b, ok := p.mod.Memory().Read(p.scratch, uint32(n))
	if !ok {
		p.t.Fatal("scratch read out of range")
	}
	copy(p.buf, b)
}

func (p *plugin) name(recs []abi.NameRecord) abi.Status {
	copy(abi.View[abi.NameRecord](p.buf, len(recs)), recs)
	p.write(len(recs) * abi.NameRecordSize)
	st := abi.Status(p.call(abi.ExportName, uint64(len(recs))))
	p.read(len(recs) * abi.NameRecordSize)
	copy(recs, abi.View[abi.NameRecord](p.buf, len(recs)))
	return st
}

func (p *plugin) access(recs ...abi.AccessRecord) abi.Status {
	copy(abi.View[abi.AccessRecord](p.buf, len(recs)), recs)
	p.write(len(recs) * abi.AccessRecordSize)
	return abi.Status(p.call(abi.ExportAccess, uint64(len(recs))))
}

func (p *plugin) evict(req abi.EvictRequest, max int) []uint64 {
	abi.View[abi.EvictRequest](p.buf, 1)[0] = req
	p.write(abi.EvictHeaderSize)
	n := p.call(abi.ExportEvict, uint64(max))
	if n < 0 || n > int64(max) {
		p.t.Fatalf("kvhost_evict returned %d for max %d", n, max)
	}
	p.read(abi.EvictHeaderSize + int(n)*abi.VictimSize)
	vs := abi.View[abi.Victim](p.buf[abi.EvictHeaderSize:], int(n))
	ids := make([]uint64, len(vs))
	for i, v := range vs {
		ids[i] = v.Entry
		if i > 0 && v.Score <= vs[i-1].Score {
			p.t.Errorf("victim scores %v are not ascending", vs)
		}
	}
	return ids
}

func TestScratchBounds(t *testing.T) {
	p := load(t)
	if got := p.call(abi.ExportScratch, uint64(uint32(1<<30))); got != 0 {
		t.Errorf("kvhost_scratch(1 GiB) = %#x, want 0 (cannot provide)", got)
	}
	for _, export := range []string{abi.ExportName, abi.ExportAccess, abi.ExportEvict} {
		if st := p.call(export, abi.MaxBatch+1); st != int64(abi.StatusInvalidInput) {
			t.Errorf("%s(MaxBatch+1) = %d, want %d", export, st, abi.StatusInvalidInput)
		}
	}
}

func TestName(t *testing.T) {
	p := load(t)
	rng := rand.New(rand.NewPCG(3, 4))
	for _, mounts := range []uint32{0, 1, 3} {
		recs := make([]abi.NameRecord, abi.MaxBatch)
		for i := range recs {
			key := make([]byte, rng.IntN(abi.MaxKeyLen+1))
			for j := range key {
				key[j] = byte(rng.Uint32())
			}
			recs[i].SetKey(key)
			recs[i].MountCount = mounts
		}
		if st := p.name(recs); st != abi.StatusOK {
			t.Fatalf("kvhost_name: %v", st)
		}
		for _, r := range recs {
			want := fmt.Sprintf("wat/%016x.kv", r.KeyHash)
			if string(r.Path()) != want {
				t.Fatalf("path %q, want %q", r.Path(), want)
			}
			if err := abi.CheckPath(r.Path()); err != nil {
				t.Fatal(err)
			}
			if wantMount := uint32(0); mounts > 0 && r.Mount != uint32(r.KeyHash%uint64(mounts)) || mounts == 0 && r.Mount != wantMount {
				t.Fatalf("mount %d for hash %#x of %d mounts", r.Mount, r.KeyHash, mounts)
			}
		}
	}
}

func rec(kind uint32, entry, size uint64, mount uint32) abi.AccessRecord {
	return abi.AccessRecord{Kind: kind, Entry: entry, Size: size, Mount: mount, Time: entry}
}

func TestFIFO(t *testing.T) {
	anyMount := uint32(abi.AnyMount)
	tests := []struct {
		name   string
		events []abi.AccessRecord
		req    abi.EvictRequest
		max    int
		want   []uint64
	}{
		{"insertion order", nil, abi.EvictRequest{Bytes: 1 << 40, Mount: anyMount}, 64, []uint64{1, 2, 3, 4, 5, 6}},
		{"hits do not reorder", []abi.AccessRecord{rec(abi.AccessHit, 1, 10, 1)}, abi.EvictRequest{Bytes: 1 << 40, Mount: anyMount}, 64, []uint64{1, 2, 3, 4, 5, 6}},
		{"bytes covered", nil, abi.EvictRequest{Bytes: 25, Mount: anyMount}, 64, []uint64{1, 2, 3}},
		{"output full", nil, abi.EvictRequest{Bytes: 1 << 40, Mount: anyMount}, 2, []uint64{1, 2}},
		{"mount filter", nil, abi.EvictRequest{Bytes: 1 << 40, Mount: 1}, 64, []uint64{1, 3, 5}},
		{"pins nest", []abi.AccessRecord{rec(abi.AccessPin, 2, 0, 0), rec(abi.AccessPin, 2, 0, 0), rec(abi.AccessUnpin, 2, 0, 0)}, abi.EvictRequest{Bytes: 1 << 40, Mount: anyMount}, 64, []uint64{1, 3, 4, 5, 6}},
		{"unpinned", []abi.AccessRecord{rec(abi.AccessPin, 2, 0, 0), rec(abi.AccessUnpin, 2, 0, 0), rec(abi.AccessUnpin, 2, 0, 0)}, abi.EvictRequest{Bytes: 1 << 40, Mount: anyMount}, 64, []uint64{1, 2, 3, 4, 5, 6}},
		{"removed", []abi.AccessRecord{rec(abi.AccessRemove, 1, 0, 0), rec(abi.AccessRemove, 4, 0, 0), rec(abi.AccessRemove, 99, 0, 0)}, abi.EvictRequest{Bytes: 1 << 40, Mount: anyMount}, 64, []uint64{2, 3, 5, 6}},
		{"hit without size keeps size", []abi.AccessRecord{{Kind: abi.AccessHit, Entry: 1}, {Kind: abi.AccessHit, Entry: 2}}, abi.EvictRequest{Bytes: 25, Mount: anyMount}, 64, []uint64{1, 2, 3}},
		{"a pin of an unknown entry offers nothing new", []abi.AccessRecord{rec(abi.AccessPin, 7, 10, 0)}, abi.EvictRequest{Bytes: 1 << 40, Mount: anyMount}, 64, []uint64{1, 2, 3, 4, 5, 6}},
		{"zero bytes", nil, abi.EvictRequest{Mount: anyMount}, 64, []uint64{}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p := load(t)
			for e := uint64(1); e <= 6; e++ {
				if st := p.access(rec(abi.AccessInsert, e, 10, uint32(e%2))); st != abi.StatusOK {
					t.Fatal(st)
				}
			}
			if st := p.access(tt.events...); st != abi.StatusOK {
				t.Fatal(st)
			}
			if got := p.evict(tt.req, tt.max); !slices.Equal(got, tt.want) {
				t.Errorf("victims %v, want %v", got, tt.want)
			}
		})
	}
}

func TestBadKind(t *testing.T) {
	p := load(t)
	for _, kind := range []uint32{0, 7, 1 << 31} {
		if st := p.access(rec(kind, 1, 1, 0)); st != abi.StatusInvalidInput {
			t.Errorf("kind %d: status %v, want invalid input", kind, st)
		}
	}
}

// TestChurn drives the table through many inserts and removes (so the ring
// wraps and compacts and the table's backward-shift deletion runs) and
// compares every eviction with a reference FIFO kept in Go.
func TestChurn(t *testing.T) {
	p := load(t)
	rng := rand.New(rand.NewPCG(5, 6))
	type ent struct {
		id    uint64
		mount uint32
		pins  int
	}
	var ref []ent // insertion order
	next := uint64(1)
	for round := range 600 {
		var batch []abi.AccessRecord
		for range 256 {
			switch op := rng.IntN(10); {
			case op < 5 || len(ref) == 0:
				m := uint32(rng.IntN(3))
				batch = append(batch, rec(abi.AccessInsert, next, 1, m))
				ref = append(ref, ent{id: next, mount: m})
				next++
			case op < 8:
				i := rng.IntN(len(ref))
				batch = append(batch, rec(abi.AccessRemove, ref[i].id, 0, 0))
				ref = slices.Delete(ref, i, i+1)
			case op < 9:
				i := rng.IntN(len(ref))
				batch = append(batch, rec(abi.AccessPin, ref[i].id, 0, 0))
				ref[i].pins++
			default:
				i := rng.IntN(len(ref))
				batch = append(batch, rec(abi.AccessUnpin, ref[i].id, 0, 0))
				ref[i].pins = max(0, ref[i].pins-1)
			}
		}
		if st := p.access(batch...); st != abi.StatusOK {
			t.Fatalf("round %d: %v", round, st)
		}
		mount := uint32(abi.AnyMount)
		if round%2 == 1 {
			mount = uint32(rng.IntN(3))
		}
		want := []uint64{}
		for _, e := range ref {
			if len(want) < 100 && e.pins == 0 && (mount == abi.AnyMount || mount == e.mount) {
				want = append(want, e.id)
			}
		}
		if got := p.evict(abi.EvictRequest{Bytes: 100, Mount: mount}, abi.MaxBatch); !slices.Equal(got, want) {
			t.Fatalf("round %d (%d live, mount %d): victims\n%v\nwant\n%v", round, len(ref), mount, got, want)
		}
	}
	if next < 65536 {
		t.Errorf("only %d inserts: the ring never wrapped", next)
	}
}
