package main

import (
	"slices"
	"testing"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/abi/guest"
)

// driver runs the policy through a guest.Dispatcher, over a scratch area, as
// the wasm exports do.
type driver struct {
	d       *guest.Dispatcher
	scratch []byte
}

func newDriver(t *testing.T) *driver {
	d := &driver{d: guest.NewDispatcher(NewPolicy())}
	d.scratch = d.d.Scratch(abi.MaxBatch*abi.NameRecordSize + abi.EvictHeaderSize)
	if st := d.d.Init(0); st != 0 {
		t.Fatalf("init: %v", abi.Status(st))
	}
	return d
}

func (d *driver) access(t *testing.T, recs ...abi.AccessRecord) {
	t.Helper()
	copy(abi.View[abi.AccessRecord](d.scratch, len(recs)), recs)
	if st := d.d.Access(int32(len(recs))); st != 0 {
		t.Fatalf("access: %v", abi.Status(st))
	}
}

func (d *driver) evict(t *testing.T, req abi.EvictRequest) []uint64 {
	t.Helper()
	abi.View[abi.EvictRequest](d.scratch, 1)[0] = req
	n := d.d.Evict(64)
	if n < 0 {
		t.Fatalf("evict: %v", abi.Status(n))
	}
	var ids []uint64
	for _, v := range abi.View[abi.Victim](d.scratch[abi.EvictHeaderSize:], int(n)) {
		ids = append(ids, v.Entry)
	}
	return ids
}

func ins(id, size uint64, mount uint32) abi.AccessRecord {
	return abi.AccessRecord{Kind: abi.AccessInsert, Entry: id, Size: size, Mount: mount}
}

func TestSizeFirst(t *testing.T) {
	anyMount := uint32(abi.AnyMount)
	tests := []struct {
		name   string
		events []abi.AccessRecord
		req    abi.EvictRequest
		want   []uint64
	}{
		{"largest first", nil, abi.EvictRequest{Bytes: 1 << 20, Mount: anyMount}, []uint64{3, 4, 1, 2}},
		{"stop when covered", nil, abi.EvictRequest{Bytes: 300, Mount: anyMount}, []uint64{3}},
		{"mount", nil, abi.EvictRequest{Bytes: 1 << 20, Mount: 1}, []uint64{4, 2}},
		{"pinned", []abi.AccessRecord{{Kind: abi.AccessPin, Entry: 3}}, abi.EvictRequest{Bytes: 1 << 20, Mount: anyMount}, []uint64{4, 1, 2}},
		{"unpinned", []abi.AccessRecord{{Kind: abi.AccessPin, Entry: 3}, {Kind: abi.AccessUnpin, Entry: 3}}, abi.EvictRequest{Bytes: 1 << 20, Mount: anyMount}, []uint64{3, 4, 1, 2}},
		{"removed", []abi.AccessRecord{{Kind: abi.AccessRemove, Entry: 3}, {Kind: abi.AccessRemove, Entry: 1}}, abi.EvictRequest{Bytes: 1 << 20, Mount: anyMount}, []uint64{4, 2}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			d := newDriver(t)
			d.access(t, ins(1, 100, 0), ins(2, 50, 1), ins(3, 400, 0), ins(4, 200, 1))
			d.access(t, tt.events...)
			if got := d.evict(t, tt.req); !slices.Equal(got, tt.want) {
				t.Errorf("victims %v, want %v", got, tt.want)
			}
		})
	}
}

func TestName(t *testing.T) {
	d := newDriver(t)
	recs := abi.View[abi.NameRecord](d.scratch, 2)
	recs[0] = abi.NameRecord{Fingerprint: 0xabc, TPRank: 3}
	recs[0].SetKey([]byte{0x01, 0xff})
	recs[1] = abi.NameRecord{Fingerprint: 0xabc}
	if st := d.d.Name(2); st != 0 {
		t.Fatalf("name: %v", abi.Status(st))
	}
	for i, want := range []string{"abc_r3/01ff.kv", "abc_r0/_.kv"} {
		if got := string(recs[i].Path()); got != want {
			t.Errorf("path %q, want %q", got, want)
		}
		if err := abi.CheckPath(recs[i].Path()); err != nil {
			t.Error(err)
		}
	}
}
