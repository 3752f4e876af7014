package server_test

import (
	"bytes"
	"context"
	"errors"
	"math/rand/v2"
	"strings"
	"testing"

	"github.com/kvhost/kvhost/client"
	"github.com/kvhost/kvhost/internal/server"
	"github.com/kvhost/kvhost/protocol"
)

// TestTransferNoBlock: the daemon takes protocol.NoBlock in a load's block
// ids: the key's other blocks are loaded, and no byte of the cache outside
// them changes; a store carrying it, and a load of a key whose every
// block is NoBlock, are refused as invalid, naming the key, and store or
// change nothing.
func TestTransferNoBlock(t *testing.T) {
	f := newFixture(t, server.Config{})
	c := f.dial(t)
	k := newCache(t, c)
	ctx := context.Background()
	rng := rand.New(rand.NewPCG(3, 4))
	k.bytesOf([]uint32{0, 1, 2, 3}, rng)
	stored := bytes.Clone(k.mem.Bytes())
	job, err := c.Store(ctx, k.id, [][]byte{[]byte("a"), []byte("b")}, [][]uint32{{0, 1}, {2, 3}})
	if err != nil {
		t.Fatal(err)
	}
	if res, err := job.Wait(ctx); err != nil || res.Keys[0].Outcome != client.OutcomeStored || res.Keys[1].Outcome != client.OutcomeStored {
		t.Fatalf("store: %v %v", res, err)
	}
	// at returns the offset of layer l, plane p, block b of the cache.
	at := func(l, p int, b uint32) int64 {
		return int64(l)*2*numBlocks*k.bb + int64(p)*numBlocks*k.bb + int64(b)*k.bb
	}
	for _, tc := range []struct {
		name   string
		kind   protocol.JobKind
		blocks [][]uint32
		from   map[uint32]uint32 // loaded block -> the stored block whose bytes it gets
		refuse string            // the refusal's text, "" if accepted
	}{
		{"load starting inside a key", protocol.JobLoad, [][]uint32{{client.NoBlock, 10}, {11, 12}}, map[uint32]uint32{10: 1, 11: 2, 12: 3}, ""},
		{"load ending inside a key", protocol.JobLoad, [][]uint32{{20, 21}, {22, client.NoBlock}}, map[uint32]uint32{20: 0, 21: 1, 22: 2}, ""},
		{"store with NoBlock", protocol.JobStore, [][]uint32{{4, 5}, {protocol.NoBlock, 7}}, nil, "key 1: block id 0xffffffff (NoBlock) in a store"},
		{"load of a key of NoBlocks only", protocol.JobLoad, [][]uint32{{10, 11}, {protocol.NoBlock, protocol.NoBlock}}, nil, "key 1: every block id is 0xffffffff (NoBlock)"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			mem := k.mem.Bytes()
			for i := range mem {
				mem[i] = 0xC3
			}
			want := bytes.Clone(mem)
			for to, from := range tc.from {
				for l := range int(geo.Layers) {
					for p := range 2 {
						copy(want[at(l, p, to):at(l, p, to)+k.bb], stored[at(l, p, from):at(l, p, from)+k.bb])
					}
				}
			}
			keys := [][]byte{[]byte("a"), []byte("b")}
			var job *client.Job
			var err error
			if tc.kind == protocol.JobStore {
				keys = [][]byte{[]byte("c"), []byte("d")}
				job, err = c.Store(ctx, k.id, keys, tc.blocks)
			} else {
				job, err = c.Load(ctx, k.id, keys, tc.blocks)
			}
			if tc.refuse != "" {
				if !errors.Is(err, &protocol.Error{Code: protocol.CodeInvalid}) || !strings.Contains(err.Error(), tc.refuse) {
					t.Fatalf("got %v, want invalid argument saying %q", err, tc.refuse)
				}
				if n, err := c.Lookup(ctx, k.ns.ID, [][]byte{[]byte("c")}); n != 0 || err != nil {
					t.Fatalf("after a refused store: lookup %d %v", n, err)
				}
			} else {
				if err != nil {
					t.Fatal(err)
				}
				res, err := job.Wait(ctx)
				if err != nil || res.Keys[0].Outcome != client.OutcomeLoaded || res.Keys[1].Outcome != client.OutcomeLoaded {
					t.Fatalf("load: %+v %v", res, err)
				}
				if n := int64(len(tc.from)) * int64(geo.Layers) * 2 * k.bb; int64(res.Bytes) != n {
					t.Fatalf("the completion says %d bytes, want the %d of the blocks loaded", res.Bytes, n)
				}
			}
			if !bytes.Equal(mem, want) {
				t.Fatal("the cache's bytes are not the ones the named blocks were to get and the rest untouched")
			}
		})
	}
}
