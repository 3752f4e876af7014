package server_test

import (
	"bytes"
	"crypto/rand"
	"errors"
	"io"
	mrand "math/rand/v2"
	"net"
	"os"
	"testing"
	"time"

	"github.com/kvhost/kvhost/client"
	"github.com/kvhost/kvhost/internal/server"
	"github.com/kvhost/kvhost/protocol"
)

// FuzzSession feeds arbitrary bytes, after a valid handshake and
// registration (region 1, namespace 2, cache 3 on the connection), into a
// session served by a real engine on a temp dir. The daemon must not crash
// or hang, and keys stored before by another client must still load with
// their bytes.
func FuzzSession(f *testing.F) {
	fx := newFixture(f, server.Config{MaxFrame: protocol.MinFrame, MaxInflightJobs: 4})
	owner := fx.dial(f)
	k := newCache(f, owner)
	rng := mrand.New(mrand.NewPCG(1, 1))
	type stored struct {
		key  string
		want []byte
	}
	var refs []stored
	for i := 0; i < 4; i++ {
		key := make([]byte, 32) // unguessable by the fuzzer
		rand.Read(key)
		blocks := []uint32{uint32(2 * i), uint32(2*i + 1)}
		refs = append(refs, stored{string(key), k.store(f, string(key), blocks, rng)})
	}

	for _, seed := range fuzzSeeds() {
		f.Add(seed)
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		mem, err := client.NewMemfd("fuzz", int64(geo.Layers)*2*numBlocks*geo.BlockBytes())
		if err != nil {
			t.Fatal(err)
		}
		defer mem.Close()
		c, err := net.DialUnix("unix", nil, &net.UnixAddr{Name: fx.socket, Net: "unix"})
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		var pre []byte
		pre = protocol.AppendFrame(pre, 1, &protocol.Hello{Version: protocol.Version, Client: "fuzz"})
		reg := protocol.AppendFrame(nil, 2, &protocol.RegisterMemory{Kind: protocol.MemoryMemfd, Size: uint64(mem.Len())})
		if _, err := c.Write(pre); err != nil {
			t.Fatal(err)
		}
		if _, _, err := c.WriteMsgUnix(reg, client.Rights(mem.Fd()), nil); err != nil {
			t.Fatal(err)
		}
		var post []byte
		post = protocol.AppendFrame(post, 3, &protocol.Declare{Geometry: geo})
		post = protocol.AppendFrame(post, 4, &protocol.RegisterCache{NS: 2, Layers: fuzzLayers()})
		post = append(post, data...)
		c.SetDeadline(time.Now().Add(20 * time.Second))
		go func() {
			c.Write(post)
			c.CloseWrite()
		}()
		if _, err := io.Copy(io.Discard, c); err != nil {
			if errors.Is(err, os.ErrDeadlineExceeded) {
				t.Fatal("the daemon neither answered nor closed the connection")
			}
		}
		for i, r := range refs {
			if got := k.load(t, r.key, []uint32{uint32(numBlocks - 2), uint32(numBlocks - 1)}); !bytes.Equal(got, r.want) {
				t.Fatalf("reference key %d no longer loads its bytes (nil: %v)", i, got == nil)
			}
		}
	})
}

func fuzzLayers() []protocol.Layer {
	bb := geo.BlockBytes()
	layers := make([]protocol.Layer, geo.Layers)
	for l := range layers {
		layers[l] = protocol.Layer{Region: 1, NumBlocks: numBlocks, Offset: int64(l) * 2 * numBlocks * bb, BlockStride: bb, PlaneStride: numBlocks * bb}
	}
	return layers
}

// fuzzSeeds are request sequences that use the harness's registrations.
func fuzzSeeds() [][]byte {
	key := [][]byte{[]byte("fuzz-key")}
	var seq []byte
	seq = protocol.AppendFrame(seq, 10, &protocol.Transfer{Kind: protocol.JobStore, Cache: 3, Keys: key, Blocks: [][]uint32{{0, 1}}})
	seq = protocol.AppendFrame(seq, 11, &protocol.Lookup{NS: 2, Keys: key})
	seq = protocol.AppendFrame(seq, 12, &protocol.Transfer{Kind: protocol.JobLoad, Cache: 3, Keys: key, Blocks: [][]uint32{{2, 3}}})
	seq = protocol.AppendFrame(seq, 13, &protocol.Cancel{Job: 1})
	seq = protocol.AppendFrame(seq, 14, &protocol.Delete{NS: 2, Keys: key})
	seq = protocol.AppendFrame(seq, 15, &protocol.StatsRequest{})
	seq = protocol.AppendFrame(seq, 16, &protocol.UnregisterCache{Cache: 3})
	seq = protocol.AppendFrame(seq, 17, &protocol.UnregisterMemory{Region: 1})
	seq = protocol.AppendFrame(seq, 18, &protocol.Undeclare{NS: 2})
	var pins []byte
	pins = protocol.AppendFrame(pins, 20, &protocol.Pin{NS: 2, LeaseMillis: 1000, Keys: key})
	pins = protocol.AppendFrame(pins, 21, &protocol.Pin{NS: 2, Keys: key, Loadable: true, Group: "g"})
	pins = protocol.AppendFrame(pins, 22, &protocol.Group{Name: "g"})
	pins = protocol.AppendFrame(pins, 23, &protocol.Pin{NS: 2, Keys: key, Loadable: true})
	pins = protocol.AppendFrame(pins, 24, &protocol.Unpin{Pin: 1})
	pins = protocol.AppendFrame(pins, 25, &protocol.UnregisterCache{Cache: 3})
	pins = protocol.AppendFrame(pins, 26, &protocol.Pin{NS: 2, Keys: key, Loadable: true, Group: "g"})
	var layers []byte
	layers = protocol.AppendFrame(layers, 30, &protocol.Transfer{Kind: protocol.JobStore, Cache: 3, Keys: key, Blocks: [][]uint32{{0, 1}}})
	layers = protocol.AppendFrame(layers, 31, &protocol.Transfer{Kind: protocol.JobLoad, Cache: 3, Keys: key, Blocks: [][]uint32{{2, 3}}, Layers: &protocol.LayerRange{First: 1, Count: 1}})
	layers = protocol.AppendFrame(layers, 32, &protocol.Transfer{Kind: protocol.JobLoad, Cache: 3, Keys: key, Blocks: [][]uint32{{protocol.NoBlock, 3}}, Layers: &protocol.LayerRange{}})
	layers = protocol.AppendFrame(layers, 33, &protocol.Transfer{Kind: protocol.JobLoad, Cache: 3, Keys: key, Blocks: [][]uint32{{2, 3}}, Layers: &protocol.LayerRange{First: 1, Count: 2}})
	return [][]byte{
		seq,
		pins,
		layers,
		protocol.AppendFrame(nil, 1, &protocol.RegisterMemory{Kind: protocol.MemoryMemfd, Size: 4096}),
		protocol.AppendFrame(nil, 1, &protocol.RegisterMemory{Kind: protocol.MemoryCUDAIPC, Size: 4096}),
		protocol.AppendFrame(nil, 1, &protocol.Hello{Version: 1}),
		protocol.AppendFrame(nil, 1, &protocol.RegisterCache{NS: 2, Layers: []protocol.Layer{{Region: 1, NumBlocks: 1 << 31, BlockStride: 1 << 40}}}),
		{0xff, 0xff, 0xff, 0xff, 7, 0, 0, 0},
	}
}
