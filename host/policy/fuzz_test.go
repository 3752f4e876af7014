package policy_test

import (
	"context"
	"errors"
	"sync"
	"testing"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/abi/guest"
	"github.com/kvhost/kvhost/host/policy"
	"github.com/kvhost/kvhost/host/policy/policytest"
)

// scripted is a policy whose outputs come from fuzz data.
type scripted struct {
	data []byte
}

func (s *scripted) Init(guest.Config) error { return nil }
func (s *scripted) Access([]abi.AccessRecord) error {
	return nil
}

func (s *scripted) Name(recs []abi.NameRecord) error {
	for i := range recs {
		r := &recs[i]
		if len(s.data) > 0 {
			r.Mount = uint32(s.data[0] % 4)
		}
		r.PathLen = uint32(copy(r.PathBuf[:], s.data))
		if len(s.data) > 1 && s.data[1] == 0xff {
			r.PathLen = abi.MaxPathLen + 1
		}
	}
	return nil
}

func (s *scripted) Evict(_ *abi.EvictRequest, out []abi.Victim) (int, error) {
	n := 0
	for i := 0; i+1 < len(s.data) && n < len(out); i += 2 {
		out[n] = abi.Victim{Entry: uint64(s.data[i] % 16), Score: uint64(s.data[i+1])}
		n++
	}
	return n, nil
}

// FuzzOutputValidation feeds arbitrary plugin outputs to the host: it must
// accept only valid ones and never panic.
func FuzzOutputValidation(f *testing.F) {
	for _, seed := range []string{"a/b", "../x", "/abs", "", "a//b", ".hidden", "ok-name_1.kv", "\x00\x01\x02\x03", "\x05\xff"} {
		f.Add([]byte(seed))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		ctx := context.Background()
		idx := policytest.NewIndex()
		recs := make([]abi.AccessRecord, 10)
		for i := range recs {
			recs[i] = abi.AccessRecord{Entry: uint64(i), Size: 10, Kind: abi.AccessInsert, Mount: uint32(i % 2)}
		}
		recs[3].Kind = abi.AccessPin
		idx.Apply(recs)
		h, err := policy.NewNative(func() guest.Policy { return &scripted{data: data} }, idx, policy.Config{Shards: 1, Logger: quietLogger()})
		if err != nil {
			t.Fatal(err)
		}
		defer h.Close(ctx)
		names := nameRecords(3, 0)
		for i := range names {
			names[i].MountCount = 2
		}
		if err := h.Name(ctx, names); err == nil {
			for _, r := range names {
				if abi.CheckPath(r.Path()) != nil || r.Mount >= 2 {
					t.Fatalf("accepted mount %d path %q", r.Mount, r.Path())
				}
			}
		} else if !errors.Is(err, policy.ErrPlugin) {
			t.Fatalf("Name: %v", err)
		}
		v, err := h.Victims(ctx, abi.EvictRequest{Bytes: 1 << 20, Mount: 1}, 8)
		if err != nil {
			if !errors.Is(err, policy.ErrPlugin) {
				t.Fatalf("Victims: %v", err)
			}
			return
		}
		seen := map[uint64]bool{}
		for _, x := range v {
			e, ok := idx.Lookup(x.Entry)
			if !ok || e.Pins > 0 || e.Mount != 1 || seen[x.Entry] {
				t.Fatalf("accepted victim %+v (entry %+v, in index %v)", x, e, ok)
			}
			seen[x.Entry] = true
		}
	})
}

// TestConcurrentFallback has concurrent callers drive a hostile plugin into
// the fallback: no caller deadlocks, and every call after the switch succeeds.
func TestConcurrentFallback(t *testing.T) {
	ctx := context.Background()
	idx := policytest.NewIndex()
	h := declaredHost(t, fixture(t, "traversal"), "traversal", idx, policy.Config{Shards: 2, Fallback: newLRU, Logger: quietLogger()})
	insert(t, h, idx, 1, 100, 10, 4)
	var wg sync.WaitGroup
	for w := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for range 30 {
				err := h.Name(ctx, nameRecords(8, byte(w)))
				if err != nil && !errors.Is(err, policy.ErrPlugin) {
					t.Errorf("Name: %v", err)
				}
				if _, err := h.Victims(ctx, abi.EvictRequest{Bytes: 30, Mount: abi.AnyMount}, 4); err != nil {
					t.Errorf("Victims: %v", err)
				}
			}
		}()
	}
	wg.Wait()
	if s := h.Stats(); !s.Fallback {
		t.Fatalf("no fallback: %+v", s)
	}
	checkAnswers(t, h, idx)
}
